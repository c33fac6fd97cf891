"""What fastcoll's extension is compiled from: its sources and flags.

One description shared by the ahead-of-time build (setup.py, which loads this
file by path: it imports neither torch nor fastcoll) and the build at first
import (fastcoll.extension), so the two compile the same thing the same way.

The CPU inner loops come in several instruction-set builds (default, AVX2,
AVX-512 BF16); they are selected inside the sources by target pragmas
(csrc/cpu/avx2_target.h), not by per-file flags, and only on x86: which builds
exist depends on the machine, and the cache key records it.
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Dict, List, Optional, Tuple

#: The module's name inside the package: fastcoll._C (PYBIND11_MODULE(TORCH_EXTENSION_NAME)).
NAME = "_C"
CXX_FLAGS: Tuple[str, ...] = ("-O3", "-fopenmp")  # OpenMP: at::parallel_for is serial without it
#: What the ahead-of-time build also gets from Python's own compile flags (setuptools adds sysconfig's
#: CFLAGS, e.g. "-DNDEBUG -g -fwrapv -O3 -Wall"): the build at import adds them so both compile the same
#: code (NDEBUG turns off torch's debug-only checks). Not -g: a 30 MB library instead of 1.3 MB.
JIT_CXX_FLAGS: Tuple[str, ...] = ("-DNDEBUG", "-fwrapv")
NVCC_FLAGS: Tuple[str, ...] = ("-O3", "--expt-relaxed-constexpr", "-lineinfo")
#: -l:libstdc++.so.6: the C++ runtime's shared library, by file name, whatever the compiler driver links
#: by default. The H200 image's g++ wrapper resolved libstdc++ (even an explicit -lstdc++) to the static
#: archive; the second C++ runtime inside the extension, beside the one python and torch load, crashed
#: every error message that formatted a number (SIGSEGV in std::ostream's integer insertion).
LD_FLAGS: Tuple[str, ...] = ("-fopenmp",) + (("-l:libstdc++.so.6",) if sys.platform.startswith("linux") else ())
#: sm_80 and sm_90 machine code, plus sm_90 PTX that the driver compiles for newer GPUs.
DEFAULT_CUDA_ARCHS = "8.0;9.0+PTX"
#: Files of the source tree that a build reads (compiled or included); their hash is part of the key.
SOURCE_SUFFIXES: Tuple[str, ...] = (".cpp", ".cu", ".h", ".cuh")
#: Written beside the sources in a wheel (fastcoll/_csrc): their hash, so an import never hashes them.
MANIFEST = "SOURCES.json"


def compiled_sources(csrc: str, with_cuda: bool) -> List[str]:
    """The translation units of the extension.

    Args:
        csrc: The source directory (the repository's ``csrc/`` or a wheel's ``fastcoll/_csrc/``).
        with_cuda: Whether the CUDA kernels (``cuda/*.cu``, and their host side ``cuda/*.cpp``) are built.

    Returns:
        Paths relative to ``csrc``, sorted: ``*.cpp``, ``cpu/*.cpp``, then ``cuda/*.cpp`` and ``cuda/*.cu``.
    """
    groups = [("", ".cpp"), ("cpu", ".cpp")] + ([("cuda", ".cpp"), ("cuda", ".cu")] if with_cuda else [])
    out: List[str] = []
    for sub, suffix in groups:
        folder = os.path.join(csrc, sub)
        names = sorted(n for n in os.listdir(folder) if n.endswith(suffix)) if os.path.isdir(folder) else []
        out += [os.path.join(sub, n) if sub else n for n in names]
    stems = [os.path.splitext(os.path.basename(p))[0] + (".cu" if p.endswith(".cu") else "") for p in out]
    if len(set(stems)) != len(stems):  # the JIT build names each object file after its source's base name
        raise ValueError(f"fastcoll: two sources share a base name in {csrc}: {sorted(out)}")
    return out


def source_files(csrc: str) -> List[str]:
    """Every file a build reads, relative to ``csrc``, sorted (POSIX separators)."""
    found = []
    for root, dirs, files in os.walk(csrc):
        dirs.sort()
        rel = os.path.relpath(root, csrc)
        for name in sorted(files):
            if name.endswith(SOURCE_SUFFIXES):
                found.append(name if rel == "." else f"{rel}/{name}".replace(os.sep, "/"))
    return found


def sources_hash(csrc: str) -> str:
    """SHA-256 over the names and contents of :func:`source_files`."""
    h = hashlib.sha256()
    for rel in source_files(csrc):
        with open(os.path.join(csrc, rel), "rb") as f:
            data = f.read()
        h.update(f"{rel}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def defines(with_cuda: bool, cuda_archs: Optional[str]) -> List[Tuple[str, str]]:
    """Preprocessor definitions, apart from FASTCOLL_COMPILER (added when compiling: it needs the compiler)."""
    if not with_cuda:
        return []
    return [("FASTCOLL_WITH_CUDA", "1"), ("FASTCOLL_CUDA_ARCHS", f'"{cuda_archs}"')]


def cpu_isa_builds(machine: str) -> Tuple[str, ...]:
    """The builds of the CPU inner loops compiled in on ``machine`` (``os.uname().machine``)."""
    x86 = machine.lower() in ("x86_64", "amd64", "i386", "i686")
    return ("default", "avx2", "avx512bf16") if x86 else ("default",)


def flags(with_cuda: bool, cuda_archs: Optional[str]) -> Dict[str, object]:
    """Everything about the build's flags that the cache key must cover."""
    return {
        "cxx": list(CXX_FLAGS + JIT_CXX_FLAGS),
        "nvcc": list(NVCC_FLAGS) if with_cuda else None,
        "ld": list(LD_FLAGS),
        "defines": defines(with_cuda, cuda_archs),
        "cuda_archs": cuda_archs if with_cuda else None,
    }


def compiler_name(cxx: str) -> str:
    """The first line of ``cxx --version`` (recorded in the library as FASTCOLL_COMPILER), else ``cxx``."""
    import subprocess

    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return cxx
    return out.splitlines()[0].replace('"', "'") if out.strip() else cxx
