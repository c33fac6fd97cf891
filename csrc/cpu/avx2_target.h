// Included first by the AVX2-based builds of the CPU inner loops
// (copy_scale_avx2.cpp, copy_scale_avx512bf16.cpp), on x86 only: every
// function after it is built for AVX2+FMA+F16C. g++ (unlike gcc) does not
// define the ISA macros for a target pragma, and the vector headers (ATen's,
// sleef's) select their AVX2 code by those macros, so they are defined here.
// The includer defines CPU_CAPABILITY (the at::vec namespace) and
// CPU_CAPABILITY_AVX2 itself.
#pragma once
#pragma GCC target("avx2,fma,f16c")
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
