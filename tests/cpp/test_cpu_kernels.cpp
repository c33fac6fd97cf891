// C++ test of the CPU kernels, reached through the dispatcher exactly as Python
// reaches them, and of the CUDA kernel's chunk table and per-thread copy code
// (csrc/cuda/copy_chunk.cuh) run on the CPU the way a launch runs them. Each
// case compares against a float64 computation done here, with the destination
// poisoned first. Also: the dtype table (csrc/dtypes.h), the CUDA chunk sizes
// (25 MiB buckets of every dtype pair within the kernel-argument table) and the
// choice of table for a number of chunks. The gradient-health ops too: values,
// flag and sums through the dispatcher (sums the same bits for 1, 2 and 4
// threads), and the CUDA kernel's observed chunk loop emulated the same way.
// flatten_accumulate too: the CPU kernel (one fused multiply-add per element,
// into a prefilled out whose tail past the tensors stays untouched) against
// float64, and bit for bit against the CUDA kernel's accumulate loop run on
// the CPU. Exit code 0 = all passed.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "cuda/chunk_table.h"
#include "cuda/copy_chunk.cuh"
#include "dtypes.h"
#include "fastcoll.h"

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
  expect_throws([&] { flatten_op().call({}, out, 1.0); }, "fastcoll.flatten_scale: tensors is empty", "empty list");
  expect_throws([&] { unflatten_op().call(out, {}, 1.0); }, "fastcoll.unflatten_scale: tensors is empty", "empty list");
  expect_throws([&] { flatten_op().call({at::ones({3})}, out, 1.0); }, "3 elements in total but out has 5", "numel");
  expect_throws(
      [&] { flatten_op().call({at::ones({3}), at::ones({2}, at::kInt)}, out, 1.0); },
      "fastcoll.flatten_scale: tensors[1] has dtype int32; supported dtypes are float32, float16, bfloat16 and float64",
      "int dtype");
  expect_throws(
      [&] { unflatten_op().call(out, {at::ones({3}), at::ones({2}, at::kInt)}, 1.0); },
      "fastcoll.unflatten_scale: tensors[1] has dtype int32", "int dtype (unflatten)");
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

// Runs one direction of an op: pack (tensors -> flat) or unpack (flat -> tensors).
using RunFn = std::function<void(const std::vector<at::Tensor>& tensors, const at::Tensor& flat, double scale, bool pack)>;

// A round trip through misaligned buffers: tensors start at odd element offsets
// inside their storage and the flat buffer is offset too, so that source and
// destination alignment varies (vector paths, scalar fallbacks, heads and
// tails). Everything is poisoned first; neighbours of the destinations must
// stay poisoned.
const std::vector<int64_t> kSmallSizes = {1, 0, 7, 8, 9, 31, 33, 100, 3, 257, 1000, 5, 4099};
// Several full chunks of every dtype pair at the default chunk size (32768 elements for 16-bit pairs).
const std::vector<int64_t> kLargeSizes = {3, 70001, 1, 32768, 16385, 5};

void misaligned_round_trip(
    at::ScalarType src, at::ScalarType dst, double scale, const std::string& how, const RunFn& run,
    const std::vector<int64_t>& sizes = kSmallSizes) {
  int64_t room = 2;
  for (auto n : sizes) room += n + 1 + (n % 3);
  auto storage = at::randn({room}, at::kDouble).to(src);
  std::vector<at::Tensor> tensors;
  int64_t pos = 1, total = 0;
  for (auto n : sizes) {
    tensors.push_back(storage.narrow(0, pos, n));
    pos += n + 1 + (n % 3);  // gaps of 1..3 elements shift every alignment
    total += n;
  }
  auto out_storage = at::full({total + 3}, NAN, at::TensorOptions().dtype(dst));
  auto out = out_storage.narrow(0, 1 + (total % 2), total);
  const std::string tag = std::string(c10::toString(src)) + "->" + c10::toString(dst) + " " + how;

  run(tensors, out, scale, /*pack=*/true);
  expect(!at::isnan(out_storage.narrow(0, out.storage_offset(), total)).any().item<bool>(), "pack wrote every element: " + tag);
  expect(at::isnan(out_storage[0]).item<bool>() || out.storage_offset() == 0, "pack wrote nothing before out: " + tag);
  expect(at::isnan(out_storage[-1]).item<bool>(), "pack wrote nothing after out: " + tag);
  const double tol = tolerance(src) + tolerance(dst);
  int64_t off = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t n = tensors[i].numel();
    auto expected = tensors[i].to(at::kDouble) * scale;
    expect(n == 0 || at::allclose(out.narrow(0, off, n).to(at::kDouble), expected, tol, tol),
           "pack tensor " + std::to_string(i) + ": " + tag);
    off += n;
  }

  auto back_storage = at::full({storage.numel()}, NAN, at::TensorOptions().dtype(src));
  std::vector<at::Tensor> back;
  for (auto& t : tensors) back.push_back(back_storage.narrow(0, t.storage_offset(), t.numel()));
  run(back, out, 1.0 / scale, /*pack=*/false);
  int64_t written = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].numel() == 0) continue;
    const double t2 = 2 * tol + tolerance(src);
    expect(at::allclose(back[i].to(at::kDouble), tensors[i].to(at::kDouble), t2, t2),
           "unpack tensor " + std::to_string(i) + ": " + tag);
    written += tensors[i].numel();
  }
  expect(at::isnan(back_storage).sum().item<int64_t>() == back_storage.numel() - written, "unpack wrote only its tensors: " + tag);
}

