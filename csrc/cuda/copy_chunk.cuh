// The per-chunk work of the CUDA kernels and the chunk descriptor they read.
//
// Device code and constants only: nothing here throws, allocates or calls into
// torch beyond c10's Half/BFloat16 conversions (tests/test_cuda_no_throw.py).
// The host side, which cuts segments into chunks and writes the descriptors,
// is chunk_table.h, compiled by the host compiler only (csrc/cuda/cuda_ops.cpp).
//
// Written so that it also compiles as plain C++: nvcc builds it into the
// kernels (flatten_scale_cuda.cu, health_cuda.cu for the gradient-health
// ops, which run the same chunk loop with an observer of the stored values,
// and accumulate_cuda.cu, whose loop also reads the destination),
// and the C++ test (tests/cpp) runs the very same code on the CPU, calling run_chunk once per (chunk, thread) the way a
// launch would, to check the chunk table and the head / 16-byte vector / tail
// split against a float64 reference without a GPU.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "dtypes.h"

#if defined(__CUDACC__)
#define FASTCOLL_HOST_DEVICE __host__ __device__ __forceinline__
#define FASTCOLL_UNROLL _Pragma("unroll")
#else
#define FASTCOLL_HOST_DEVICE inline
#define FASTCOLL_UNROLL
#endif

namespace fastcoll {
namespace cuda_chunks {

constexpr int kThreads = 256;  // threads per block (one block per chunk)
constexpr int kUnroll = 4;     // independent loads in flight per thread
constexpr int kVecBytes = 16;  // one vector load or store

// A chunk is at most kChunkBytes of the wider of its source and destination
// dtypes: chunk_elements() = kChunkBytes / max(source, destination element
// size), 16384 elements for float32 (as float32, or packed to/from 16 bits),
// 32768 for 16-bit pairs, 8192 when float64 is on either side. Sizing by bytes
// rather than elements gives every dtype pair the same work per block: one
// pass of a block moves kThreads * kUnroll * 16 bytes = 16 KiB of the wider
// side, so a full chunk is 4 passes whatever the dtypes, and a 25 MiB bucket
// (25 MiB of its wider side; in fastcoll.DDP the gradients, as the wire dtype
// never widens) is 400 full chunks plus at most one partial chunk per tensor
// boundary: within the 512-chunk kernel-argument table for up to 113 tensors,
// while the 400 blocks still fill a GPU (132 SMs on an H100) about three deep.
// Half that size (32 KiB) would make a 25 MiB bucket 800 chunks.
constexpr int64_t kChunkBytes = 64 * 1024;
constexpr int64_t kPassBytes = int64_t(kThreads) * kUnroll * kVecBytes;
static_assert(kChunkBytes % kPassBytes == 0, "a full chunk is whole passes of a block");
// Per-chunk index math is 32-bit: the most elements a chunk can have must fit.
constexpr int64_t kMaxChunkElements = kChunkBytes / int64_t(kMinElementSize);
static_assert(kMaxChunkElements + int64_t(kUnroll) * kThreads <= INT32_MAX, "per-chunk indices must fit in int");

// One block's work: `numel` elements from address `src` to address `dst`.
struct ChunkDesc {
  int64_t src;    // address of the first source element
  int64_t dst;    // address of the first destination element
  int64_t numel;  // elements in this chunk, 1..chunk_elements(src dtype, dst dtype)
  int64_t kinds;  // dtype_code(src) << kDtypeCodeBits | dtype_code(dst)
};
static_assert(sizeof(ChunkDesc) == 4 * sizeof(int64_t), "ChunkDesc is sent as int64 words");

// How the chunk table reaches the kernel (chosen by cuda/cuda_ops.cpp): as
// the kernel argument itself, in a table of kSmallTable, kMidTable or
// kLargeTable descriptors (the smallest that holds it, so that small calls
// copy few argument bytes), or, past the largest table this process may pass,
// from device memory (uploaded through pinned host memory).
constexpr int kSmallTable = 32;
constexpr int kMidTable = 120;    // 3840 bytes + the scale: within the classic 4 KiB of kernel arguments
constexpr int kLargeTable = 512;  // 16 KiB: needs CUDA 12.1+, toolkit and driver (32764 bytes of arguments)
static_assert(kMidTable * sizeof(ChunkDesc) + sizeof(double) <= 4096, "the mid table must fit in 4 KiB of arguments");
static_assert(kLargeTable * sizeof(ChunkDesc) + sizeof(double) <= 32764, "the large table must fit in the argument space");

enum class TablePath { kSmall, kMid, kLarge, kPinned };

// The path of a call of `nchunks` chunks when tables of up to `max_inline`
// chunks may be kernel arguments (kLargeTable, or kMidTable where the toolkit
// or the driver predates CUDA 12.1).
constexpr TablePath choose_table(int64_t nchunks, int64_t max_inline) {
  if (nchunks <= kSmallTable) return TablePath::kSmall;
  if (nchunks <= kMidTable) return TablePath::kMid;
  if (nchunks <= std::min<int64_t>(max_inline, kLargeTable)) return TablePath::kLarge;
  return TablePath::kPinned;
}

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// float math, or double when either side is double.
template <typename S, typename D>
using opmath_t = std::conditional_t<std::is_same_v<S, double> || std::is_same_v<D, double>, double, float>;

template <typename S, typename D, typename M>
FASTCOLL_HOST_DEVICE D convert_scale(S x, M scale) {
  return static_cast<D>(static_cast<M>(x) * scale);
}

// Per-chunk index math is 32-bit (a chunk has at most kMaxChunkElements elements),
// which keeps the kernel's register count down.
// Thread `tid` of `nthreads` hands elements tid, tid + nthreads, ... of [0, n)
// to `sink(i, value)`, kUnroll loads in flight before the first hand-over. In
// is a single element or a 16-byte Pack of them. The order in which one thread
// hands over its elements depends only on n, tid and nthreads.
template <typename In, typename Sink>
FASTCOLL_HOST_DEVICE void strided_each(const In* src, int n, Sink sink, int tid, int nthreads) {
  for (int base = tid; base < n; base += kUnroll * nthreads) {
    In in[kUnroll];
FASTCOLL_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * nthreads;
      if (i < n) in[u] = src[i];
    }
FASTCOLL_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * nthreads;
      if (i < n) sink(i, in[u]);
    }
  }
}

