// Direct eager entry points of the fused ops, for plain tensors.
//
// Calling torch.ops.fastcoll.* from Python costs about 130 ns per listed
// tensor before any kernel runs: the boxed call converts the list into
// IValues, copies it again into a std::vector<at::Tensor>, and, having
// released the GIL, takes it back for every tensor whose last extra
// reference it drops. For a bucket of 1024 small gradients that is more time
// than the copy itself. These entry points borrow the tensors from their
// Python objects (no reference counting), release the GIL once, and
// redispatch to the same backend kernel the dispatcher would reach.
//
// They only take calls whose result cannot differ from torch.ops': every
// tensor an exact torch.Tensor (or nn.Parameter) whose dispatch keys are those
// of a plain CPU or CUDA tensor, all on one backend, none requiring grad, no
// dispatch key forced on by thread-local state (modes, functionalization,
// vmap) and no torch function mode. For anything else they return False
// having done nothing, and fastcoll/ops/__init__.py makes the boxed call, which also
// produces the usual errors for arguments that are not tensors. The kernels
// check every argument themselves (plan_segments), so errors are the same.
#include <torch/csrc/utils/pybind.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/python_variable.h>

#include <atomic>
#include <optional>
#include <vector>

#include "plan.h"

namespace fastcoll {
namespace {

std::atomic<int64_t> direct_calls{0};
std::atomic<int64_t> deferred_calls{0};

// The dispatch keys of a plain dense tensor on `backend` (CPU or CUDA): the
// backend's own key plus the autograd and autocast keys every such tensor carries.
c10::DispatchKeySet plain_keys(c10::DispatchKey backend_key, c10::BackendComponent backend) {
  return c10::DispatchKeySet(backend_key) | c10::getAutogradRelatedKeySetFromBackend(backend) |
      c10::getAutocastRelatedKeySetFromBackend(backend);
}

// The backend key a call on `t` redispatches to; nullopt when `t` is not a
// plain CPU or CUDA tensor (see the file comment).
std::optional<c10::DispatchKey> plain_backend(const at::Tensor& t) {
  static const c10::DispatchKeySet cpu = plain_keys(c10::DispatchKey::CPU, c10::BackendComponent::CPUBit);
  static const c10::DispatchKeySet cuda = plain_keys(c10::DispatchKey::CUDA, c10::BackendComponent::CUDABit);
  const c10::DispatchKeySet ks = t.key_set();
  if (ks == cpu) return c10::DispatchKey::CPU;
  if (ks == cuda) return c10::DispatchKey::CUDA;
  return std::nullopt;
}

// The tensors of one call, borrowed from their Python objects. `owner` keeps
// those objects alive while the GIL is released (a tuple: nobody can remove
// them from it), so the borrows need no reference counts of their own.
class BorrowedCall {
 public:
  BorrowedCall() = default;
  BorrowedCall(const BorrowedCall&) = delete;
  BorrowedCall& operator=(const BorrowedCall&) = delete;
  ~BorrowedCall() {
    for (auto& t : list_) c10::MaybeOwnedTraits<at::Tensor>::destroyBorrow(t);
    for (auto& t : singles_) c10::MaybeOwnedTraits<at::Tensor>::destroyBorrow(t);
  }

  // Borrows every element of `seq` as the call's tensor list.
  bool add_list(py::handle seq) {
    PyObject* tuple = PySequence_Tuple(seq.ptr());
    if (tuple == nullptr) {
      PyErr_Clear();
      return false;
    }
    owner_ = py::reinterpret_steal<py::tuple>(tuple);
    const Py_ssize_t n = PyTuple_GET_SIZE(tuple);
    list_.reserve(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      const at::Tensor* t = check(PyTuple_GET_ITEM(tuple, i));
      if (t == nullptr) return false;
      list_.push_back(c10::MaybeOwnedTraits<at::Tensor>::createBorrow(*t));
    }
    return true;
  }

  // Borrows one tensor argument (kept alive by the caller's frame, which
  // holds it for the whole call); returns its index in singles().
  bool add_single(py::handle obj) {
    const at::Tensor* t = check(obj.ptr());
    if (t == nullptr) return false;
    singles_.push_back(c10::MaybeOwnedTraits<at::Tensor>::createBorrow(*t));
    return true;
  }

  // An optional tensor argument: None, or a tensor as add_single takes it.
  bool add_optional(py::handle obj, std::optional<at::Tensor>& into) {
    if (obj.is_none()) return true;
    const at::Tensor* t = check(obj.ptr());
    if (t == nullptr) return false;
    into = *t;  // an owned reference, dropped while the GIL is held again
    return true;
  }

