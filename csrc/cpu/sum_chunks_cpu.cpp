// CPU kernel of fastcoll::sum_chunks: the local half of a reduce-scatter that
// sends 16-bit values and rounds once.
//
// chunks is [N, n]: row r holds rank r's contribution to this rank's range.
// For each element i: acc = double(chunks[0][i]); acc = acc + double(chunks[r][i])
// for r = 1..N-1 (float64 adds in row order: exact while a column's values
// span at most 45 - log2(N) binades, and for float16 up to 8192 rows); then
// acc * scale (one float64 multiply, exact for a power of two); then
// float(acc), the one rounding, stored as float32 or rounded to chunks' 16-bit
// dtype (round to nearest even, c10's conversion). No fused multiply-add can
// form: every product is of a finished sum. at::parallel_for splits the n
// columns; each element's arithmetic does not depend on the split. The loop
// is the inner-loop build's in use (cpu/copy_scale.h, cpu_isa.cpp): the same
// bits from each.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "fastcoll.h"

namespace fastcoll {
FASTCOLL_IN_EACH_CPU_BUILD(SumChunksFn pick_sum_chunks(at::ScalarType in, bool out_f32))

namespace {

constexpr int64_t kGrainElements = 16384;

SumChunksFn pick_sum_chunks(at::ScalarType in, bool out_f32) {
  return FASTCOLL_CALL_CPU_BUILD(pick_sum_chunks, in, out_f32);
}

void sum_chunks_cpu(const at::Tensor& chunks, const at::Tensor& out, double scale) {
  check_sum_chunks(chunks, out);
  if (out.numel() == 0) return;
  const SumChunksFn fn = pick_sum_chunks(chunks.scalar_type(), out.scalar_type() == at::kFloat);
  const void* in = chunks.const_data_ptr();
  void* dst = out.data_ptr();
  const int64_t rows = chunks.size(0), n = chunks.size(1);
  at::parallel_for(0, n, kGrainElements, [&](int64_t begin, int64_t end) { fn(in, dst, rows, n, begin, end, scale); });
}

}  // namespace
}  // namespace fastcoll

TORCH_LIBRARY_IMPL(fastcoll, CPU, m) {
  m.impl("sum_chunks", &fastcoll::sum_chunks_cpu);
}
