// CPU kernels of fastcoll::flatten_scale and fastcoll::unflatten_scale.
//
// One call handles the whole bucket: the segments are laid end to end in flat
// order and at::parallel_for splits that element range evenly across threads,
// so a huge tensor is shared by all threads and many tiny ones are batched into
// one thread's range. The inner loops use at::vec; the multiply runs in float
// (double when either side is double). Nothing is allocated beyond the plan.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>

#include "fastcoll.h"

namespace fastcoll {
namespace {

using at::vec::Vectorized;
using FVec = Vectorized<float>;

// Loads/stores two float vectors' worth of elements (2 * FVec::size()) of type T.
template <typename T>
struct FloatPair;

template <>
struct FloatPair<float> {
  static inline void load(const float* p, FVec& a, FVec& b) {
    a = FVec::loadu(p);
    b = FVec::loadu(p + FVec::size());
  }
  static inline void store(float* p, const FVec& a, const FVec& b) {
    a.store(p);
    b.store(p + FVec::size());
  }
};

template <typename R>  // c10::Half or c10::BFloat16
struct ReducedFloatPair {
  static inline void load(const R* p, FVec& a, FVec& b) {
    std::tie(a, b) = at::vec::convert_to_float<R>(Vectorized<R>::loadu(p));
  }
  static inline void store(R* p, const FVec& a, const FVec& b) {
    at::vec::convert_from_float<R>(a, b).store(p);
  }
};
template <>
struct FloatPair<c10::Half> : ReducedFloatPair<c10::Half> {};
template <>
struct FloatPair<c10::BFloat16> : ReducedFloatPair<c10::BFloat16> {};

template <typename S, typename D>
void copy_scale(const S* src, D* dst, int64_t n, double scale) {
  constexpr bool kHasDouble = std::is_same_v<S, double> || std::is_same_v<D, double>;
  if constexpr (kHasDouble) {
    // float64 on either side: the compiler vectorizes this plain loop.
    for (int64_t i = 0; i < n; ++i) {
      dst[i] = static_cast<D>(static_cast<double>(src[i]) * scale);
    }
  } else {
    const float fscale = static_cast<float>(scale);
    constexpr int64_t kStep = 2 * FVec::size();
    const FVec vscale(fscale);
    int64_t i = 0;
    for (; i + kStep <= n; i += kStep) {
      FVec a, b;
      FloatPair<S>::load(src + i, a, b);
      FloatPair<D>::store(dst + i, a * vscale, b * vscale);
    }
    for (; i < n; ++i) {
      dst[i] = static_cast<D>(static_cast<float>(src[i]) * fscale);
    }
  }
}

using CopyFn = void (*)(const void*, void*, int64_t, double);

template <typename S, typename D>
void copy_scale_erased(const void* src, void* dst, int64_t n, double scale) {
  copy_scale<S, D>(static_cast<const S*>(src), static_cast<D*>(dst), n, scale);
}

CopyFn pick_copy(at::ScalarType src, at::ScalarType dst) {
  CopyFn fn = nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src, "fastcoll_cpu_src", [&] {
    using src_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dst, "fastcoll_cpu_dst", [&] {
      fn = &copy_scale_erased<src_t, scalar_t>;
    });
  });
  return fn;
}

// Elements below which splitting across threads costs more than it saves.
constexpr int64_t kGrainElements = 32768;

void run_plan(const std::vector<Segment>& segments, double scale) {
  if (segments.empty()) return;
  std::vector<CopyFn> fns;
  fns.reserve(segments.size());
  for (const auto& s : segments) fns.push_back(pick_copy(s.src_dtype, s.dst_dtype));
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