  at::TensorList list() const { return list_; }
  // The device type of the call's backend (after a successful add_*).
  c10::DeviceType device_type() const { return *backend_ == c10::DispatchKey::CPU ? c10::kCPU : c10::kCUDA; }
  const at::Tensor& single(size_t i) const { return singles_[i]; }
  // The backend kernel's key: the dispatcher would reach it past the autograd
  // and autocast keys, which do nothing for these tensors.
  c10::DispatchKeySet backend() const { return c10::DispatchKeySet(*backend_); }

 private:
  // The tensor behind `obj` when it may take the direct path, else nullptr.
  const at::Tensor* check(PyObject* obj) {
    if (!THPVariable_CheckExact(obj)) return nullptr;
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.defined() || t.requires_grad()) return nullptr;
    if (!backend_.has_value()) {  // the first tensor fixes the backend; the others must match it exactly
      backend_ = plain_backend(t);
      if (!backend_.has_value()) return nullptr;
      keys_ = t.key_set();
    } else if (t.key_set() != keys_) {
      return nullptr;
    }
    return &t;
  }

  py::tuple owner_;
  std::vector<at::Tensor> list_;
  std::vector<at::Tensor> singles_;
  std::optional<c10::DispatchKey> backend_;
  c10::DispatchKeySet keys_;
};

// Thread-local state that the dispatcher would act on: keys forced into
// every dispatch (modes, functionalization, vmap) or a torch function mode.
bool state_allows_direct() {
  const c10::DispatchKeySet forced = c10::impl::tls_local_dispatch_key_set().included_ - c10::default_included_set;
  return forced.empty() && !at::impl::torch_function_mode_enabled();
}

template <class Fn>
bool run_direct(BorrowedCall& call, bool ok, Fn&& fn) {
  if (!ok || !state_allows_direct()) {
    deferred_calls.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  {
    py::gil_scoped_release no_gil;
    fn(call.backend());
  }
  direct_calls.fetch_add(1, std::memory_order_relaxed);
  return true;
}

template <class Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

bool flatten_scale(py::handle tensors, py::handle out, double scale) {
  static const auto handle = op<void(at::TensorList, const at::Tensor&, double)>("fastcoll::flatten_scale");
  BorrowedCall call;
  const bool ok = call.add_single(out) && call.add_list(tensors);
  return run_direct(call, ok, [&](c10::DispatchKeySet ks) {
    handle.redispatch(ks, call.list(), call.single(0), scale);
  });
}

bool flatten_scale_ex(py::handle tensors, py::handle out, double scale, py::handle scale_by, py::handle nonfinite) {
  static const auto handle = op<void(
      at::TensorList, const at::Tensor&, double, const std::optional<at::Tensor>&,
      const std::optional<at::Tensor>&)>("fastcoll::flatten_scale_ex");
  BorrowedCall call;
  std::optional<at::Tensor> by, flag;
  const bool ok = call.add_single(out) && call.add_list(tensors) && call.add_optional(scale_by, by) &&
      call.add_optional(nonfinite, flag);
  return run_direct(call, ok, [&](c10::DispatchKeySet ks) {
    handle.redispatch(ks, call.list(), call.single(0), scale, by, flag);
  });
}

bool flatten_accumulate(py::handle tensors, py::handle out, double scale, py::handle nonfinite) {
  static const auto handle = op<void(at::TensorList, const at::Tensor&, double, const std::optional<at::Tensor>&)>(
      "fastcoll::flatten_accumulate");
  BorrowedCall call;
  std::optional<at::Tensor> flag;
  const bool ok = call.add_single(out) && call.add_list(tensors) && call.add_optional(nonfinite, flag);
  return run_direct(call, ok, [&](c10::DispatchKeySet ks) {
    handle.redispatch(ks, call.list(), call.single(0), scale, flag);
  });
}

bool unflatten_scale(py::handle flat, py::handle tensors, double scale) {
  static const auto handle = op<void(const at::Tensor&, at::TensorList, double)>("fastcoll::unflatten_scale");
  BorrowedCall call;
  const bool ok = call.add_single(flat) && call.add_list(tensors);
  return run_direct(call, ok, [&](c10::DispatchKeySet ks) {
    handle.redispatch(ks, call.single(0), call.list(), scale);
  });
}

bool unflatten_scale_ex(py::handle flat, py::handle tensors, double scale, py::handle sumsq) {
  static const auto handle = op<void(const at::Tensor&, at::TensorList, double, const std::optional<at::Tensor>&)>(
      "fastcoll::unflatten_scale_ex");
  BorrowedCall call;
  std::optional<at::Tensor> sum;
  const bool ok = call.add_single(flat) && call.add_list(tensors) && call.add_optional(sumsq, sum);
  return run_direct(call, ok, [&](c10::DispatchKeySet ks) {
    handle.redispatch(ks, call.single(0), call.list(), scale, sum);
  });
}

bool sum_of_squares(py::handle tensors, py::handle out) {
  static const auto handle = op<void(at::TensorList, const at::Tensor&)>("fastcoll::sum_of_squares");
  BorrowedCall call;
  const bool ok = call.add_single(out) && call.add_list(tensors);
  return run_direct(call, ok, [&](c10::DispatchKeySet ks) { handle.redispatch(ks, call.list(), call.single(0)); });
}

// ---- Planned calls (plan.h): the direct path's conditions, then the bucket's plan ----

bool flatten_scale_planned(BucketPlan& plan, py::handle tensors, py::handle out, double scale) {
  BorrowedCall call;
  const bool ok = call.add_single(out) && call.add_list(tensors) && has_planned_runner(call.device_type());
  return run_direct(call, ok, [&](c10::DispatchKeySet) {
    plan.run(BucketPlan::kPack, call.list(), call.single(0), scale);
  });
}

bool unflatten_scale_planned(BucketPlan& plan, py::handle flat, py::handle tensors, double scale) {
  BorrowedCall call;
  const bool ok = call.add_single(flat) && call.add_list(tensors) && has_planned_runner(call.device_type());
  return run_direct(call, ok, [&](c10::DispatchKeySet) {
    plan.run(BucketPlan::kUnpack, call.list(), call.single(0), scale);
  });
}

py::dict eager_stats() {
  py::dict d;
  d["direct"] = direct_calls.load(std::memory_order_relaxed);
  d["deferred"] = deferred_calls.load(std::memory_order_relaxed);
  return d;
}

}  // namespace

void bind_eager(py::module_& m) {
  const char* doc = "Direct eager call for plain tensors; False (nothing done) when torch.ops must take it";
  m.def("_flatten_scale", &flatten_scale, doc, py::arg("tensors"), py::arg("out"), py::arg("scale"));
  m.def(
      "_flatten_scale_ex", &flatten_scale_ex, doc, py::arg("tensors"), py::arg("out"), py::arg("scale"),
      py::arg("scale_by"), py::arg("nonfinite"));
  m.def(
      "_flatten_accumulate", &flatten_accumulate, doc, py::arg("tensors"), py::arg("out"), py::arg("scale"),
      py::arg("nonfinite"));
  m.def("_unflatten_scale", &unflatten_scale, doc, py::arg("flat"), py::arg("tensors"), py::arg("scale"));
  m.def(
      "_unflatten_scale_ex", &unflatten_scale_ex, doc, py::arg("flat"), py::arg("tensors"), py::arg("scale"),
      py::arg("sumsq"));
  m.def("_sum_of_squares", &sum_of_squares, doc, py::arg("tensors"), py::arg("out"));
  py::class_<BucketPlan>(m, "_BucketPlan", "A bucket's kept pack and unpack plans (csrc/plan.h; fastcoll.ops.BucketPlan)")
      .def(py::init<>())
      .def(
          "stats",
          [](const BucketPlan& p) {
            py::dict d;
            d["builds"] = p.builds();
            d["reuses"] = p.reuses();
            return d;
          },
          "Plans (re)built and calls that reused one")
      .def("clear", &BucketPlan::clear, "Forget the kept plans", py::call_guard<py::gil_scoped_release>());
  const char* planned = "Direct eager call with a bucket plan; False (nothing done) when torch.ops must take it";
  m.def(
      "_flatten_scale_planned", &flatten_scale_planned, planned, py::arg("plan"), py::arg("tensors"), py::arg("out"),
      py::arg("scale"));
  m.def(
      "_unflatten_scale_planned", &unflatten_scale_planned, planned, py::arg("plan"), py::arg("flat"),
      py::arg("tensors"), py::arg("scale"));
  m.def("_eager_stats", &eager_stats, "Calls taken by the direct eager entry points, and calls they deferred");
}

}  // namespace fastcoll