// The sink of strided_map: dst[i] = f(value).
template <typename Out, typename F>
struct StoreMapped {
  Out* dst;
  F f;
  template <typename In>
  FASTCOLL_HOST_DEVICE void operator()(int i, const In& x) const {
    dst[i] = f(x);
  }
};

// Thread `tid` of `nthreads` maps elements tid, tid + nthreads, ... of [0, n)
// through `f`, kUnroll loads in flight before the first store. In and Out are
// single elements or 16-byte Packs of them.
template <typename In, typename Out, typename F>
FASTCOLL_HOST_DEVICE void strided_map(const In* src, Out* dst, int n, F f, int tid, int nthreads) {
  strided_each(src, n, StoreMapped<Out, F>{dst, f}, tid, nthreads);
}

// ---- Observers: what the health ops learn from the values a chunk stores (or reads) ----

// Sees nothing: the plain copy (flatten_scale / unflatten_scale).
struct NoHealth {
  template <typename T>
  FASTCOLL_HOST_DEVICE void see(const T&) {}
};

template <typename T>
FASTCOLL_HOST_DEVICE double as_double(const T& v) {
  if constexpr (std::is_same_v<T, double> || std::is_same_v<T, float>) {
    return static_cast<double>(v);
  } else {
    return static_cast<double>(static_cast<float>(v));  // float16 / bfloat16: exact
  }
}

// Whether any value seen is NaN or +-Inf (x - x is 0 exactly for finite x).
struct NonFiniteSeen {
  bool bad = false;
  template <typename T>
  FASTCOLL_HOST_DEVICE void see(const T& v) {
    const double x = as_double(v);
    bad |= !(x - x == 0.0);
  }
};

// The float64 sum of the squares of the values seen, in the order seen.
struct SquaresSeen {
  double sum = 0.0;
  template <typename T>
  FASTCOLL_HOST_DEVICE void see(const T& v) {
    const double x = as_double(v);
    sum += x * x;
  }
};

template <typename H>
constexpr bool kObserves = !std::is_same_v<H, NoHealth>;

// The sinks of a read-only pass (sum_of_squares): every element, or every lane of a Pack, to the observer.
template <typename H>
struct SeeElement {
  H* health;
  template <typename T>
  FASTCOLL_HOST_DEVICE void operator()(int, const T& x) const {
    health->see(x);
  }
};

