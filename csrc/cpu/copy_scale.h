// The copy-and-scale inner loops of the CPU kernels, compiled three times:
// for the baseline ISA (copy_scale_default.cpp), for AVX2+FMA+F16C
// (copy_scale_avx2.cpp), and for AVX2 with its float -> bfloat16 conversions
// done by AVX-512 BF16's VCVTNE2PS2BF16, one instruction where AVX2 needs seven
// per vector (copy_scale_avx512bf16.cpp; it stores the same bits, see
// bf16_from_floats). cpu_isa.cpp picks the build at run time. Each includer
// defines FASTCOLL_CPU_NS (and CPU_CAPABILITY for the vector builds) first, so
// the builds never share a symbol.
//
// The AVX2 build also has streaming variants, for calls that write more than
// the caches hold: their 32-byte stores bypass the cache (non-temporal), so
// the destination's lines are not first read from memory only to be
// overwritten. That removes a third of the memory traffic of a large copy.
// The baseline build's "streaming" variants are its regular loops.
//
// The copies of the gradient-health ops, which observe the values they store
// (sum of squares, non-finite check), flatten_accumulate's loops and
// sum_chunks' are here too, compiled with each build; see the bottom of the
// file.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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

#if defined(FASTCOLL_AVX512BF16)
// 16 floats (a: elements 0-7, b: 8-15) to bfloat16 in element order, rounded
// to nearest even. VCVTNE2PS2BF16 treats subnormal inputs as zero and quiets
// NaNs, where the other builds keep subnormals and store NaN as 0xFFFF: a
// step holding a NaN or a subnormal (rare in gradients) takes at::vec's
// conversion instead, so every build stores the same bits. (bfloat16 has
// float's exponent range: only subnormal inputs give subnormal outputs.)
inline __m256i bf16_from_floats(const __m256& a, const __m256& b) {
  constexpr int kNanOrSubnormal = 0x01 | 0x20 | 0x80;  // VFPCLASSPS: quiet NaN, subnormal, signaling NaN
  if (__builtin_expect((_mm256_fpclass_ps_mask(a, kNanOrSubnormal) | _mm256_fpclass_ps_mask(b, kNanOrSubnormal)) != 0, 0)) {
    return at::vec::convert_from_float<c10::BFloat16>(a, b);
  }
  return reinterpret_cast<__m256i>(_mm256_cvtne2ps_pbh(b, a));  // b to the upper half, a to the lower
}
#endif

// 2 * FVec::size() floats to R (float16 or bfloat16), in element order.
template <typename R>
inline Vectorized<R> reduced_from_floats(const FVec& a, const FVec& b) {
#if defined(FASTCOLL_AVX512BF16)
  if constexpr (std::is_same_v<R, c10::BFloat16>) return Vectorized<R>(bf16_from_floats(a, b));
#endif
  return at::vec::convert_from_float<R>(a, b);
}

template <typename R>  // c10::Half or c10::BFloat16
struct ReducedFloatPair {
  static inline void load(const R* p, FVec& a, FVec& b) {
    std::tie(a, b) = at::vec::convert_to_float<R>(Vectorized<R>::loadu(p));
  }
  static inline void store(R* p, const FVec& a, const FVec& b) {
    reduced_from_floats<R>(a, b).store(p);
  }
#if defined(CPU_CAPABILITY_AVX2)
  static inline void stream(R* p, const FVec& a, const FVec& b) {  // p 32-byte aligned
    const __m256i v = reduced_from_floats<R>(a, b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), v);
  }
#endif
};
template <>
struct FloatPair<c10::Half> : ReducedFloatPair<c10::Half> {};
#if defined(CPU_CAPABILITY_AVX2)
// bfloat16 -> float is a 16-bit shift: one cross-lane permute puts elements
// 0-3 and 8-11 in the low lane and 4-7 and 12-15 in the high one, and two
// interleaves with zero then give 0-7 and 8-15 (3 instructions; at::vec's
// convert_to_float takes 5). Same values.
template <>
struct FloatPair<c10::BFloat16> : ReducedFloatPair<c10::BFloat16> {
  static inline void load(const c10::BFloat16* p, FVec& a, FVec& b) {
    const __m256i v = _mm256_permute4x64_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), 0xD8);
    const __m256i zero = _mm256_setzero_si256();
    a = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
    b = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
  }
};
#else
template <>
struct FloatPair<c10::BFloat16> : ReducedFloatPair<c10::BFloat16> {};
#endif

// How one step of copy_scale's float loop (2 * FVec::size() elements) reads S
// and writes D: FloatPair's element order, or for bfloat16 -> bfloat16 (AVX2)
// an order of its own that needs no cross-lane permute either way: the
// interleaves with zero give elements [0-3, 8-11] and [4-7, 12-15] as floats,
// and packing their rounded upper halves back puts them in place.
template <typename S, typename D>
struct StepIO {
  static inline void load(const S* p, FVec& a, FVec& b) {
    FloatPair<S>::load(p, a, b);
  }
  static inline void store(D* p, const FVec& a, const FVec& b) {
    FloatPair<D>::store(p, a, b);
  }
#if defined(CPU_CAPABILITY_AVX2)
  static inline void stream(D* p, const FVec& a, const FVec& b) {
    FloatPair<D>::stream(p, a, b);
  }
#endif
};

