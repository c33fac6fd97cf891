// CPU kernel of fastcoll::sum_chunks: the local half of a reduce-scatter that
// sends 16-bit values and accumulates in float32 (one rounding).
//
// chunks is [N, n]: row r holds rank r's contribution to this rank's range.
// For each element i: acc = float(chunks[0][i]); acc = acc + float(chunks[r][i])
// for r = 1..N-1 (float32 adds, in row order); then acc * float(scale) (one
// float32 multiply); then out[i] = acc (float32 out) or acc rounded once to
// chunks' 16-bit dtype (round to nearest even, c10's conversion). No fused
// multiply-add can form: every product is of a finished sum. at::parallel_for
// splits the n columns; each element's arithmetic does not depend on the split.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "fastcoll.h"

namespace fastcoll {
namespace {

constexpr int64_t kGrainElements = 16384;

template <typename In, typename Out>
void sum_rows(const In* in, Out* out, int64_t rows, int64_t n, float scale) {
  at::parallel_for(0, n, kGrainElements, [&](int64_t begin, int64_t end) {
    constexpr int64_t kBlock = 256;  // columns summed together: each row's block is read once, in order
    float acc[kBlock];
    for (int64_t lo = begin; lo < end; lo += kBlock) {
      const int64_t m = std::min(kBlock, end - lo);
      const In* row = in + lo;
      for (int64_t j = 0; j < m; ++j) acc[j] = static_cast<float>(row[j]);
      for (int64_t r = 1; r < rows; ++r) {
        row = in + r * n + lo;
        for (int64_t j = 0; j < m; ++j) acc[j] = acc[j] + static_cast<float>(row[j]);
      }
      for (int64_t j = 0; j < m; ++j) out[lo + j] = static_cast<Out>(acc[j] * scale);
    }
  });
}

template <typename In>
void sum_into(const at::Tensor& chunks, const at::Tensor& out, float scale) {
  const In* in = static_cast<const In*>(chunks.const_data_ptr());
  const int64_t rows = chunks.size(0), n = chunks.size(1);
  if (out.scalar_type() == at::kFloat) {
    sum_rows(in, static_cast<float*>(out.data_ptr()), rows, n, scale);
  } else {
    sum_rows(in, static_cast<In*>(out.data_ptr()), rows, n, scale);
  }
}

void sum_chunks_cpu(const at::Tensor& chunks, const at::Tensor& out, double scale) {
  check_sum_chunks(chunks, out);
  if (out.numel() == 0) return;
  const auto s = static_cast<float>(scale);
  if (chunks.scalar_type() == at::kBFloat16) {
    sum_into<c10::BFloat16>(chunks, out, s);
  } else {
    sum_into<c10::Half>(chunks, out, s);
  }
}

}  // namespace
}  // namespace fastcoll

TORCH_LIBRARY_IMPL(fastcoll, CPU, m) {
  m.impl("sum_chunks", &fastcoll::sum_chunks_cpu);
}