// The CPU ops themselves (through the dispatcher).
void cpu_op(const std::vector<at::Tensor>& tensors, const at::Tensor& flat, double scale, bool pack) {
  if (pack) {
    flatten_op().call(tensors, flat, scale);
  } else {
    unflatten_op().call(flat, tensors, scale);
  }
}

namespace cc = fastcoll::cuda_chunks;

// The table's dtypes in code order.
std::vector<at::ScalarType> table_dtypes() {
  return {
#define FASTCOLL_TEST_DTYPE(code, T, st, name) at::ScalarType::st,
      FASTCOLL_FOR_EACH_DTYPE(FASTCOLL_TEST_DTYPE)
#undef FASTCOLL_TEST_DTYPE
  };
}

std::string pair_tag(at::ScalarType s, at::ScalarType d) {
  return std::string(c10::toString(s)) + "->" + c10::toString(d);
}

// Checks that `table` cuts `segments` into consecutive chunks, each full but
// the last of its segment, none over chunk_elements() of its dtype pair.
void expect_tiles(const std::vector<fastcoll::Segment>& segments, const std::vector<cc::ChunkDesc>& table,
                  int64_t chunk_bytes, const std::string& what) {
  size_t c = 0;
  bool ok = true;
  for (const auto& s : segments) {
    const int64_t per_chunk = cc::chunk_elements(s.src_dtype, s.dst_dtype, chunk_bytes);
    const int64_t kinds = int64_t(fastcoll::dtype_code(s.src_dtype)) << fastcoll::kDtypeCodeBits | fastcoll::dtype_code(s.dst_dtype);
    int64_t done = 0;
    while (done < s.numel && c < table.size()) {
      const auto& d = table[c++];
      const int64_t want = std::min(per_chunk, s.numel - done);
      ok = ok && d.numel == want && d.kinds == kinds &&
          d.src == reinterpret_cast<int64_t>(s.src) + done * int64_t(c10::elementSize(s.src_dtype)) &&
          d.dst == reinterpret_cast<int64_t>(s.dst) + done * int64_t(c10::elementSize(s.dst_dtype));
      done += d.numel;
    }
    ok = ok && done == s.numel;
  }
  expect(ok && c == table.size(), what + ": chunks tile the segments");
}

// The CUDA kernel's work, run on the CPU: the same chunk table the launch
// passes (chunks of `chunk_bytes` of the wider dtype), and every (block,
// thread) pair's share of it, one after another.
RunFn cuda_chunks_emulated(int64_t chunk_bytes, int64_t nthreads) {
  return [=](const std::vector<at::Tensor>& tensors, const at::Tensor& flat, double scale, bool pack) {
    auto segments = fastcoll::plan_segments(tensors, flat, pack);
    std::vector<cc::ChunkDesc> table(cc::count_chunks(segments, chunk_bytes));
    cc::write_chunks(segments, table.data(), chunk_bytes);
    expect_tiles(segments, table, chunk_bytes, "emulated launch");
    int64_t covered = 0;
    for (const auto& d : table) {
      covered += d.numel;
      for (int64_t tid = 0; tid < nthreads; ++tid) cc::run_chunk(d, scale, static_cast<int>(tid), static_cast<int>(nthreads));
    }
    expect(covered == flat.numel(), "chunks cover every element");
  };
}

// Segments of a bucket of `sizes` elements from `src` to `dst` dtype at fake,
// 256-byte-aligned addresses (the chunk table only computes addresses).
std::vector<fastcoll::Segment> fake_bucket(at::ScalarType src, at::ScalarType dst, const std::vector<int64_t>& sizes) {
  std::vector<fastcoll::Segment> segments;
  int64_t src_addr = int64_t(1) << 32, dst_addr = int64_t(1) << 40, off = 0;
  for (auto n : sizes) {
    fastcoll::Segment s;
    s.src = reinterpret_cast<const void*>(src_addr);
    s.dst = reinterpret_cast<void*>(dst_addr + off * int64_t(c10::elementSize(dst)));
    s.numel = n;
    s.flat_offset = off;
    s.src_dtype = src;
    s.dst_dtype = dst;
    segments.push_back(s);
    src_addr += (n * int64_t(c10::elementSize(src)) + 255) / 256 * 256;
    off += n;
  }
  return segments;
}

