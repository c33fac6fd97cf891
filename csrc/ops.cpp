// Op schemas and the argument checks shared by every device.
//
// The schemas here must match fastcoll/ops/loader.py SCHEMAS (the pure-PyTorch
// fallback registers the same ones when this library is not built).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <initializer_list>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dtypes.h"
#include "fastcoll.h"


namespace fastcoll {

std::string shape_str(at::IntArrayRef a) {
  std::string s = "(";
  for (size_t i = 0; i < a.size(); ++i) {
    s += std::to_string(a[i]);
    if (a.size() == 1 || i + 1 < a.size()) s += ", ";
  }
  if (a.size() == 1) s.pop_back();
  return s + ")";
}

namespace {

// The name Python prints for a dtype (float32, int64, bool, ...).
std::string dtype_name(at::ScalarType t) {
  return std::string(c10::getDtypeNames(t).first);
}

// Messages follow "fastcoll.<public name>: what went wrong (values); how to fix it";
// `op` is that prefix ("fastcoll.flatten_scale" or "fastcoll.unflatten_scale").

void check_dtype(const char* op, const at::Tensor& t, const std::string& what) {
  TORCH_CHECK_TYPE(
      is_supported_dtype(t.scalar_type()), op, ": ", what, " has dtype ", dtype_name(t.scalar_type()),
      "; supported dtypes are ", supported_dtype_names());
}

void check_strided(const char* op, const at::Tensor& t, const std::string& what) {
  TORCH_CHECK_TYPE(
      t.layout() == at::kStrided, op, ": ", what, " has layout ", t.layout(),
      "; only strided (dense) tensors are supported");
}


// The checks of one listed tensor (tensors[i]) against the op's flat buffer
// (or sum_of_squares' out): layout, device, dtype, dense.
void check_listed(const char* op, const at::Tensor& t, size_t i, const at::Tensor& flat, const std::string& flat_name) {
  // The common case first, without building the tensor's name (this runs once per listed tensor).
  if (t.layout() == at::kStrided && t.device() == flat.device() && is_supported_dtype(t.scalar_type()) &&
      (t.numel() <= 1 || t.is_non_overlapping_and_dense())) {
    return;
  }
  const std::string what = "tensors[" + std::to_string(i) + "]";
  check_strided(op, t, what);
  TORCH_CHECK(
      t.device() == flat.device(), op, ": ", what, " is on ", t.device(), " but ", flat_name,
      " is on ", flat.device(), "; move them to one device");
  check_dtype(op, t, what);
  TORCH_CHECK_VALUE(
      t.numel() <= 1 || t.is_non_overlapping_and_dense(), op, ": ", what, " (shape ",
      shape_str(t.sizes()), ", strides ", shape_str(t.strides()),
      ") is not dense and non-overlapping; make it .contiguous() first");
}

// ---- The small tensors of the health ops (same words as fastcoll/ops/reference.py) ----

// "a float32 tensor of shape (2,) on cpu"
std::string describe(const at::Tensor& t) {
  const std::string dt = dtype_name(t.scalar_type());
  const bool strided = t.layout() == at::kStrided;
  const bool vowel = strided && std::string("aeiou").find(dt[0]) != std::string::npos;
  return std::string(vowel ? "an " : "a ") + (strided ? "" : "non-strided ") + dt + " tensor of shape " +
      shape_str(t.sizes()) + " on " + t.device().str();
}

// `t` must be strided, of one of `dtypes`, on `device`, with exactly one (or,
// with at_least_one, at least one) element; `need` says so in the message.
void check_small(
    const char* op, const at::Tensor& t, const char* name, std::initializer_list<at::ScalarType> dtypes,
    const char* need, const at::Device& device, bool at_least_one) {
  const bool dtype_ok = std::find(dtypes.begin(), dtypes.end(), t.scalar_type()) != dtypes.end();
  TORCH_CHECK_TYPE(
      t.layout() == at::kStrided && dtype_ok, op, ": ", name, " must be ", need, " on ", device, ", got ", describe(t));
  TORCH_CHECK(t.device() == device, op, ": ", name, " must be ", need, " on ", device, ", got ", describe(t));
  TORCH_CHECK_VALUE(
      at_least_one ? t.numel() >= 1 : t.numel() == 1, op, ": ", name, " must be ", need, " on ", device, ", got ",
      describe(t));
}

// The element of `t` the op reads or writes (its first) shares no byte with any of `others`.
void check_apart(
    const char* op, const at::Tensor& t, const char* name,
    const std::vector<std::pair<std::string, const at::Tensor*>>& others) {
  const auto lo = reinterpret_cast<uintptr_t>(t.data_ptr());
  const auto hi = lo + t.element_size();
  for (const auto& [other_name, o] : others) {
    if (o == nullptr || o->numel() == 0) continue;
    const auto o_lo = reinterpret_cast<uintptr_t>(o->data_ptr());
    const auto o_hi = o_lo + o->numel() * o->element_size();
    TORCH_CHECK_VALUE(
        !(lo < o_hi && o_lo < hi), op, ": ", name, " overlaps ", other_name, "; give ", name, " memory of its own");
  }
}

std::vector<std::pair<std::string, const at::Tensor*>> listed(at::TensorList tensors) {
  std::vector<std::pair<std::string, const at::Tensor*>> v;
  v.reserve(tensors.size() + 2);
  for (size_t i = 0; i < tensors.size(); ++i) v.emplace_back("tensors[" + std::to_string(i) + "]", &tensors[i]);
  return v;
}

constexpr const char* kNeedScaleBy = "a float32 or float64 tensor with 1 element";
constexpr const char* kNeedFlag = "an int32 tensor with at least 1 element";
constexpr const char* kNeedSum = "a float64 tensor with 1 element";

}  // namespace

int dtype_code(at::ScalarType t) {
  switch (t) {
#define FASTCOLL_DTYPE_CODE_CASE(code, T, st, name) \
  case at::ScalarType::st:                          \
    return code;
    FASTCOLL_FOR_EACH_DTYPE(FASTCOLL_DTYPE_CODE_CASE)
#undef FASTCOLL_DTYPE_CODE_CASE
    default:
      TORCH_CHECK(
          false, "fastcoll internal error: dtype_code(", dtype_name(t),
          ") reached a kernel; plan_segments should have refused it. Please report this");
  }
}

std::vector<Segment> plan_segments(
    at::TensorList tensors, const at::Tensor& flat, bool pack, const char* op_name, FlatFit fit) {
  const char* op = op_name != nullptr ? op_name : pack ? "fastcoll.flatten_scale" : "fastcoll.unflatten_scale";
  const std::string flat_name = pack ? "out" : "flat";
  const bool exact = fit == FlatFit::kExact;
  TORCH_CHECK_VALUE(!exact || !tensors.empty(), op, ": tensors is empty; pass at least one tensor");
  check_strided(op, flat, flat_name);
  check_dtype(op, flat, flat_name);
  TORCH_CHECK_VALUE(
      flat.dim() == 1 && flat.is_contiguous(), op, ": ", flat_name,
      " must be a 1-D contiguous tensor, got shape ", shape_str(flat.sizes()), " with strides ",
      shape_str(flat.strides()), "; pass a 1-D contiguous buffer");

  std::vector<int64_t> offsets;
  offsets.reserve(tensors.size());
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    check_listed(op, t, i, flat, flat_name);
    offsets.push_back(total);
    total += t.numel();
  }
  TORCH_CHECK_VALUE(
      exact ? total == flat.numel() : total <= flat.numel(), op, ": the tensors hold ", total,
      " elements in total but ", flat_name, " has ", flat.numel(), "; ", flat_name, " must have ",
      exact ? "exactly" : "at least", " as many");

