// Shared declarations for fastcoll's fused multi-tensor ops.
//
// Both ops reduce to the same work: a list of segments, each a run of `numel`
// consecutive elements copied from one address to another, multiplied by a
// scale and cast between floating dtypes. The argument checks and the segment
// plan are device-independent (csrc/ops.cpp); each device file only runs a plan.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
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

// Checks the arguments of flatten_scale (pack=true: tensors -> flat) or
// unflatten_scale (pack=false: flat -> tensors) and returns the segments in
// flat order. Throws (ValueError/TypeError/RuntimeError, naming the culprit,
// prefixed "fastcoll.flatten_scale: " or "fastcoll.unflatten_scale: ") before
// anything is written.
std::vector<Segment> plan_segments(
    at::TensorList tensors,
    const at::Tensor& flat,
    bool pack);

// CPU inner loop: copies n elements from src to dst, multiplied by scale and cast.
using CopyFn = void (*)(const void* src, void* dst, int64_t n, double scale);

// CPU calls that write at least this many bytes use non-temporal (cache-
// bypassing) stores; FASTCOLL_CPU_STREAM_MIN_BYTES sets the initial value.
int64_t cpu_stream_min_bytes();
void set_cpu_stream_min_bytes(int64_t nbytes);

// Small integer code of a supported dtype: its row in FASTCOLL_FOR_EACH_DTYPE
// (dtypes.h). Only for dtypes plan_segments accepted.
int dtype_code(at::ScalarType t);

}  // namespace fastcoll