int64_t chunks_of(at::ScalarType src, at::ScalarType dst, const std::vector<int64_t>& sizes) {
  return cc::count_chunks(fake_bucket(src, dst, sizes));
}

// 25 MiB buckets stay within the 512-chunk kernel-argument table: for every
// dtype pair when the 25 MiB is the wider side (in fastcoll.DDP the gradients:
// the wire dtype never widens), with up to 113 tensors per bucket.
void chunk_counts_of_25mib_buckets() {
  constexpr int64_t kBucket = int64_t(25) << 20;
  const auto dtypes = table_dtypes();
  expect(cc::kChunkBytes == 65536, "chunks are 64 KiB of the wider dtype");
  for (auto s : dtypes) {
    for (auto d : dtypes) {
      const std::string tag = pair_tag(s, d);
      const int64_t wide = int64_t(std::max(c10::elementSize(s), c10::elementSize(d)));
      expect(cc::chunk_elements(s, d) * wide == cc::kChunkBytes, tag + ": a full chunk is 64 KiB of the wider side");
      expect(cc::chunk_elements(s, d) <= cc::kMaxChunkElements, tag + ": chunk elements within the 32-bit bound");
      // One tensor of 25 MiB of the wider dtype: exactly 400 chunks, on every pair.
      const int64_t one = chunks_of(s, d, {kBucket / wide});
      expect(one == 400, tag + ": 25 MiB as one tensor is 400 chunks, got " + std::to_string(one));
      // 113 tensors of uneven sizes (each boundary can add a partial chunk): still <= 512.
      std::vector<int64_t> sizes;
      int64_t left = kBucket / wide;
      for (int k = 0; k < 112; ++k) {
        const int64_t n = 1 + (int64_t(k) * 7919 + 13) % (2 * left / (113 - k));
        sizes.push_back(std::min(n, left - (112 - k)));
        left -= sizes.back();
      }
      sizes.push_back(left);
      auto segments = fake_bucket(s, d, sizes);
      const int64_t many = cc::count_chunks(segments);
      expect(many <= cc::kLargeTable, tag + ": 25 MiB in 113 tensors is " + std::to_string(many) + " chunks (> 512)");
      expect(many <= 400 + 112, tag + ": at most one partial chunk per tensor boundary");
      expect(cc::choose_table(many, cc::kLargeTable) != cc::TablePath::kPinned, tag + ": 25 MiB bucket passed inline");
      std::vector<cc::ChunkDesc> table(many);
      cc::write_chunks(segments, table.data());
      expect_tiles(segments, table, cc::kChunkBytes, tag + " 25 MiB in 113 tensors");
      // The worst case for 113 tensors: 112 of one chunk and one element, two chunks each.
      const int64_t per_chunk = cc::chunk_elements(s, d);
      std::vector<int64_t> worst(112, per_chunk + 1);
      worst.push_back(kBucket / wide - 112 * (per_chunk + 1));
      const int64_t worst_count = chunks_of(s, d, worst);
      expect(worst_count == 512, tag + ": worst 113-tensor 25 MiB bucket is 512 chunks, got " + std::to_string(worst_count));
      // A bucket capped by the bytes of its narrower side can be larger: 25 MiB of
      // float16 unpacked into float64 is 100 MiB of destination, 1600 chunks.
      const int64_t narrow = int64_t(std::min(c10::elementSize(s), c10::elementSize(d)));
      const int64_t by_narrow = chunks_of(s, d, {kBucket / narrow});
      expect(by_narrow == 400 * wide / narrow, tag + ": 25 MiB of the narrower side is 400 * wide / narrow chunks");
    }
  }
  // The old 16384-element chunks made a 25 MiB 16-bit bucket 800 chunks.
  expect(chunks_of(at::kBFloat16, at::kBFloat16, {kBucket / 2}) == 400, "25 MiB of bfloat16 is 400 chunks");
  expect(chunks_of(at::kHalf, at::kDouble, {kBucket / 2}) == 1600, "25 MiB of float16 widened to float64 is 1600 chunks");
}

