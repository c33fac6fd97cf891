// The one table of dtypes fastcoll's kernels handle.
//
// Everything that needs the list expands FASTCOLL_FOR_EACH_DTYPE: the
// argument checks and their messages (ops.cpp), dtype_code, the CPU kernels'
// choice of inner loop (cpu/copy_scale.h), the CUDA kernel's switch over the
// dtype pair (cuda/copy_chunk.cuh) and build_info()["dtypes"]. Python has the
// same table in fastcoll/ops/dtypes.py; tests/test_ops.py checks that they agree.
//
// Compiles as plain C++ and under nvcc (device code uses the C++ types only).
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstddef>
#include <string>

// _(code, C++ type, c10::ScalarType enumerator, name as Python prints it)
// Codes are dense from 0 and fit in kDtypeCodeBits bits (the CUDA chunk
// descriptor packs two of them). Append new rows; never renumber.
#define FASTCOLL_FOR_EACH_DTYPE(_)            \
  _(0, float, Float, "float32")               \
  _(1, c10::Half, Half, "float16")            \
  _(2, c10::BFloat16, BFloat16, "bfloat16")   \
  _(3, double, Double, "float64")

namespace fastcoll {

#define FASTCOLL_DTYPE_COUNT_ONE(code, T, st, name) +1
constexpr int kNumDtypes = 0 FASTCOLL_FOR_EACH_DTYPE(FASTCOLL_DTYPE_COUNT_ONE);
#undef FASTCOLL_DTYPE_COUNT_ONE

constexpr int kDtypeCodeBits = 2;
static_assert(kNumDtypes <= (1 << kDtypeCodeBits), "dtype codes must fit in kDtypeCodeBits bits");

// Each row's C++ type is the one c10 maps its ScalarType to, and its code is its row number.
namespace dtype_table_checks {
#define FASTCOLL_DTYPE_CHECK_ROW(code, T, st, name) \
  static_assert(c10::CppTypeToScalarType<T>::value == c10::ScalarType::st, "dtype table: type of " name);
FASTCOLL_FOR_EACH_DTYPE(FASTCOLL_DTYPE_CHECK_ROW)
#undef FASTCOLL_DTYPE_CHECK_ROW
constexpr bool codes_are_row_numbers() {
  int row = 0;
  bool ok = true;
#define FASTCOLL_DTYPE_CHECK_CODE(code, T, st, name) ok = ok && (code) == row++;
  FASTCOLL_FOR_EACH_DTYPE(FASTCOLL_DTYPE_CHECK_CODE)
#undef FASTCOLL_DTYPE_CHECK_CODE
  return ok;
}
static_assert(codes_are_row_numbers(), "dtype table: codes must be 0, 1, 2, ... in row order");
}  // namespace dtype_table_checks

// Bytes of the narrowest supported element (bounds the elements of a CUDA chunk).
constexpr size_t kMinElementSize = [] {
  size_t m = 64;
#define FASTCOLL_DTYPE_MIN_SIZE(code, T, st, name) m = sizeof(T) < m ? sizeof(T) : m;
  FASTCOLL_FOR_EACH_DTYPE(FASTCOLL_DTYPE_MIN_SIZE)
#undef FASTCOLL_DTYPE_MIN_SIZE
  return m;
}();

constexpr bool is_supported_dtype(c10::ScalarType t) {
#define FASTCOLL_DTYPE_IS(code, T, st, name) \
  if (t == c10::ScalarType::st) return true;
  FASTCOLL_FOR_EACH_DTYPE(FASTCOLL_DTYPE_IS)
#undef FASTCOLL_DTYPE_IS
  return false;
}

// The supported dtypes for messages: "float32, float16, bfloat16 and float64".
inline std::string supported_dtype_names() {
  static const char* const names[] = {
#define FASTCOLL_DTYPE_NAME(code, T, st, name) name,
      FASTCOLL_FOR_EACH_DTYPE(FASTCOLL_DTYPE_NAME)
#undef FASTCOLL_DTYPE_NAME
  };
  std::string s;
  for (int i = 0; i < kNumDtypes; ++i) {
    if (i > 0) s += i + 1 == kNumDtypes ? " and " : ", ";
    s += names[i];
  }
  return s;
}

}  // namespace fastcoll
