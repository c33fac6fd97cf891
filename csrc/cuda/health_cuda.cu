// CUDA kernels of the gradient-health ops: fastcoll::flatten_scale_ex,
// fastcoll::unflatten_scale_ex and fastcoll::sum_of_squares.
//
// The same chunk table and per-chunk loop as flatten_scale / unflatten_scale
// (copy_chunk.cuh: one block per chunk of at most 64 KiB of the wider dtype,
// 16-byte vectors where co-aligned), run with an observer of the values each
// thread stores, and the same ways of passing the table (the kernel argument
// itself up to 512 chunks, capturable in CUDA graphs; pinned memory and an
// upload beyond, refused under capture). One launch per call for the work,
// plus, for a sum, one single-block launch that adds the per-chunk partials.
// No host synchronization, no atomics.
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

enum class Mode : int {
  kPack,    // copy by scale (* scale_by), flag non-finite values (flatten_scale_ex; unflatten_scale_ex without a sum)
  kUnpack,  // copy by scale, sum the squares of the values stored (unflatten_scale_ex)
  kRead,    // sum the squares of the values read (sum_of_squares)
};

struct HealthArgs {
  double scale;
  const void* scale_by;  // kPack: nullptr, or one float (one double when scale_by_f64) on the device
  int32_t* nonfinite;    // kPack: nullptr, or the flag
  double* partials;      // kUnpack, kRead: one per chunk
  int32_t scale_by_f64;
};

// Tables of chunk descriptors passed as the kernel argument: csrc/cuda/inline_table.cuh.
using cuda_chunks::InlineTable;
using cuda_chunks::max_inline_chunks;
constexpr int kSmallTable = cuda_chunks::kSmallTable;
constexpr int kMidTable = cuda_chunks::kMidTable;
constexpr int kLargeTable = cuda_chunks::kLargeInline;
static_assert(sizeof(InlineTable<kMidTable>) + sizeof(HealthArgs) <= 4096, "the mid table must fit in 4 KiB of arguments");
static_assert(sizeof(InlineTable<kLargeTable>) + sizeof(HealthArgs) <= 32764, "the large table must fit in the argument space");

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

template <Mode kMode>
__device__ __forceinline__ void run_block(const ChunkDesc& d, const HealthArgs& a) {
  const int tid = static_cast<int>(threadIdx.x);
  const int nthreads = static_cast<int>(blockDim.x);
  if constexpr (kMode == Mode::kPack) {
    cuda_chunks::NonFiniteSeen seen;
    const cuda_chunks::Factor f{a.scale, a.scale_by, a.scale_by_f64 != 0};
    cuda_chunks::run_chunk_seen<true>(d, f, &seen, tid, nthreads);
    if (a.nonfinite != nullptr) {  // the same in every thread of the block
      if (__syncthreads_or(seen.bad) && tid == 0) *a.nonfinite = 1;
    }
  } else {
    cuda_chunks::SquaresSeen seen;
    if constexpr (kMode == Mode::kUnpack) {
      const cuda_chunks::Factor f{a.scale, nullptr, false};
      cuda_chunks::run_chunk_seen<false>(d, f, &seen, tid, nthreads);
    } else {
      cuda_chunks::read_chunk_seen(d, &seen, tid, nthreads);
    }
    const double total = block_sum(seen.sum);
    if (tid == 0) a.partials[blockIdx.x] = total;
  }
}

template <int N, Mode kMode>
__global__ void __launch_bounds__(kThreads) health_inline_kernel(const __grid_constant__ InlineTable<N> table, const HealthArgs args) {
  run_block<kMode>(table.chunks[blockIdx.x], args);
}

template <Mode kMode>
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