void table_choice() {
  using P = cc::TablePath;
  struct Case {
    int64_t nchunks, max_inline;
    P want;
  };
  const Case cases[] = {
      {1, 512, P::kSmall},   {32, 512, P::kSmall}, {33, 512, P::kMid},    {120, 512, P::kMid},
      {121, 512, P::kLarge}, {400, 512, P::kLarge}, {512, 512, P::kLarge}, {513, 512, P::kPinned},
      {100000, 512, P::kPinned},
      // Before CUDA 12.1 (toolkit or driver) only 4 KiB of arguments: nothing past 120 inline.
      {32, 120, P::kSmall},  {120, 120, P::kMid},  {121, 120, P::kPinned}, {512, 120, P::kPinned},
  };
  for (const auto& c : cases) {
    expect(cc::choose_table(c.nchunks, c.max_inline) == c.want,
           "choose_table(" + std::to_string(c.nchunks) + ", " + std::to_string(c.max_inline) + ")");
  }
}

void dtype_table() {
  const auto dtypes = table_dtypes();
  expect(fastcoll::kNumDtypes == 4 && dtypes.size() == 4, "four supported dtypes");
  expect(fastcoll::supported_dtype_names() == "float32, float16, bfloat16 and float64", "supported_dtype_names()");
  for (size_t i = 0; i < dtypes.size(); ++i) {
    expect(fastcoll::dtype_code(dtypes[i]) == int(i), "dtype_code is the row number");
    expect(fastcoll::is_supported_dtype(dtypes[i]), "is_supported_dtype of a table row");
  }
  for (auto t : {at::kInt, at::kLong, at::kBool, at::kByte, at::kComplexFloat, at::kFloat8_e4m3fn}) {
    expect(!fastcoll::is_supported_dtype(t), std::string("unsupported: ") + c10::toString(t));
  }
  expect(fastcoll::kMinElementSize == 2, "narrowest element is 2 bytes");
}


// ---- Gradient health ----

auto flatten_ex_op() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("fastcoll::flatten_scale_ex", "")
      .typed<void(at::TensorList, const at::Tensor&, double, const std::optional<at::Tensor>&,
                  const std::optional<at::Tensor>&)>();
}

auto unflatten_ex_op() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("fastcoll::unflatten_scale_ex", "")
      .typed<void(const at::Tensor&, at::TensorList, double, const std::optional<at::Tensor>&)>();
}

auto sum_of_squares_op() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("fastcoll::sum_of_squares", "")
      .typed<void(at::TensorList, const at::Tensor&)>();
}

// float64 sum of squares of every element of `tensors`, as stored.
double squares_of(const std::vector<at::Tensor>& tensors) {
  double s = 0.0;
  for (const auto& t : tensors) {
    if (t.numel() > 0) s += (memory_order(t) * memory_order(t)).sum().item<double>();
  }
  return s;
}

bool close_rel(double got, double want, double rtol) {
  return std::abs(got - want) <= rtol * std::abs(want);
}

void health_ops(at::ScalarType src, at::ScalarType dst) {
  const std::string tag = pair_tag(src, dst);
  const std::vector<int64_t> sizes = {3, 16383, 1, 40000, 0, 70001, 5};
  std::vector<at::Tensor> tensors;
  int64_t total = 0;
  for (auto n : sizes) {
    tensors.push_back(at::randn({n}, at::kDouble).to(src));
    total += n;
  }
  // flatten_scale_ex by 0.5 * scale_by 0.5 (exact in any math): the bits of flatten_scale by 0.25.
  auto out = at::full({total}, NAN, at::TensorOptions().dtype(dst));
  auto plain = at::full({total}, NAN, at::TensorOptions().dtype(dst));
  auto flag = at::zeros({1}, at::kInt);
  flatten_ex_op().call(tensors, out, 0.5, at::full({1}, 0.5), flag);
  flatten_op().call(tensors, plain, 0.25);
  expect(at::equal(out.view(at::kByte), plain.view(at::kByte)), "flatten_scale_ex == flatten_scale bits: " + tag);
  expect(flag.item<int>() == 0, "no flag for finite values: " + tag);
  tensors[5].index_put_({70000}, std::numeric_limits<double>::infinity());
  flatten_ex_op().call(tensors, out, 1.0, std::nullopt, flag);
  expect(flag.item<int>() == 1, "flag for an inf in the last element: " + tag);

  // unflatten_scale_ex: the bits of unflatten_scale, and the sum of squares of what it wrote.
  auto flat = at::randn({total}, at::kDouble).to(dst);
  std::vector<at::Tensor> back, back_plain;
  for (auto& t : tensors) {
    back.push_back(at::full_like(t, NAN));
    back_plain.push_back(at::full_like(t, NAN));
  }
  auto sumsq = at::full({1}, NAN, at::kDouble);
  std::vector<double> sums;
  for (int threads : {1, 2, 4}) {
    at::set_num_threads(threads);
    unflatten_ex_op().call(flat, back, 1.0 / 3.0, sumsq);
    sums.push_back(sumsq.item<double>());
    auto out_sum = at::full({}, NAN, at::kDouble);
    sum_of_squares_op().call(back, out_sum);
    sums.push_back(out_sum.item<double>());
  }
  at::set_num_threads(1);
  unflatten_op().call(flat, back_plain, 1.0 / 3.0);
  for (size_t i = 0; i < back.size(); ++i) {
    expect(at::equal(back[i].view(at::kByte), back_plain[i].view(at::kByte)), "unflatten_scale_ex == unflatten_scale bits: " + tag);
  }
  const double want = squares_of(back);
  expect(close_rel(sums[0], want, 1e-12), "sumsq close to float64: " + tag);
  expect(close_rel(sums[1], want, 1e-12), "sum_of_squares close to float64: " + tag);
  bool same = true;
  for (size_t k = 2; k < sums.size(); ++k) same = same && std::memcmp(&sums[k], &sums[k % 2], sizeof(double)) == 0;
  expect(same, "sums are the same bits for 1, 2 and 4 threads: " + tag);
}

