// The copy-and-scale inner loops of the CPU kernels, compiled twice: once for
// the baseline ISA (copy_scale_default.cpp) and once for AVX2+FMA+F16C
// (copy_scale_avx2.cpp); flatten_scale_cpu.cpp picks one at run time. Each
// includer defines FASTCOLL_CPU_NS (and, for AVX2, CPU_CAPABILITY) first, so
// the two builds never share a symbol.
//
// The AVX2 build also has streaming variants, for calls that write more than
// the caches hold: their 32-byte stores bypass the cache (non-temporal), so
// the destination's lines are not first read from memory only to be
// overwritten. That removes a third of the memory traffic of a large copy.
// The baseline build's "streaming" variants are its regular loops.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif
#include <type_traits>

#include "dtypes.h"
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
#if defined(CPU_CAPABILITY_AVX2)
  static inline void stream(float* p, const FVec& a, const FVec& b) {  // p 32-byte aligned
    _mm256_stream_ps(p, a);
    _mm256_stream_ps(p + FVec::size(), b);
  }
#endif
};

template <typename R>  // c10::Half or c10::BFloat16
struct ReducedFloatPair {
  static inline void load(const R* p, FVec& a, FVec& b) {
    std::tie(a, b) = at::vec::convert_to_float<R>(Vectorized<R>::loadu(p));
  }
  static inline void store(R* p, const FVec& a, const FVec& b) {
    at::vec::convert_from_float<R>(a, b).store(p);
  }
#if defined(CPU_CAPABILITY_AVX2)
  static inline void stream(R* p, const FVec& a, const FVec& b) {  // p 32-byte aligned
    const __m256i v = at::vec::convert_from_float<R>(a, b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), v);
  }
#endif
};
template <>
struct FloatPair<c10::Half> : ReducedFloatPair<c10::Half> {};
template <>
struct FloatPair<c10::BFloat16> : ReducedFloatPair<c10::BFloat16> {};

#if defined(CPU_CAPABILITY_AVX2)
constexpr bool kCanStream = true;

inline bool aligned32(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 31) == 0;
}

// memcpy with non-temporal 32-byte stores.
inline void stream_copy_bytes(const char* src, char* dst, int64_t nbytes) {
  int64_t i = 0;
  const int64_t head = std::min<int64_t>(nbytes, (32 - (reinterpret_cast<uintptr_t>(dst) & 31)) & 31);
  std::memcpy(dst, src, head);
  i = head;
  for (; i + 64 <= nbytes; i += 64) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
  }
  std::memcpy(dst + i, src + i, nbytes - i);
  _mm_sfence();
}
#else
constexpr bool kCanStream = false;
#endif

// kStream: non-temporal stores (see the top of this file); only meaningful in the AVX2 build.
template <typename S, typename D, bool kStream>
void copy_scale(const S* src, D* dst, int64_t n, double scale) {
  constexpr bool kHasDouble = std::is_same_v<S, double> || std::is_same_v<D, double>;
  if constexpr (std::is_same_v<S, D>) {
    if (scale == 1.0) {  // x * 1 is exact: a plain copy gives the same bits
      if (src == dst) return;
#if defined(CPU_CAPABILITY_AVX2)
      if constexpr (kStream) {
        stream_copy_bytes(reinterpret_cast<const char*>(src), reinterpret_cast<char*>(dst), n * int64_t(sizeof(S)));
        return;
      }
#endif
      std::memcpy(dst, src, n * sizeof(S));
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
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (kStream) {
      // Scalar head up to the destination's 32-byte boundary (one step of kStep
      // elements is 32 bytes of 16-bit or 64 of 32-bit output).
      for (; i < n && !aligned32(dst + i); ++i) {
        dst[i] = static_cast<D>(static_cast<float>(src[i]) * fscale);
      }
      for (; i + kStep <= n; i += kStep) {
        FVec a, b;
        FloatPair<S>::load(src + i, a, b);
        FloatPair<D>::stream(dst + i, a * vscale, b * vscale);
      }
      _mm_sfence();
    }
#endif
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

template <typename S, typename D, bool kStream>
void copy_scale_erased(const void* src, void* dst, int64_t n, double scale) {
  copy_scale<S, D, kStream>(static_cast<const S*>(src), static_cast<D*>(dst), n, scale);
}

template <typename S>
CopyFn pick_copy_from(at::ScalarType dst, bool streaming) {
  switch (dst) {
#define FASTCOLL_PICK_TO(code, T, st, name) \
  case at::ScalarType::st:                  \
    return streaming && kCanStream ? &copy_scale_erased<S, T, true> : &copy_scale_erased<S, T, false>;
    FASTCOLL_FOR_EACH_DTYPE(FASTCOLL_PICK_TO)
#undef FASTCOLL_PICK_TO
    default:
      return nullptr;
  }
}

// The inner loop for one (source, destination) dtype pair of the table in
// dtypes.h; `streaming` asks for non-temporal stores (honoured by the AVX2
// build). Both dtypes have passed plan_segments' checks.
CopyFn pick_copy(at::ScalarType src, at::ScalarType dst, bool streaming) {
  CopyFn fn = nullptr;
  switch (src) {
#define FASTCOLL_PICK_FROM(code, T, st, name) \
  case at::ScalarType::st:                    \
    fn = pick_copy_from<T>(dst, streaming);   \
    break;
    FASTCOLL_FOR_EACH_DTYPE(FASTCOLL_PICK_FROM)
#undef FASTCOLL_PICK_FROM
    default:
      break;
  }
  TORCH_CHECK(fn != nullptr, "fastcoll internal error: no CPU kernel for ", src, " -> ", dst, ". Please report this");
  return fn;
}

}  // namespace FASTCOLL_CPU_NS
}  // namespace fastcoll
