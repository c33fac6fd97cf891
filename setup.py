"""Build script for fastcoll and its C++/CUDA extension (fastcoll._C).

Two kinds of build, told apart by whether torch can be imported here:

* torch importable (``pip install --no-build-isolation [-e] .``, ``setup.py
  build_ext``): the extension is compiled now, against that torch. The CPU
  kernels are always built; the CUDA kernels when torch has CUDA and nvcc is
  found (CUDA_HOME); FASTCOLL_CUDA=0/1 forces the choice.
* torch not importable (plain ``pip install .``, ``pip install <sdist>``,
  ``uv pip install .``: build isolation hides the environment's torch, and
  building against whatever torch an index hands out would break the C++ ABI):
  nothing is compiled. ``import fastcoll`` compiles the extension once against
  the torch it runs with and caches it (fastcoll/extension/).

Either way the wheel carries the sources, csrc/, as fastcoll/_csrc with their
hash (fastcoll/extension/spec.py: MANIFEST), so that an installation can always
compile for the torch it meets. FASTCOLL_AOT=0 skips the compile even when
torch is importable; FASTCOLL_AOT=1 makes a missing torch an error.
"""

import importlib.util
import json
import os
import shutil
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(HERE, "csrc")


def _load_spec():
    # fastcoll/extension/spec.py by path: importing the package would import torch and compile.
    path = os.path.join(HERE, "fastcoll", "extension", "spec.py")
    loaded = importlib.util.spec_from_file_location("_fastcoll_build_spec", path)
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module


spec = _load_spec()


class BuildPyWithSources(build_py):
    """build_py that also puts csrc/ into the package as fastcoll/_csrc, with its hash."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install compiles from the checkout's csrc/ (fastcoll/extension/key.py)
        target = os.path.join(self.build_lib, "fastcoll", "_csrc")
        shutil.rmtree(target, ignore_errors=True)
        for rel in spec.source_files(CSRC):
            dest = os.path.join(target, rel)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copyfile(os.path.join(CSRC, rel), dest)
        with open(os.path.join(target, spec.MANIFEST), "w") as f:
            json.dump({"sha256": spec.sources_hash(CSRC), "files": spec.source_files(CSRC)}, f, indent=1)


def _torch_or_none():
    mode = os.environ.get("FASTCOLL_AOT", "").strip()
    if mode == "0":
        return None
    try:
        import torch
    except ImportError:
        if mode == "1":
            sys.exit(
                "fastcoll: FASTCOLL_AOT=1 but torch cannot be imported here; install torch first "
                "(e.g. `pip install torch==2.13.0`), then `pip install --no-build-isolation .`"
            )
        print(
            "fastcoll: torch is not importable in this build environment (an isolated build): the wheel carries "
            "the C++/CUDA sources, which `import fastcoll` compiles once against the installed torch "
            "(or run `python -m fastcoll.extension`); for a build now, `pip install --no-build-isolation .`",
            flush=True,
        )
        return None
    return torch


def _want_cuda(torch, cuda_home) -> bool:
    forced = os.environ.get("FASTCOLL_CUDA")
    has_nvcc = cuda_home is not None and (
        os.path.exists(os.path.join(cuda_home, "bin", "nvcc")) or shutil.which("nvcc") is not None
    )
    if forced is not None and forced != "":
        if forced == "1" and (torch.version.cuda is None or not has_nvcc):
            sys.exit(
                f"fastcoll: FASTCOLL_CUDA=1 but torch.version.cuda={torch.version.cuda} and "
                f"CUDA_HOME={cuda_home}; install a CUDA build of torch and set CUDA_HOME to the toolkit"
            )
        return forced == "1"
    return torch.version.cuda is not None and has_nvcc


def _extension_and_command(torch):
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    use_cuda = _want_cuda(torch, CUDA_HOME)
    sources = sorted(os.path.join("csrc", s) for s in spec.compiled_sources(CSRC, with_cuda=False))
    if use_cuda:
        cpu_only = set(spec.compiled_sources(CSRC, with_cuda=False))
        sources += [os.path.join("csrc", s) for s in spec.compiled_sources(CSRC, with_cuda=True) if s not in cpu_only]
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", spec.DEFAULT_CUDA_ARCHS)
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST") if use_cuda else None
    define_macros = [("FASTCOLL_COMPILER", f'"{spec.compiler_name(os.environ.get("CXX", "c++"))}"')]
    define_macros += spec.defines(use_cuda, archs)
    extra = {"cxx": list(spec.CXX_FLAGS)}
    if use_cuda:
        extra["nvcc"] = list(spec.NVCC_FLAGS)
    print(
        "fastcoll build configuration:\n"
        f"  torch           {torch.__version__} (cuda {torch.version.cuda})\n"
        f"  CUDA kernels    {'yes' if use_cuda else 'no'}"
        + (f" (CUDA_HOME={CUDA_HOME}, TORCH_CUDA_ARCH_LIST={archs})" if use_cuda else "")
        + f"\n  sources         {len(sources)} files\n",
        flush=True,
    )
    ext = (CUDAExtension if use_cuda else CppExtension)(
        name="fastcoll._C",
        sources=sources,
        include_dirs=[CSRC],
        define_macros=define_macros,
        extra_compile_args=extra,
        extra_link_args=list(spec.LD_FLAGS),
    )

    class BuildExtensionWithRecord(BuildExtension):
        """Also writes, beside the library, the torch it was built for (fastcoll/ops/loader.py reads it)."""

        def run(self):
            super().run()  # builds into build_lib, then copies into the tree if --inplace (or editable)
            inplace, self.inplace = self.inplace, False
            outputs = [self.get_ext_fullpath(e.name) for e in self.extensions]
            self.inplace = inplace
            if inplace:
                outputs += [self.get_ext_fullpath(e.name) for e in self.extensions]
            record = {
                "torch": torch.__version__,
                "torch_git": torch.version.git_version,
                "torch_cuda": torch.version.cuda,
                "cuda_kernels": use_cuda,
                "sources": spec.sources_hash(CSRC),  # an edit of csrc/ makes the import compile anew
            }
            for path in outputs:
                if os.path.exists(path):
                    with open(os.path.join(os.path.dirname(path), "_C.build.json"), "w") as f:
                        json.dump(dict(record, size=os.path.getsize(path)), f, indent=1)

    return ext, BuildExtensionWithRecord.with_options(use_ninja=True)


cmdclass = {"build_py": BuildPyWithSources}
ext_modules = []
_torch = _torch_or_none()
if _torch is not None:
    _ext, cmdclass["build_ext"] = _extension_and_command(_torch)
    ext_modules.append(_ext)

setup(ext_modules=ext_modules, cmdclass=cmdclass)
