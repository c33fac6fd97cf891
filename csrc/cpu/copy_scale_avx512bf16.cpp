// The AVX2 build of the CPU inner loops (copy_scale.h) with its float ->
// bfloat16 conversions done by AVX-512 BF16 instructions. Only called after a
// run-time check that the CPU has AVX2, FMA, F16C, AVX-512 F/VL/BW/DQ and
// AVX-512 BF16 (cpu_isa.cpp).
//
// Every header is included, and so built, under the AVX2 target alone (as in
// copy_scale_avx2.cpp, but in an at::vec namespace of its own); the AVX-512
// target is switched on only for copy_scale.h's loops, defined after it. So
// no inline function that another file also emits (and the linker may pick
// for it) holds AVX-512 instructions: a CPU without them never runs one.
// tests/test_cpu_isa.py checks the built library for that.
#if defined(__x86_64__) || defined(__i386__)
#include "cpu/avx2_target.h"
#define CPU_CAPABILITY AVX2_BF16
#define CPU_CAPABILITY_AVX2
#include <immintrin.h>

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>

#include "dtypes.h"
#include "fastcoll.h"

#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512bf16")
#define FASTCOLL_AVX512BF16 1
#define FASTCOLL_CPU_NS cpu_avx512bf16
#include "cpu/copy_scale.h"
#else
// Other architectures: the entry point is the baseline build (never picked).
#define FASTCOLL_CPU_NS cpu_avx512bf16
#include "cpu/copy_scale.h"
#endif
