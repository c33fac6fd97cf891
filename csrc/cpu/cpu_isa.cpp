// Which build of the CPU inner loops (copy_scale.h) runs: the best one this
// CPU can execute, or a lower one if FASTCOLL_CPU_ISA asks for it (to compare
// builds, or to work around a problem). Every build stores the same values,
// bit for bit apart from NaN payloads (tests/test_cpu_isa.py).
#include <cstdlib>
#include <cstring>

#include <c10/util/Exception.h>

#include "fastcoll.h"

namespace fastcoll {
namespace {

CpuIsa best_supported() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (!avx2) return CpuIsa::kDefault;
  const bool bf16 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512bf16");
  return bf16 ? CpuIsa::kAvx512Bf16 : CpuIsa::kAvx2;
#else
  return CpuIsa::kDefault;
#endif
}

CpuIsa chosen() {
  const CpuIsa best = best_supported();
  const char* env = std::getenv("FASTCOLL_CPU_ISA");
  if (env == nullptr || *env == '\0') return best;
  for (CpuIsa isa : {CpuIsa::kDefault, CpuIsa::kAvx2, CpuIsa::kAvx512Bf16}) {
    if (std::strcmp(env, cpu_isa_name(isa)) == 0) {
      TORCH_CHECK(
          isa <= best, "fastcoll: FASTCOLL_CPU_ISA=", env, " asks for instructions this CPU lacks (the best it runs is ",
          cpu_isa_name(best), "); unset it or name a lower one: default, avx2");
      return isa;
    }
  }
  TORCH_CHECK(false, "fastcoll: FASTCOLL_CPU_ISA=", env, " is not one of default, avx2, avx512bf16; unset it to use the best (",
              cpu_isa_name(best), ")");
}

}  // namespace

CpuIsa cpu_isa() {
  static const CpuIsa isa = chosen();
  return isa;
}

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512Bf16:
      return "avx512bf16";
    case CpuIsa::kAvx2:
      return "avx2";
    default:
      return "default";
  }
}

}  // namespace fastcoll
