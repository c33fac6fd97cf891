// Chunk tables passed as the kernel argument itself, shared by every CUDA op.
//
// Kernel arguments may total 4 KiB, or 32764 bytes with CUDA 12.1+ (toolkit and
// driver) on sm_70+. The table sizes and the choice between them are in
// copy_chunk.cuh (choose_table), where the C++ test checks them; this header
// holds the CUDA-only part: the table type, the largest size this toolkit can
// compile, and the largest this process's driver accepts.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/copy_chunk.cuh"

namespace fastcoll {
namespace cuda_chunks {

#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
constexpr int kLargeInline = kLargeTable;  // 16 KiB
#else
constexpr int kLargeInline = kMidTable;
#endif

// A table of N chunk descriptors, passed by value (read in place with __grid_constant__).
template <int N>
struct InlineTable {
  ChunkDesc chunks[N];
};

// The largest table this process may pass as an argument (the driver must be 12.1+ for more than 4 KiB).
inline int64_t max_inline_chunks() {
  static const int64_t limit = [] {
    int driver = 0;
    return cudaDriverGetVersion(&driver) == cudaSuccess && driver >= 12010 ? kLargeInline : kMidTable;
  }();
  return limit;
}

}  // namespace cuda_chunks
}  // namespace fastcoll
