// The copy-and-scale inner loops of the CPU kernels, compiled twice: once for
// the baseline ISA (copy_scale_default.cpp) and once for AVX2+FMA+F16C
// (copy_scale_avx2.cpp); flatten_scale_cpu.cpp picks one at run time. Each
// includer defines FASTCOLL_CPU_NS (and, for AVX2, CPU_CAPABILITY) first, so
// the two builds never share a symbol.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstring>
#include <tuple>
#include <type_traits>

#include "fastcoll.h"

#ifndef FASTCOLL_CPU_NS
#error "define FASTCOLL_CPU_NS before including copy_scale.h"
#endif

namespace fastcoll {

namespace FASTCOLL_CPU_NS {

using at::vec::Vectorized;
using FVec = Vectorized<float>;

// Loads/stores two float vectors' worth of elements (2 * FVec::size()) of type T.
template <typename T>
struct FloatPair;

template <>
struct FloatPair<float> {
  static inline void load(const float* p, FVec& a, FVec& b) {
    a = FVec::loadu(p);
    b = FVec::loadu(p + FVec::size());
  }
  static inline void store(float* p, const FVec& a, const FVec& b) {
    a.store(p);
    b.store(p + FVec::size());
  }
};

template <typename R>  // c10::Half or c10::BFloat16
struct ReducedFloatPair {
  static inline void load(const R* p, FVec& a, FVec& b) {
    std::tie(a, b) = at::vec::convert_to_float<R>(Vectorized<R>::loadu(p));
  }
  static inline void store(R* p, const FVec& a, const FVec& b) {
    at::vec::convert_from_float<R>(a, b).store(p);
  }
};
template <>
struct FloatPair<c10::Half> : ReducedFloatPair<c10::Half> {};
template <>
struct FloatPair<c10::BFloat16> : ReducedFloatPair<c10::BFloat16> {};

template <typename S, typename D>
void copy_scale(const S* src, D* dst, int64_t n, double scale) {
  constexpr bool kHasDouble = std::is_same_v<S, double> || std::is_same_v<D, double>;
  if constexpr (std::is_same_v<S, D>) {
    if (scale == 1.0) {  // x * 1 is exact: a plain copy gives the same bits
      if (src != dst) std::memcpy(dst, src, n * sizeof(S));
      return;
    }
  }
  if constexpr (kHasDouble) {
    // float64 on either side: the compiler vectorizes this plain loop.
    for (int64_t i = 0; i < n; ++i) {
      dst[i] = static_cast<D>(static_cast<double>(src[i]) * scale);
    }
  } else {
    const float fscale = static_cast<float>(scale);
    constexpr int64_t kStep = 2 * FVec::size();
    const FVec vscale(fscale);
    int64_t i = 0;
    for (; i + kStep <= n; i += kStep) {
      FVec a, b;
      FloatPair<S>::load(src + i, a, b);
      FloatPair<D>::store(dst + i, a * vscale, b * vscale);
    }
    for (; i < n; ++i) {
      dst[i] = static_cast<D>(static_cast<float>(src[i]) * fscale);
    }
  }
}

template <typename S, typename D>
void copy_scale_erased(const void* src, void* dst, int64_t n, double scale) {
  copy_scale<S, D>(static_cast<const S*>(src), static_cast<D*>(dst), n, scale);
}

CopyFn pick_copy(at::ScalarType src, at::ScalarType dst) {
  CopyFn fn = nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src, "fastcoll_cpu_src", [&] {
    using src_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dst, "fastcoll_cpu_dst", [&] {
      fn = &copy_scale_erased<src_t, scalar_t>;
    });
  });
  return fn;
}

}  // namespace FASTCOLL_CPU_NS
}  // namespace fastcoll