  // Aliasing. A tensor sitting exactly in its own slot of the flat buffer is an
  // in-place scale and is allowed; any other overlap would read overwritten data.
  char* const flat_data = static_cast<char*>(flat.data_ptr());
  const auto flat_lo = reinterpret_cast<uintptr_t>(flat_data);
  const auto flat_hi = flat_lo + flat.numel() * flat.element_size();
  const int64_t fsize = flat.element_size();
  std::vector<std::tuple<uintptr_t, uintptr_t, size_t>> ranges;
  ranges.reserve(tensors.size());
  std::vector<Segment> segments;
  segments.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (t.numel() == 0) continue;
    const auto lo = reinterpret_cast<uintptr_t>(t.data_ptr());
    const auto hi = lo + t.numel() * t.element_size();
    if (lo < flat_hi && flat_lo < hi) {
      const bool in_slot = t.scalar_type() == flat.scalar_type() && lo == flat_lo + offsets[i] * fsize;
      TORCH_CHECK_VALUE(
          in_slot, op, ": tensors[", i, "] overlaps ", flat_name, " outside its own slot (elements ",
          offsets[i], "..", offsets[i] + t.numel(), "); the op would read overwritten data: use separate "
          "memory, or exactly that slot (fastcoll.bucket_views) for an in-place scale");
    }
    ranges.emplace_back(lo, hi, i);
    char* slot = flat_data + offsets[i] * fsize;
    Segment s;
    s.numel = t.numel();
    s.flat_offset = offsets[i];
    if (pack) {
      s.src = t.data_ptr();
      s.dst = slot;
      s.src_dtype = t.scalar_type();
      s.dst_dtype = flat.scalar_type();
    } else {
      s.src = slot;
      s.dst = t.data_ptr();
      s.src_dtype = flat.scalar_type();
      s.dst_dtype = t.scalar_type();
    }
    segments.push_back(s);
  }
  if (!pack && ranges.size() > 1) {
    std::sort(ranges.begin(), ranges.end());
    for (size_t k = 0; k + 1 < ranges.size(); ++k) {
      if (std::get<0>(ranges[k + 1]) < std::get<1>(ranges[k])) {
        const size_t a = std::min(std::get<2>(ranges[k]), std::get<2>(ranges[k + 1]));
        const size_t b = std::max(std::get<2>(ranges[k]), std::get<2>(ranges[k + 1]));
        TORCH_CHECK_VALUE(
            false, op, ": tensors[", a, "] and tensors[", b,
            "] overlap in memory; destinations must not share memory");
      }
    }
  }
  return segments;
}

