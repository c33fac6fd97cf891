// CUDA kernels of fastcoll::flatten_scale and fastcoll::unflatten_scale.
//
// One launch per call, whatever the number of tensors. The host cuts every
// segment into chunks of at most kChunkElements elements and writes one small
// descriptor per chunk (source, destination, length, dtype pair) into pinned
// memory; it is copied to the device on the current stream and each block
// handles one chunk. Work is thus split in proportion to bytes: a huge
// embedding gets many blocks, a bias gets one. Inside a chunk, 16-byte vector
// loads/stores are used when source and destination are co-aligned, with a
// scalar head and tail; otherwise a scalar loop (copy_chunk.cuh, which the C++
// test also runs on the CPU). No host synchronization.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <climits>
#include <cstdint>

#include "cuda/copy_chunk.cuh"
#include "fastcoll.h"

namespace fastcoll {
namespace {

using cuda_chunks::ChunkDesc;
using cuda_chunks::kThreads;

__global__ void __launch_bounds__(kThreads) multi_tensor_copy_scale_kernel(const ChunkDesc* descs, double scale) {
  cuda_chunks::run_chunk(descs[blockIdx.x], scale, threadIdx.x, blockDim.x);
}

void run_plan_cuda(const std::vector<Segment>& segments, const at::Tensor& flat, double scale, const char* op) {
  if (segments.empty()) return;
  c10::cuda::CUDAGuard guard(flat.device());
  // The chunk table is read from host memory when the copy below runs; a
  // captured graph would replay that copy from memory reused long since.
  TORCH_CHECK(
      c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None,
      "fastcoll.", op, ": not supported inside CUDA graph capture (its chunk table is uploaded from host memory "
      "on every call); run it outside torch.cuda.graph(...)");
  const int64_t nchunks = cuda_chunks::count_chunks(segments);
  TORCH_CHECK(nchunks <= INT_MAX, "fastcoll.", op, ": ", nchunks, " chunks exceed one launch's grid; split the bucket");

  // Descriptors go through pinned memory and an async copy on the current
  // stream; the caching host allocator keeps the pinned block alive until the
  // copy has run, so nothing here waits for the device.
  auto host = at::empty({nchunks * 4}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  cuda_chunks::write_chunks(segments, reinterpret_cast<ChunkDesc*>(host.data_ptr<int64_t>()));
  auto device_desc = host.to(flat.device(), /*non_blocking=*/true);
  const auto stream = at::cuda::getCurrentCUDAStream();
  multi_tensor_copy_scale_kernel<<<static_cast<unsigned int>(nchunks), kThreads, 0, stream>>>(
      reinterpret_cast<const ChunkDesc*>(device_desc.data_ptr<int64_t>()), scale);
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
