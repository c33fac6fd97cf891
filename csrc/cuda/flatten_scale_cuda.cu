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
// How the chunk table reaches the device:
// * up to 512 chunks (120 with a CUDA driver or toolkit older than 12.1): as
//   the kernel argument itself, read in place from the parameter space
//   (__grid_constant__): no upload, nothing to wait for, and safe to capture
//   in a CUDA graph. A 25 MiB bucket (of its wider dtype: the gradients' in
//   fastcoll.DDP) is 400 chunks plus at most one per tensor boundary, so any
//   such bucket of up to 113 tensors, of any dtype pair, stays on this path;
// * more: through pinned memory and an async copy on the current stream (the
//   caching host allocator keeps the pinned block alive until the copy has
//   run); refused under CUDA graph capture, where a replay would read reused
//   host memory.
#include <ATen/ops/empty.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <climits>
#include <cstdint>

#include "cuda/copy_chunk.cuh"
#include "cuda/inline_table.cuh"
#include "fastcoll.h"

namespace fastcoll {
namespace {

using cuda_chunks::ChunkDesc;
using cuda_chunks::kThreads;
using cuda_chunks::TablePath;

// Tables of chunk descriptors passed as the kernel argument: csrc/cuda/inline_table.cuh.
using cuda_chunks::InlineTable;
using cuda_chunks::max_inline_chunks;
constexpr int kSmallTable = cuda_chunks::kSmallTable;
constexpr int kMidTable = cuda_chunks::kMidTable;
constexpr int kLargeTable = cuda_chunks::kLargeInline;
static_assert(sizeof(InlineTable<kMidTable>) + sizeof(double) <= 4096, "the mid table must fit in 4 KiB of arguments");
static_assert(sizeof(InlineTable<kLargeTable>) + sizeof(double) <= 32764, "the large table must fit in the argument space");

template <int N>
__global__ void __launch_bounds__(kThreads) copy_scale_inline_kernel(const __grid_constant__ InlineTable<N> table, double scale) {
  cuda_chunks::run_chunk(table.chunks[blockIdx.x], scale, threadIdx.x, blockDim.x);
}

__global__ void __launch_bounds__(kThreads) copy_scale_table_kernel(const ChunkDesc* chunks, double scale) {
  cuda_chunks::run_chunk(chunks[blockIdx.x], scale, threadIdx.x, blockDim.x);
}

template <int N>
void launch_inline(const std::vector<Segment>& segments, int64_t nchunks, double scale, cudaStream_t stream) {
  InlineTable<N> table;
  cuda_chunks::write_chunks(segments, table.chunks);
  copy_scale_inline_kernel<N><<<static_cast<unsigned int>(nchunks), kThreads, 0, stream>>>(table, scale);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void run_plan_cuda(const std::vector<Segment>& segments, const at::Tensor& flat, double scale, const char* op) {
  if (segments.empty()) return;
  c10::cuda::CUDAGuard guard(flat.device());
  const int64_t nchunks = cuda_chunks::count_chunks(segments);
  TORCH_CHECK(nchunks <= INT_MAX, "fastcoll.", op, ": ", nchunks, " chunks exceed one launch's grid; split the bucket");
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t inline_limit = max_inline_chunks();
  switch (cuda_chunks::choose_table(nchunks, inline_limit)) {
    case TablePath::kSmall: return launch_inline<kSmallTable>(segments, nchunks, scale, stream);
    case TablePath::kMid: return launch_inline<kMidTable>(segments, nchunks, scale, stream);
    case TablePath::kLarge: return launch_inline<kLargeTable>(segments, nchunks, scale, stream);
    case TablePath::kPinned: break;
  }

  TORCH_CHECK(
      c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None,
      "fastcoll.", op, ": not supported inside CUDA graph capture for more than ", inline_limit,
      " chunks (this call has ", nchunks, "; a chunk is at most ", cuda_chunks::kChunkBytes / 1024,
      " KiB of the wider dtype of one tensor, so every tensor is at least one chunk): its chunk table is then "
      "uploaded from host memory on every call; use smaller buckets, or fewer tensors per call, or run it "
      "outside torch.cuda.graph(...)");
  auto host = at::empty({nchunks * 4}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  cuda_chunks::write_chunks(segments, reinterpret_cast<ChunkDesc*>(host.data_ptr<int64_t>()));
  auto device_table = host.to(flat.device(), /*non_blocking=*/true);
  copy_scale_table_kernel<<<static_cast<unsigned int>(nchunks), kThreads, 0, stream>>>(
      reinterpret_cast<const ChunkDesc*>(device_table.data_ptr<int64_t>()), scale);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void flatten_scale_cuda(at::TensorList tensors, const at::Tensor& out, double scale) {
  run_plan_cuda(plan_segments(tensors, out, /*pack=*/true), out, scale, "flatten_scale");
}

void unflatten_scale_cuda(const at::Tensor& flat, at::TensorList tensors, double scale) {
  run_plan_cuda(plan_segments(tensors, flat, /*pack=*/false), flat, scale, "unflatten_scale");
}

}  // namespace
}  // namespace fastcoll

TORCH_LIBRARY_IMPL(fastcoll, CUDA, m) {
  m.impl("flatten_scale", &fastcoll::flatten_scale_cuda);
  m.impl("unflatten_scale", &fastcoll::unflatten_scale_cuda);
}
