// C++ test of the CPU kernels, reached through the dispatcher exactly as Python
// reaches them. Each case compares against a float64 computation done here,
// with the destination poisoned first. Exit code 0 = all passed.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace {

int failures = 0;
int checks = 0;

void expect(bool ok, const std::string& what) {
  ++checks;
  if (!ok) {
    ++failures;
    std::printf("FAIL: %s\n", what.c_str());
  }
}

auto flatten_op() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("fastcoll::flatten_scale", "")
      .typed<void(at::TensorList, const at::Tensor&, double)>();
}

auto unflatten_op() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("fastcoll::unflatten_scale", "")
      .typed<void(const at::Tensor&, at::TensorList, double)>();
}

// Elements of a dense tensor in memory order, as float64.
at::Tensor memory_order(const at::Tensor& t) {
  return t.as_strided({t.numel()}, {1}, t.storage_offset()).to(at::kDouble);
}

double tolerance(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return 1e-3;
    case at::kBFloat16: return 8e-3;
    case at::kFloat: return 1e-6;
    default: return 1e-12;
  }
}

void round_trip(at::ScalarType src, at::ScalarType dst, double scale) {
  std::vector<int64_t> sizes = {1, 0, 7, 65535, 65536, 65537, 3, 200003, 5};
  std::vector<at::Tensor> tensors;
  int64_t total = 0;
  for (auto n : sizes) {
    tensors.push_back(at::randn({n}, at::kDouble).to(src));
    total += n;
  }
  tensors.push_back(at::randn({2, 3, 4, 5}, at::kDouble).to(src).contiguous(at::MemoryFormat::ChannelsLast));
  total += 120;
  auto out = at::full({total}, NAN, at::TensorOptions().dtype(dst));
  flatten_op().call(tensors, out, scale);

  const std::string tag = std::string(c10::toString(src)) + "->" + c10::toString(dst);
  int64_t off = 0;
  const double tol_pack = tolerance(src) + tolerance(dst);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t n = tensors[i].numel();
    auto expected = memory_order(tensors[i]) * scale;
    auto got = out.narrow(0, off, n).to(at::kDouble);
    const bool ok = n == 0 || at::allclose(got, expected, tol_pack, tol_pack);
    expect(ok, "flatten " + tag + " tensor " + std::to_string(i));
    off += n;
  }
  expect(!at::isnan(out).any().item<bool>(), "flatten " + tag + " wrote every element");

  std::vector<at::Tensor> back;
  for (auto& t : tensors) back.push_back(at::full_like(t, NAN));
  unflatten_op().call(out, back, 1.0 / scale);
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].numel() == 0) continue;
    const double tol = 2 * tol_pack + tolerance(src);
    expect(
        at::allclose(memory_order(back[i]), memory_order(tensors[i]), tol, tol),
        "unflatten " + tag + " tensor " + std::to_string(i));
    expect(back[i].strides() == tensors[i].strides(), "unflatten keeps strides");
  }
}

void expect_throws(const std::function<void()>& fn, const std::string& needle, const std::string& what) {
  try {
    fn();
    expect(false, what + ": no exception");
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    expect(msg.find(needle) != std::string::npos, what + ": message '" + msg + "' lacks '" + needle + "'");
  }
}

void bad_inputs() {
  auto out = at::full({5}, 7.0);
  auto untouched = [&] { return at::all(out == 7.0).item<bool>(); };
  expect_throws([&] { flatten_op().call({}, out, 1.0); }, "empty", "empty list");
  expect_throws([&] { flatten_op().call({at::ones({3})}, out, 1.0); }, "3 elements in total but out has 5", "numel");
  expect_throws(
      [&] { flatten_op().call({at::ones({3}), at::ones({2}, at::kInt)}, out, 1.0); }, "tensors[1]", "int dtype");
  expect_throws(
      [&] { flatten_op().call({at::ones({4, 4}).t().slice(0, 0, 4, 2).slice(1, 0, 1)}, at::empty({2}), 1.0); },
      "not dense", "non-dense");
  expect_throws([&] { flatten_op().call({at::ones({1}).expand({5})}, out, 1.0); }, "tensors[0]", "overlapping");
  expect_throws(
      [&] {
        auto buf = at::zeros({10});
        flatten_op().call({buf.narrow(0, 1, 5)}, buf.narrow(0, 0, 5), 1.0);
      },
      "overlaps out", "alias");
  expect(untouched(), "nothing written on error");
  // In place: each input exactly in its own slot is a legal in-place scale.
  auto buf = at::arange(6, at::kFloat);
  flatten_op().call({buf.narrow(0, 0, 2), buf.narrow(0, 2, 4)}, buf, 2.0);
  expect(at::equal(buf, at::arange(6, at::kFloat) * 2), "in-place scale");
}

}  // namespace

int main() {
  at::manual_seed(0);
  const std::vector<at::ScalarType> dtypes = {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble};
  for (auto s : dtypes) {
    for (auto d : dtypes) {
      round_trip(s, d, 0.25);
      round_trip(s, d, 1.0 / 3.0);
    }
  }
  bad_inputs();
  std::printf("%d checks, %d failures\n", checks, failures);
  return failures == 0 ? 0 : 1;
}
