// CUDA kernel of fastcoll::flatten_accumulate: out[slot] = out[slot] + scale * tensor.
//
// The chunk table of flatten_scale (copy_chunk.cuh: one block per chunk of at
// most 64 KiB of the wider dtype, 16-byte vectors where source and destination
// are co-aligned, the table passed as the kernel argument up to 512 chunks and
// so capturable in CUDA graphs, read from device memory beyond). Each thread
// reads its elements of the source and of the destination, kUnroll of each in
// flight, and stores D(fma(M(x), M(scale), M(old))) (float math, double when
// either side is double; __fmaf_rn / __fma_rn, the same bits as the CPU
// kernels' FMA). With a nonfinite flag, a block that stored a NaN or +-Inf
// (__syncthreads_or) has its thread 0 write 1 to nonfinite[0]; without one,
// the kernel has no observer at all. One launch per call, no host
// synchronization, no atomics. Elements of out past the last tensor's slot
// belong to no chunk. Arguments are checked, and the table built, by
// csrc/cuda/cuda_ops.cpp before the launcher is entered (launch.h).
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

struct AccumulateArgs {
  double scale;
  int32_t* nonfinite;  // kCheck: the flag on the device
};

static_assert(
    sizeof(InlineTable<cuda_chunks::kMidTable>) + sizeof(AccumulateArgs) <= 4096, "the mid table must fit in 4 KiB of arguments");
static_assert(
    sizeof(InlineTable<cuda_chunks::kLargeInline>) + sizeof(AccumulateArgs) <= 32764,
    "the large table must fit in the argument space");

template <bool kCheck>
__device__ __forceinline__ void run_block(const ChunkDesc& d, const AccumulateArgs& a) {
  const int tid = static_cast<int>(threadIdx.x);
  const int nthreads = static_cast<int>(blockDim.x);
  if constexpr (kCheck) {
    cuda_chunks::NonFiniteSeen seen;
    cuda_chunks::run_chunk_accumulate(d, a.scale, &seen, tid, nthreads);
    if (__syncthreads_or(seen.bad) && tid == 0) *a.nonfinite = 1;
  } else {
    cuda_chunks::run_chunk_accumulate<cuda_chunks::NoHealth>(d, a.scale, nullptr, tid, nthreads);
  }
}

template <int N, bool kCheck>
__global__ void __launch_bounds__(kThreads)
    accumulate_inline_kernel(const __grid_constant__ InlineTable<N> table, const AccumulateArgs args) {
  run_block<kCheck>(table.chunks[blockIdx.x], args);
}

template <bool kCheck>
__global__ void __launch_bounds__(kThreads) accumulate_table_kernel(const ChunkDesc* chunks, const AccumulateArgs args) {
  run_block<kCheck>(chunks[blockIdx.x], args);
}

template <bool kCheck>
struct AccumulateInline {
  template <int N>
  static const void* get() noexcept {
    return reinterpret_cast<const void*>(&accumulate_inline_kernel<N, kCheck>);
  }
};

}  // namespace

namespace cuda_launch {

cudaError_t launch_accumulate(const Table& table, double scale, int32_t* nonfinite, cudaStream_t stream) noexcept {
  AccumulateArgs a{scale, nonfinite};
  void* args[2] = {nullptr, &a};
  const auto kernels = nonfinite != nullptr
      ? cuda_chunks::kernel_set<AccumulateInline<true>>(reinterpret_cast<const void*>(&accumulate_table_kernel<true>))
      : cuda_chunks::kernel_set<AccumulateInline<false>>(reinterpret_cast<const void*>(&accumulate_table_kernel<false>));
  return cuda_chunks::launch_chunks(kernels, table, args, stream);
}

}  // namespace cuda_launch
}  // namespace fastcoll
