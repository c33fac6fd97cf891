// CPU kernel of fastcoll::flatten_accumulate (fp32 "main gradients": many
// gradients added into one wide flat buffer, out[slot] += scale * tensor).
//
// The split is flatten_scale_cpu.cpp's: the segments are laid end to end in
// flat order and at::parallel_for cuts that element range evenly across
// threads (grain kGrainElements), so a huge tensor is shared by all threads and
// many tiny ones are batched into one thread's range. Each thread runs, for
// each segment its range overlaps, the accumulation loop of the build in use
// (copy_scale.h: one fused multiply-add per element in float, or double when
// either side is double, then the cast to out's dtype), the checking variant
// while a nonfinite flag is wanted and not yet known to be set. Elements past
// the last segment are never touched. No non-temporal stores (the loop reads
// every destination line first), nothing allocated beyond the plan.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <vector>

#include "fastcoll.h"

namespace fastcoll {
FASTCOLL_IN_EACH_CPU_BUILD(AccumulateFns pick_accumulate(at::ScalarType src, at::ScalarType dst))

namespace {

AccumulateFns pick_accumulate(at::ScalarType src, at::ScalarType dst) {
  return FASTCOLL_CALL_CPU_BUILD(pick_accumulate, src, dst);
}

// Elements below which splitting across threads costs more than it saves (flatten_scale's grain).
constexpr int64_t kGrainElements = 32768;

void run_accumulate(const HealthPlan& plan, double scale) {
  const std::vector<Segment>& segments = plan.segments;
  if (segments.empty()) return;
  std::vector<AccumulateFns> fns;
  fns.reserve(segments.size());
  for (const auto& s : segments) fns.push_back(pick_accumulate(s.src_dtype, s.dst_dtype));
  const bool want_flag = plan.nonfinite != nullptr;
  std::atomic<bool> bad{false};
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
      if (want_flag && !bad.load(std::memory_order_relaxed)) {
        if (fns[k].accumulate_check(src, dst, hi - lo, scale)) bad.store(true, std::memory_order_relaxed);
      } else {
        fns[k].accumulate(src, dst, hi - lo, scale);  // the flag is set already, or there is none
      }
    }
  });
  if (want_flag && bad.load()) *plan.nonfinite = 1;
}

void flatten_accumulate_cpu(
    at::TensorList tensors, const at::Tensor& out, double scale, const std::optional<at::Tensor>& nonfinite) {
  run_accumulate(plan_flatten_accumulate(tensors, out, nonfinite), scale);
}

}  // namespace
}  // namespace fastcoll

TORCH_LIBRARY_IMPL(fastcoll, CPU, m) {
  m.impl("flatten_accumulate", &fastcoll::flatten_accumulate_cpu);
}
