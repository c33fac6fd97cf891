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
// kChecksumInlineSpans tensors (capturable in CUDA graphs), else read from
// device memory (uploaded from pinned memory, refused under capture, as for
// the other fused ops). The arguments are checked, the spans and buffers made
// and the accumulators zeroed by csrc/cuda/cuda_ops.cpp before the launcher is
// entered (launch.h).
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/inline_table.cuh"
#include "cuda/launch.h"

namespace fastcoll {
namespace {

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
static_assert(kChunkWords * 8 == cuda_launch::kChecksumChunkBytes, "launch.h sizes the chunks the host counts");

// One tensor: its bytes and where its chunks start in the list's numbering.
using cuda_launch::Span;
static_assert(sizeof(Span) == 24, "Span is three 8-byte fields (the uploaded table is int64s)");

constexpr int kInlineSpans = static_cast<int>(cuda_launch::kChecksumInlineSpans);  // 3840 bytes: within 4 KiB of arguments
struct InlineSpans {
  Span spans[kInlineSpans];
};

using Args = cuda_launch::ChecksumArgs;
static_assert(sizeof(InlineSpans) + sizeof(Args) <= 4096, "the inline spans must fit in 4 KiB of arguments");

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

}  // namespace

namespace cuda_launch {

cudaError_t launch_checksum(
    const Span* spans, bool inline_spans, const ChecksumArgs& args, unsigned int grid, cudaStream_t stream) noexcept {
  Args a = args;
  const Span* device_spans = spans;
  void* kernel_args[2] = {inline_spans ? const_cast<Span*>(spans) : static_cast<void*>(&device_spans), &a};
  const void* kernel = inline_spans ? reinterpret_cast<const void*>(&checksum_inline_kernel)
                                    : reinterpret_cast<const void*>(&checksum_table_kernel);
  return cuda_chunks::launch_error(cudaLaunchKernel(kernel, dim3(grid), dim3(kThreads), kernel_args, 0, stream));
}

}  // namespace cuda_launch
}  // namespace fastcoll