void health_bad_inputs() {
  auto out = at::full({5}, 7.0);
  std::vector<at::Tensor> ts = {at::ones({2}), at::ones({3})};
  expect_throws(
      [&] { flatten_ex_op().call(ts, out, 1.0, at::ones({2}), std::nullopt); },
      "fastcoll.flatten_scale_ex: scale_by must be a float32 or float64 tensor with 1 element on cpu, got a float32 tensor of shape (2,) on cpu",
      "scale_by numel");
  expect_throws(
      [&] { flatten_ex_op().call(ts, out, 1.0, std::nullopt, at::zeros({1}, at::kLong)); },
      "nonfinite must be an int32 tensor with at least 1 element on cpu, got an int64 tensor", "nonfinite dtype");
  expect_throws(
      [&] { unflatten_ex_op().call(out, ts, 1.0, at::zeros({1})); },
      "fastcoll.unflatten_scale_ex: sumsq must be a float64 tensor with 1 element on cpu, got a float32 tensor of shape (1,) on cpu",
      "sumsq dtype");
  expect_throws(
      [&] { flatten_ex_op().call(ts, out, 1.0, std::nullopt, out.view(at::kInt).narrow(0, 1, 1)); },
      "fastcoll.flatten_scale_ex: nonfinite overlaps out", "nonfinite inside out");
  expect_throws([&] { sum_of_squares_op().call({}, at::zeros({1}, at::kDouble)); }, "fastcoll.sum_of_squares: tensors is empty", "empty");
  expect(at::all(out == 7.0).item<bool>(), "nothing written on error (health ops)");
}

