// CUDA kernel of fastcoll::flatten_accumulate: out[slot] = out[slot] + scale * tensor.
//
// The chunk table of flatten_scale (copy_chunk.cuh: one block per chunk of at
// most 64 KiB of the wider dtype, 16-byte vectors where source and destination
// are co-aligned, the table passed as the kernel argument up to 512 chunks and
// so capturable in CUDA graphs, uploaded from pinned memory beyond and then
// refused under capture). Each thread reads its elements of the source and of
// the destination, kUnroll of each in flight, and stores
// D(fma(M(x), M(scale), M(old))) (float math, double when either side is
// double; __fmaf_rn / __fma_rn, the same bits as the CPU kernels' FMA). With a
// nonfinite flag, a block that stored a NaN or +-Inf (__syncthreads_or) has
// its thread 0 write 1 to nonfinite[0]; without one, the kernel has no
// observer at all. One launch per call, no host synchronization, no atomics.
// Elements of out past the last tensor's slot belong to no chunk.
#include <ATen/ops/empty.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <climits>
#include <cstdint>
#include <optional>

#include "cuda/copy_chunk.cuh"
#include "cuda/inline_table.cuh"
#include "fastcoll.h"

namespace fastcoll {
namespace {

using cuda_chunks::ChunkDesc;
using cuda_chunks::kThreads;
using cuda_chunks::TablePath;

struct AccumulateArgs {
  double scale;
  int32_t* nonfinite;  // kCheck: the flag on the device
};

// Tables of chunk descriptors passed as the kernel argument: csrc/cuda/inline_table.cuh.
using cuda_chunks::InlineTable;
using cuda_chunks::max_inline_chunks;
constexpr int kSmallTable = cuda_chunks::kSmallTable;
constexpr int kMidTable = cuda_chunks::kMidTable;
constexpr int kLargeTable = cuda_chunks::kLargeInline;
static_assert(sizeof(InlineTable<kMidTable>) + sizeof(AccumulateArgs) <= 4096, "the mid table must fit in 4 KiB of arguments");
static_assert(
    sizeof(InlineTable<kLargeTable>) + sizeof(AccumulateArgs) <= 32764, "the large table must fit in the argument space");

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

template <int N>
void launch_inline(const std::vector<Segment>& segments, int64_t nchunks, const AccumulateArgs& args, cudaStream_t stream) {
  InlineTable<N> table;
  cuda_chunks::write_chunks(segments, table.chunks);
  const auto blocks = static_cast<unsigned int>(nchunks);
  if (args.nonfinite != nullptr) {
    accumulate_inline_kernel<N, true><<<blocks, kThreads, 0, stream>>>(table, args);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else {
    accumulate_inline_kernel<N, false><<<blocks, kThreads, 0, stream>>>(table, args);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

void run_accumulate_cuda(const HealthPlan& plan, const at::Tensor& out, double scale) {
  const char* op = "fastcoll.flatten_accumulate";
  if (plan.segments.empty()) return;
  c10::cuda::CUDAGuard guard(out.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t nchunks = cuda_chunks::count_chunks(plan.segments);
  TORCH_CHECK(nchunks <= INT_MAX, op, ": ", nchunks, " chunks exceed one launch's grid; split the bucket");
  const AccumulateArgs args{scale, plan.nonfinite};
  const int64_t inline_limit = max_inline_chunks();
  switch (cuda_chunks::choose_table(nchunks, inline_limit)) {
    case TablePath::kSmall: return launch_inline<kSmallTable>(plan.segments, nchunks, args, stream);
    case TablePath::kMid: return launch_inline<kMidTable>(plan.segments, nchunks, args, stream);
    case TablePath::kLarge: return launch_inline<kLargeTable>(plan.segments, nchunks, args, stream);
    case TablePath::kPinned: break;
  }
  TORCH_CHECK(
      c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None,
      op, ": not supported inside CUDA graph capture for more than ", inline_limit, " chunks (this call has ",
      nchunks, "; a chunk is at most ", cuda_chunks::kChunkBytes / 1024,
      " KiB of the wider dtype of one tensor, so every tensor is at least one chunk): its chunk table is then "
      "uploaded from host memory on every call; use smaller buckets, or fewer tensors per call, or run it "
      "outside torch.cuda.graph(...)");
  auto host = at::empty({nchunks * 4}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  cuda_chunks::write_chunks(plan.segments, reinterpret_cast<ChunkDesc*>(host.data_ptr<int64_t>()));
  auto device_table = host.to(out.device(), /*non_blocking=*/true);
  const auto* chunks = reinterpret_cast<const ChunkDesc*>(device_table.data_ptr<int64_t>());
  const auto blocks = static_cast<unsigned int>(nchunks);
  if (args.nonfinite != nullptr) {
    accumulate_table_kernel<true><<<blocks, kThreads, 0, stream>>>(chunks, args);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else {
    accumulate_table_kernel<false><<<blocks, kThreads, 0, stream>>>(chunks, args);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

void flatten_accumulate_cuda(
    at::TensorList tensors, const at::Tensor& out, double scale, const std::optional<at::Tensor>& nonfinite) {
  run_accumulate_cuda(plan_flatten_accumulate(tensors, out, nonfinite), out, scale);
}

}  // namespace
}  // namespace fastcoll

TORCH_LIBRARY_IMPL(fastcoll, CUDA, m) {
  m.impl("flatten_accumulate", &fastcoll::flatten_accumulate_cuda);
}