template <typename T, int N, typename H>
struct SeePack {
  H* health;
  FASTCOLL_HOST_DEVICE void operator()(int, const Pack<T, N>& x) const {
FASTCOLL_UNROLL
    for (int k = 0; k < N; ++k) health->see(x.v[k]);
  }
};

// x * scale as D, one element or every lane of a Pack; an observer H (not
// NoHealth) sees each value as stored.
template <typename S, typename D, typename M, typename H = NoHealth>
struct ScaleElement {
  M scale;
  H* health = nullptr;
  FASTCOLL_HOST_DEVICE D operator()(S x) const {
    const D out = convert_scale<S, D, M>(x, scale);
    if constexpr (kObserves<H>) health->see(out);
    return out;
  }
};

template <typename S, typename D, typename M, int N, typename H = NoHealth>
struct ScalePack {
  M scale;
  H* health = nullptr;
  FASTCOLL_HOST_DEVICE Pack<D, N> operator()(const Pack<S, N>& x) const {
    Pack<D, N> out;
FASTCOLL_UNROLL
    for (int k = 0; k < N; ++k) {
      out.v[k] = convert_scale<S, D, M>(x.v[k], scale);
      if constexpr (kObserves<H>) health->see(out.v[k]);
    }
    return out;
  }
};

template <typename S, typename D, typename M, typename H = NoHealth>
FASTCOLL_HOST_DEVICE void scalar_range(const S* src, D* dst, int n, M scale, int tid, int nthreads, H* health = nullptr) {
  strided_map(src, dst, n, ScaleElement<S, D, M, H>{scale, health}, tid, nthreads);
}

// One thread's share of a chunk: a scalar head up to the source's 16-byte
// boundary, 16-byte vectors when the destination is then aligned too, a scalar
// tail; a scalar loop over everything when source and destination are not
// co-aligned. Every thread computes the same split, so each element is
// written by exactly one thread. An observer (health, not NoHealth) sees the
// values this thread stores, in the order it stores them: an order fixed by
// n, the addresses' alignment, tid and nthreads.
template <typename S, typename D, typename M, typename H = NoHealth>
FASTCOLL_HOST_DEVICE void copy_chunk(const S* src, D* dst, int n, M scale, int tid, int nthreads, H* health = nullptr) {
  constexpr int kWidest = sizeof(S) > sizeof(D) ? sizeof(S) : sizeof(D);
  constexpr int kVec = kVecBytes / kWidest;
  constexpr uintptr_t kSrcAlign = kVec * sizeof(S);
  constexpr uintptr_t kDstAlign = kVec * sizeof(D);
  const auto src_addr = reinterpret_cast<uintptr_t>(src);
  const auto dst_addr = reinterpret_cast<uintptr_t>(dst);
  int head = static_cast<int>(((kSrcAlign - src_addr % kSrcAlign) % kSrcAlign) / sizeof(S));
  if (head > n) head = n;
  if ((dst_addr + head * sizeof(D)) % kDstAlign != 0) {
    scalar_range<S, D, M, H>(src, dst, n, scale, tid, nthreads, health);
    return;
  }
  scalar_range<S, D, M, H>(src, dst, head, scale, tid, nthreads, health);
  const int nvec = (n - head) / kVec;
  const auto* vsrc = reinterpret_cast<const Pack<S, kVec>*>(src + head);
  auto* vdst = reinterpret_cast<Pack<D, kVec>*>(dst + head);
  strided_map(vsrc, vdst, nvec, ScalePack<S, D, M, kVec, H>{scale, health}, tid, nthreads);
  const int done = head + nvec * kVec;
  scalar_range<S, D, M, H>(src + done, dst + done, n - done, scale, tid, nthreads, health);
}

