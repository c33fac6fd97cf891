// Bucket plans (plan.h): the check of a call against the kept plan, the
// rebuild, and the registry of the backends' runners.
#include "plan.h"

#include <c10/util/Exception.h>

#include <utility>

namespace fastcoll {
namespace {

// Runners by device type, filled by static initializers (constant-initialized: no order to worry about).
PlannedRunFn runners[static_cast<int>(at::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)] = {};

TensorKey key_of(const at::Tensor& t) {
  return TensorKey{t.data_ptr(), t.numel(), t.scalar_type()};
}

// Whether `t` is the tensor `k` was taken from as far as plan_segments' checks go: the same
// address (data_ptr(), as the kernels write it: a copy-on-write tensor materializes, and
// then differs), element count and dtype, on `device`, still dense.
bool same(const TensorKey& k, const at::Tensor& t, const at::Device& device) {
  return t.data_ptr() == k.data && t.numel() == k.numel && t.scalar_type() == k.dtype && t.device() == device &&
      (k.numel <= 1 || t.is_non_overlapping_and_dense());
}

const char* op_name(BucketPlan::Direction d) {
  return d == BucketPlan::kPack ? "fastcoll.flatten_scale" : "fastcoll.unflatten_scale";
}

}  // namespace

bool register_planned_runner(at::DeviceType type, PlannedRunFn fn) {
  runners[static_cast<int>(type)] = fn;
  return true;
}

bool has_planned_runner(at::DeviceType type) {
  return runners[static_cast<int>(type)] != nullptr;
}

bool BucketPlan::matches(const PlanEntry& e, at::TensorList tensors, const at::Tensor& flat) const {
  if (!e.valid || e.keys.size() != tensors.size() || flat.dim() != 1 || !flat.is_contiguous() ||
      !same(e.flat, flat, e.device)) {
    return false;
  }
  const TensorKey* k = e.keys.data();
  for (const at::Tensor& t : tensors) {
    if (!same(*k++, t, e.device)) return false;
  }
  return true;
}

void BucketPlan::rebuild(PlanEntry& e, Direction d, at::TensorList tensors, const at::Tensor& flat) {
  e.valid = false;
  // Every check of the op, with its messages; throws before the entry or any tensor changes.
  std::vector<Segment> segments = plan_segments(tensors, flat, d == kPack);
  e.keys.clear();
  e.keys.reserve(tensors.size());
  for (const at::Tensor& t : tensors) e.keys.push_back(key_of(t));
  e.flat = key_of(flat);
  e.device = flat.device();
  e.segments = std::move(segments);
  e.state.reset();
  e.valid = true;
  ++builds_;
}

void BucketPlan::run(Direction d, at::TensorList tensors, const at::Tensor& flat, double scale) {
  const PlannedRunFn runner = runners[static_cast<int>(flat.device().type())];
  TORCH_CHECK(
      runner != nullptr, op_name(d), ": no planned kernels for ", flat.device().type(),
      " tensors in this build; call it without a plan");
  std::lock_guard<std::mutex> lock(mutex_);
  PlanEntry& e = entries_[d];
  if (matches(e, tensors, flat)) {
    ++reuses_;
  } else {
    rebuild(e, d, tensors, flat);
  }
  runner(e, flat, scale, op_name(d));
}

void BucketPlan::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (PlanEntry& e : entries_) e = PlanEntry();
}

}  // namespace fastcoll
