// AVX2+FMA+F16C build of the CPU inner loops (see copy_scale.h). Only called
// after a run-time check that the CPU has these extensions.
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx2,fma,f16c")
// g++ (unlike gcc) does not define the ISA macros for a target pragma, and the
// vector headers (ATen's, sleef's) select their AVX2 code by those macros.
#ifndef __AVX__
#define __AVX__ 1
#endif
#ifndef __AVX2__
#define __AVX2__ 1
#endif
#ifndef __FMA__
#define __FMA__ 1
#endif
#ifndef __F16C__
#define __F16C__ 1
#endif
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#define FASTCOLL_CPU_NS cpu_avx2
#include "cpu/copy_scale.h"
#else
// Other architectures: the "AVX2" entry point is the baseline build.
#define FASTCOLL_CPU_NS cpu_avx2
#include "cpu/copy_scale.h"
#endif