// One thread's share of a read-only chunk (sum_of_squares): the same split on
// the source's alignment alone, every value read handed to the observer.
template <typename S, typename H>
FASTCOLL_HOST_DEVICE void read_chunk(const S* src, int n, int tid, int nthreads, H* health) {
  constexpr int kVec = kVecBytes / sizeof(S);
  constexpr uintptr_t kAlign = kVecBytes;
  const auto addr = reinterpret_cast<uintptr_t>(src);
  int head = static_cast<int>(((kAlign - addr % kAlign) % kAlign) / sizeof(S));
  if (head > n) head = n;
  strided_each(src, head, SeeElement<H>{health}, tid, nthreads);
  const int nvec = (n - head) / kVec;
  strided_each(reinterpret_cast<const Pack<S, kVec>*>(src + head), nvec, SeePack<S, kVec, H>{health}, tid, nthreads);
  const int done = head + nvec * kVec;
  strided_each(src + done, n - done, SeeElement<H>{health}, tid, nthreads);
}

template <typename S, typename D>
FASTCOLL_HOST_DEVICE void run_typed(const ChunkDesc& d, double scale, int tid, int nthreads) {
  using M = opmath_t<S, D>;
  copy_chunk<S, D, M>(
      reinterpret_cast<const S*>(d.src), reinterpret_cast<D*>(d.dst), static_cast<int>(d.numel), static_cast<M>(scale), tid, nthreads);
}

// Codes are fastcoll::dtype_code's, the rows of FASTCOLL_FOR_EACH_DTYPE (dtypes.h).
template <typename S>
FASTCOLL_HOST_DEVICE void run_from(const ChunkDesc& d, int dst_code, double scale, int tid, int nthreads) {
  switch (dst_code) {
#define FASTCOLL_RUN_TO(code, T, st, name) \
  case code:                               \
    run_typed<S, T>(d, scale, tid, nthreads); \
    break;
    FASTCOLL_FOR_EACH_DTYPE(FASTCOLL_RUN_TO)
#undef FASTCOLL_RUN_TO
  }
}

// Thread `tid` of `nthreads`' part of chunk `d`.
FASTCOLL_HOST_DEVICE void run_chunk(const ChunkDesc& d, double scale, int tid, int nthreads) {
  const int src_code = static_cast<int>(d.kinds >> kDtypeCodeBits);
  const int dst_code = static_cast<int>(d.kinds & ((1 << kDtypeCodeBits) - 1));
  switch (src_code) {
#define FASTCOLL_RUN_FROM(code, T, st, name)          \
  case code:                                          \
    run_from<T>(d, dst_code, scale, tid, nthreads);   \
    break;
    FASTCOLL_FOR_EACH_DTYPE(FASTCOLL_RUN_FROM)
#undef FASTCOLL_RUN_FROM
  }
}

// ---- The health ops (csrc/cuda/health_cuda.cu) ----

// flatten_scale_ex's factor: scale, times *by when by is not null (one float,
// or one double when by_f64, read where it lives: device memory in a kernel).
struct Factor {
  double scale;
  const void* by;
  bool by_f64;
};

// The chunk as run_typed copies it, with the factor applied in the chunk's
// math (float unless a side or by is double: the same as the CPU kernels) and
// the stored values shown to `health`. kScaleBy false: f.by is ignored (and
// the float64-factor variant of every pair is not compiled).
template <typename S, typename D, bool kScaleBy, typename H>
FASTCOLL_HOST_DEVICE void run_typed_seen(const ChunkDesc& d, const Factor& f, H* health, int tid, int nthreads) {
  const auto* src = reinterpret_cast<const S*>(d.src);
  auto* dst = reinterpret_cast<D*>(d.dst);
  const int n = static_cast<int>(d.numel);
  using M = opmath_t<S, D>;
  if constexpr (kScaleBy) {
    if (f.by != nullptr && f.by_f64) {
      copy_chunk<S, D, double, H>(src, dst, n, f.scale * *static_cast<const double*>(f.by), tid, nthreads, health);
      return;
    }
    if (f.by != nullptr) {
      const M m = static_cast<M>(f.scale) * static_cast<M>(*static_cast<const float*>(f.by));
      copy_chunk<S, D, M, H>(src, dst, n, m, tid, nthreads, health);
      return;
    }
  }
  copy_chunk<S, D, M, H>(src, dst, n, static_cast<M>(f.scale), tid, nthreads, health);
}

template <typename S, bool kScaleBy, typename H>
FASTCOLL_HOST_DEVICE void run_from_seen(const ChunkDesc& d, int dst_code, const Factor& f, H* health, int tid, int nthreads) {
  switch (dst_code) {
#define FASTCOLL_RUN_SEEN_TO(code, T, st, name)                       \
  case code:                                                          \
    run_typed_seen<S, T, kScaleBy, H>(d, f, health, tid, nthreads);   \
    break;
    FASTCOLL_FOR_EACH_DTYPE(FASTCOLL_RUN_SEEN_TO)
#undef FASTCOLL_RUN_SEEN_TO
  }
}

