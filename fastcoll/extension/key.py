"""What a build of the extension is for, and the cache key that names it.

The key covers everything that makes one build unusable in place of another:
the sources (a hash) and the build flags, torch's version and git hash, the
CUDA version the kernels are built for (or none), the Python version and ABI,
the C++ ABI flag, the machine and the CPU instruction-set builds, and the
compiler chosen by ``CXX``/``CC`` (by name: the key never runs a compiler).
Computing it reads a few small files and environment variables; in an
installed wheel the sources' hash comes from the manifest written when the
wheel was built, so an import never hashes the sources.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import os
import sys
from typing import Dict, NamedTuple, Optional, Tuple

import torch

from . import spec, toolchain
from .errors import ExtensionUnavailable

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../fastcoll


class Plan(NamedTuple):
    """One build: what it compiles, for what, and under which key."""

    csrc: str  #: the source directory
    with_cuda: bool  #: whether the CUDA kernels are built
    cuda_home: Optional[str]
    cuda_archs: Optional[str]
    cuda_missing: Optional[str]  #: why a CUDA torch gets no CUDA kernels (no nvcc), else None
    inputs: Dict[str, object]  #: everything the key covers
    key: str


def find_sources() -> str:
    """The extension's sources: ``fastcoll/_csrc`` in a wheel, else ``csrc/`` beside the package in a checkout.

    Raises:
        ExtensionUnavailable: Neither is there.
    """
    wheel = os.path.join(_PACKAGE, "_csrc")
    if os.path.isdir(wheel):
        return wheel
    checkout = os.path.join(os.path.dirname(_PACKAGE), "csrc")
    if os.path.isfile(os.path.join(checkout, "python_module.cpp")):
        return checkout
    raise ExtensionUnavailable(
        f"this installation of fastcoll ({_PACKAGE}) carries no C++ sources (no _csrc folder)",
        "Reinstall it from a wheel or sdist built by this version's setup.py (`pip install .`)",
    )


def hash_sources(csrc: str) -> str:
    """The sources' hash: from the wheel's manifest when it has one, else computed (a checkout: sources change)."""
    try:
        with open(os.path.join(csrc, spec.MANIFEST)) as f:
            return str(json.load(f)["sha256"])
    except (OSError, ValueError, KeyError):
        return spec.sources_hash(csrc)


def _cuda_choice() -> Tuple[bool, Optional[str], Optional[str]]:
    """(with_cuda, cuda_home, why the CUDA kernels are missing) for the running torch."""
    forced = os.environ.get("FASTCOLL_CUDA", "").strip()
    home = toolchain.cuda_home() if torch.version.cuda is not None and forced != "0" else None
    if forced == "1" and (torch.version.cuda is None or toolchain.nvcc(home) is None):
        raise ExtensionUnavailable(
            f"FASTCOLL_CUDA=1 but torch.version.cuda={torch.version.cuda} and nvcc was not found (CUDA_HOME={home})",
            "Install a CUDA build of torch and the CUDA toolkit (CUDA_HOME), or unset FASTCOLL_CUDA",
        )
    if torch.version.cuda is None or forced == "0":
        return False, None, None
    if toolchain.nvcc(home) is None:
        why = (
            f"torch {torch.__version__} is a CUDA build but nvcc was not found (CUDA_HOME={home}); "
            "install the CUDA toolkit (or `conda install cuda-nvcc`) and set CUDA_HOME to it for the CUDA kernels"
        )
        return False, None, why
    return True, home, None


def plan() -> Plan:
    """The build this process needs, and its key.

    Raises:
        ExtensionUnavailable: The package carries no sources, or FASTCOLL_CUDA=1 cannot be honoured.
    """
    csrc = find_sources()
    with_cuda, home, missing = _cuda_choice()
    archs = toolchain.cuda_archs() if with_cuda else None
    machine = os.uname().machine
    inputs: Dict[str, object] = {
        "sources": hash_sources(csrc),
        "flags": spec.flags(with_cuda, archs),
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "cuda": torch.version.cuda if with_cuda else None,
        "python": f"{sys.implementation.cache_tag}{importlib.machinery.EXTENSION_SUFFIXES[0]}",
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        "machine": machine,
        "cpu_isa_builds": list(spec.cpu_isa_builds(machine)),
        "compiler": [toolchain.cxx(), os.environ.get("CC")],
    }
    return Plan(csrc, with_cuda, home, archs, missing, inputs, make_key(inputs))


def make_key(inputs: Dict[str, object]) -> str:
    """A readable prefix (torch, Python, kernels) and a hash of all ``inputs``."""
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:20]
    kernels = f"cu{inputs['cuda']}" if inputs.get("cuda") else "cpu"
    return f"torch{inputs['torch']}-{sys.implementation.cache_tag}-{kernels}-{digest}"
