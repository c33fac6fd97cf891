// CUDA kernel of fastcoll::checksum: the hash defined in csrc/cpu/checksum_cpu.cpp
// (and fastcoll.ops.checksum), the same 64 bits as the CPU kernel for the same bytes.
//
// One launch for the whole list (plus a memset of the accumulators). Each
// tensor's words are cut into chunks of kChunkWords; the chunks of all the
// tensors are numbered end to end and a grid-stride loop hands them to blocks.
// A block adds the terms of its chunk's words (each thread a strided share,
// then a warp-shuffle and shared-memory sum) and adds the chunk's sum into its
// tensor's accumulator with one 64-bit atomicAdd: sums mod 2^64, so the order
// of the atomics does not matter and the result is exact and deterministic.
// The last block to finish (a ticket counter after a fence) finalizes every
// tensor: out[j] = mix(S_j ^ mix(L_j + K)).
//
// Loads: a tensor whose bytes start 8-byte aligned is read in 8-byte words;
// otherwise each whole word is assembled from the two aligned 8-byte words it
// straddles (both hold bytes of the tensor), and the partial last word byte by
// byte, so nothing outside the tensor's 8-byte granules is read.
//
// The table of tensors is a kernel argument (__grid_constant__) up to
// kInlineSpans tensors (capturable in CUDA graphs), else uploaded from pinned
// memory (refused under capture, as for the other fused ops).
#include <ATen/ops/empty.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <vector>