// Checks in the order of fastcoll/ops/reference.py: the list and the flat buffer
// (plan_segments), scale_by, nonfinite (or sumsq), then overlaps.
HealthPlan plan_flatten_scale_ex(
    at::TensorList tensors, const at::Tensor& out, const std::optional<at::Tensor>& scale_by,
    const std::optional<at::Tensor>& nonfinite) {
  const char* op = "fastcoll.flatten_scale_ex";
  HealthPlan plan;
  plan.segments = plan_segments(tensors, out, /*pack=*/true, op);
  const at::Tensor* by = scale_by.has_value() ? &*scale_by : nullptr;
  if (by != nullptr) check_small(op, *by, "scale_by", {at::kFloat, at::kDouble}, kNeedScaleBy, out.device(), false);
  if (nonfinite.has_value()) check_small(op, *nonfinite, "nonfinite", {at::kInt}, kNeedFlag, out.device(), true);
  if (by != nullptr) check_apart(op, *by, "scale_by", {{"out", &out}});
  if (nonfinite.has_value()) {
    auto others = listed(tensors);
    others.insert(others.begin(), {"out", &out});
    others.emplace_back("scale_by", by);
    check_apart(op, *nonfinite, "nonfinite", others);
  }
  if (by != nullptr) {
    plan.scale_by = by->data_ptr();
    plan.scale_by_f64 = by->scalar_type() == at::kDouble;
  }
  if (nonfinite.has_value()) plan.nonfinite = nonfinite->data_ptr<int32_t>();
  return plan;
}

HealthPlan plan_unflatten_scale_ex(
    const at::Tensor& flat, at::TensorList tensors, const std::optional<at::Tensor>& sumsq) {
  const char* op = "fastcoll.unflatten_scale_ex";
  HealthPlan plan;
  plan.segments = plan_segments(tensors, flat, /*pack=*/false, op);
  if (sumsq.has_value()) {
    check_small(op, *sumsq, "sumsq", {at::kDouble}, kNeedSum, flat.device(), false);
    auto others = listed(tensors);
    others.insert(others.begin(), {"flat", &flat});
    check_apart(op, *sumsq, "sumsq", others);
    plan.sumsq = sumsq->data_ptr<double>();
  }
  return plan;
}

// Checks in the order of fastcoll/ops/reference.py: the list and out
// (plan_segments, out at least as long as the tensors), nonfinite, then its overlaps.
HealthPlan plan_flatten_accumulate(
    at::TensorList tensors, const at::Tensor& out, const std::optional<at::Tensor>& nonfinite) {
  const char* op = "fastcoll.flatten_accumulate";
  HealthPlan plan;
  plan.segments = plan_segments(tensors, out, /*pack=*/true, op, FlatFit::kPrefix);
  if (nonfinite.has_value()) {
    check_small(op, *nonfinite, "nonfinite", {at::kInt}, kNeedFlag, out.device(), true);
    auto others = listed(tensors);
    others.insert(others.begin(), {"out", &out});
    check_apart(op, *nonfinite, "nonfinite", others);
    plan.nonfinite = nonfinite->data_ptr<int32_t>();
  }
  return plan;
}

HealthPlan plan_sum_of_squares(at::TensorList tensors, const at::Tensor& out) {
  const char* op = "fastcoll.sum_of_squares";
  TORCH_CHECK_VALUE(!tensors.empty(), op, ": tensors is empty; pass at least one tensor");
  for (size_t i = 0; i < tensors.size(); ++i) check_listed(op, tensors[i], i, out, "out");
  check_small(op, out, "out", {at::kDouble}, kNeedSum, out.device(), false);
  check_apart(op, out, "out", listed(tensors));
  HealthPlan plan;
  int64_t offset = 0;
  for (const at::Tensor& t : tensors) {
    if (t.numel() == 0) continue;
    Segment s;
    s.src = t.data_ptr();
    s.dst = nullptr;
    s.numel = t.numel();
    s.flat_offset = offset;
    s.src_dtype = t.scalar_type();
    s.dst_dtype = t.scalar_type();
    plan.segments.push_back(s);
    offset += t.numel();
  }
  plan.sumsq = out.data_ptr<double>();
  return plan;
}