template <Mode kMode, int N>
void launch_inline_mode(const InlineTable<N>& table, int64_t nchunks, const HealthArgs& args, cudaStream_t stream) {
  health_inline_kernel<N, kMode><<<static_cast<unsigned int>(nchunks), kThreads, 0, stream>>>(table, args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int N>
void launch_inline(
    const std::vector<Segment>& segments, int64_t nchunks, const HealthArgs& args, Mode mode, cudaStream_t stream) {
  InlineTable<N> table;
  cuda_chunks::write_chunks(segments, table.chunks);
  switch (mode) {
    case Mode::kPack: return launch_inline_mode<Mode::kPack>(table, nchunks, args, stream);
    case Mode::kUnpack: return launch_inline_mode<Mode::kUnpack>(table, nchunks, args, stream);
    case Mode::kRead: return launch_inline_mode<Mode::kRead>(table, nchunks, args, stream);
  }
}

template <Mode kMode>
void launch_table_mode(const ChunkDesc* chunks, int64_t nchunks, const HealthArgs& args, cudaStream_t stream) {
  health_table_kernel<kMode><<<static_cast<unsigned int>(nchunks), kThreads, 0, stream>>>(chunks, args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The work of one call: one launch over the plan's chunks.
void launch_chunks(
    const std::vector<Segment>& segments, int64_t nchunks, const at::Tensor& like, const HealthArgs& args, Mode mode,
    cudaStream_t stream, const char* op) {
  const int64_t inline_limit = max_inline_chunks();
  switch (cuda_chunks::choose_table(nchunks, inline_limit)) {
    case TablePath::kSmall: return launch_inline<kSmallTable>(segments, nchunks, args, mode, stream);
    case TablePath::kMid: return launch_inline<kMidTable>(segments, nchunks, args, mode, stream);
    case TablePath::kLarge: return launch_inline<kLargeTable>(segments, nchunks, args, mode, stream);
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
  cuda_chunks::write_chunks(segments, reinterpret_cast<ChunkDesc*>(host.data_ptr<int64_t>()));
  auto device_table = host.to(like.device(), /*non_blocking=*/true);
  const auto* chunks = reinterpret_cast<const ChunkDesc*>(device_table.data_ptr<int64_t>());
  switch (mode) {
    case Mode::kPack: return launch_table_mode<Mode::kPack>(chunks, nchunks, args, stream);
    case Mode::kUnpack: return launch_table_mode<Mode::kUnpack>(chunks, nchunks, args, stream);
    case Mode::kRead: return launch_table_mode<Mode::kRead>(chunks, nchunks, args, stream);
  }
}

// `like`: the plan's device and the options of the scratch buffer (the flat buffer, or out).
void run_health_cuda(const HealthPlan& plan, const at::Tensor& like, double scale, bool read_only, const char* op) {
  c10::cuda::CUDAGuard guard(like.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t nchunks = cuda_chunks::count_chunks(plan.segments);
  TORCH_CHECK(nchunks <= INT_MAX, op, ": ", nchunks, " chunks exceed one launch's grid; split the bucket");
  const bool want_sum = plan.sumsq != nullptr;
  HealthArgs args{scale, plan.scale_by, plan.nonfinite, nullptr, plan.scale_by_f64 ? 1 : 0};
  const Mode mode = read_only ? Mode::kRead : want_sum ? Mode::kUnpack : Mode::kPack;
  at::Tensor partials;
  if (want_sum && nchunks > 0) {
    partials = at::empty({nchunks}, like.options().dtype(at::kDouble));  // the caching allocator, on this stream
    args.partials = partials.data_ptr<double>();
  }
  if (nchunks > 0) launch_chunks(plan.segments, nchunks, like, args, mode, stream, op);
  if (want_sum) {
    sum_partials_kernel<<<1, kThreads, 0, stream>>>(args.partials, nchunks, plan.sumsq);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

void flatten_scale_ex_cuda(
    at::TensorList tensors, const at::Tensor& out, double scale, const std::optional<at::Tensor>& scale_by,
    const std::optional<at::Tensor>& nonfinite) {
  run_health_cuda(
      plan_flatten_scale_ex(tensors, out, scale_by, nonfinite), out, scale, /*read_only=*/false,
      "fastcoll.flatten_scale_ex");
}

void unflatten_scale_ex_cuda(
    const at::Tensor& flat, at::TensorList tensors, double scale, const std::optional<at::Tensor>& sumsq) {
  run_health_cuda(
      plan_unflatten_scale_ex(flat, tensors, sumsq), flat, scale, /*read_only=*/false, "fastcoll.unflatten_scale_ex");
}

void sum_of_squares_cuda(at::TensorList tensors, const at::Tensor& out) {
  run_health_cuda(plan_sum_of_squares(tensors, out), out, 1.0, /*read_only=*/true, "fastcoll.sum_of_squares");
}

}  // namespace
}  // namespace fastcoll

TORCH_LIBRARY_IMPL(fastcoll, CUDA, m) {
  m.impl("flatten_scale_ex", &fastcoll::flatten_scale_ex_cuda);
  m.impl("unflatten_scale_ex", &fastcoll::unflatten_scale_ex_cuda);
  m.impl("sum_of_squares", &fastcoll::sum_of_squares_cuda);
}
