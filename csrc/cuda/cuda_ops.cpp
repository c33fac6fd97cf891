// The CUDA ops of fastcoll: every check, every allocation and every choice of
// the CUDA kernels' host side, compiled by the host compiler.
//
// No C++ exception ever crosses code that nvcc compiled: an error thrown
// through nvcc-built host code crashed the process (SIGSEGV) on one GPU
// machine instead of reaching Python (issue 32). So each op here checks its
// arguments (csrc/ops.cpp: devices, dtypes, sizes, aliasing), the chunk limit
// of one launch and the CUDA graph capture status, picks the device, the
// stream and the way its chunk table reaches the kernel, allocates what the
// kernel needs, and only then calls a launcher of the .cu files (launch.h),
// which takes those validated arguments and returns the launch's CUDA error
// instead of throwing; a failed launch is raised here, naming the op.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "cuda/chunk_table.h"
#include "cuda/launch.h"
#include "fastcoll.h"
#include "plan.h"

namespace fastcoll {

void check_checksum_args(at::TensorList tensors);  // csrc/cpu/checksum_cpu.cpp

namespace {

using cuda_chunks::ChunkDesc;
using cuda_chunks::TablePath;
using cuda_launch::TableKind;

// Raises the CUDA error a launcher returned (nothing on cudaSuccess).
void raise_on_error(cudaError_t err, const char* op) {
  TORCH_CHECK(
      err == cudaSuccess, op, ": CUDA error ", cudaGetErrorName(err), " (", cudaGetErrorString(err),
      ") when launching its kernel");
}

// The largest table this process may pass as a kernel argument: 512 chunks
// when the toolkit that built the kernels and the driver are CUDA 12.1+, else 120.
int64_t max_inline_chunks() {
  static const int64_t limit = [] {
    int driver = 0;
    const bool large = cuda_launch::large_inline_compiled() && cudaDriverGetVersion(&driver) == cudaSuccess &&
        driver >= 12010;
    return large ? int64_t(cuda_chunks::kLargeTable) : int64_t(cuda_chunks::kMidTable);
  }();
  return limit;
}

// Refuses a call whose table would be uploaded from host memory while the
// current stream is being captured into a CUDA graph: a replay would read
// host memory reused since.
// `what`: the unit counted ("chunks", "tensors"); `why`: said after the count;
// `upload`: what would be uploaded, and when; `fix`: what to do instead.
void refuse_upload_under_capture(
    const char* op, const char* what, int64_t n, int64_t limit, const char* why, const char* upload, const char* fix) {
  TORCH_CHECK(
      c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None, op,
      ": not supported inside CUDA graph capture for more than ", limit, " ", what, " (this call has ", n, why, "): ",
      upload, "; ", fix, ", or run it outside torch.cuda.graph(...)");
}

constexpr const char* kChunkWhy =
    "; a chunk is at most 64 KiB of the wider dtype of one tensor, so every tensor is at least one chunk";
static_assert(cuda_chunks::kChunkBytes == 64 * 1024, "kChunkWhy states the chunk size");
constexpr const char* kChunkUpload = "its chunk table is then uploaded from host memory on every call";
constexpr const char* kChunkFix = "use smaller buckets, or fewer tensors per call";

// The chunk count of `segments` and the way their table reaches the kernel
// (chunks left null); refuses a call too large for one launch.
cuda_launch::Table table_for(const std::vector<Segment>& segments, const char* op) {
  const int64_t nchunks = cuda_chunks::count_chunks(segments);
  TORCH_CHECK(nchunks <= INT_MAX, op, ": ", nchunks, " chunks exceed one launch's grid; split the bucket");
  cuda_launch::Table table{nullptr, nchunks, TableKind::kDevice};
  switch (cuda_chunks::choose_table(nchunks, max_inline_chunks())) {
    case TablePath::kSmall: table.kind = TableKind::kInline32; break;
    case TablePath::kMid: table.kind = TableKind::kInline120; break;
    case TablePath::kLarge: table.kind = TableKind::kInline512; break;
    case TablePath::kPinned: table.kind = TableKind::kDevice; break;
  }
  return table;
}

// Writes the descriptors of `segments` into pinned memory and copies them to
// `device` on the current stream (the caching host allocator keeps the pinned
// block until the copy has run); returns the device table.
at::Tensor upload_chunks(const std::vector<Segment>& segments, int64_t nchunks, const at::Device& device) {
  auto pinned = at::empty({nchunks * 4}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  cuda_chunks::write_chunks(segments, reinterpret_cast<ChunkDesc*>(pinned.data_ptr<int64_t>()));
  return pinned.to(device, /*non_blocking=*/true);
}

// The chunk table of one call, ready to launch: in host memory for a table
// passed as the kernel argument (this thread's buffer, reused by its next
// call: the launch has copied it by then), else uploaded to the device
// through pinned memory on the current stream.
class CallTable {
 public:
  CallTable(const std::vector<Segment>& segments, const at::Tensor& like, const char* op)
      : table_(table_for(segments, op)) {
    if (table_.kind != TableKind::kDevice) {
      static thread_local std::vector<ChunkDesc> host;
      host.resize(std::max<size_t>(host.size(), cuda_launch::inline_capacity(table_.kind)));
      cuda_chunks::write_chunks(segments, host.data());
      table_.chunks = host.data();
      return;
    }
    refuse_upload_under_capture(op, "chunks", table_.nchunks, max_inline_chunks(), kChunkWhy, kChunkUpload, kChunkFix);
    device_ = upload_chunks(segments, table_.nchunks, like.device());
    table_.chunks = reinterpret_cast<const ChunkDesc*>(device_.data_ptr<int64_t>());
  }

  const cuda_launch::Table& table() const { return table_; }

 private:
  cuda_launch::Table table_;
  at::Tensor device_;
};

cudaStream_t current_stream() {
  return at::cuda::getCurrentCUDAStream().stream();
}

// ---- flatten_scale / unflatten_scale ----

void run_copy_scale(const std::vector<Segment>& segments, const at::Tensor& like, double scale, const char* op) {
  if (segments.empty()) return;
  c10::cuda::CUDAGuard guard(like.device());
  const CallTable t(segments, like, op);
  raise_on_error(cuda_launch::launch_copy_scale(t.table(), scale, current_stream()), op);
}

void flatten_scale_cuda(at::TensorList tensors, const at::Tensor& out, double scale) {
  run_copy_scale(plan_segments(tensors, out, /*pack=*/true), out, scale, "fastcoll.flatten_scale");
}

void unflatten_scale_cuda(const at::Tensor& flat, at::TensorList tensors, double scale) {
  run_copy_scale(plan_segments(tensors, flat, /*pack=*/false), flat, scale, "fastcoll.unflatten_scale");
}

// ---- Calls with a bucket plan (plan.h) ----

// Device tables that a CUDA graph captured, kept for the life of the process
// once their plan drops them: a replay still reads them.
std::vector<at::Tensor>& captured_tables() {
  static auto* kept = new std::vector<at::Tensor>();  // never destroyed: no order to worry about at exit
  return *kept;
}

// A plan entry's chunk table on CUDA, written once per (re)build of the entry:
// kept in host memory when it is passed as the kernel argument, else uploaded
// once to device memory, on the stream of the call that built it, and read
// from there by every later call. A call on another stream first makes that
// stream wait for the upload (an event; under graph capture an external event
// node) and, outside capture, records the table's use on it for the caching
// allocator; a table used under capture is never freed (captured_tables).
class ResidentTable final : public PlanDeviceState {
 public:
  ResidentTable(const std::vector<Segment>& segments, const at::Tensor& like, const char* op, const at::cuda::CUDAStream& stream)
      : table_(table_for(segments, op)) {
    if (table_.kind != TableKind::kDevice) {
      host_.resize(cuda_launch::inline_capacity(table_.kind));
      cuda_chunks::write_chunks(segments, host_.data());
      table_.chunks = host_.data();
      return;
    }
    refuse_upload_under_capture(
        op, "chunks", table_.nchunks, max_inline_chunks(), kChunkWhy,
        "this bucket plan was (re)built inside the capture, and its chunk table would be uploaded from host memory",
        "make one call with this bucket plan before the capture (its table is then resident), or use smaller buckets");
    device_ = upload_chunks(segments, table_.nchunks, like.device());
    table_.chunks = reinterpret_cast<const ChunkDesc*>(device_.data_ptr<int64_t>());
    check(cudaEventCreateWithFlags(&uploaded_, cudaEventDisableTiming), op, "creating an event");
    check(cudaEventRecord(uploaded_, stream.stream()), op, "recording its upload");
    streams_.push_back(stream.stream());
  }

  ResidentTable(const ResidentTable&) = delete;
  ResidentTable& operator=(const ResidentTable&) = delete;

  ~ResidentTable() override {
    if (uploaded_ != nullptr) (void)cudaEventDestroy(uploaded_);  // released once its work completes
    if (captured_) captured_tables().push_back(std::move(device_));
  }

  // Makes the table safe to read from `stream` (see the class comment).
  void use_on(const at::cuda::CUDAStream& stream, const char* op) {
    if (table_.kind != TableKind::kDevice) return;
    for (cudaStream_t s : streams_) {
      if (s == stream.stream()) return;
    }
    const bool capturing = c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
    check(
        cudaStreamWaitEvent(stream.stream(), uploaded_, capturing ? cudaEventWaitExternal : cudaEventWaitDefault), op,
        "waiting for its chunk table's upload");
    if (capturing) {
      captured_ = true;
    } else {
      c10::cuda::CUDACachingAllocator::recordStream(device_.storage().data_ptr(), stream);
    }
    streams_.push_back(stream.stream());
  }

  const cuda_launch::Table& table() const { return table_; }

 private:
  static void check(cudaError_t err, const char* op, const char* what) {
    TORCH_CHECK(err == cudaSuccess, op, ": CUDA error ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ") ", what);
  }

  cuda_launch::Table table_;
  std::vector<ChunkDesc> host_;
  at::Tensor device_;
  cudaEvent_t uploaded_ = nullptr;
  std::vector<cudaStream_t> streams_;  // streams that may read the device table
  bool captured_ = false;
};

void run_planned_cuda(PlanEntry& entry, const at::Tensor& like, double scale, const char* op) {
  if (entry.segments.empty()) return;
  c10::cuda::CUDAGuard guard(like.device());
  const at::cuda::CUDAStream stream = at::cuda::getCurrentCUDAStream();
  auto* table = static_cast<ResidentTable*>(entry.state.get());
  if (table == nullptr) {
    auto made = std::make_unique<ResidentTable>(entry.segments, like, op, stream);
    table = made.get();
    entry.state = std::move(made);
  }
  table->use_on(stream, op);
  raise_on_error(cuda_launch::launch_copy_scale(table->table(), scale, stream.stream()), op);
}

[[maybe_unused]] const bool planned_runner = register_planned_runner(at::DeviceType::CUDA, &run_planned_cuda);

// ---- flatten_accumulate ----

void flatten_accumulate_cuda(
    at::TensorList tensors, const at::Tensor& out, double scale, const std::optional<at::Tensor>& nonfinite) {
  const char* op = "fastcoll.flatten_accumulate";
  const HealthPlan plan = plan_flatten_accumulate(tensors, out, nonfinite);
  if (plan.segments.empty()) return;
  c10::cuda::CUDAGuard guard(out.device());
  const CallTable t(plan.segments, out, op);
  raise_on_error(cuda_launch::launch_accumulate(t.table(), scale, plan.nonfinite, current_stream()), op);
}

// ---- sum_chunks ----

void sum_chunks_cuda(const at::Tensor& chunks, const at::Tensor& out, double scale) {
  const char* op = "fastcoll.sum_chunks";
  check_sum_chunks(chunks, out);
  if (out.numel() == 0) return;
  c10::cuda::CUDAGuard guard(out.device());
  const cuda_launch::SumChunksArgs args{
      chunks.const_data_ptr(), out.data_ptr(), chunks.size(0), chunks.size(1), scale,
      chunks.scalar_type() == at::kBFloat16, out.scalar_type() == at::kFloat};
  raise_on_error(cuda_launch::launch_sum_chunks(args, current_stream()), op);
}

// ---- flatten_scale_ex, unflatten_scale_ex, sum_of_squares ----

// `like`: the plan's device and the options of the scratch buffer (the flat buffer, or out).
void run_health_cuda(const HealthPlan& plan, const at::Tensor& like, double scale, bool read_only, const char* op) {
  c10::cuda::CUDAGuard guard(like.device());
  const cudaStream_t stream = current_stream();
  const bool want_sum = plan.sumsq != nullptr;
  cuda_launch::HealthArgs args{scale, plan.scale_by, plan.nonfinite, nullptr, plan.scale_by_f64 ? 1 : 0};
  const auto mode = read_only  ? cuda_launch::HealthMode::kRead
      : want_sum               ? cuda_launch::HealthMode::kUnpack
                               : cuda_launch::HealthMode::kPack;
  int64_t nchunks = 0;
  at::Tensor partials;
  if (!plan.segments.empty()) {
    const CallTable t(plan.segments, like, op);
    nchunks = t.table().nchunks;
    if (want_sum) {
      partials = at::empty({nchunks}, like.options().dtype(at::kDouble));  // the caching allocator, on this stream
      args.partials = partials.data_ptr<double>();
    }
    raise_on_error(cuda_launch::launch_health(t.table(), args, mode, stream), op);
  }
  if (want_sum) raise_on_error(cuda_launch::launch_sum_partials(args.partials, nchunks, plan.sumsq, stream), op);
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

// ---- checksum ----

at::Tensor checksum_cuda(at::TensorList tensors) {
  const char* op = "fastcoll.checksum";
  check_checksum_args(tensors);
  const int64_t n = static_cast<int64_t>(tensors.size());
  if (n == 0) return at::empty({0}, at::TensorOptions().dtype(at::kLong));
  const at::Device device = tensors[0].device();
  c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = current_stream();
  const auto options = at::TensorOptions().dtype(at::kLong).device(device);

  const bool inline_spans = n <= cuda_launch::kChecksumInlineSpans;
  if (!inline_spans) {
    refuse_upload_under_capture(
        op, "tensors", n, cuda_launch::kChecksumInlineSpans, "",
        "the table of tensors is then uploaded from host memory on every call", "checksum fewer tensors per call");
  }
  std::vector<cuda_launch::Span> spans(std::max(n, cuda_launch::kChecksumInlineSpans));
  int64_t nchunks = 0;
  for (int64_t j = 0; j < n; ++j) {
    const at::Tensor& t = tensors[j];
    const int64_t nbytes = t.numel() == 0 ? 0 : static_cast<int64_t>(t.nbytes());
    spans[j].ptr = nbytes == 0 ? nullptr : static_cast<const unsigned char*>(t.const_data_ptr());
    spans[j].nbytes = nbytes;
    spans[j].chunk_begin = nchunks;
    nchunks += (nbytes + cuda_launch::kChecksumChunkBytes - 1) / cuda_launch::kChecksumChunkBytes;
  }

  at::Tensor out = at::empty({n}, options);
  at::Tensor acc = at::empty({n + 1}, options);  // the accumulators and the ticket counter
  const cudaError_t zeroed = cudaMemsetAsync(acc.data_ptr(), 0, (n + 1) * sizeof(int64_t), stream);
  TORCH_CHECK(zeroed == cudaSuccess, op, ": CUDA error ", cudaGetErrorName(zeroed), " (", cudaGetErrorString(zeroed),
              ") when zeroing its accumulators");
  const cuda_launch::ChecksumArgs args{
      n, nchunks, reinterpret_cast<unsigned long long*>(acc.data_ptr<int64_t>()), out.data_ptr<int64_t>()};

  // Enough blocks to fill the GPU (8 of 256 threads per SM), at least one (it finalizes).
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const auto grid = static_cast<unsigned int>(std::max<int64_t>(1, std::min<int64_t>(nchunks, sms * 8)));

  if (inline_spans) {
    raise_on_error(cuda_launch::launch_checksum(spans.data(), true, args, grid, stream), op);
    return out;
  }
  auto pinned = at::empty({n * 3}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::copy(spans.begin(), spans.begin() + n, reinterpret_cast<cuda_launch::Span*>(pinned.data_ptr<int64_t>()));
  auto device_spans = pinned.to(device, /*non_blocking=*/true);
  raise_on_error(
      cuda_launch::launch_checksum(
          reinterpret_cast<const cuda_launch::Span*>(device_spans.data_ptr<int64_t>()), false, args, grid, stream),
      op);
  return out;
}

}  // namespace
}  // namespace fastcoll

TORCH_LIBRARY_IMPL(fastcoll, CUDA, m) {
  m.impl("flatten_scale", &fastcoll::flatten_scale_cuda);
  m.impl("unflatten_scale", &fastcoll::unflatten_scale_cuda);
  m.impl("flatten_accumulate", &fastcoll::flatten_accumulate_cuda);
  m.impl("flatten_scale_ex", &fastcoll::flatten_scale_ex_cuda);
  m.impl("unflatten_scale_ex", &fastcoll::unflatten_scale_ex_cuda);
  m.impl("sum_of_squares", &fastcoll::sum_of_squares_cuda);
  m.impl("checksum", &fastcoll::checksum_cuda);
  m.impl("sum_chunks", &fastcoll::sum_chunks_cuda);
}