#if defined(CPU_CAPABILITY_AVX2) && !defined(FASTCOLL_AVX512BF16)
// (The AVX-512 BF16 build converts in element order instead: FloatPair's load,
// bf16_from_floats.)
// float -> bfloat16 bits in the low half of each 32-bit lane: round to nearest
// even, NaN to 0xFFFF (at::vec's cvtfp32_bf16, before its pack and permute).
inline __m256i bf16_bits_in_low_half(const __m256& x) {
  const __m256i v = _mm256_castps_si256(x);
  const __m256i ordered = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_ORD_Q));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(v, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(v, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  return _mm256_blendv_epi8(_mm256_set1_epi32(0xFFFF), rounded, ordered);
}

template <>
struct StepIO<c10::BFloat16, c10::BFloat16> {
  static inline void load(const c10::BFloat16* p, FVec& a, FVec& b) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i zero = _mm256_setzero_si256();
    a = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
    b = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
  }
  static inline __m256i pack(const FVec& a, const FVec& b) {
    return _mm256_packus_epi32(bf16_bits_in_low_half(a), bf16_bits_in_low_half(b));
  }
  static inline void store(c10::BFloat16* p, const FVec& a, const FVec& b) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), pack(a, b));
  }
  static inline void stream(c10::BFloat16* p, const FVec& a, const FVec& b) {  // p 32-byte aligned
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), pack(a, b));
  }
};
#endif

#if defined(CPU_CAPABILITY_AVX2)
constexpr bool kCanStream = true;

inline bool aligned32(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 31) == 0;
}

// A streaming call (one that writes more than the caches hold) reads its
// source from memory too. In the observed copies below, the observer's work
// fills the out-of-order window, so fewer loads are in flight than in a plain
// copy, and the hardware prefetcher alone left a 25 MiB float copy with a sum
// of squares ~13 % slower than without it (one thread); asking for the source
// kPrefetchBytes ahead brings it level. The plain copies do without: there the
// same prefetches cost ~5 % (the hardware prefetcher keeps up on its own). A
// prefetch never faults, so the lines past the end of the source are harmless.
constexpr uintptr_t kPrefetchBytes = 4096;

template <typename S>
C10_ALWAYS_INLINE void prefetch_ahead(const S* p, int64_t n) {  // the lines of p[0, n), kPrefetchBytes ahead
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(p) + kPrefetchBytes;
  for (uintptr_t b = 0; b < uintptr_t(n) * sizeof(S); b += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(ahead + b), _MM_HINT_T0);
  }
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

// Whether the multiply of S -> D runs in float64: either side is float64, or
// kF64 asks for it (flatten_scale_ex with a float64 scale_by).
template <typename S, typename D, bool kF64>
constexpr bool kDoubleMath = kF64 || std::is_same_v<S, double> || std::is_same_v<D, double>;

// kStream: non-temporal stores (see the top of this file); only meaningful in the AVX2 build.
// kF64: multiply in float64 whatever the dtypes (see kDoubleMath).
template <typename S, typename D, bool kStream, bool kF64 = false>
void copy_scale(const S* src, D* dst, int64_t n, double scale) {
  constexpr bool kHasDouble = kDoubleMath<S, D, kF64>;
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
    int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX2)
    constexpr bool kWide16 = std::is_same_v<S, double> && !std::is_same_v<D, double> && !std::is_same_v<D, float>;
    constexpr bool k16Wide = std::is_same_v<D, double> && !std::is_same_v<S, double> && !std::is_same_v<S, float>;
    if constexpr (kWide16 || k16Wide) {
      // float64 <-> float16/bfloat16: the conversions through float vectors
      // (the scalar conversions are not vectorized). float64 -> 16 bits is
      // float64 -> float -> 16 bits, both rounded to nearest even, as the
      // scalar cast does; 16 bits -> float64 is exact.
      const __m256d vscale = _mm256_set1_pd(scale);
      constexpr int64_t kStep = 2 * FVec::size();
      if constexpr (kStream) {  // destination 32-byte aligned for the non-temporal stores
        for (; i < n && !aligned32(dst + i); ++i) dst[i] = static_cast<D>(static_cast<double>(src[i]) * scale);
      }
      for (; i + kStep <= n; i += kStep) {
        if constexpr (kWide16) {
          __m128 f[4];
          for (int q = 0; q < 4; ++q) f[q] = _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_loadu_pd(src + i + 4 * q), vscale));
          const FVec a = _mm256_set_m128(f[1], f[0]);
          const FVec b = _mm256_set_m128(f[3], f[2]);
          if constexpr (kStream) {
            FloatPair<D>::stream(dst + i, a, b);
          } else {
            FloatPair<D>::store(dst + i, a, b);
          }
        } else {
          FVec a, b;
          FloatPair<S>::load(src + i, a, b);
          const __m256 ab[2] = {a, b};
          for (int q = 0; q < 4; ++q) {
            const __m128 half = (q % 2 == 0) ? _mm256_castps256_ps128(ab[q / 2]) : _mm256_extractf128_ps(ab[q / 2], 1);
            const __m256d v = _mm256_mul_pd(_mm256_cvtps_pd(half), vscale);
            if constexpr (kStream) {
              _mm256_stream_pd(dst + i + 4 * q, v);
            } else {
              _mm256_storeu_pd(dst + i + 4 * q, v);
            }
          }
        }
      }
      if constexpr (kStream) _mm_sfence();
    }
