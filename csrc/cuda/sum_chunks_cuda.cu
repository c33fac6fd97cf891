// CUDA kernel of fastcoll::sum_chunks: out[i] = cast(scale * (chunks[0][i] + ... + chunks[N-1][i])),
// the sum in float32 in row order (__fadd_rn, then one __fmul_rn: nothing is
// contracted into a fused multiply-add), then float32 out or one rounding to
// chunks' 16-bit dtype (__float2bfloat16_rn / __float2half_rn): the same bits
// as the CPU kernel (csrc/cpu/sum_chunks_cpu.cpp). A grid-stride loop over the
// n columns; each thread reads its column of every row (coalesced across the
// warp). Arguments are checked by csrc/cuda/cuda_ops.cpp before the launcher
// is entered (launch.h): the launcher only launches and returns the error.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/launch.h"

namespace fastcoll {
namespace {

constexpr int kSumThreads = 256;

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ void store(float v, float* p) { *p = v; }
__device__ __forceinline__ void store(float v, __nv_bfloat16* p) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store(float v, __half* p) { *p = __float2half_rn(v); }

template <typename In, typename Out>
__global__ void __launch_bounds__(kSumThreads)
    sum_chunks_kernel(const In* __restrict__ in, Out* __restrict__ out, int64_t rows, int64_t n, float scale) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float acc = to_float(in[i]);
    for (int64_t r = 1; r < rows; ++r) acc = __fadd_rn(acc, to_float(in[r * n + i]));
    store(__fmul_rn(acc, scale), out + i);
  }
}

template <typename In, typename Out>
cudaError_t launch_typed(const void* in, void* out, int64_t rows, int64_t n, float scale, cudaStream_t stream) noexcept {
  const int64_t want = (n + kSumThreads - 1) / kSumThreads;
  const unsigned int grid = static_cast<unsigned int>(want < 65535 ? want : 65535);
  sum_chunks_kernel<In, Out><<<grid, kSumThreads, 0, stream>>>(
      static_cast<const In*>(in), static_cast<Out*>(out), rows, n, scale);
  return cudaGetLastError();
}

}  // namespace

namespace cuda_launch {

cudaError_t launch_sum_chunks(const SumChunksArgs& a, cudaStream_t stream) noexcept {
  if (a.n <= 0) return cudaSuccess;
  if (a.bf16) {
    return a.out_f32 ? launch_typed<__nv_bfloat16, float>(a.chunks, a.out, a.rows, a.n, a.scale, stream)
                     : launch_typed<__nv_bfloat16, __nv_bfloat16>(a.chunks, a.out, a.rows, a.n, a.scale, stream);
  }
  return a.out_f32 ? launch_typed<__half, float>(a.chunks, a.out, a.rows, a.n, a.scale, stream)
                   : launch_typed<__half, __half>(a.chunks, a.out, a.rows, a.n, a.scale, stream);
}

}  // namespace cuda_launch
}  // namespace fastcoll