// The CUDA kernel's observed chunk loop, run on the CPU (every block and thread
// of the launch in turn), against a float64 computation: the flag of a pack
// with a NaN, and the sums of squares of an unpack and of a read-only pass.
void cuda_health_emulated(at::ScalarType src, at::ScalarType dst, int64_t chunk_bytes, int nthreads) {
  const std::string tag = pair_tag(src, dst) + " chunk " + std::to_string(chunk_bytes) + " threads " + std::to_string(nthreads);
  auto storage = at::randn({20000}, at::kDouble).to(src);
  std::vector<at::Tensor> tensors = {storage.narrow(0, 1, 7), storage.narrow(0, 9, 9000), storage.narrow(0, 9011, 5)};
  auto out_storage = at::full({9014}, NAN, at::TensorOptions().dtype(dst));
  auto out = out_storage.narrow(0, 1, 9012);
  auto scale_by = at::full({1}, 0.5, at::kDouble);

  // Pack by 2 * scale_by (float64 math), then with a NaN in the middle tensor.
  auto segments = fastcoll::plan_segments(tensors, out, /*pack=*/true);
  std::vector<cc::ChunkDesc> table(cc::count_chunks(segments, chunk_bytes));
  cc::write_chunks(segments, table.data(), chunk_bytes);
  const cc::Factor f{2.0, scale_by.data_ptr(), true};
  bool bad = false;
  for (const auto& d : table) {
    for (int tid = 0; tid < nthreads; ++tid) {
      cc::NonFiniteSeen seen;
      cc::run_chunk_seen<true>(d, f, &seen, tid, nthreads);
      bad = bad || seen.bad;
    }
  }
  auto expected = at::cat({tensors[0], tensors[1], tensors[2]}).to(at::kDouble);
  expect(!bad && at::allclose(out.to(at::kDouble), expected, tolerance(dst) + tolerance(src), 1e-30), "emulated pack by scale_by: " + tag);
  tensors[1].index_put_({4321}, NAN);
  bad = false;
  for (const auto& d : table) {
    for (int tid = 0; tid < nthreads; ++tid) {
      cc::NonFiniteSeen seen;
      cc::run_chunk_seen<true>(d, f, &seen, tid, nthreads);
      bad = bad || seen.bad;
    }
  }
  expect(bad, "emulated pack flags a NaN: " + tag);

  // Unpack with a sum of squares; read-only sum of the tensors.
  auto flat = at::randn({9012}, at::kDouble).to(dst);
  std::vector<at::Tensor> back = {at::full({7}, NAN, at::TensorOptions().dtype(src)), at::full({9000}, NAN, at::TensorOptions().dtype(src)),
                                  at::full({5}, NAN, at::TensorOptions().dtype(src))};
  auto unpack = fastcoll::plan_segments(back, flat, /*pack=*/false);
  std::vector<cc::ChunkDesc> utable(cc::count_chunks(unpack, chunk_bytes));
  cc::write_chunks(unpack, utable.data(), chunk_bytes);
  double sum = 0.0;
  for (const auto& d : utable) {
    for (int tid = 0; tid < nthreads; ++tid) {
      cc::SquaresSeen seen;
      cc::run_chunk_seen<false>(d, cc::Factor{0.5, nullptr, false}, &seen, tid, nthreads);
      sum += seen.sum;
    }
  }
  expect(!at::isnan(back[1]).any().item<bool>(), "emulated unpack wrote every element: " + tag);
  expect(close_rel(sum, squares_of(back), 1e-12), "emulated unpack sum of squares: " + tag);

  auto reads = fastcoll::plan_sum_of_squares(back, at::zeros({1}, at::kDouble)).segments;
  std::vector<cc::ChunkDesc> rtable(cc::count_chunks(reads, chunk_bytes));
  cc::write_chunks(reads, rtable.data(), chunk_bytes);
  double rsum = 0.0;
  for (const auto& d : rtable) {
    for (int tid = 0; tid < nthreads; ++tid) {
      cc::SquaresSeen seen;
      cc::read_chunk_seen(d, &seen, tid, nthreads);
      rsum += seen.sum;
    }
  }
  expect(close_rel(rsum, squares_of(back), 1e-12), "emulated read-only sum of squares: " + tag);
}


// ---- flatten_accumulate ----

auto accumulate_op() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("fastcoll::flatten_accumulate", "")
      .typed<void(at::TensorList, const at::Tensor&, double, const std::optional<at::Tensor>&)>();
}

// Adds `tensors` * scale into `out` (a prefix of it); returns whether the flag was set.
using AccumulateRun = std::function<bool(const std::vector<at::Tensor>& tensors, const at::Tensor& out, double scale)>;

bool cpu_accumulate(const std::vector<at::Tensor>& tensors, const at::Tensor& out, double scale) {
  auto flag = at::zeros({1}, at::kInt);
  accumulate_op().call(tensors, out, scale, flag);
  return flag.item<int>() != 0;
}

// The CUDA kernel's accumulate loop, every (block, thread) of the launch in
// turn, over the chunk table of plan_flatten_accumulate's segments, each
// thread's stored values checked for NaN/Inf (the kernel's flag).
AccumulateRun cuda_accumulate_emulated(int64_t chunk_bytes, int nthreads) {
  return [=](const std::vector<at::Tensor>& tensors, const at::Tensor& out, double scale) {
    auto plan = fastcoll::plan_flatten_accumulate(tensors, out, std::nullopt);
    std::vector<cc::ChunkDesc> table(cc::count_chunks(plan.segments, chunk_bytes));
    cc::write_chunks(plan.segments, table.data(), chunk_bytes);
    expect_tiles(plan.segments, table, chunk_bytes, "emulated accumulate launch");
    bool bad = false;
    for (const auto& d : table) {
      for (int tid = 0; tid < nthreads; ++tid) {
        cc::NonFiniteSeen seen;
        cc::run_chunk_accumulate(d, scale, &seen, tid, nthreads);
        bad = bad || seen.bad;
      }
    }
    return bad;
  };
}

