"""Finding the tools a build needs (C++ compiler, nvcc, ninja) and the build's environment.

Nothing here runs a compiler: these checks are cheap enough for every import.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Dict, Optional

from . import spec
from .errors import ExtensionUnavailable


def cxx() -> str:
    """The C++ compiler torch.utils.cpp_extension uses: ``$CXX``, else ``c++``."""
    return os.environ.get("CXX") or "c++"


def find_cxx() -> str:
    """The C++ compiler's path.

    Raises:
        ExtensionUnavailable: It is not installed (or ``$CXX`` names nothing runnable).
    """
    path = shutil.which(cxx())
    if path is None:
        raise ExtensionUnavailable(
            f"no C++ compiler: `{cxx()}` was not found on PATH",
            "Install one (e.g. `apt install g++`, `conda install gxx`) or set CXX to it, then import fastcoll again "
            "or run `python -m fastcoll.extension`",
        )
    return path


def cuda_home() -> Optional[str]:
    """The CUDA toolkit, found as torch.utils.cpp_extension finds it (without importing it: that imports setuptools).

    Returns:
        ``$CUDA_HOME`` or ``$CUDA_PATH``, else the folder above the ``nvcc`` on PATH, else
        ``/usr/local/cuda`` if it exists, else None.
    """
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    nvcc = shutil.which("nvcc")
    if nvcc is not None:
        return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    return "/usr/local/cuda" if os.path.isdir("/usr/local/cuda") else None


def nvcc(home: Optional[str]) -> Optional[str]:
    """``home/bin/nvcc`` if it exists."""
    path = os.path.join(home, "bin", "nvcc") if home else None
    return path if path and os.path.exists(path) else None


def cuda_archs() -> str:
    """``$TORCH_CUDA_ARCH_LIST``, else the architectures the ahead-of-time build uses."""
    return os.environ.get("TORCH_CUDA_ARCH_LIST") or spec.DEFAULT_CUDA_ARCHS


def max_jobs() -> int:
    """Parallel compile jobs: ``$MAX_JOBS``, else the CPUs this process may use, at most 8."""
    value = os.environ.get("MAX_JOBS", "").strip()
    if value:
        try:
            return max(1, int(value))
        except ValueError:
            raise ValueError(f"fastcoll: MAX_JOBS={value!r} is not an integer") from None
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover (not Linux)
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


def build_env(with_cuda: bool, home: Optional[str], archs: str) -> Dict[str, str]:
    """The environment of the build process.

    The ``ninja`` that fastcoll depends on lives in the environment's scripts folder, which is
    not on PATH when the interpreter is run without activating its venv ("Ninja is required"):
    both it and the ninja package's own folder go first on PATH.
    """
    env = dict(os.environ)
    paths = [os.path.dirname(sys.executable)]
    try:
        import ninja  # the PyPI package: its binary's folder

        paths.append(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    env["PATH"] = os.pathsep.join(paths + [env.get("PATH", "")])
    env["MAX_JOBS"] = str(max_jobs())
    if with_cuda:
        env["CUDA_HOME"] = home or ""
        env["TORCH_CUDA_ARCH_LIST"] = archs
    return env