#endif
    // float64 on either side (the rest): the compiler vectorizes this plain loop.
    for (; i < n; ++i) {
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
        StepIO<S, D>::load(src + i, a, b);
        StepIO<S, D>::stream(dst + i, a * vscale, b * vscale);
      }
      _mm_sfence();
    }
#endif
    for (; i + kStep <= n; i += kStep) {
      FVec a, b;
      StepIO<S, D>::load(src + i, a, b);
      StepIO<S, D>::store(dst + i, a * vscale, b * vscale);
    }
    for (; i < n; ++i) {
      dst[i] = static_cast<D>(static_cast<float>(src[i]) * fscale);
    }
  }
}

template <typename S, typename D, bool kStream, bool kF64 = false>
void copy_scale_erased(const void* src, void* dst, int64_t n, double scale) {
  copy_scale<S, D, kStream, kF64>(static_cast<const S*>(src), static_cast<D*>(dst), n, scale);
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


// ---------------------------------------------------------------------------
// Gradient health: copies that observe every value they store.
//
// Same values, same bits as copy_scale<S, D, kStream, kF64> (same float or
// float64 math, same conversions; at a scale of exactly 1 between equal dtypes
// the bits are copied as they are), and an observer sees each stored value as
// it leaves the registers, so a sum of squares or a non-finite check costs no
// second pass over memory:
// * SquaresObserver: the float64 sum of the squares of the stored values.
//   Element i of the call goes to lane i % kSqLanes, each lane adds its
//   elements in increasing i (with add_square), and the lanes are combined in
//   a fixed tree: the result depends on n and the values only, never on
//   addresses, alignment or threads. The vector loop keeps the lanes in
//   registers, rotated by where it starts (after the scalar head that aligns
//   non-temporal stores), and puts them back in place when it ends.
// * NonFiniteObserver: whether any stored value is NaN or +-Inf.
// A null destination (or one equal to the source at a scale of 1) makes the
// call read-only: the observer sees the source's own values (sum_of_squares).
// Unlike copy_scale, the streaming variants do not end with a store fence:
// the caller fences once when its whole range is done (health_cpu.cpp).
// ---------------------------------------------------------------------------

constexpr int kSqLanes = 32;
constexpr int64_t kObsStep = 4 * FVec::size();  // elements per vector step: one round of the lanes
static_assert(kObsStep == kSqLanes, "a vector step is one round of the lanes");

// acc + x * x, rounded once in the AVX2 build (FMA) and twice in the baseline
// build; the same everywhere in a build. For values of float, float16 or
// bfloat16, x * x is exact in float64 and the two builds agree too.
inline double add_square(double acc, double x) {
#if defined(CPU_CAPABILITY_AVX2)
  return std::fma(x, x, acc);
#else
  return acc + x * x;
#endif
}

// An observer's vector loop: run(i, n, step) calls step(i, v) for each whole
// step of kObsStep elements from i (step copies them and fills v, the step's 4
// float vectors in element order), observes v, and returns where it stopped.
// The observer's loop state is local variables of run(), which must stay in
// registers: on the stack (as g++ had placed them) each step stores and
// reloads every accumulator, and the sum of squares ran at half the speed of
// the copy it rides on.
// FASTCOLL_INLINE_LAMBDA forces the step into the loop.
#if defined(__GNUC__)
#define FASTCOLL_INLINE_LAMBDA __attribute__((always_inline))
#else
#define FASTCOLL_INLINE_LAMBDA
#endif

struct SquaresObserver {
  static constexpr bool kNeedsStored = true;  // step(): the values rounded to the destination dtype
  alignas(32) double lanes[kSqLanes] = {};
#if defined(CPU_CAPABILITY_AVX2) && !defined(FASTCOLL_AVX512BF16)
  // acc_lo += squares of f's elements 0-3, acc_hi += squares of 4-7 (float64, one rounding each).
  C10_ALWAYS_INLINE static void add_squares(const __m256 f, __m256d& acc_lo, __m256d& acc_hi) {
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(f));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1));
    acc_lo = _mm256_fmadd_pd(lo, lo, acc_lo);
    acc_hi = _mm256_fmadd_pd(hi, hi, acc_hi);
  }
