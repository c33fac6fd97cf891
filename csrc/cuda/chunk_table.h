// The host side of the CUDA kernels' chunk table: how many chunks a plan's
// segments make and the descriptors that say so (cuda/copy_chunk.cuh: ChunkDesc).
//
// Host-compiler code only (csrc/cuda/cuda_ops.cpp, tests/cpp):
// dtype_code and c10::elementSize may throw, and no exception may cross code
// that nvcc compiled (tests/test_cuda_no_throw.py).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cuda/copy_chunk.cuh"
#include "fastcoll.h"

namespace fastcoll {
namespace cuda_chunks {

// Elements per chunk of a segment from `src` to `dst` dtype (>= 1), for chunks
// of `chunk_bytes` of the wider side (the tests pass small sizes to split
// tensors at many places).
inline int64_t chunk_elements(at::ScalarType src, at::ScalarType dst, int64_t chunk_bytes = kChunkBytes) {
  const int64_t widest = static_cast<int64_t>(std::max(c10::elementSize(src), c10::elementSize(dst)));
  return std::max<int64_t>(1, chunk_bytes / widest);
}

// Number of chunks the segments are cut into.
inline int64_t count_chunks(const std::vector<Segment>& segments, int64_t chunk_bytes = kChunkBytes) {
  int64_t n = 0;
  for (const auto& s : segments) {
    const int64_t per_chunk = chunk_elements(s.src_dtype, s.dst_dtype, chunk_bytes);
    n += (s.numel + per_chunk - 1) / per_chunk;
  }
  return n;
}

// Writes count_chunks(segments, chunk_bytes) descriptors to `out`, in flat order.
inline void write_chunks(const std::vector<Segment>& segments, ChunkDesc* out, int64_t chunk_bytes = kChunkBytes) {
  int64_t c = 0;
  for (const auto& s : segments) {
    const int64_t kinds = int64_t(dtype_code(s.src_dtype)) << kDtypeCodeBits | dtype_code(s.dst_dtype);
    const int64_t src_size = c10::elementSize(s.src_dtype);
    const int64_t dst_size = c10::elementSize(s.dst_dtype);
    const int64_t per_chunk = chunk_elements(s.src_dtype, s.dst_dtype, chunk_bytes);
    for (int64_t start = 0; start < s.numel; start += per_chunk) {
      out[c].src = reinterpret_cast<int64_t>(s.src) + start * src_size;
      out[c].dst = reinterpret_cast<int64_t>(s.dst) + start * dst_size;
      out[c].numel = std::min(per_chunk, s.numel - start);
      out[c].kinds = kinds;
      ++c;
    }
  }
}

}  // namespace cuda_chunks
}  // namespace fastcoll
