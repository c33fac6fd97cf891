// Bucket plans: a bucket's segment plan (and, on CUDA, its chunk table) built
// once and reused by every call whose tensors are still where they were.
//
// A fused op call spends host time per listed tensor: checking it, planning
// its segment, and on CUDA cutting it into chunks, writing their descriptors
// and, past 512 chunks, uploading them. A bucket's layout is fixed for many
// iterations, so a BucketPlan keeps, per direction (pack: tensors -> flat,
// unpack: flat -> tensors), the segments of the last call and what their
// checks depended on: each tensor's data pointer, element count, dtype and
// density, and the flat buffer's. A call whose tensors all match is the same
// call as far as every check of plan_segments goes (its verdicts are functions
// of exactly those), so it runs the kept plan at once: per tensor, a handful of
// field comparisons. A call that does not match (a gradient reallocated, a
// tensor replaced) is checked in full and replaces the plan.
//
// Why an object the caller holds, rather than a cache inside the extension
// keyed by the tensors: a cache would have to hash every tensor of every call
// to find its entry (the very per-tensor work a plan saves), could not tell a
// bucket's new storage from another bucket, and would have no owner to free
// its device tables. The Python reducer holds one plan per bucket
// (fastcoll.ops.BucketPlan) for as long as the bucket lives; the ops' schemas
// are unchanged (a plan is an argument of the direct eager entry points only,
// csrc/eager.cpp; torch.ops calls, tracing and torch.compile never see it).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "fastcoll.h"

namespace fastcoll {

// What the checks of one tensor (or of the flat buffer) depend on.
struct TensorKey {
  const void* data = nullptr;
  int64_t numel = -1;
  at::ScalarType dtype = at::ScalarType::Undefined;
};

// A backend's state of one plan entry (the CUDA chunk table); dropped when the entry is rebuilt.
struct PlanDeviceState {
  virtual ~PlanDeviceState() = default;
};

// One direction's plan.
struct PlanEntry {
  bool valid = false;
  std::vector<TensorKey> keys;  // one per listed tensor
  TensorKey flat;
  at::Device device{at::kCPU};
  std::vector<Segment> segments;              // plan_segments' result
  std::unique_ptr<PlanDeviceState> state;     // the backend's, built at the first run after a rebuild
};

class BucketPlan {
 public:
  enum Direction : int { kPack = 0, kUnpack = 1 };

  // Runs flatten_scale (kPack: tensors -> flat) or unflatten_scale (kUnpack)
  // with this plan: a call matching the kept entry runs it, any other is
  // checked in full (the op's own errors, before anything is written) and
  // replaces it. Every tensor must be a plain strided CPU or CUDA tensor of
  // one backend (csrc/eager.cpp checks that before calling); the backend must
  // have a planned runner (has_runner).
  void run(Direction d, at::TensorList tensors, const at::Tensor& flat, double scale);

  // Times an entry was (re)built, and calls that reused one.
  int64_t builds() const { return builds_; }
  int64_t reuses() const { return reuses_; }
  // Forgets both entries (the next calls rebuild them).
  void clear();

 private:
  bool matches(const PlanEntry& e, at::TensorList tensors, const at::Tensor& flat) const;
  void rebuild(PlanEntry& e, Direction d, at::TensorList tensors, const at::Tensor& flat);

  std::mutex mutex_;  // one call at a time (the GIL is released while a call runs)
  PlanEntry entries_[2];
  int64_t builds_ = 0;
  int64_t reuses_ = 0;
};

// A backend's runner of a built entry: copies entry.segments times `scale`
// (the plain flatten_scale / unflatten_scale kernels). `like` is the flat
// buffer; `op` prefixes errors ("fastcoll.flatten_scale").
using PlannedRunFn = void (*)(PlanEntry& entry, const at::Tensor& like, double scale, const char* op);
// Registered at load time by the CPU kernels (cpu/flatten_scale_cpu.cpp) and
// the CUDA ops (cuda/cuda_ops.cpp).
bool register_planned_runner(at::DeviceType type, PlannedRunFn fn);
bool has_planned_runner(at::DeviceType type);

}  // namespace fastcoll
