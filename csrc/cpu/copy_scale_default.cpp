// Baseline-ISA build of the CPU inner loops (see copy_scale.h).
#define FASTCOLL_CPU_NS cpu_default
#include "cpu/copy_scale.h"
