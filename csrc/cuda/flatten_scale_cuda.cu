// CUDA kernels of fastcoll::flatten_scale and fastcoll::unflatten_scale.
//
// One launch per call, whatever the number of tensors. The host cuts every
// segment into chunks of at most kChunkElements elements and writes one small
// descriptor per chunk (source, destination, length, dtype pair) into pinned
// memory; it is copied to the device on the current stream and each block
// handles one chunk. Work is thus split in proportion to bytes: a huge
// embedding gets many blocks, a bias gets one. Inside a chunk, 16-byte vector
// loads/stores are used when source and destination are co-aligned, with a
// scalar head and tail; otherwise a scalar loop. No host synchronization.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "fastcoll.h"

namespace fastcoll {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunkElements = 16384;
constexpr int kUnroll = 4;  // independent loads in flight per thread

struct ChunkDesc {
  int64_t src;    // address of the first source element
  int64_t dst;    // address of the first destination element
  int64_t numel;  // elements in this chunk, 1..kChunkElements
  int64_t kinds;  // dtype_code(src) * 4 + dtype_code(dst)
};
static_assert(sizeof(ChunkDesc) == 4 * sizeof(int64_t), "ChunkDesc is sent as int64 words");

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename S, typename D>
using opmath_t = std::conditional_t<std::is_same_v<S, double> || std::is_same_v<D, double>, double, float>;

template <typename S, typename D, typename M>
__device__ __forceinline__ D convert_scale(S x, M scale) {
  return static_cast<D>(static_cast<M>(x) * scale);
}

template <typename S, typename D, typename M>
__device__ void scalar_range(const S* src, D* dst, int64_t n, M scale) {
  for (int64_t base = threadIdx.x; base < n; base += kUnroll * blockDim.x) {
    S in[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * blockDim.x;
      if (i < n) in[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * blockDim.x;
      if (i < n) dst[i] = convert_scale<S, D, M>(in[u], scale);
    }
  }
}

template <typename S, typename D, typename M>
__device__ void copy_chunk(const S* src, D* dst, int64_t n, M scale) {
  constexpr int kWidest = sizeof(S) > sizeof(D) ? sizeof(S) : sizeof(D);
  constexpr int kVec = 16 / kWidest;
  constexpr uintptr_t kSrcAlign = kVec * sizeof(S);
  constexpr uintptr_t kDstAlign = kVec * sizeof(D);
  const auto src_addr = reinterpret_cast<uintptr_t>(src);
  const auto dst_addr = reinterpret_cast<uintptr_t>(dst);
  int64_t head = static_cast<int64_t>(((kSrcAlign - src_addr % kSrcAlign) % kSrcAlign) / sizeof(S));
  if (head > n) head = n;
  if ((dst_addr + head * sizeof(D)) % kDstAlign != 0) {
    scalar_range<S, D, M>(src, dst, n, scale);  // not co-aligned: no vector path
    return;
  }
  scalar_range<S, D, M>(src, dst, head, scale);
  const int64_t nvec = (n - head) / kVec;
  const auto* vsrc = reinterpret_cast<const Pack<S, kVec>*>(src + head);
  auto* vdst = reinterpret_cast<Pack<D, kVec>*>(dst + head);
  for (int64_t base = threadIdx.x; base < nvec; base += kUnroll * blockDim.x) {
    Pack<S, kVec> in[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * blockDim.x;
      if (i < nvec) in[u] = vsrc[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * blockDim.x;
      if (i < nvec) {
        Pack<D, kVec> out;
#pragma unroll
        for (int k = 0; k < kVec; ++k) out.v[k] = convert_scale<S, D, M>(in[u].v[k], scale);
        vdst[i] = out;
      }
    }
  }
  const int64_t done = head + nvec * kVec;
  scalar_range<S, D, M>(src + done, dst + done, n - done, scale);
}

template <typename S, typename D>
__device__ __forceinline__ void run_chunk(const ChunkDesc& d, double scale) {
  using M = opmath_t<S, D>;
  copy_chunk<S, D, M>(
      reinterpret_cast<const S*>(d.src), reinterpret_cast<D*>(d.dst), d.numel, static_cast<M>(scale));
}

// Codes follow fastcoll::dtype_code: float32=0, float16=1, bfloat16=2, float64=3.
template <typename S>
__device__ __forceinline__ void run_chunk_src(const ChunkDesc& d, int dst_code, double scale) {
  switch (dst_code) {
    case 0: run_chunk<S, float>(d, scale); break;
    case 1: run_chunk<S, c10::Half>(d, scale); break;
    case 2: run_chunk<S, c10::BFloat16>(d, scale); break;
    case 3: run_chunk<S, double>(d, scale); break;
  }
}

__global__ void __launch_bounds__(kThreads) multi_tensor_copy_scale_kernel(const ChunkDesc* descs, double scale) {
  const ChunkDesc d = descs[blockIdx.x];
  const int src_code = static_cast<int>(d.kinds >> 2);
  const int dst_code = static_cast<int>(d.kinds & 3);
  switch (src_code) {
    case 0: run_chunk_src<float>(d, dst_code, scale); break;
    case 1: run_chunk_src<c10::Half>(d, dst_code, scale); break;
    case 2: run_chunk_src<c10::BFloat16>(d, dst_code, scale); break;
    case 3: run_chunk_src<double>(d, dst_code, scale); break;
  }
}

void run_plan_cuda(const std::vector<Segment>& segments, const at::Tensor& flat, double scale) {
  if (segments.empty()) return;
  c10::cuda::CUDAGuard guard(flat.device());
  int64_t nchunks = 0;
  for (const auto& s : segments) nchunks += (s.numel + kChunkElements - 1) / kChunkElements;
  TORCH_CHECK(nchunks <= INT_MAX, "fastcoll: ", nchunks, " chunks exceed one launch's grid; split the bucket");

  // Descriptors go through pinned memory and an async copy on the current
  // stream; the caching host allocator keeps the pinned block alive until the
  // copy has run, so nothing here waits for the device.
  auto host = at::empty({nchunks * 4}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  auto* desc = reinterpret_cast<ChunkDesc*>(host.data_ptr<int64_t>());
  int64_t c = 0;
  for (const auto& s : segments) {
    const int64_t kinds = dtype_code(s.src_dtype) * 4 + dtype_code(s.dst_dtype);
    const int64_t src_size = c10::elementSize(s.src_dtype);
    const int64_t dst_size = c10::elementSize(s.dst_dtype);
    for (int64_t start = 0; start < s.numel; start += kChunkElements) {
      desc[c].src = reinterpret_cast<int64_t>(s.src) + start * src_size;
      desc[c].dst = reinterpret_cast<int64_t>(s.dst) + start * dst_size;
      desc[c].numel = std::min(kChunkElements, s.numel - start);
      desc[c].kinds = kinds;
      ++c;
    }
  }
  auto device_desc = host.to(flat.device(), /*non_blocking=*/true);
  const auto stream = at::cuda::getCurrentCUDAStream();
  multi_tensor_copy_scale_kernel<<<static_cast<unsigned int>(nchunks), kThreads, 0, stream>>>(
      reinterpret_cast<const ChunkDesc*>(device_desc.data_ptr<int64_t>()), scale);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void flatten_scale_cuda(at::TensorList tensors, const at::Tensor& out, double scale) {
  run_plan_cuda(plan_segments(tensors, out, /*pack=*/true), out, scale);
}

void unflatten_scale_cuda(const at::Tensor& flat, at::TensorList tensors, double scale) {
  run_plan_cuda(plan_segments(tensors, flat, /*pack=*/false), flat, scale);
}

}  // namespace
}  // namespace fastcoll

TORCH_LIBRARY_IMPL(fastcoll, CUDA, m) {
  m.impl("flatten_scale", &fastcoll::flatten_scale_cuda);
  m.impl("unflatten_scale", &fastcoll::unflatten_scale_cuda);
}
