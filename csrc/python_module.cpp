// The Python module fastcoll._C. Importing it loads this shared library, whose
// static initializers run the TORCH_LIBRARY registrations of every op file.
#include <torch/csrc/utils/pybind.h>

#include <string>

#include "dtypes.h"
#include "fastcoll.h"

#ifdef FASTCOLL_WITH_CUDA
#include <cuda.h>
#endif

#ifndef FASTCOLL_COMPILER
#define FASTCOLL_COMPILER "unknown"
#endif

namespace fastcoll {
void bind_eager(py::module_& m);  // csrc/eager.cpp
}  // namespace fastcoll

namespace {

py::dict build_info() {
  py::dict info;
  info["extension"] = true;
  info["compiler"] = FASTCOLL_COMPILER;
  info["cpu_stream_min_bytes"] = fastcoll::cpu_stream_min_bytes();
  try {  // the build of the CPU inner loops that runs (cpu_isa.cpp); FASTCOLL_CPU_ISA may name one this CPU lacks
    info["cpu_isa"] = fastcoll::cpu_isa_name(fastcoll::cpu_isa());
  } catch (const c10::Error& e) {
    info["cpu_isa"] = std::string("error: ") + e.what_without_backtrace();
  }
  // The kernels' dtype table (dtypes.h), by name, in code order.
  py::list dtypes;
#define FASTCOLL_DTYPE_NAME(code, T, st, name) dtypes.append(name);
  FASTCOLL_FOR_EACH_DTYPE(FASTCOLL_DTYPE_NAME)
#undef FASTCOLL_DTYPE_NAME
  info["dtypes"] = dtypes;
#ifdef FASTCOLL_WITH_CUDA
  info["cuda_kernels"] = true;
  info["cuda_version"] = std::to_string(CUDA_VERSION / 1000) + "." + std::to_string((CUDA_VERSION % 1000) / 10);
  std::string archs = FASTCOLL_CUDA_ARCHS;
  py::list arch_list;
  size_t start = 0;
  while (start <= archs.size()) {
    size_t end = archs.find_first_of("; ", start);
    if (end == std::string::npos) end = archs.size();
    if (end > start) arch_list.append(archs.substr(start, end - start));
    start = end + 1;
  }
  info["cuda_arch_list"] = arch_list;
#else
  info["cuda_kernels"] = false;
  info["cuda_version"] = py::none();
  info["cuda_arch_list"] = py::list();
#endif
  return info;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastcoll's compiled kernels; importing this module registers torch.ops.fastcoll.*";
  m.def("build_info", &build_info, "How the extension was built");
  m.def("_cpu_stream_min_bytes", &fastcoll::cpu_stream_min_bytes,
        "CPU calls writing at least this many bytes use non-temporal stores");
  m.def("_set_cpu_stream_min_bytes", &fastcoll::set_cpu_stream_min_bytes,
        "Set the non-temporal store threshold of the CPU kernels (bytes written per call; tests use 0)");
  fastcoll::bind_eager(m);
}
