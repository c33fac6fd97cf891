// CPU kernels of the gradient-health ops: fastcoll::flatten_scale_ex,
// fastcoll::unflatten_scale_ex and fastcoll::sum_of_squares.
//
// The segments are laid end to end in flat order (as in flatten_scale_cpu.cpp)
// and cut into fixed pieces of kPieceElements elements of that flat range.
// at::parallel_for hands whole pieces to threads; for each piece (each
// thread's whole range when there is no sum to make), and each segment it
// overlaps in flat order, one observed copy (copy_scale.h: the same
// values and bits as flatten_scale / unflatten_scale, non-temporal stores for
// large calls, with the stored values summed as squares or checked for
// NaN/Inf in registers on the way) handles the part of the segment in the
// piece. sum_of_squares runs the same loops without a destination.
//
// Determinism of the sums: a piece's partial sum is the sum, in segment order,
// of the observed copies' results on its parts, each of which depends only on
// the values and the part's length (32 fixed lanes, copy_scale.h); the partials
// are stored by piece index and added in index order by the calling thread.
// Nothing depends on the number of threads or on how parallel_for splits the
// pieces, so the result is the same bits for 1, 2 or 64 threads, run after
// run. No allocation but the plan and one double per piece (with a sum).
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <optional>
#include <vector>

#include "fastcoll.h"