// Thread `tid` of `nthreads`' part of chunk `d`, copied by factor `f`, the values stored shown to `health`.
template <bool kScaleBy, typename H>
FASTCOLL_HOST_DEVICE void run_chunk_seen(const ChunkDesc& d, const Factor& f, H* health, int tid, int nthreads) {
  const int src_code = static_cast<int>(d.kinds >> kDtypeCodeBits);
  const int dst_code = static_cast<int>(d.kinds & ((1 << kDtypeCodeBits) - 1));
  switch (src_code) {
#define FASTCOLL_RUN_SEEN_FROM(code, T, st, name)                           \
  case code:                                                                \
    run_from_seen<T, kScaleBy, H>(d, dst_code, f, health, tid, nthreads);   \
    break;
    FASTCOLL_FOR_EACH_DTYPE(FASTCOLL_RUN_SEEN_FROM)
#undef FASTCOLL_RUN_SEEN_FROM
  }
}

// Thread `tid` of `nthreads`' part of read-only chunk `d` (sum_of_squares:
// d.dst is unused, the source dtype is both codes), shown to `health`.
template <typename H>
FASTCOLL_HOST_DEVICE void read_chunk_seen(const ChunkDesc& d, H* health, int tid, int nthreads) {
  const int src_code = static_cast<int>(d.kinds >> kDtypeCodeBits);
  const int n = static_cast<int>(d.numel);
  switch (src_code) {
#define FASTCOLL_READ_SEEN(code, T, st, name)                                        \
  case code:                                                                         \
    read_chunk<T, H>(reinterpret_cast<const T*>(d.src), n, tid, nthreads, health);   \
    break;
    FASTCOLL_FOR_EACH_DTYPE(FASTCOLL_READ_SEEN)
#undef FASTCOLL_READ_SEEN
  }
}

// ---- flatten_accumulate (csrc/cuda/accumulate_cuda.cu) ----

// a * b + c with one rounding (the CPU kernels' VFMADD / std::fma).
template <typename M>
FASTCOLL_HOST_DEVICE M fused_multiply_add(M a, M b, M c) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<M, float>) {
    return __fmaf_rn(a, b, c);
  } else {
    return __fma_rn(a, b, c);
  }
#else
  return std::fma(a, b, c);
#endif
}

// Thread `tid` of `nthreads` updates elements tid, tid + nthreads, ... of
// [0, n): dst[i] = f(src[i], dst[i]), kUnroll loads of each in flight before
// the first store. In and Out are single elements or 16-byte Packs of them.
// An element is read and written by the same thread, so src may be dst.
template <typename In, typename Out, typename F>
FASTCOLL_HOST_DEVICE void strided_update(const In* src, Out* dst, int n, F f, int tid, int nthreads) {
  for (int base = tid; base < n; base += kUnroll * nthreads) {
    In in[kUnroll];
    Out old[kUnroll];
FASTCOLL_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * nthreads;
      if (i < n) {
        in[u] = src[i];
        old[u] = dst[i];
      }
    }
FASTCOLL_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * nthreads;
      if (i < n) dst[i] = f(in[u], old[u]);
    }
  }
}

// D(fma(M(x), scale, M(old))), one element or every lane of a Pack; an
// observer H (not NoHealth) sees each value as stored.
template <typename S, typename D, typename M, typename H = NoHealth>
struct AccumulateElement {
  M scale;
  H* health = nullptr;
  FASTCOLL_HOST_DEVICE D operator()(S x, D old) const {
    const D out = static_cast<D>(fused_multiply_add<M>(static_cast<M>(x), scale, static_cast<M>(old)));
    if constexpr (kObserves<H>) health->see(out);
    return out;
  }
};