// Misaligned inputs (odd offsets in their storage) added into a prefilled,
// misaligned out with 5 elements of tail and a guard on each side: the values
// against float64 (one rounding in the op math, the cast, the rounding of the
// scale), the tail and guards untouched, no flag; then an inf that must be
// flagged. Returns out's storage after the finite call, for bitwise comparisons.
at::Tensor accumulate_case(
    at::ScalarType src, at::ScalarType dst, double scale, const std::string& how, const AccumulateRun& run,
    const std::vector<int64_t>& sizes = kSmallSizes) {
  const std::string tag = pair_tag(src, dst) + " " + how;
  int64_t room = 2;
  for (auto n : sizes) room += n + 1 + (n % 3);
  at::manual_seed(17);
  auto storage = at::randn({room}, at::kDouble).to(src);
  std::vector<at::Tensor> tensors;
  int64_t pos = 1, total = 0;
  for (auto n : sizes) {
    tensors.push_back(storage.narrow(0, pos, n));
    pos += n + 1 + (n % 3);
    total += n;
  }
  constexpr int64_t kTail = 5;
  auto out_storage = (at::randn({total + kTail + 2}, at::kDouble) * 3).to(dst);
  out_storage.narrow(0, 1 + total, kTail).fill_(NAN);
  auto out = out_storage.narrow(0, 1, total + kTail);
  const auto before = out_storage.clone();

  const bool flagged = run(tensors, out, scale);
  expect(!flagged, "accumulate flags nothing for finite values: " + tag);
  const bool wide = src == at::kDouble || dst == at::kDouble;
  const double u_math = wide ? 0x1p-53 : 0x1p-24;
  const double tol = tolerance(dst) + 2 * u_math + (src == at::kDouble ? tolerance(dst) : 0.0);
  int64_t off = 0;
  bool ok = true;
  for (const auto& t : tensors) {
    const int64_t n = t.numel();
    if (n == 0) continue;
    auto product = t.to(at::kDouble) * scale;
    auto expected = before.narrow(0, 1 + off, n).to(at::kDouble) + product;
    auto err = (out.narrow(0, off, n).to(at::kDouble) - expected).abs();
    ok = ok && (err <= expected.abs() * tol + product.abs() * (2 * u_math) + 1e-30).all().item<bool>();
    off += n;
  }
  expect(ok, "accumulated values against float64: " + tag);
  const auto bytes = [](const at::Tensor& t) { return t.contiguous().view(at::kByte); };
  expect(at::equal(bytes(out_storage.narrow(0, 1 + total, kTail + 1)), bytes(before.narrow(0, 1 + total, kTail + 1))),
         "accumulate left out's tail and the guard after it alone: " + tag);
  expect(at::equal(bytes(out_storage.narrow(0, 0, 1)), bytes(before.narrow(0, 0, 1))), "nothing written before out: " + tag);
  const auto result = out_storage.clone();

  tensors.back().index_put_({tensors.back().numel() - 1}, std::numeric_limits<double>::infinity());
  expect(run(tensors, out, scale), "accumulate flags an inf in the last element: " + tag);
  return result;
}

void accumulate_bad_inputs() {
  auto out = at::full({5}, 7.0);
  std::vector<at::Tensor> ts = {at::ones({2}), at::ones({3}, at::kBFloat16)};
  expect_throws(
      [&] { accumulate_op().call(ts, at::full({4}, 7.0), 1.0, std::nullopt); },
      "fastcoll.flatten_accumulate: the tensors hold 5 elements in total but out has 4; out must have at least as many",
      "accumulate into a short out");
  expect_throws(
      [&] { accumulate_op().call({at::ones({2}), at::ones({2}, at::kInt)}, out, 1.0, std::nullopt); },
      "fastcoll.flatten_accumulate: tensors[1] has dtype int32", "accumulate int dtype");
  expect_throws(
      [&] { accumulate_op().call(ts, out, 1.0, out.view(at::kInt).narrow(0, 4, 1)); },
      "fastcoll.flatten_accumulate: nonfinite overlaps out", "accumulate flag inside out");
  expect_throws(
      [&] {
        auto buf = at::zeros({10});
        accumulate_op().call({buf.narrow(0, 1, 5)}, buf.narrow(0, 0, 8), 1.0, std::nullopt);
      },
      "overlaps out", "accumulate alias");
  expect(at::all(out == 7.0).item<bool>(), "nothing written on error (accumulate)");
  accumulate_op().call({}, out, 1.0, std::nullopt);  // an empty list: nothing to do
  accumulate_op().call(ts, out, 2.0, std::nullopt);
  expect(at::equal(out, at::full({5}, 9.0)), "accumulate into out's prefix");
  auto buf = at::arange(6, at::kFloat);  // in place: each tensor exactly its own slot
  accumulate_op().call({buf.narrow(0, 0, 2), buf.narrow(0, 2, 3)}, buf, 1.0, std::nullopt);
  expect(at::equal(buf, at::tensor({0.f, 2.f, 4.f, 6.f, 8.f, 5.f})), "in-place accumulation, tail untouched");
}

