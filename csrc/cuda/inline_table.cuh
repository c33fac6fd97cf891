// Chunk tables passed as the kernel argument itself, shared by every CUDA op.
//
// Kernel arguments may total 4 KiB, or 32764 bytes with CUDA 12.1+ (toolkit and
// driver) on sm_70+. The table sizes and the choice between them are in
// copy_chunk.cuh (choose_table), where the C++ test checks them; this header
// holds the CUDA-only part: the table type, the largest size this toolkit can
// compile, and the launch of a kernel whose first argument is such a table
// (launch.h: validated by the caller, never throwing). The
// largest size this process's driver accepts is the caller's to find
// (csrc/cuda/cuda_ops.cpp, max_inline_chunks).
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "cuda/copy_chunk.cuh"
#include "cuda/launch.h"

namespace fastcoll {
namespace cuda_chunks {

#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
constexpr int kLargeInline = kLargeTable;  // 16 KiB
#else
constexpr int kLargeInline = kMidTable;
#endif

// A table of N chunk descriptors, passed by value (read in place with __grid_constant__).
template <int N>
struct InlineTable {
  ChunkDesc chunks[N];
};

// The error of a launch, or else any error left from earlier work (as
// C10_CUDA_KERNEL_LAUNCH_CHECK reports it); clears the runtime's last error.
inline cudaError_t launch_error(cudaError_t launched) noexcept {
  const cudaError_t last = cudaGetLastError();
  return launched != cudaSuccess ? launched : last;
}

// The kernels of one op: one per inline table size, reading the table from
// its first argument by value, and one reading it through a device pointer.
// inline_large is null when this toolkit cannot pass 16 KiB of arguments.
struct KernelSet {
  const void* inline_small;
  const void* inline_mid;
  const void* inline_large;
  const void* device;
};

// Launches the kernel of `kernels` that reads `table` on table.nchunks blocks
// of kThreads threads. args[0] is set here to the table's argument (the host
// table itself, which the runtime copies into the launch's argument space, or
// the device pointer); args[1..] are the kernel's other arguments.
inline cudaError_t launch_chunks(
    const KernelSet& kernels, const cuda_launch::Table& table, void** args, cudaStream_t stream) noexcept {
  using cuda_launch::TableKind;
  const ChunkDesc* device_chunks = table.chunks;
  const void* kernel = nullptr;
  args[0] = const_cast<ChunkDesc*>(table.chunks);
  switch (table.kind) {
    case TableKind::kInline32: kernel = kernels.inline_small; break;
    case TableKind::kInline120: kernel = kernels.inline_mid; break;
    case TableKind::kInline512: kernel = kernels.inline_large; break;
    case TableKind::kDevice:
      kernel = kernels.device;
      args[0] = &device_chunks;
      break;
  }
  if (kernel == nullptr || table.nchunks < 1 || table.nchunks > INT32_MAX) return cudaErrorInvalidValue;
  return launch_error(
      cudaLaunchKernel(kernel, dim3(static_cast<unsigned int>(table.nchunks)), dim3(kThreads), args, 0, stream));
}

// The KernelSet of an op: Inline::get<N>() is the address of its kernel for
// an inline table of N descriptors, `device` that of its device-table kernel.
template <class Inline>
KernelSet kernel_set(const void* device) noexcept {
  return KernelSet{
      Inline::template get<kSmallTable>(), Inline::template get<kMidTable>(),
      kLargeInline == kLargeTable ? Inline::template get<kLargeInline>() : nullptr, device};
}

}  // namespace cuda_chunks
}  // namespace fastcoll