#endif

  void lane(int64_t k, double x) {
    lanes[k] = add_square(lanes[k], x);
  }
  void scalar(int64_t i, double x) {
    lane(i % kSqLanes, x);
  }
  // The loop's lane j is lanes[(i + j) % kSqLanes], i where it starts.
  template <typename Step>
  C10_ALWAYS_INLINE int64_t run(int64_t i, int64_t n, Step&& step) {
    // rotated: lanes rotated left by rot, into the accumulators and back. The
    // compiler fences keep g++ from forwarding the accumulators' vector stores
    // into the copies' smaller loads: it then gave them a home on the stack,
    // not in registers.
    const int64_t rot = i % kSqLanes;
    alignas(64) double rotated[kSqLanes];
    std::memcpy(rotated, lanes + rot, (kSqLanes - rot) * sizeof(double));
    std::memcpy(rotated + (kSqLanes - rot), lanes, rot * sizeof(double));
    std::atomic_signal_fence(std::memory_order_seq_cst);
#if defined(FASTCOLL_AVX512BF16)
    // Four 512-bit vectors, lanes 8k..8k+7 in a<k>: the same lanes, and the
    // same one-rounding FMA per lane, as the AVX2 layout below, in half the
    // instructions.
    __m512d a0 = _mm512_load_pd(rotated), a1 = _mm512_load_pd(rotated + 8);
    __m512d a2 = _mm512_load_pd(rotated + 16), a3 = _mm512_load_pd(rotated + 24);
    for (; i + kObsStep <= n; i += kObsStep) {
      FVec v[4];
      step(i, v);
      __m512d x;
      x = _mm512_cvtps_pd(v[0]);
      a0 = _mm512_fmadd_pd(x, x, a0);
      x = _mm512_cvtps_pd(v[1]);
      a1 = _mm512_fmadd_pd(x, x, a1);
      x = _mm512_cvtps_pd(v[2]);
      a2 = _mm512_fmadd_pd(x, x, a2);
      x = _mm512_cvtps_pd(v[3]);
      a3 = _mm512_fmadd_pd(x, x, a3);
    }
    _mm512_store_pd(rotated, a0);
    _mm512_store_pd(rotated + 8, a1);
    _mm512_store_pd(rotated + 16, a2);
    _mm512_store_pd(rotated + 24, a3);
#elif defined(CPU_CAPABILITY_AVX2)
    // Eight vectors, lanes 4k..4k+3 in a<k>.
    __m256d a0 = _mm256_load_pd(rotated), a1 = _mm256_load_pd(rotated + 4);
    __m256d a2 = _mm256_load_pd(rotated + 8), a3 = _mm256_load_pd(rotated + 12);
    __m256d a4 = _mm256_load_pd(rotated + 16), a5 = _mm256_load_pd(rotated + 20);
    __m256d a6 = _mm256_load_pd(rotated + 24), a7 = _mm256_load_pd(rotated + 28);
    for (; i + kObsStep <= n; i += kObsStep) {
      FVec v[4];
      step(i, v);
      add_squares(v[0], a0, a1);
      add_squares(v[1], a2, a3);
      add_squares(v[2], a4, a5);
      add_squares(v[3], a6, a7);
    }
    _mm256_store_pd(rotated, a0);
    _mm256_store_pd(rotated + 4, a1);
    _mm256_store_pd(rotated + 8, a2);
    _mm256_store_pd(rotated + 12, a3);
    _mm256_store_pd(rotated + 16, a4);
    _mm256_store_pd(rotated + 20, a5);
    _mm256_store_pd(rotated + 24, a6);
    _mm256_store_pd(rotated + 28, a7);
#else
    for (; i + kObsStep <= n; i += kObsStep) {
      FVec v[4];
      step(i, v);
      float f[kSqLanes];
      for (int q = 0; q < 4; ++q) v[q].store(f + q * FVec::size());
      for (int j = 0; j < kSqLanes; ++j) rotated[j] = add_square(rotated[j], static_cast<double>(f[j]));
    }
#endif
    std::atomic_signal_fence(std::memory_order_seq_cst);
    std::memcpy(lanes + rot, rotated, (kSqLanes - rot) * sizeof(double));
    std::memcpy(lanes, rotated + (kSqLanes - rot), rot * sizeof(double));
    return i;
  }
  double result() {
    for (int w = kSqLanes / 2; w > 0; w /= 2) {
      for (int k = 0; k < w; ++k) lanes[k] += lanes[k + w];
    }
    return lanes[0];
  }
};

