// fastcoll::checksum: one bitwise hash per tensor, of the bytes it holds, for
// replica verification (fastcoll/ddp/replicas.py). CPU kernel, the argument
// checks (shared with csrc/cuda/checksum_cuda.cu) and the kernel for an empty
// list (CompositeExplicitAutograd: a call without tensors has no device).
//
// The hash (the same definition in fastcoll/ops/__init__.py, fastcoll/ops/reference.py,
// and checksum_cuda.cu). A tensor's bytes are the L = numel * element_size
// bytes from data_ptr() in memory order (it must be dense). With
//   mix(x) = splitmix64's finalizer: x ^= x >> 30; x *= 0xBF58476D1CE4E5B9;
//            x ^= x >> 27; x *= 0x94D049BB133111EB; x ^= x >> 31
//            (every step is a bijection of 64-bit words, so mix is one),
//   K      = 0x9E3779B97F4A7C15,
//   w_i    = bytes [8i, 8i + 8) as a little-endian 64-bit word, bytes past L
//            read as 0, for i = 0 .. ceil(L / 8) - 1,
//   S      = sum over i of mix(w_i ^ (i + 1) * K)   (mod 2^64),
//   h      = mix(S ^ mix(L + K)),
// the op returns h as an int64 (the same 64 bits). All arithmetic is mod 2^64.
//
// Why: flipping any one bit (more generally, changing the bytes of one word)
// changes exactly one term of S, by a nonzero amount since mix is a bijection;
// and h is a bijection of S for a given L: so such a change always changes h.
// Sums mod 2^64 do not depend on the order of the additions, so the result is
// the same for any thread count, any split of the words, and on CUDA (atomic
// adds in any order) as on the CPU.
//
// The CPU kernel: the words of all the tensors laid end to end, split by one
// at::parallel_for; each range adds its terms per tensor and adds each sum into
// the tensor's accumulator (a relaxed atomic add: order-free). The inner loop
// is a plain loop the compiler vectorizes, built three times (AVX-512, AVX2,
// baseline) and picked by what the CPU has; loads go through memcpy, so any
// alignment of the data is fine.
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fastcoll.h"

namespace fastcoll {

// The argument checks of fastcoll.checksum (the words of fastcoll/ops/reference.py
// checksum): every tensor strided, on tensors[0]'s device, dense. Any dtype.
// Also called by the CUDA kernel (checksum_cuda.cu declares it).
void check_checksum_args(at::TensorList tensors);

namespace {

constexpr const char* kOp = "fastcoll.checksum";

}  // namespace

void check_checksum_args(at::TensorList tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK_TYPE(
        t.layout() == at::kStrided, kOp, ": tensors[", i, "] has layout ", t.layout(),
        "; only strided (dense) tensors are supported");
    TORCH_CHECK(
        t.device() == tensors[0].device(), kOp, ": tensors[", i, "] is on ", t.device(), " but tensors[0] is on ",
        tensors[0].device(), "; move them to one device");
    TORCH_CHECK_VALUE(
        t.numel() <= 1 || t.is_non_overlapping_and_dense(), kOp, ": tensors[", i, "] (shape ", shape_str(t.sizes()),
        ", strides ", shape_str(t.strides()), ") is not dense and non-overlapping; make it .contiguous() first");
  }
}

namespace {

constexpr uint64_t kK = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kM1 = 0xBF58476D1CE4E5B9ull;
constexpr uint64_t kM2 = 0x94D049BB133111EBull;

inline __attribute__((always_inline)) uint64_t mix(uint64_t x) {
  x ^= x >> 30;
  x *= kM1;
  x ^= x >> 27;
  x *= kM2;
  x ^= x >> 31;
  return x;
}

// The sum of the terms of the whole words i in [begin, end) of the bytes at p.
inline __attribute__((always_inline)) uint64_t sum_words_body(const unsigned char* p, int64_t begin, int64_t end) {
  uint64_t s = 0;
  uint64_t key = static_cast<uint64_t>(begin + 1) * kK;  // (i + 1) * K, stepped (no multiply per word)
  for (int64_t i = begin; i < end; ++i) {
    uint64_t w;
    std::memcpy(&w, p + 8 * i, 8);  // little-endian hosts only (x86, ARM as Linux runs it)
    s += mix(w ^ key);
    key += kK;
  }
  return s;
}

using SumWordsFn = uint64_t (*)(const unsigned char*, int64_t, int64_t);

uint64_t sum_words_default(const unsigned char* p, int64_t begin, int64_t end) {
  return sum_words_body(p, begin, end);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx2"))) uint64_t sum_words_avx2(const unsigned char* p, int64_t begin, int64_t end) {
  return sum_words_body(p, begin, end);
}

// AVX-512DQ has the 64-bit multiply (vpmullq) the mixer needs; AVX2 emulates it.
__attribute__((target("avx512f,avx512dq,avx512vl,avx512bw"))) uint64_t sum_words_avx512(
    const unsigned char* p, int64_t begin, int64_t end) {
  return sum_words_body(p, begin, end);
}
#endif

SumWordsFn pick_sum_words() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw")) {
    return &sum_words_avx512;
  }
  if (__builtin_cpu_supports("avx2")) return &sum_words_avx2;