namespace fastcoll {
FASTCOLL_IN_EACH_CPU_BUILD(HealthFns pick_health(at::ScalarType src, at::ScalarType dst, bool streaming, bool f64))

namespace {

// The fixed pieces of the flat range the sums are made of (a thread count
// never changes them). 16384 elements: the per-piece work (finding the
// segments, setting up and combining 32 lanes, one partial) is well under 1%
// of a piece's copy.
constexpr int64_t kPieceElements = 16384;
// Pieces per parallel_for grain: 32768 elements, the grain of the plain kernels.
constexpr int64_t kGrainPieces = 2;

// Orders the non-temporal stores of the observed copies (which do not fence)
// before whatever follows this thread's range.
void store_fence() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_sfence();
#endif
}

HealthFns pick_health(at::ScalarType src, at::ScalarType dst, bool streaming, bool f64) {
  return FASTCOLL_CALL_CPU_BUILD(pick_health, src, dst, streaming, f64);
}

bool is_double(at::ScalarType t) {
  return t == at::kDouble;
}

// Runs a plan: copies (unless read_only), and sums squares into *plan.sumsq
// and/or flags non-finite values in *plan.nonfinite when the plan asks.
void run_health(const HealthPlan& plan, double scale, bool read_only) {
  const std::vector<Segment>& segments = plan.segments;
  const bool want_sum = plan.sumsq != nullptr;
  const bool want_flag = plan.nonfinite != nullptr;
  if (segments.empty()) {
    if (want_sum) *plan.sumsq = 0.0;
    return;
  }
  // The factor of each segment: scale, times scale_by in the segment's math
  // (float32 unless a side or scale_by is float64; the product rounded to
  // float32 is exactly representable in the double the inner loop gets).
  double by = 1.0;
  if (plan.scale_by != nullptr) {
    by = plan.scale_by_f64 ? *static_cast<const double*>(plan.scale_by)
                           : static_cast<double>(*static_cast<const float*>(plan.scale_by));
  }
  int64_t written = 0;
  if (!read_only) {
    for (const auto& s : segments) written += s.numel * int64_t(c10::elementSize(s.dst_dtype));
  }
  const bool streaming = !read_only && written >= cpu_stream_min_bytes();
  std::vector<HealthFns> fns;
  std::vector<double> factors;
  fns.reserve(segments.size());
  factors.reserve(segments.size());
  for (const auto& s : segments) {
    const bool f64 = plan.scale_by != nullptr && plan.scale_by_f64;
    fns.push_back(pick_health(s.src_dtype, s.dst_dtype, streaming, f64));
    const bool double_math = f64 || is_double(s.src_dtype) || is_double(s.dst_dtype);
    if (plan.scale_by == nullptr) {
      factors.push_back(scale);  // exactly flatten_scale's / unflatten_scale's argument
    } else if (double_math) {
      factors.push_back(scale * by);
    } else {
      factors.push_back(static_cast<double>(static_cast<float>(scale) * static_cast<float>(by)));
    }
  }

  const int64_t total = segments.back().flat_offset + segments.back().numel;
  const int64_t npieces = (total + kPieceElements - 1) / kPieceElements;
  std::vector<double> partials(want_sum ? npieces : 0);
  std::atomic<bool> bad{false};
  at::parallel_for(0, npieces, kGrainPieces, [&](int64_t p_begin, int64_t p_end) {
    // The spans this thread copies in turn: each piece when summing (a partial
    // per piece), else its whole range at once.
    const int64_t span = want_sum ? kPieceElements : (p_end - p_begin) * kPieceElements;
    const int64_t range_end = std::min(total, p_end * kPieceElements);
    // First segment whose range ends after the range's start.
    size_t k = std::upper_bound(
                   segments.begin(), segments.end(), p_begin * kPieceElements,
                   [](int64_t pos, const Segment& s) { return pos < s.flat_offset + s.numel; }) -
        segments.begin();
    for (int64_t lo_flat = p_begin * kPieceElements; lo_flat < range_end; lo_flat += span) {
      const int64_t hi_flat = std::min(range_end, lo_flat + span);
      double partial = 0.0;
      // Segments overlapping [lo_flat, hi_flat), in flat order; k stays on the
      // last one, which may go on into the next span.
      for (; k < segments.size(); ++k) {
        const Segment& s = segments[k];
        const int64_t lo = std::max(lo_flat, s.flat_offset) - s.flat_offset;
        const int64_t hi = std::min(hi_flat, s.flat_offset + s.numel) - s.flat_offset;
        if (hi > lo) {
          const auto src = static_cast<const char*>(s.src) + lo * c10::elementSize(s.src_dtype);
          const auto dst = read_only ? nullptr : static_cast<char*>(s.dst) + lo * c10::elementSize(s.dst_dtype);
          if (want_sum) {
            partial += fns[k].copy_sumsq(src, dst, hi - lo, factors[k]);
          } else if (want_flag && !bad.load(std::memory_order_relaxed)) {
            if (fns[k].copy_check(src, dst, hi - lo, factors[k])) bad.store(true, std::memory_order_relaxed);
          } else {
            fns[k].copy(src, dst, hi - lo, factors[k]);  // the flag is set already, or there is none
          }
        }
        if (s.flat_offset + s.numel > hi_flat) break;  // continues in the next span
      }
      if (want_sum) partials[lo_flat / kPieceElements] = partial;
    }
    if (streaming) store_fence();
  });
  if (want_flag && bad.load()) *plan.nonfinite = 1;
  if (want_sum) {
    double sum = 0.0;
    for (double v : partials) sum += v;
    *plan.sumsq = sum;
  }
}

void flatten_scale_ex_cpu(
    at::TensorList tensors, const at::Tensor& out, double scale, const std::optional<at::Tensor>& scale_by,
    const std::optional<at::Tensor>& nonfinite) {
  run_health(plan_flatten_scale_ex(tensors, out, scale_by, nonfinite), scale, /*read_only=*/false);
}

void unflatten_scale_ex_cpu(
    const at::Tensor& flat, at::TensorList tensors, double scale, const std::optional<at::Tensor>& sumsq) {
  run_health(plan_unflatten_scale_ex(flat, tensors, sumsq), scale, /*read_only=*/false);
}

void sum_of_squares_cpu(at::TensorList tensors, const at::Tensor& out) {
  run_health(plan_sum_of_squares(tensors, out), 1.0, /*read_only=*/true);
}

}  // namespace
}  // namespace fastcoll

TORCH_LIBRARY_IMPL(fastcoll, CPU, m) {
  m.impl("flatten_scale_ex", &fastcoll::flatten_scale_ex_cpu);
  m.impl("unflatten_scale_ex", &fastcoll::unflatten_scale_ex_cpu);
  m.impl("sum_of_squares", &fastcoll::sum_of_squares_cpu);
}