struct NonFiniteObserver {
  // step(): the products before the cast to the destination dtype, checked
  // against finite_bound<D>() (the cast rounds to nearest even, so |v| below
  // the bound is finite after it and |v| at or above it, or NaN, is not).
  static constexpr bool kNeedsStored = false;
  float bound;
  bool bad = false;
  explicit NonFiniteObserver(float bound_) : bound(bound_) {}
  void lane(int64_t, double x) {  // x: a stored value
    bad |= !(std::fabs(x) < std::numeric_limits<double>::infinity());
  }
  void scalar(int64_t i, double x) {
    lane(i, x);
  }
  template <typename Step>
  C10_ALWAYS_INLINE int64_t run(int64_t i, int64_t n, Step&& step) {
#if defined(CPU_CAPABILITY_AVX2)
    __m256 seen = _mm256_setzero_ps();  // lanes that met a value at or above the bound, or NaN
    const __m256 vbound = _mm256_set1_ps(bound);
    for (; i + kObsStep <= n; i += kObsStep) {
      FVec v[4];
      step(i, v);
      for (int q = 0; q < 4; ++q) seen = _mm256_or_ps(seen, _mm256_cmp_ps(v[q].abs(), vbound, _CMP_NLT_UQ));
    }
    bad |= _mm256_movemask_ps(seen) != 0;
#else
    bool seen = false;
    for (; i + kObsStep <= n; i += kObsStep) {
      FVec v[4];
      step(i, v);
      float f[kSqLanes];
      for (int q = 0; q < 4; ++q) v[q].store(f + q * FVec::size());
      for (int j = 0; j < kSqLanes; ++j) seen |= !(std::fabs(f[j]) < bound);
    }
    bad |= seen;
#endif
    return i;
  }
  bool result() const {
    return bad;
  }
};

// |v| below this float is finite once v is rounded to D (to nearest even):
// float16's largest finite value is 65504 and 65520 the halfway point to the
// next binade; bfloat16's is 0x7F7F0000 and the halfway point 0x7F7F8000.
template <typename D>
inline float finite_bound() {
  if constexpr (std::is_same_v<D, c10::Half>) {
    return 65520.0f;
  } else if constexpr (std::is_same_v<D, c10::BFloat16>) {
    const uint32_t bits = 0x7F7F8000u;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  } else {
    return std::numeric_limits<float>::infinity();
  }
}

// Stores a and b (2 * FVec::size() values) to p as D, like FloatPair<D>::store
// / stream; with kKeep, a and b become the values as stored.
template <typename D, bool kStream, bool kKeep>
inline void put_pair(D* p, FVec& a, FVec& b) {
  if constexpr (std::is_same_v<D, float>) {
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (kStream) {
      FloatPair<float>::stream(p, a, b);
      return;
    }
#endif
    FloatPair<float>::store(p, a, b);
  } else {
    const auto r = reduced_from_floats<D>(a, b);
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (kStream) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(p), r);
    } else {
      r.store(p);
    }
#else
    r.store(p);
#endif
    if constexpr (kKeep) std::tie(a, b) = at::vec::convert_to_float<D>(r);
  }
}

// kObsStep elements of T copied as they are (to dst unless it is null;
// non-temporal stores with kStream, dst then 32-byte aligned), and their values
// as 4 float vectors.
template <typename T, bool kStream>
inline void copy_bits_step(const T* src, T* dst, FVec* v) {
  if constexpr (std::is_same_v<T, float>) {
    for (int q = 0; q < 4; ++q) v[q] = FVec::loadu(src + q * FVec::size());
    if (dst != nullptr) {
#if defined(CPU_CAPABILITY_AVX2)
      if constexpr (kStream) {
        for (int q = 0; q < 4; ++q) _mm256_stream_ps(dst + q * FVec::size(), v[q]);
        return;
      }
#endif
      for (int q = 0; q < 4; ++q) v[q].store(dst + q * FVec::size());
    }
  } else {  // float16 / bfloat16
    using RVec = Vectorized<T>;
    static_assert(2 * RVec::size() == kObsStep, "two 16-bit vectors make a step");
    const RVec r0 = RVec::loadu(src);
    const RVec r1 = RVec::loadu(src + RVec::size());
    if (dst != nullptr) {
#if defined(CPU_CAPABILITY_AVX2)
      if constexpr (kStream) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), r0);
        _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + RVec::size()), r1);
      } else {
        r0.store(dst);
        r1.store(dst + RVec::size());
      }
#else
      r0.store(dst);
      r1.store(dst + RVec::size());
#endif
    }
    std::tie(v[0], v[1]) = at::vec::convert_to_float<T>(r0);
    std::tie(v[2], v[3]) = at::vec::convert_to_float<T>(r1);
  }
}