void accumulate_ops(at::ScalarType s, at::ScalarType d, int64_t default_stream_min) {
  const std::string tag = pair_tag(s, d);
  std::vector<at::Tensor> results;
  for (int threads : {1, 2}) {
    at::set_num_threads(threads);
    results.push_back(accumulate_case(s, d, 1.0 / 3.0, "cpu", cpu_accumulate, kLargeSizes));
  }
  at::set_num_threads(1);
  fastcoll::set_cpu_stream_min_bytes(0);  // no streaming variant: the threshold changes nothing
  results.push_back(accumulate_case(s, d, 1.0 / 3.0, "cpu, stream threshold 0", cpu_accumulate, kLargeSizes));
  fastcoll::set_cpu_stream_min_bytes(default_stream_min);
  results.push_back(accumulate_case(
      s, d, 1.0 / 3.0, "cuda emulated, full chunks", cuda_accumulate_emulated(cc::kChunkBytes, cc::kThreads), kLargeSizes));
  const auto bytes = [](const at::Tensor& t) { return t.contiguous().view(at::kByte); };
  for (size_t k = 1; k < results.size(); ++k) {
    expect(at::equal(bytes(results[k]), bytes(results[0])), "accumulate: the same bits (threads, cuda loop): " + tag);
  }
  accumulate_case(s, d, -0.5, "cpu", cpu_accumulate);
  const auto a = accumulate_case(s, d, 3.0, "cpu", cpu_accumulate);
  const auto b = accumulate_case(s, d, 3.0, "cuda emulated, 148-byte chunks, 5 threads", cuda_accumulate_emulated(148, 5));
  expect(at::equal(bytes(a), bytes(b)), "accumulate: cpu and emulated cuda, the same bits: " + tag);
}

}  // namespace

int main() {
  at::manual_seed(0);
  dtype_table();
  table_choice();
  chunk_counts_of_25mib_buckets();
  const std::vector<at::ScalarType> dtypes = table_dtypes();
  for (auto s : dtypes) {
    for (auto d : dtypes) {
      round_trip(s, d, 0.25);
      round_trip(s, d, 1.0 / 3.0);
    }
  }
  bad_inputs();
  const int64_t default_stream_min = fastcoll::cpu_stream_min_bytes();
  for (auto s : dtypes) {
    for (auto d : dtypes) {
      for (double scale : {0.5, 1.0}) {  // 1.0: the plain-copy paths
        fastcoll::set_cpu_stream_min_bytes(default_stream_min);
        misaligned_round_trip(s, d, scale, "cpu", cpu_op);
        fastcoll::set_cpu_stream_min_bytes(0);  // every call with non-temporal stores
        misaligned_round_trip(s, d, scale, "cpu streaming", cpu_op);
      }
      misaligned_round_trip(s, d, 0.5, "cuda emulated", cuda_chunks_emulated(cc::kChunkBytes, cc::kThreads));
      misaligned_round_trip(
          s, d, 0.25, "cuda emulated, full chunks", cuda_chunks_emulated(cc::kChunkBytes, cc::kThreads), kLargeSizes);
      // Small chunks split tensors at many places, at odd element counts
      // (74 bytes: 37 16-bit, 18 32-bit or 9 64-bit elements; 148: 74, 37 or 18).
      misaligned_round_trip(s, d, 1.0 / 3.0, "cuda emulated, 74-byte chunks, 3 threads", cuda_chunks_emulated(74, 3));
      misaligned_round_trip(s, d, 3.0, "cuda emulated, 148-byte chunks, 5 threads", cuda_chunks_emulated(148, 5));
      misaligned_round_trip(s, d, 0.5, "cuda emulated, 256-byte chunks, 7 threads", cuda_chunks_emulated(256, 7));
    }
  }
  fastcoll::set_cpu_stream_min_bytes(0);  // the aligned round trips once more, streaming
  for (auto s : dtypes) {
    for (auto d : dtypes) round_trip(s, d, 0.25);
  }
  fastcoll::set_cpu_stream_min_bytes(default_stream_min);
  health_bad_inputs();
  for (auto s : dtypes) {
    for (auto d : dtypes) {
      health_ops(s, d);
      fastcoll::set_cpu_stream_min_bytes(0);
      health_ops(s, d);
      fastcoll::set_cpu_stream_min_bytes(default_stream_min);
      cuda_health_emulated(s, d, cc::kChunkBytes, cc::kThreads);
      cuda_health_emulated(s, d, 148, 5);
    }
  }
  accumulate_bad_inputs();
  for (auto s : dtypes) {
    for (auto d : dtypes) accumulate_ops(s, d, default_stream_min);
  }
  std::printf("%d checks, %d failures\n", checks, failures);
  return failures == 0 ? 0 : 1;
}
