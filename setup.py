"""Build script for fastcoll's C++/CUDA extension (fastcoll._C).

The CPU kernels are always built. The CUDA kernels are built when the
installed torch has CUDA and nvcc is found (CUDA_HOME); FASTCOLL_CUDA=0/1
forces the choice. Build with ``pip install --no-build-isolation -e .`` so the
extension is compiled against the torch already in the environment.
"""

import glob
import os
import shutil
import sys

from setuptools import setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError:  # pragma: no cover
    sys.exit(
        "fastcoll: torch must be installed before building fastcoll "
        "(e.g. `pip install torch==2.13.0`), then `pip install --no-build-isolation .`"
    )

HERE = os.path.dirname(os.path.abspath(__file__))


def _want_cuda() -> bool:
    forced = os.environ.get("FASTCOLL_CUDA")
    has_nvcc = CUDA_HOME is not None and (
        os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")) or shutil.which("nvcc") is not None
    )
    if forced is not None and forced != "":
        if forced == "1" and (torch.version.cuda is None or not has_nvcc):
            sys.exit(
                f"fastcoll: FASTCOLL_CUDA=1 but torch.version.cuda={torch.version.cuda} and "
                f"CUDA_HOME={CUDA_HOME}; install a CUDA build of torch and set CUDA_HOME to the toolkit"
            )
        return forced == "1"
    return torch.version.cuda is not None and has_nvcc


def _extension():
    use_cuda = _want_cuda()
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")) + glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    # torch.utils.cpp_extension picks the C++ standard its headers need. OpenMP
    # is what makes at::parallel_for parallel (without it, it runs serially);
    # at run time the process shares torch's own libgomp.
    cxx_flags = ["-O3", "-fopenmp"]
    define_macros = [("FASTCOLL_COMPILER", f'"{_compiler_name()}"')]
    if use_cuda:
        sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        # sm_80 and sm_90 machine code, plus sm_90 PTX that the driver compiles
        # (JIT) for newer GPUs, which have no machine code here.
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
        define_macros += [
            ("FASTCOLL_WITH_CUDA", "1"),
            ("FASTCOLL_CUDA_ARCHS", f'"{os.environ["TORCH_CUDA_ARCH_LIST"]}"'),
        ]
        ext_cls = CUDAExtension
        extra = {"cxx": cxx_flags, "nvcc": ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]}
    else:
        ext_cls = CppExtension
        extra = {"cxx": cxx_flags}
    print(
        "fastcoll build configuration:\n"
        f"  torch           {torch.__version__} (cuda {torch.version.cuda})\n"
        f"  CUDA kernels    {'yes' if use_cuda else 'no'}"
        + (f" (CUDA_HOME={CUDA_HOME}, TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']})" if use_cuda else "")
        + f"\n  sources         {len(sources)} files\n",
        flush=True,
    )
    return ext_cls(
        name="fastcoll._C",
        sources=sources,
        include_dirs=[os.path.join(HERE, "csrc")],
        define_macros=define_macros,
        extra_compile_args=extra,
        extra_link_args=["-fopenmp"],
    )


def _compiler_name() -> str:
    cxx = os.environ.get("CXX", "c++")
    try:
        import subprocess

        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
        return out.splitlines()[0].replace('"', "'") if out else cxx
    except Exception:
        return cxx


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