// Float math (neither side float64): D(float(x) * fscale), or with kIdentity
// (S == D, scale exactly 1) the bits of x; dst may be null (read-only, kIdentity only).
template <typename S, typename D, bool kStream, bool kIdentity, typename Obs>
void observed_float(const S* src, D* dst, int64_t n, float fscale, Obs& obs) {
  auto value = [&](int64_t i) -> D {
    if constexpr (kIdentity) {
      return src[i];
    } else {
      return static_cast<D>(static_cast<float>(src[i]) * fscale);
    }
  };
  const FVec vscale(fscale);
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (kStream) {
    for (; i < n && !aligned32(dst + i); ++i) {  // scalar head up to the destination's 32-byte boundary
      const D d = value(i);
      dst[i] = d;
      obs.scalar(i, static_cast<double>(static_cast<float>(d)));
    }
  }
#endif
  i = obs.run(i, n, [&](int64_t j, FVec* v) FASTCOLL_INLINE_LAMBDA {
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (kStream) prefetch_ahead(src + j, kObsStep);
#endif
    if constexpr (kIdentity) {
      copy_bits_step<S, kStream>(src + j, dst == nullptr ? nullptr : dst + j, v);
    } else {
      FloatPair<S>::load(src + j, v[0], v[1]);
      FloatPair<S>::load(src + j + 2 * FVec::size(), v[2], v[3]);
      for (int q = 0; q < 4; ++q) v[q] = v[q] * vscale;
      put_pair<D, kStream, Obs::kNeedsStored>(dst + j, v[0], v[1]);
      put_pair<D, kStream, Obs::kNeedsStored>(dst + j + 2 * FVec::size(), v[2], v[3]);
    }
  });
  for (; i < n; ++i) {
    const D d = value(i);
    if (dst != nullptr) dst[i] = d;
    obs.scalar(i, static_cast<double>(static_cast<float>(d)));
  }
}

// float64 math: D(double(x) * scale), or with identity (S == D, scale exactly
// 1) the bits of x; dst may be null (read-only, identity only). Written in
// rounds of kSqLanes so that the compiler can vectorize it.
template <typename S, typename D, typename Obs>
void observed_double(const S* src, D* dst, int64_t n, double scale, bool identity, Obs& obs) {
  auto value = [&](int64_t i) -> D {
    if constexpr (std::is_same_v<S, D>) {
      if (identity) return src[i];
    }
    return static_cast<D>(static_cast<double>(src[i]) * scale);
  };
  int64_t i = 0;
  for (; i + kSqLanes <= n; i += kSqLanes) {
    for (int k = 0; k < kSqLanes; ++k) {
      const D d = value(i + k);
      if (dst != nullptr) dst[i + k] = d;
      obs.lane(k, static_cast<double>(d));
    }
  }
  for (; i < n; ++i) {
    const D d = value(i);
    if (dst != nullptr) dst[i] = d;
    obs.scalar(i, static_cast<double>(d));
  }
}

// The observed copy of n elements; the same values and bits as copy_scale<S, D, kStream, kF64>.
template <typename S, typename D, bool kStream, bool kF64, typename Obs>
void copy_observed(const S* src, D* dst, int64_t n, double scale, Obs& obs) {
  const bool identity = std::is_same_v<S, D> && scale == 1.0;  // copy_scale copies bits here too
  if (identity && static_cast<const void*>(dst) == static_cast<const void*>(src)) dst = nullptr;  // in place: nothing changes
  if constexpr (kDoubleMath<S, D, kF64>) {
    observed_double<S, D>(src, dst, n, scale, identity, obs);
  } else {
    if constexpr (std::is_same_v<S, D>) {
      if (identity) {
        if (dst == nullptr) {
          observed_float<S, D, false, true>(src, dst, n, 1.0f, obs);
        } else {
          observed_float<S, D, kStream, true>(src, dst, n, 1.0f, obs);
        }
        return;
      }
    }
    observed_float<S, D, kStream, false>(src, dst, n, static_cast<float>(scale), obs);
  }
}

template <typename S, typename D, bool kStream, bool kF64>
double copy_sumsq_erased(const void* src, void* dst, int64_t n, double scale) {
  SquaresObserver obs;
  copy_observed<S, D, kStream, kF64>(static_cast<const S*>(src), static_cast<D*>(dst), n, scale, obs);
  return obs.result();
}

template <typename S, typename D, bool kStream, bool kF64>
bool copy_check_erased(const void* src, void* dst, int64_t n, double scale) {
  NonFiniteObserver obs(finite_bound<D>());
  copy_observed<S, D, kStream, kF64>(static_cast<const S*>(src), static_cast<D*>(dst), n, scale, obs);
  return obs.result();
}

template <typename S, typename D, bool kStream, bool kF64>
HealthFns health_fns_of() {
  return {&copy_scale_erased<S, D, kStream, kF64>, &copy_sumsq_erased<S, D, kStream, kF64>,
          &copy_check_erased<S, D, kStream, kF64>};
}