// sum_chunks: chunks [N, n] (N >= 1) of float16 or bfloat16, dense row-major;
// out 1-D contiguous, n elements, float32 or chunks' dtype, on chunks' device,
// sharing no byte with chunks. Checked in the order of fastcoll/ops/reference.py.
void check_sum_chunks(const at::Tensor& chunks, const at::Tensor& out) {
  const char* op = "fastcoll.sum_chunks";
  check_strided(op, chunks, "chunks");
  check_strided(op, out, "out");
  const auto ct = chunks.scalar_type();
  TORCH_CHECK_TYPE(
      ct == at::kHalf || ct == at::kBFloat16, op, ": chunks has dtype ", dtype_name(ct),
      "; it must be float16 or bfloat16 (the 16-bit values received from every rank)");
  TORCH_CHECK_VALUE(
      chunks.dim() == 2 && chunks.size(0) >= 1 && chunks.is_contiguous(), op,
      ": chunks must be a contiguous 2-D tensor [ranks, n] with at least one row, got shape ",
      shape_str(chunks.sizes()), " with strides ", shape_str(chunks.strides()));
  TORCH_CHECK(
      out.device() == chunks.device(), op, ": out is on ", out.device(), " but chunks is on ", chunks.device(),
      "; move them to one device");
  TORCH_CHECK_TYPE(
      out.scalar_type() == at::kFloat || out.scalar_type() == ct, op, ": out has dtype ",
      dtype_name(out.scalar_type()), "; it must be float32 or chunks' dtype (", dtype_name(ct), ")");
  TORCH_CHECK_VALUE(
      out.dim() == 1 && out.is_contiguous() && out.numel() == chunks.size(1), op,
      ": out must be a 1-D contiguous tensor of ", chunks.size(1), " elements (one row of chunks), got shape ",
      shape_str(out.sizes()), " with strides ", shape_str(out.strides()));
  if (out.numel() > 0) {
    const auto lo = reinterpret_cast<uintptr_t>(out.data_ptr());
    const auto hi = lo + out.numel() * out.element_size();
    const auto c_lo = reinterpret_cast<uintptr_t>(chunks.data_ptr());
    const auto c_hi = c_lo + chunks.numel() * chunks.element_size();
    TORCH_CHECK_VALUE(
        !(lo < c_hi && c_lo < hi), op, ": out overlaps chunks; the sum would read values it overwrote: give out "
        "memory of its own");
  }
}

}  // namespace fastcoll

TORCH_LIBRARY(fastcoll, m) {
  m.def("flatten_scale(Tensor[] tensors, Tensor(a!) out, float scale=1.0) -> ()");
  m.def("unflatten_scale(Tensor flat, Tensor(a!)[] tensors, float scale=1.0) -> ()");
  // Gradient health (HealthPlan in fastcoll.h; semantics in fastcoll/ops/__init__.py and fastcoll/ops/reference.py).
  m.def(
      "flatten_scale_ex(Tensor[] tensors, Tensor(a!) out, float scale=1.0, Tensor? scale_by=None, "
      "Tensor(b!)? nonfinite=None) -> ()");
  m.def("unflatten_scale_ex(Tensor flat, Tensor(a!)[] tensors, float scale=1.0, Tensor(b!)? sumsq=None) -> ()");
  m.def("sum_of_squares(Tensor[] tensors, Tensor(a!) out) -> ()");
  // fp32 main gradients: out[slot] = out[slot] + scale * tensor, one fused multiply-add
  // (definition in fastcoll/ops/__init__.py; CPU: csrc/cpu/accumulate_cpu.cpp).
  m.def("flatten_accumulate(Tensor[] tensors, Tensor(a!) out, float scale=1.0, Tensor(b!)? nonfinite=None) -> ()");
  // One-rounding reduction: out = cast(float(scale * (chunks[0] + ... + chunks[N-1]))), summed in float64 in
  // row order, rounded once to float32 (definition in fastcoll/ops/__init__.py; CPU: csrc/cpu/sum_chunks_cpu.cpp).
  m.def("sum_chunks(Tensor chunks, Tensor(a!) out, float scale=1.0) -> ()");
  // Replica verification: one int64 hash per tensor (definition in csrc/cpu/checksum_cpu.cpp).
  m.def("checksum(Tensor[] tensors) -> Tensor");
}
