// Shared declarations for fastcoll's fused multi-tensor ops.
//
// Both ops reduce to the same work: a list of segments, each a run of `numel`
// consecutive elements copied from one address to another, multiplied by a
// scale and cast between floating dtypes. The argument checks and the segment
// plan are device-independent (csrc/ops.cpp); each device file only runs a plan.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dtypes.h"

namespace fastcoll {

// One contiguous run of elements to copy-and-scale.
struct Segment {
  const void* src;
  void* dst;
  int64_t numel;        // > 0; zero-element tensors never make a segment
  int64_t flat_offset;  // element offset of this run inside the flat buffer
  at::ScalarType src_dtype;
  at::ScalarType dst_dtype;
};

// How the tensors fill the flat buffer: all of it (flatten_scale and the
// others: a non-empty list whose numels add up to the buffer's), or a prefix
// of it (flatten_accumulate: the buffer may be longer, its tail is left alone;
// an empty list is a prefix of length 0).
enum class FlatFit { kExact, kPrefix };

// Checks the arguments of flatten_scale (pack=true: tensors -> flat) or
// unflatten_scale (pack=false: flat -> tensors) and returns the segments in
// flat order. Throws (ValueError/TypeError/RuntimeError, naming the culprit,
// prefixed "fastcoll.flatten_scale: " or "fastcoll.unflatten_scale: ", or
// `op` when given) before anything is written.
std::vector<Segment> plan_segments(
    at::TensorList tensors,
    const at::Tensor& flat,
    bool pack,
    const char* op = nullptr,
    FlatFit fit = FlatFit::kExact);

// The gradient-health ops (flatten_scale_ex, unflatten_scale_ex,
// sum_of_squares): a segment plan plus the small tensors they read or write,
// all on the plan's device. Built by the plan_* functions below (csrc/ops.cpp),
// which check everything first, like plan_segments.
struct HealthPlan {
  // flatten_scale_ex / unflatten_scale_ex: plan_segments'. sum_of_squares: one
  // segment per non-empty tensor, dst == nullptr and dst_dtype == src_dtype
  // (the values are read, not copied), flat_offset counting elements of the
  // tensors laid end to end.
  std::vector<Segment> segments;
  // flatten_scale_ex: the factor is scale * *scale_by (a float, or a double
  // when scale_by_f64) when given, read where it lives (on the device).
  const void* scale_by = nullptr;
  bool scale_by_f64 = false;
  // flatten_scale_ex, flatten_accumulate: set to 1 when a written value is NaN or +-Inf; never 0.
  int32_t* nonfinite = nullptr;
  // unflatten_scale_ex / sum_of_squares: overwritten with the float64 sum of
  // the squares of the values written (read), in a thread-independent order.
  double* sumsq = nullptr;
};

HealthPlan plan_flatten_scale_ex(
    at::TensorList tensors,
    const at::Tensor& out,
    const std::optional<at::Tensor>& scale_by,
    const std::optional<at::Tensor>& nonfinite);
HealthPlan plan_unflatten_scale_ex(
    const at::Tensor& flat,
    at::TensorList tensors,
    const std::optional<at::Tensor>& sumsq);
HealthPlan plan_sum_of_squares(at::TensorList tensors, const at::Tensor& out);
// flatten_accumulate: plan_segments' pack into a prefix of out (FlatFit::kPrefix)
// and the optional flag (segments and nonfinite set; the rest unused).
HealthPlan plan_flatten_accumulate(
    at::TensorList tensors,
    const at::Tensor& out,
    const std::optional<at::Tensor>& nonfinite);

// sum_chunks: the argument checks (csrc/ops.cpp), raised before anything is written.
void check_sum_chunks(const at::Tensor& chunks, const at::Tensor& out);

// CPU inner loop: copies n elements from src to dst, multiplied by scale and cast.
using CopyFn = void (*)(const void* src, void* dst, int64_t n, double scale);

// CPU copies of the health ops (cpu/copy_scale.h): the same values and bits
// as a CopyFn with the same scale, and what they stored observed on the way:
// the float64 sum of the squares, in a fixed order that depends on n and the
// values only (element i goes to lane i % 32, lanes added in a fixed tree), or
// whether any is NaN or +-Inf. A null dst reads only (the source's own values
// at a scale of 1: sum_of_squares).
using CopySumSqFn = double (*)(const void* src, void* dst, int64_t n, double scale);
using CopyCheckFn = bool (*)(const void* src, void* dst, int64_t n, double scale);
struct HealthFns {
  CopyFn copy;
  CopySumSqFn copy_sumsq;
  CopyCheckFn copy_check;
};

// CPU accumulation (cpu/copy_scale.h, flatten_accumulate): for i < n,
// dst[i] = D(fma(M(src[i]), M(scale), M(dst[i]))), one fused multiply-add in
// M = float (double when either side is double), the exact value rounded once
// to M, then cast to the destination dtype D. The checked variant also returns
// whether any value it stored is NaN or +-Inf. No non-temporal stores: the
// destination's lines are read anyway.
using AccumulateFn = void (*)(const void* src, void* dst, int64_t n, double scale);
using AccumulateCheckFn = bool (*)(const void* src, void* dst, int64_t n, double scale);
struct AccumulateFns {
  AccumulateFn accumulate;
  AccumulateCheckFn accumulate_check;
};

// CPU sum of received chunks (cpu/copy_scale.h, sum_chunks): for the columns
// begin <= i < end of a [rows, n] 16-bit array, out[i] = float(scale * (in[0][i]
// + ... + in[rows-1][i])), the adds and the multiply in double in row order,
// stored as float32 or rounded once more to the input's 16-bit dtype.
using SumChunksFn = void (*)(const void* in, void* out, int64_t rows, int64_t n, int64_t begin, int64_t end, double scale);

// The build of the CPU inner loops in use (cpu/cpu_isa.cpp): the best this CPU
// runs, or the one FASTCOLL_CPU_ISA names ("default", "avx2", "avx512bf16";
// a name the CPU cannot run is an error). Read once, at the first call.
enum class CpuIsa { kDefault = 0, kAvx2 = 1, kAvx512Bf16 = 2 };
CpuIsa cpu_isa();
const char* cpu_isa_name(CpuIsa isa);

// Declares a function of every build of the CPU inner loops (cpu_default,
// cpu_avx2, cpu_avx512bf16: cpu/copy_scale.h); FASTCOLL_CALL_CPU_BUILD(fn, args)
// calls the one of the build cpu_isa() selects.
#define FASTCOLL_IN_EACH_CPU_BUILD(...)  \
  namespace cpu_default {                \
  __VA_ARGS__;                           \
  }                                      \
  namespace cpu_avx2 {                   \
  __VA_ARGS__;                           \
  }                                      \
  namespace cpu_avx512bf16 {             \
  __VA_ARGS__;                           \
  }
#define FASTCOLL_CALL_CPU_BUILD(fn, ...)                                                \
  (::fastcoll::cpu_isa() == ::fastcoll::CpuIsa::kAvx512Bf16 ? cpu_avx512bf16::fn(__VA_ARGS__) \
   : ::fastcoll::cpu_isa() == ::fastcoll::CpuIsa::kAvx2     ? cpu_avx2::fn(__VA_ARGS__)       \
                                                            : cpu_default::fn(__VA_ARGS__))

// CPU calls that write at least this many bytes use non-temporal (cache-
// bypassing) stores. Set once at load by fastcoll/ops/stores.py (the machine's
// cache, or FASTCOLL_CPU_STREAM_MIN_BYTES); 16 MiB until then.
int64_t cpu_stream_min_bytes();
void set_cpu_stream_min_bytes(int64_t nbytes);

// A shape or strides as Python prints a tuple: "(2, 3)", "(4,)", "()" (error messages).
std::string shape_str(at::IntArrayRef a);

// Small integer code of a supported dtype: its row in FASTCOLL_FOR_EACH_DTYPE
// (dtypes.h). Only for dtypes plan_segments accepted.
int dtype_code(at::ScalarType t);

}  // namespace fastcoll