#endif
  return &sum_words_default;
}

// The term of the last word when it is partial (1 to 7 bytes, zero-padded).
uint64_t tail_term(const unsigned char* p, int64_t nbytes) {
  const int64_t i = nbytes / 8;
  uint64_t w = 0;
  for (int64_t b = 0; b < nbytes - 8 * i; ++b) w |= static_cast<uint64_t>(p[8 * i + b]) << (8 * b);
  return mix(w ^ (static_cast<uint64_t>(i + 1) * kK));
}

// Words per parallel_for grain: 256 KiB, the scale at which a thread's start costs little.
constexpr int64_t kGrainWords = 32768;

at::Tensor checksum_cpu(at::TensorList tensors) {
  check_checksum_args(tensors);
  const int64_t n = static_cast<int64_t>(tensors.size());
  at::Tensor out = at::empty({n}, at::TensorOptions().dtype(at::kLong).device(at::kCPU));
  if (n == 0) return out;
  std::vector<const unsigned char*> ptrs(n);
  std::vector<int64_t> nbytes(n);
  std::vector<int64_t> word_end(n);  // words of tensors 0..j, whole and partial
  int64_t total = 0;
  for (int64_t j = 0; j < n; ++j) {
    const at::Tensor& t = tensors[j];
    nbytes[j] = t.numel() == 0 ? 0 : static_cast<int64_t>(t.nbytes());
    ptrs[j] = nbytes[j] == 0 ? nullptr : static_cast<const unsigned char*>(t.const_data_ptr());
    total += (nbytes[j] + 7) / 8;
    word_end[j] = total;
  }
  static const SumWordsFn sum_words = pick_sum_words();
  std::vector<std::atomic<uint64_t>> acc(n);  // value-initialized: 0
  at::parallel_for(0, total, kGrainWords, [&](int64_t begin, int64_t end) {
    // The first tensor whose words end after `begin` (tensors without bytes are passed over).
    int64_t j = std::upper_bound(word_end.begin(), word_end.end(), begin) - word_end.begin();
    for (int64_t pos = begin; pos < end; ++j) {
      const int64_t first = word_end[j] - (nbytes[j] + 7) / 8;  // the tensor's first word in the list
      const int64_t lo = pos - first;
      const int64_t hi = std::min(end, word_end[j]) - first;
      const int64_t whole = nbytes[j] / 8;
      uint64_t s = sum_words(ptrs[j], lo, std::min(hi, whole));
      if (hi > whole) s += tail_term(ptrs[j], nbytes[j]);
      if (lo < hi) acc[j].fetch_add(s, std::memory_order_relaxed);
      pos = first + hi;
    }
  });
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) {
    const uint64_t h = mix(acc[j].load(std::memory_order_relaxed) ^ mix(static_cast<uint64_t>(nbytes[j]) + kK));
    std::memcpy(&o[j], &h, 8);
  }
  return out;
}

// A call with an empty list (no tensor to pick a device) returns an empty CPU
// tensor; any other call that lands here has tensors on a device without a
// kernel in this build.
at::Tensor checksum_no_kernel(at::TensorList tensors) {
  check_checksum_args(tensors);
  TORCH_CHECK(
      tensors.empty(), kOp, ": no kernel for tensors on ", tensors.empty() ? at::Device(at::kCPU) : tensors[0].device(),
      " in this build of fastcoll (CPU and, when built with them, CUDA kernels); move the tensors to the CPU");
  return at::empty({0}, at::TensorOptions().dtype(at::kLong).device(at::kCPU));
}

}  // namespace
}  // namespace fastcoll

TORCH_LIBRARY_IMPL(fastcoll, CPU, m) {
  m.impl("checksum", &fastcoll::checksum_cpu);
}

TORCH_LIBRARY_IMPL(fastcoll, CompositeExplicitAutograd, m) {
  m.impl("checksum", &fastcoll::checksum_no_kernel);
}
