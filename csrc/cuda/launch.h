// The launchers of the CUDA kernels: the only functions of the .cu files that
// host code calls.
//
// Every check of every CUDA op (devices, dtypes, sizes, aliasing, the chunk
// limit, CUDA graph capture) runs before these are entered, in code the host
// compiler builds (csrc/ops.cpp, csrc/cuda/cuda_ops.cpp), which also picks the
// device, the stream and the table's path and allocates every buffer. The
// launchers take those validated arguments, launch, and return the CUDA error
// of the launch (cudaSuccess or another code, which cuda_ops.cpp raises with
// the op's name): they are noexcept and call nothing that throws, so no C++
// exception ever unwinds through code that nvcc compiled
// (tests/test_cuda_no_throw.py checks the sources and, where a CUDA build is
// at hand, the objects' symbols).
//
// Plain C++: included by the .cu files and by cuda_ops.cpp.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fastcoll {
namespace cuda_chunks {
struct ChunkDesc;  // cuda/copy_chunk.cuh
}  // namespace cuda_chunks

namespace cuda_launch {

// Where a launch reads its chunk table from.
enum class TableKind : int {
  kInline32 = 0,   // host memory holding at least 32 descriptors, passed as the kernel argument
  kInline120 = 1,  // ... at least 120 descriptors (3840 bytes: the classic 4 KiB of kernel arguments)
  kInline512 = 2,  // ... at least 512 descriptors (16 KiB: CUDA 12.1+, toolkit and driver)
  kDevice = 3,     // device memory, read by the kernel through a pointer
};

// A validated chunk table: `chunks` points to host memory of the inline
// kinds' capacity (only the first `nchunks` are read by the kernel, but the
// whole table is copied into the launch's arguments), or to device memory
// holding `nchunks` descriptors. 1 <= nchunks <= INT_MAX.
struct Table {
  const cuda_chunks::ChunkDesc* chunks;
  int64_t nchunks;
  TableKind kind;
};

// Descriptor capacity of an inline kind (the number of descriptors the host
// memory must hold); 0 for kDevice.
constexpr int64_t inline_capacity(TableKind kind) {
  return kind == TableKind::kInline32 ? 32 : kind == TableKind::kInline120 ? 120 : kind == TableKind::kInline512 ? 512 : 0;
}

// Whether this build's kernels can take kInline512 tables (the toolkit is CUDA
// 12.1+); the driver's side is the caller's (cudaDriverGetVersion).
bool large_inline_compiled() noexcept;

// flatten_scale / unflatten_scale: every chunk copied, times scale, cast.
cudaError_t launch_copy_scale(const Table& table, double scale, cudaStream_t stream) noexcept;

// flatten_accumulate: out[slot] = out[slot] + scale * x; with a non-null
// `nonfinite`, a block that stored NaN or +-Inf writes 1 to nonfinite[0].
cudaError_t launch_accumulate(const Table& table, double scale, int32_t* nonfinite, cudaStream_t stream) noexcept;

// sum_chunks (csrc/cuda/sum_chunks_cuda.cu): out[i] = cast(float(scale * sum over r of chunks[r * n + i])),
// summed and scaled in float64 in row order, rounded once to float32. chunks: rows x n 16-bit values
// (bfloat16 when bf16, else float16); out: n float32 values (out_f32) or n of chunks' dtype. Checked by
// cuda_ops.cpp; n == 0 launches nothing.
struct SumChunksArgs {
  const void* chunks;
  void* out;
  int64_t rows;
  int64_t n;
  double scale;
  bool bf16;
  bool out_f32;
};
cudaError_t launch_sum_chunks(const SumChunksArgs& args, cudaStream_t stream) noexcept;

// The health ops (csrc/cuda/health_cuda.cu).
enum class HealthMode : int {
  kPack = 0,    // copy by scale (* scale_by), flag non-finite values
  kUnpack = 1,  // copy by scale, one partial sum of squares per chunk
  kRead = 2,    // read only, one partial sum of squares per chunk
};
struct HealthArgs {
  double scale;
  const void* scale_by;  // kPack: nullptr, or one float (one double when scale_by_f64) on the device
  int32_t* nonfinite;    // kPack: nullptr, or the flag
  double* partials;      // kUnpack, kRead: nchunks doubles on the device
  int32_t scale_by_f64;
};
cudaError_t launch_health(const Table& table, const HealthArgs& args, HealthMode mode, cudaStream_t stream) noexcept;
// *out = the sum of partials[0..n), in a fixed order (n == 0 writes 0).
cudaError_t launch_sum_partials(const double* partials, int64_t n, double* out, cudaStream_t stream) noexcept;

// checksum (csrc/cuda/checksum_cuda.cu): one tensor's bytes and the first of its chunks.
struct Span {
  const unsigned char* ptr;
  int64_t nbytes;
  int64_t chunk_begin;  // chunks of tensors 0..j-1
};
constexpr int64_t kChecksumChunkBytes = 16 * 1024;  // bytes of one block's chunk (256 threads x 8 words)
constexpr int64_t kChecksumInlineSpans = 160;       // spans passed as the kernel argument (3840 bytes)
struct ChecksumArgs {
  int64_t nspans;
  int64_t nchunks;
  unsigned long long* acc;  // nspans accumulators, then the ticket counter; zeroed before the launch
  int64_t* out;             // nspans finalized hashes
};
// `spans`: host memory of kChecksumInlineSpans spans when nspans <= kChecksumInlineSpans
// (the kernel argument), else device memory of nspans spans. grid >= 1 blocks.
cudaError_t launch_checksum(
    const Span* spans, bool inline_spans, const ChecksumArgs& args, unsigned int grid, cudaStream_t stream) noexcept;

}  // namespace cuda_launch
}  // namespace fastcoll
