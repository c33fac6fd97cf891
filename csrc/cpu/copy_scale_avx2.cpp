// AVX2+FMA+F16C build of the CPU inner loops (see copy_scale.h). Only called
// after a run-time check that the CPU has these extensions.
#if defined(__x86_64__) || defined(__i386__)
#include "cpu/avx2_target.h"
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#define FASTCOLL_CPU_NS cpu_avx2
#include "cpu/copy_scale.h"
#else
// Other architectures: the "AVX2" entry point is the baseline build.
#define FASTCOLL_CPU_NS cpu_avx2
#include "cpu/copy_scale.h"
#endif
