// CPU kernels of fastcoll::flatten_scale and fastcoll::unflatten_scale.
//
// One call handles the whole bucket: the segments are laid end to end in flat
// order and at::parallel_for splits that element range evenly across threads,
// so a huge tensor is shared by all threads and many tiny ones are batched into
// one thread's range. The inner loops (copy_scale.h) use at::vec, built for
// AVX2 when the CPU has it, with AVX-512 BF16 conversions where it has those
// too (cpu_isa.cpp); the multiply runs in float (double when either side is
// double). A call that writes at least cpu_stream_min_bytes() uses
// non-temporal stores; fastcoll sets that threshold from the machine's cache
// when it loads the library (fastcoll/ops/stores.py). Nothing is allocated
// beyond the plan.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>

#include "fastcoll.h"
#include "plan.h"

namespace fastcoll {
FASTCOLL_IN_EACH_CPU_BUILD(CopyFn pick_copy(at::ScalarType src, at::ScalarType dst, bool streaming))

namespace {

// Until fastcoll/ops/stores.py sets the machine's value at load (and in the
// C++ tests): 16 MiB, the constant used before that rule.
std::atomic<int64_t> stream_min_bytes{int64_t(16) << 20};

}  // namespace

int64_t cpu_stream_min_bytes() {
  return stream_min_bytes.load(std::memory_order_relaxed);
}

void set_cpu_stream_min_bytes(int64_t nbytes) {
  TORCH_CHECK_VALUE(
      nbytes >= 0, "fastcoll._C._set_cpu_stream_min_bytes: the threshold must be >= 0 bytes, got ", nbytes,
      "; pass 0 to use non-temporal stores on every call");
  stream_min_bytes.store(nbytes, std::memory_order_relaxed);
}

namespace {

CopyFn pick_copy(at::ScalarType src, at::ScalarType dst, bool streaming) {
  return FASTCOLL_CALL_CPU_BUILD(pick_copy, src, dst, streaming);
}

// Elements below which splitting across threads costs more than it saves.
constexpr int64_t kGrainElements = 32768;

void run_plan(const std::vector<Segment>& segments, double scale) {
  if (segments.empty()) return;
  int64_t written = 0;
  for (const auto& s : segments) written += s.numel * int64_t(c10::elementSize(s.dst_dtype));
  const bool streaming = written >= cpu_stream_min_bytes();
  std::vector<CopyFn> fns;
  fns.reserve(segments.size());
  for (const auto& s : segments) fns.push_back(pick_copy(s.src_dtype, s.dst_dtype, streaming));
  const int64_t total = segments.back().flat_offset + segments.back().numel;
  at::parallel_for(0, total, kGrainElements, [&](int64_t begin, int64_t end) {
    // First segment whose range ends after `begin`.
    auto it = std::upper_bound(
        segments.begin(), segments.end(), begin,
        [](int64_t pos, const Segment& s) { return pos < s.flat_offset + s.numel; });
    for (size_t k = it - segments.begin(); k < segments.size(); ++k) {
      const Segment& s = segments[k];
      if (s.flat_offset >= end) break;
      const int64_t lo = std::max(begin, s.flat_offset) - s.flat_offset;
      const int64_t hi = std::min(end, s.flat_offset + s.numel) - s.flat_offset;
      const auto src = static_cast<const char*>(s.src) + lo * c10::elementSize(s.src_dtype);
      const auto dst = static_cast<char*>(s.dst) + lo * c10::elementSize(s.dst_dtype);
      fns[k](src, dst, hi - lo, scale);
    }
  });
}

// Calls with a bucket plan (plan.h) run its kept segments.
[[maybe_unused]] const bool planned_runner = register_planned_runner(
    at::DeviceType::CPU, [](PlanEntry& entry, const at::Tensor&, double scale, const char*) {
      run_plan(entry.segments, scale);
    });

void flatten_scale_cpu(at::TensorList tensors, const at::Tensor& out, double scale) {
  run_plan(plan_segments(tensors, out, /*pack=*/true), scale);
}

void unflatten_scale_cpu(const at::Tensor& flat, at::TensorList tensors, double scale) {
  run_plan(plan_segments(tensors, flat, /*pack=*/false), scale);
}

}  // namespace
}  // namespace fastcoll

TORCH_LIBRARY_IMPL(fastcoll, CPU, m) {
  m.impl("flatten_scale", &fastcoll::flatten_scale_cpu);
  m.impl("unflatten_scale", &fastcoll::unflatten_scale_cpu);
}
