// CUDA kernels of fastcoll::flatten_scale and fastcoll::unflatten_scale.
//
// One launch per call, whatever the number of tensors. The host cuts every
// segment into chunks of at most 64 KiB of the wider of its source and
// destination dtypes (kChunkBytes, copy_chunk.cuh) and writes one small
// descriptor per chunk (source, destination, length, dtype pair); each block
// handles one chunk. Work is thus split in proportion to bytes: a huge
// embedding gets many blocks, a bias gets one. Inside a chunk, 16-byte vector
// loads/stores are used when source and destination are co-aligned, with a
// scalar head and tail; otherwise a scalar loop (copy_chunk.cuh, which the C++
// test also runs on the CPU). No host synchronization.
//
// How the chunk table reaches the device (chosen by csrc/cuda/cuda_ops.cpp,
// which also checks every argument before this file's launcher is entered):
// * up to 512 chunks (120 with a CUDA driver or toolkit older than 12.1): as
//   the kernel argument itself, read in place from the parameter space
//   (__grid_constant__): no upload, nothing to wait for, and safe to capture
//   in a CUDA graph. A 25 MiB bucket (of its wider dtype: the gradients' in
//   fastcoll.DDP) is 400 chunks plus at most one per tensor boundary, so any
//   such bucket of up to 113 tensors, of any dtype pair, stays on this path;
// * more: from device memory (uploaded through pinned memory on the current
//   stream, refused under CUDA graph capture).
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
static_assert(sizeof(InlineTable<cuda_chunks::kMidTable>) + sizeof(double) <= 4096, "the mid table must fit in 4 KiB of arguments");
static_assert(
    sizeof(InlineTable<cuda_chunks::kLargeInline>) + sizeof(double) <= 32764, "the large table must fit in the argument space");

template <int N>
__global__ void __launch_bounds__(kThreads) copy_scale_inline_kernel(const __grid_constant__ InlineTable<N> table, double scale) {
  cuda_chunks::run_chunk(table.chunks[blockIdx.x], scale, threadIdx.x, blockDim.x);
}

__global__ void __launch_bounds__(kThreads) copy_scale_table_kernel(const ChunkDesc* chunks, double scale) {
  cuda_chunks::run_chunk(chunks[blockIdx.x], scale, threadIdx.x, blockDim.x);
}

struct CopyScaleInline {
  template <int N>
  static const void* get() noexcept {
    return reinterpret_cast<const void*>(&copy_scale_inline_kernel<N>);
  }
};

}  // namespace

namespace cuda_launch {

bool large_inline_compiled() noexcept {
  return cuda_chunks::kLargeInline == cuda_chunks::kLargeTable;
}

cudaError_t launch_copy_scale(const Table& table, double scale, cudaStream_t stream) noexcept {
  const auto kernels = cuda_chunks::kernel_set<CopyScaleInline>(reinterpret_cast<const void*>(&copy_scale_table_kernel));
  void* args[2] = {nullptr, &scale};
  return cuda_chunks::launch_chunks(kernels, table, args, stream);
}

}  // namespace cuda_launch
}  // namespace fastcoll