template <typename S>
HealthFns pick_health_from(at::ScalarType dst, bool streaming, bool f64) {
  const bool stream = streaming && kCanStream;
  switch (dst) {
#define FASTCOLL_PICK_HEALTH_TO(code, T, st, name)                                         \
  case at::ScalarType::st:                                                                 \
    return f64 ? (stream ? health_fns_of<S, T, true, true>() : health_fns_of<S, T, false, true>()) \
               : (stream ? health_fns_of<S, T, true, false>() : health_fns_of<S, T, false, false>());
    FASTCOLL_FOR_EACH_DTYPE(FASTCOLL_PICK_HEALTH_TO)
#undef FASTCOLL_PICK_HEALTH_TO
    default:
      return {nullptr, nullptr, nullptr};
  }
}

// The plain, sum-of-squares and non-finite-checking copies for one (source,
// destination) dtype pair of the table in dtypes.h; f64: multiply in float64
// whatever the dtypes. sum_of_squares passes the source dtype twice, a null
// destination and a scale of 1: the observer then sees the source's values.
HealthFns pick_health(at::ScalarType src, at::ScalarType dst, bool streaming, bool f64) {
  HealthFns fns{nullptr, nullptr, nullptr};
  switch (src) {
#define FASTCOLL_PICK_HEALTH_FROM(code, T, st, name) \
  case at::ScalarType::st:                           \
    fns = pick_health_from<T>(dst, streaming, f64);  \
    break;
    FASTCOLL_FOR_EACH_DTYPE(FASTCOLL_PICK_HEALTH_FROM)
#undef FASTCOLL_PICK_HEALTH_FROM
    default:
      break;
  }
  TORCH_CHECK(fns.copy != nullptr, "fastcoll internal error: no CPU health kernel for ", src, " -> ", dst, ". Please report this");
  return fns;
}


// ---------------------------------------------------------------------------
// flatten_accumulate: dst[i] = D(fma(M(src[i]), M(scale), M(dst[i]))).
//
// M is float unless either side is float64 (kDoubleMath). One fused
// multiply-add: the exact src * scale + dst rounded once to M (VFMADD in the
// AVX2 builds' vector loop, std::fma in their scalar tails and in the baseline
// build: the same bits), then cast to D as copy_scale stores it (a no-op for
// D == M). The vector loop reads a step of source and destination in the same
// element order (StepIO's), so a source that is its own slot of the
// destination (an in-place (1 + scale) * x) is read before it is written.
// An observer (NonFiniteObserver, or NoObserver for the plain loop) sees each
// step's results before the cast and each scalar as stored. There is no
// streaming variant: the destination is read first, so its lines are in the
// cache already and non-temporal stores would save no memory traffic.
// ---------------------------------------------------------------------------

// Observes nothing (the plain accumulation; compiled away).
struct NoObserver {
  static constexpr bool kNeedsStored = false;
  void lane(int64_t, double) {}
  void scalar(int64_t, double) {}
  template <typename Step>
  C10_ALWAYS_INLINE int64_t run(int64_t i, int64_t n, Step&& step) {
    for (; i + kObsStep <= n; i += kObsStep) {
      FVec v[4];
      step(i, v);
    }
    return i;
  }
};

// How a step of the accumulation reads the destination: in the order StepIO<S, D>
// reads the source and stores (StepIO<D, D>'s own when S == D).
template <typename S, typename D>
inline void load_destination(const D* p, FVec& a, FVec& b) {
  if constexpr (std::is_same_v<S, D>) {
    StepIO<D, D>::load(p, a, b);
  } else {
    FloatPair<D>::load(p, a, b);
  }
}

// Float math (neither side float64).
template <typename S, typename D, typename Obs>
void accumulate_float(const S* src, D* dst, int64_t n, float fscale, Obs& obs) {
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX2)
  const FVec vscale(fscale);
  constexpr int64_t kHalf = 2 * FVec::size();
  i = obs.run(i, n, [&](int64_t j, FVec* v) FASTCOLL_INLINE_LAMBDA {
    FVec x[4];
    StepIO<S, D>::load(src + j, x[0], x[1]);
    StepIO<S, D>::load(src + j + kHalf, x[2], x[3]);
    load_destination<S, D>(dst + j, v[0], v[1]);
    load_destination<S, D>(dst + j + kHalf, v[2], v[3]);
    for (int q = 0; q < 4; ++q) v[q] = _mm256_fmadd_ps(x[q], vscale, v[q]);
    StepIO<S, D>::store(dst + j, v[0], v[1]);
    StepIO<S, D>::store(dst + j + kHalf, v[2], v[3]);
  });
#endif
  for (; i < n; ++i) {
    const D d = static_cast<D>(std::fma(static_cast<float>(src[i]), fscale, static_cast<float>(dst[i])));
    dst[i] = d;
    obs.scalar(i, static_cast<double>(static_cast<float>(d)));
  }
}