namespace fastcoll {

// csrc/cpu/checksum_cpu.cpp: the argument checks of fastcoll.checksum.
void check_checksum_args(at::TensorList tensors);

namespace {

constexpr const char* kOp = "fastcoll.checksum";

// The hash's constants and mixer (as in checksum_cpu.cpp).
constexpr uint64_t kK = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kM1 = 0xBF58476D1CE4E5B9ull;
constexpr uint64_t kM2 = 0x94D049BB133111EBull;

__host__ __device__ __forceinline__ uint64_t mix(uint64_t x) {
  x ^= x >> 30;
  x *= kM1;
  x ^= x >> 27;
  x *= kM2;
  x ^= x >> 31;
  return x;
}

constexpr int kThreads = 256;
constexpr int kWordsPerThread = 8;
constexpr int64_t kChunkWords = int64_t(kThreads) * kWordsPerThread;  // 16 KiB per chunk

// One tensor: its bytes and where its chunks start in the list's numbering.
struct Span {
  const unsigned char* ptr;
  int64_t nbytes;
  int64_t chunk_begin;  // chunks of tensors 0..j-1
};
static_assert(sizeof(Span) == 24, "Span is three 8-byte fields (the uploaded table is int64s)");

constexpr int kInlineSpans = 160;  // 3840 bytes: with the other arguments, within the 4 KiB of kernel arguments
struct InlineSpans {
  Span spans[kInlineSpans];
};

struct Args {
  int64_t nspans;
  int64_t nchunks;
  unsigned long long* acc;  // nspans accumulators, then the ticket counter; zeroed before the launch
  int64_t* out;             // nspans finalized hashes
};

// Whole word w (bytes [8w, 8w + 8) inside the tensor) of bytes at p, little-endian.
__device__ __forceinline__ uint64_t load_word(const unsigned char* p, int64_t w, int shift) {
  if (shift == 0) return __ldg(reinterpret_cast<const unsigned long long*>(p) + w);
  const auto* a = reinterpret_cast<const unsigned long long*>(p - shift / 8) + w;  // aligned
  return (static_cast<uint64_t>(__ldg(a)) >> shift) | (static_cast<uint64_t>(__ldg(a + 1)) << (64 - shift));
}

__device__ __forceinline__ uint64_t tail_term(const unsigned char* p, int64_t nbytes) {
  const int64_t i = nbytes / 8;
  uint64_t w = 0;
  for (int64_t b = 0; b < nbytes - 8 * i; ++b) w |= static_cast<uint64_t>(p[8 * i + b]) << (8 * b);
  return mix(w ^ (static_cast<uint64_t>(i + 1) * kK));
}

// The sum of v over the block, in thread 0 (mod 2^64: any order gives the same bits).
__device__ __forceinline__ uint64_t block_sum(uint64_t v) {
  __shared__ unsigned long long warp_sums[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  uint64_t total = 0;
  if (threadIdx.x == 0) {
    for (int i = 0; i < kThreads / 32; ++i) total += warp_sums[i];
  }
  __syncthreads();  // warp_sums may be reused
  return total;
}

__device__ void checksum_body(const Span* spans, const Args& a) {
  for (int64_t c = blockIdx.x; c < a.nchunks; c += gridDim.x) {
    // The tensor of chunk c: the last span whose chunks start at or before c
    // (tensors without bytes have no chunk and are passed over).
    int64_t lo = 0, hi = a.nspans;  // answer in [lo, hi)
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (spans[mid].chunk_begin <= c) lo = mid; else hi = mid;
    }
    const Span s = spans[lo];
    const int64_t whole = s.nbytes / 8;
    const int64_t nwords = (s.nbytes + 7) / 8;
    const int64_t w0 = (c - s.chunk_begin) * kChunkWords;
    const int64_t w1 = w0 + kChunkWords < nwords ? w0 + kChunkWords : nwords;
    const int64_t w1_whole = w1 < whole ? w1 : whole;
    const int shift = static_cast<int>(reinterpret_cast<uintptr_t>(s.ptr) & 7) * 8;
    uint64_t sum = 0;
#pragma unroll
    for (int k = 0; k < kWordsPerThread; ++k) {
      const int64_t w = w0 + threadIdx.x + int64_t(k) * kThreads;
      if (w < w1_whole) {
        sum += mix(load_word(s.ptr, w, shift) ^ (static_cast<uint64_t>(w + 1) * kK));
      } else if (w == whole && w < w1) {
        sum += tail_term(s.ptr, s.nbytes);
      }
    }
    const uint64_t total = block_sum(sum);
    if (threadIdx.x == 0) atomicAdd(&a.acc[lo], static_cast<unsigned long long>(total));
  }
  // The last block to get here finalizes every tensor.
  __shared__ bool last;
  __threadfence();  // this block's atomics before its ticket
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(&a.acc[a.nspans], 1ull) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int64_t j = threadIdx.x; j < a.nspans; j += blockDim.x) {
    const uint64_t total = atomicAdd(&a.acc[j], 0ull);  // read at the device-coherent point
    const uint64_t h = mix(total ^ mix(static_cast<uint64_t>(spans[j].nbytes) + kK));
    a.out[j] = static_cast<int64_t>(h);
  }
}

__global__ void __launch_bounds__(kThreads) checksum_inline_kernel(const __grid_constant__ InlineSpans table, const Args a) {
  checksum_body(table.spans, a);
}

__global__ void __launch_bounds__(kThreads) checksum_table_kernel(const Span* spans, const Args a) {
  checksum_body(spans, a);
}

at::Tensor checksum_cuda(at::TensorList tensors) {
  check_checksum_args(tensors);
  const int64_t n = static_cast<int64_t>(tensors.size());
  if (n == 0) return at::empty({0}, at::TensorOptions().dtype(at::kLong));
  const at::Device device = tensors[0].device();
  c10::cuda::CUDAGuard guard(device);
  const auto stream = at::cuda::getCurrentCUDAStream();
  const auto options = at::TensorOptions().dtype(at::kLong).device(device);

  std::vector<Span> spans(n);
  int64_t nchunks = 0;
  for (int64_t j = 0; j < n; ++j) {
    const at::Tensor& t = tensors[j];
    const int64_t nbytes = t.numel() == 0 ? 0 : static_cast<int64_t>(t.nbytes());
    spans[j].ptr = nbytes == 0 ? nullptr : static_cast<const unsigned char*>(t.const_data_ptr());
    spans[j].nbytes = nbytes;
    spans[j].chunk_begin = nchunks;
    nchunks += ((nbytes + 7) / 8 + kChunkWords - 1) / kChunkWords;
  }

  at::Tensor out = at::empty({n}, options);
  at::Tensor acc = at::empty({n + 1}, options);  // the accumulators and the ticket counter
  C10_CUDA_CHECK(cudaMemsetAsync(acc.data_ptr(), 0, (n + 1) * sizeof(int64_t), stream));
  Args args{n, nchunks, reinterpret_cast<unsigned long long*>(acc.data_ptr<int64_t>()), out.data_ptr<int64_t>()};

  // Enough blocks to fill the GPU (8 of 256 threads per SM), at least one (it finalizes).
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const auto grid = static_cast<unsigned int>(std::max<int64_t>(1, std::min<int64_t>(nchunks, sms * 8)));

  if (n <= kInlineSpans) {
    InlineSpans table;
    std::copy(spans.begin(), spans.end(), table.spans);
    checksum_inline_kernel<<<grid, kThreads, 0, stream>>>(table, args);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return out;
  }
  TORCH_CHECK(
      c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None, kOp,
      ": not supported inside CUDA graph capture for more than ", kInlineSpans, " tensors (this call has ", n,
      "): the table of tensors is then uploaded from host memory on every call; checksum fewer tensors per call, "
      "or run it outside torch.cuda.graph(...)");
  auto host = at::empty({n * 3}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::copy(spans.begin(), spans.end(), reinterpret_cast<Span*>(host.data_ptr<int64_t>()));
  auto device_table = host.to(device, /*non_blocking=*/true);
  checksum_table_kernel<<<grid, kThreads, 0, stream>>>(reinterpret_cast<const Span*>(device_table.data_ptr<int64_t>()), args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace
}  // namespace fastcoll

TORCH_LIBRARY_IMPL(fastcoll, CUDA, m) {
  m.impl("checksum", &fastcoll::checksum_cuda);
}
