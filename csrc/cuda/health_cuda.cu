// CUDA kernels of the gradient-health ops: fastcoll::flatten_scale_ex,
// fastcoll::unflatten_scale_ex and fastcoll::sum_of_squares.
//
// The same chunk table and per-chunk loop as flatten_scale / unflatten_scale
// (copy_chunk.cuh: one block per chunk of at most 64 KiB of the wider dtype,
// 16-byte vectors where co-aligned), run with an observer of the values each
// thread stores, and the same ways of passing the table (the kernel argument
// itself up to 512 chunks, capturable in CUDA graphs; device memory beyond).
// One launch per call for the work, plus, for a sum, one single-block launch
// that adds the per-chunk partials. No host synchronization, no atomics.
// Arguments are checked, the table built and the partials allocated by
// csrc/cuda/cuda_ops.cpp before the launchers are entered (launch.h).
//
// * flatten_scale_ex: scale_by is a device pointer read by every thread; a
//   block that stored a NaN or +-Inf (__syncthreads_or) has its thread 0 write
//   1 to nonfinite[0] (several blocks may write the same 1).
// * unflatten_scale_ex / sum_of_squares: each thread adds the squares of the
//   values it stores (reads) in float64, in its fixed order; the block adds its
//   threads' sums in a fixed tree (block_sum) and writes one partial per chunk
//   to a scratch buffer; sum_partials_kernel then adds the partials with the
//   same fixed tree over a fixed striding. Chunk boundaries depend on the
//   tensors' sizes and dtypes only and each thread's order on the chunk's
//   alignment, so the same tensors give the same bits run after run (not the
//   CPU kernels' bits: their fixed order is another).
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/copy_chunk.cuh"
#include "cuda/inline_table.cuh"
#include "cuda/launch.h"

namespace fastcoll {
namespace {

using cuda_chunks::ChunkDesc;
using cuda_chunks::InlineTable;
using cuda_chunks::kThreads;
using cuda_launch::HealthArgs;
using cuda_launch::HealthMode;

static_assert(sizeof(InlineTable<cuda_chunks::kMidTable>) + sizeof(HealthArgs) <= 4096, "the mid table must fit in 4 KiB of arguments");
static_assert(
    sizeof(InlineTable<cuda_chunks::kLargeInline>) + sizeof(HealthArgs) <= 32764, "the large table must fit in the argument space");

// The sum of every thread's v, added in a fixed tree (the same additions in
// the same order on every run); the result in every thread.
__device__ __forceinline__ double block_sum(double v) {
  __shared__ double s[kThreads];
  s[threadIdx.x] = v;
  __syncthreads();
#pragma unroll
  for (int w = kThreads / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) s[threadIdx.x] += s[threadIdx.x + w];
    __syncthreads();
  }
  const double total = s[0];
  __syncthreads();  // s may be reused
  return total;
}

template <HealthMode kMode>
__device__ __forceinline__ void run_block(const ChunkDesc& d, const HealthArgs& a) {
  const int tid = static_cast<int>(threadIdx.x);
  const int nthreads = static_cast<int>(blockDim.x);
  if constexpr (kMode == HealthMode::kPack) {
    cuda_chunks::NonFiniteSeen seen;
    const cuda_chunks::Factor f{a.scale, a.scale_by, a.scale_by_f64 != 0};
    cuda_chunks::run_chunk_seen<true>(d, f, &seen, tid, nthreads);
    if (a.nonfinite != nullptr) {  // the same in every thread of the block
      if (__syncthreads_or(seen.bad) && tid == 0) *a.nonfinite = 1;
    }
  } else {
    cuda_chunks::SquaresSeen seen;
    if constexpr (kMode == HealthMode::kUnpack) {
      const cuda_chunks::Factor f{a.scale, nullptr, false};
      cuda_chunks::run_chunk_seen<false>(d, f, &seen, tid, nthreads);
    } else {
      cuda_chunks::read_chunk_seen(d, &seen, tid, nthreads);
    }
    const double total = block_sum(seen.sum);
    if (tid == 0) a.partials[blockIdx.x] = total;
  }
}

template <int N, HealthMode kMode>
__global__ void __launch_bounds__(kThreads) health_inline_kernel(const __grid_constant__ InlineTable<N> table, const HealthArgs args) {
  run_block<kMode>(table.chunks[blockIdx.x], args);
}

template <HealthMode kMode>
__global__ void __launch_bounds__(kThreads) health_table_kernel(const ChunkDesc* chunks, const HealthArgs args) {
  run_block<kMode>(chunks[blockIdx.x], args);
}

// *out = the sum of partials[0..n): thread t adds partials t, t + kThreads, ...
// in order, then block_sum. One block; n == 0 writes 0.
__global__ void __launch_bounds__(kThreads) sum_partials_kernel(const double* partials, int64_t n, double* out) {
  double v = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) v += partials[i];
  const double total = block_sum(v);
  if (threadIdx.x == 0) *out = total;
}

template <HealthMode kMode>
struct HealthInline {
  template <int N>
  static const void* get() noexcept {
    return reinterpret_cast<const void*>(&health_inline_kernel<N, kMode>);
  }
};

template <HealthMode kMode>
cuda_chunks::KernelSet health_kernels() noexcept {
  return cuda_chunks::kernel_set<HealthInline<kMode>>(reinterpret_cast<const void*>(&health_table_kernel<kMode>));
}

}  // namespace

namespace cuda_launch {

cudaError_t launch_health(const Table& table, const HealthArgs& args, HealthMode mode, cudaStream_t stream) noexcept {
  HealthArgs a = args;
  void* kernel_args[2] = {nullptr, &a};
  switch (mode) {
    case HealthMode::kPack: return cuda_chunks::launch_chunks(health_kernels<HealthMode::kPack>(), table, kernel_args, stream);
    case HealthMode::kUnpack:
      return cuda_chunks::launch_chunks(health_kernels<HealthMode::kUnpack>(), table, kernel_args, stream);
    case HealthMode::kRead: return cuda_chunks::launch_chunks(health_kernels<HealthMode::kRead>(), table, kernel_args, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_sum_partials(const double* partials, int64_t n, double* out, cudaStream_t stream) noexcept {
  sum_partials_kernel<<<1, kThreads, 0, stream>>>(partials, n, out);
  return cuda_chunks::launch_error(cudaSuccess);
}

}  // namespace cuda_launch
}  // namespace fastcoll