// float64 math, written in rounds of kSqLanes so that the compiler can vectorize it.
template <typename S, typename D, typename Obs>
void accumulate_double(const S* src, D* dst, int64_t n, double scale, Obs& obs) {
  auto value = [&](int64_t i) -> D {
    return static_cast<D>(std::fma(static_cast<double>(src[i]), scale, static_cast<double>(dst[i])));
  };
  int64_t i = 0;
  for (; i + kSqLanes <= n; i += kSqLanes) {
    for (int k = 0; k < kSqLanes; ++k) {
      const D d = value(i + k);
      dst[i + k] = d;
      obs.lane(k, static_cast<double>(d));
    }
  }
  for (; i < n; ++i) {
    const D d = value(i);
    dst[i] = d;
    obs.scalar(i, static_cast<double>(d));
  }
}

template <typename S, typename D, typename Obs>
void accumulate_observed(const S* src, D* dst, int64_t n, double scale, Obs& obs) {
  if constexpr (kDoubleMath<S, D, false>) {
    accumulate_double<S, D>(src, dst, n, scale, obs);
  } else {
    accumulate_float<S, D>(src, dst, n, static_cast<float>(scale), obs);
  }
}

template <typename S, typename D>
void accumulate_erased(const void* src, void* dst, int64_t n, double scale) {
  NoObserver obs;
  accumulate_observed<S, D>(static_cast<const S*>(src), static_cast<D*>(dst), n, scale, obs);
}

template <typename S, typename D>
bool accumulate_check_erased(const void* src, void* dst, int64_t n, double scale) {
  NonFiniteObserver obs(finite_bound<D>());
  accumulate_observed<S, D>(static_cast<const S*>(src), static_cast<D*>(dst), n, scale, obs);
  return obs.result();
}

template <typename S>
AccumulateFns pick_accumulate_from(at::ScalarType dst) {
  switch (dst) {
#define FASTCOLL_PICK_ACCUMULATE_TO(code, T, st, name) \
  case at::ScalarType::st:                             \
    return {&accumulate_erased<S, T>, &accumulate_check_erased<S, T>};
    FASTCOLL_FOR_EACH_DTYPE(FASTCOLL_PICK_ACCUMULATE_TO)
#undef FASTCOLL_PICK_ACCUMULATE_TO
    default:
      return {nullptr, nullptr};
  }
}

// The plain and non-finite-checking accumulations for one (source,
// destination) dtype pair of the table in dtypes.h.
AccumulateFns pick_accumulate(at::ScalarType src, at::ScalarType dst) {
  AccumulateFns fns{nullptr, nullptr};
  switch (src) {
#define FASTCOLL_PICK_ACCUMULATE_FROM(code, T, st, name) \
  case at::ScalarType::st:                               \
    fns = pick_accumulate_from<T>(dst);                  \
    break;
    FASTCOLL_FOR_EACH_DTYPE(FASTCOLL_PICK_ACCUMULATE_FROM)
#undef FASTCOLL_PICK_ACCUMULATE_FROM
    default:
      break;
  }
  TORCH_CHECK(
      fns.accumulate != nullptr, "fastcoll internal error: no CPU accumulate kernel for ", src, " -> ", dst,
      ". Please report this");
  return fns;
}

// sum_chunks (SumChunksFn): plain loops over blocks of columns, each row's
// block read once, in row order, which the compiler vectorizes for this
// build's target (4 doubles per AVX2 vector). Each step is one IEEE operation
// (double add, one double multiply, the conversions) and no add follows the
// multiply, so nothing can be contracted: every build stores the same bits.
template <typename In, typename Out>
void sum_chunks_columns(const void* in_, void* out_, int64_t rows, int64_t n, int64_t begin, int64_t end, double scale) {
  const In* in = static_cast<const In*>(in_);
  Out* out = static_cast<Out*>(out_);
  constexpr int64_t kBlock = 256;
  double acc[kBlock];
  for (int64_t lo = begin; lo < end; lo += kBlock) {
    const int64_t m = std::min(kBlock, end - lo);
    const In* row = in + lo;
    for (int64_t j = 0; j < m; ++j) acc[j] = static_cast<double>(static_cast<float>(row[j]));
    for (int64_t r = 1; r < rows; ++r) {
      row = in + r * n + lo;
      for (int64_t j = 0; j < m; ++j) acc[j] = acc[j] + static_cast<double>(static_cast<float>(row[j]));
    }
    for (int64_t j = 0; j < m; ++j) out[lo + j] = static_cast<Out>(static_cast<float>(acc[j] * scale));
  }
}

// The sum of float16 or bfloat16 chunks into float32 (out_f32) or the chunks' dtype.
SumChunksFn pick_sum_chunks(at::ScalarType in, bool out_f32) {
  if (in == at::kBFloat16) {
    return out_f32 ? &sum_chunks_columns<c10::BFloat16, float> : &sum_chunks_columns<c10::BFloat16, c10::BFloat16>;
  }
  return out_f32 ? &sum_chunks_columns<c10::Half, float> : &sum_chunks_columns<c10::Half, c10::Half>;
}

}  // namespace FASTCOLL_CPU_NS
}  // namespace fastcoll