template <typename S, typename D, typename M, int N, typename H = NoHealth>
struct AccumulatePack {
  M scale;
  H* health = nullptr;
  FASTCOLL_HOST_DEVICE Pack<D, N> operator()(const Pack<S, N>& x, const Pack<D, N>& old) const {
    Pack<D, N> out;
FASTCOLL_UNROLL
    for (int k = 0; k < N; ++k) {
      out.v[k] = static_cast<D>(fused_multiply_add<M>(static_cast<M>(x.v[k]), scale, static_cast<M>(old.v[k])));
      if constexpr (kObserves<H>) health->see(out.v[k]);
    }
    return out;
  }
};

// One thread's share of an accumulated chunk, split as copy_chunk splits a
// copy: a scalar head up to the source's 16-byte boundary, 16-byte vectors
// when the destination is then aligned too, a scalar tail; a scalar loop over
// everything when source and destination are not co-aligned.
template <typename S, typename D, typename M, typename H = NoHealth>
FASTCOLL_HOST_DEVICE void accumulate_chunk(
    const S* src, D* dst, int n, M scale, int tid, int nthreads, H* health = nullptr) {
  constexpr int kWidest = sizeof(S) > sizeof(D) ? sizeof(S) : sizeof(D);
  constexpr int kVec = kVecBytes / kWidest;
  constexpr uintptr_t kSrcAlign = kVec * sizeof(S);
  constexpr uintptr_t kDstAlign = kVec * sizeof(D);
  const AccumulateElement<S, D, M, H> element{scale, health};
  const auto src_addr = reinterpret_cast<uintptr_t>(src);
  const auto dst_addr = reinterpret_cast<uintptr_t>(dst);
  int head = static_cast<int>(((kSrcAlign - src_addr % kSrcAlign) % kSrcAlign) / sizeof(S));
  if (head > n) head = n;
  if ((dst_addr + head * sizeof(D)) % kDstAlign != 0) {
    strided_update(src, dst, n, element, tid, nthreads);
    return;
  }
  strided_update(src, dst, head, element, tid, nthreads);
  const int nvec = (n - head) / kVec;
  const auto* vsrc = reinterpret_cast<const Pack<S, kVec>*>(src + head);
  auto* vdst = reinterpret_cast<Pack<D, kVec>*>(dst + head);
  strided_update(vsrc, vdst, nvec, AccumulatePack<S, D, M, kVec, H>{scale, health}, tid, nthreads);
  const int done = head + nvec * kVec;
  strided_update(src + done, dst + done, n - done, element, tid, nthreads);
}

template <typename S, typename D, typename H>
FASTCOLL_HOST_DEVICE void accumulate_typed(const ChunkDesc& d, double scale, H* health, int tid, int nthreads) {
  using M = opmath_t<S, D>;
  accumulate_chunk<S, D, M, H>(
      reinterpret_cast<const S*>(d.src), reinterpret_cast<D*>(d.dst), static_cast<int>(d.numel), static_cast<M>(scale),
      tid, nthreads, health);
}

template <typename S, typename H>
FASTCOLL_HOST_DEVICE void accumulate_from(const ChunkDesc& d, int dst_code, double scale, H* health, int tid, int nthreads) {
  switch (dst_code) {
#define FASTCOLL_ACCUMULATE_TO(code, T, st, name)                  \
  case code:                                                       \
    accumulate_typed<S, T, H>(d, scale, health, tid, nthreads);    \
    break;
    FASTCOLL_FOR_EACH_DTYPE(FASTCOLL_ACCUMULATE_TO)
#undef FASTCOLL_ACCUMULATE_TO
  }
}

// Thread `tid` of `nthreads`' part of chunk `d`, added by `scale` into its
// destination; the values stored shown to `health` (NoHealth: nullptr).
template <typename H>
FASTCOLL_HOST_DEVICE void run_chunk_accumulate(const ChunkDesc& d, double scale, H* health, int tid, int nthreads) {
  const int src_code = static_cast<int>(d.kinds >> kDtypeCodeBits);
  const int dst_code = static_cast<int>(d.kinds & ((1 << kDtypeCodeBits) - 1));
  switch (src_code) {
#define FASTCOLL_ACCUMULATE_FROM(code, T, st, name)                      \
  case code:                                                            \
    accumulate_from<T, H>(d, dst_code, scale, health, tid, nthreads);   \
    break;
    FASTCOLL_FOR_EACH_DTYPE(FASTCOLL_ACCUMULATE_FROM)
#undef FASTCOLL_ACCUMULATE_FROM
  }
}

}  // namespace cuda_chunks
}  // namespace fastcoll
