// CUDA kernel of fastcoll::sum_chunks: out[i] = cast(float(scale * (chunks[0][i] + ... + chunks[N-1][i]))),
// the sum in float64 in row order (__dadd_rn: exact while a column spans at
// most 45 - log2(N) binades), then one __dmul_rn (nothing is contracted into a
// fused multiply-add), then __double2float_rn, the one rounding, stored as
// float32 or rounded to chunks' 16-bit dtype (__float2bfloat16_rn /
// __float2half_rn): the same bits as the CPU kernel
// (csrc/cpu/sum_chunks_cpu.cpp). A grid-stride loop over the n columns; each
// thread reads its column of every row (coalesced across the warp). Arguments
// are checked by csrc/cuda/cuda_ops.cpp before the launcher is entered
// (launch.h): the launcher only launches and returns the error.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/launch.h"

namespace fastcoll {
namespace {

constexpr int kSumThreads = 256;

__device__ __forceinline__ double to_double(__nv_bfloat16 x) { return static_cast<double>(__bfloat162float(x)); }
__device__ __forceinline__ double to_double(__half x) { return static_cast<double>(__half2float(x)); }
__device__ __forceinline__ void store(float v, float* p) { *p = v; }
__device__ __forceinline__ void store(float v, __nv_bfloat16* p) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store(float v, __half* p) { *p = __float2half_rn(v); }

template <typename In, typename Out>
__global__ void __launch_bounds__(kSumThreads)
    sum_chunks_kernel(const In* __restrict__ in, Out* __restrict__ out, int64_t rows, int64_t n, double scale) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    double acc = to_double(in[i]);
    for (int64_t r = 1; r < rows; ++r) acc = __dadd_rn(acc, to_double(in[r * n + i]));
    store(__double2float_rn(__dmul_rn(acc, scale)), out + i);
  }
}

template <typename In, typename Out>
cudaError_t launch_typed(const void* in, void* out, int64_t rows, int64_t n, double scale, cudaStream_t stream) noexcept {
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
