"""Loads the compiled extension, or registers the pure-PyTorch fallback.

Either way, after import every op of SCHEMAS (``torch.ops.fastcoll.flatten_scale``,
``unflatten_scale``, ``flatten_scale_ex``, ``unflatten_scale_ex``,
``sum_of_squares``, ``checksum``, ``sum_chunks``) exists with the same schema, so the rest of the package
never needs to know which implementation is active. An extension built from
older sources that lacks some of them gets the reference for those (listed in
REFERENCE_OPS, with a warning) rather than failing to import.

Where the extension comes from, in order (``ORIGIN`` records which):

1. ``fastcoll/_C*.so`` built ahead of time (``pip install --no-build-isolation``,
   ``setup.py build_ext``), unless its record (``_C.build.json``, written by
   setup.py) says it was built for another torch, or from other sources than
   the ones beside the package (a checkout edited after ``pip install -e .``);
2. the build cache (fastcoll/extension/): a build for this torch, Python and these
   sources, compiled at first import if there is none. The compile happens at
   import rather than at an op's first call because the ops are registered
   once, by whichever implementation loads (the compiled library's
   TORCH_LIBRARY block or the reference's): the choice cannot wait. It also
   keeps a minutes-long compile out of a training step, where collectives
   would time out on the ranks that did not compile;
3. the pure-PyTorch reference ops, with one warning naming the cause and its fix
   (``FASTCOLL_REQUIRE_EXT=1`` makes that an ImportError).

``FASTCOLL_NO_EXT=1`` goes straight to 3; ``FASTCOLL_JIT=0`` skips 2 (neither
compiles nor reads the cache: the behaviour before the cache existed).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import sys
import time
import warnings
from types import ModuleType
from typing import Optional, Tuple

import torch

from . import stores

# The schemas, shared by the C++ TORCH_LIBRARY block (csrc/ops.cpp) and the
# Python fallback below. Keep the two in sync; tests/test_ops.py checks it.
SCHEMAS = {
    "flatten_scale": "flatten_scale(Tensor[] tensors, Tensor(a!) out, float scale=1.0) -> ()",
    "unflatten_scale": "unflatten_scale(Tensor flat, Tensor(a!)[] tensors, float scale=1.0) -> ()",
    "flatten_scale_ex": (
        "flatten_scale_ex(Tensor[] tensors, Tensor(a!) out, float scale=1.0, Tensor? scale_by=None, "
        "Tensor(b!)? nonfinite=None) -> ()"
    ),
    "unflatten_scale_ex": (
        "unflatten_scale_ex(Tensor flat, Tensor(a!)[] tensors, float scale=1.0, Tensor(b!)? sumsq=None) -> ()"
    ),
    "sum_of_squares": "sum_of_squares(Tensor[] tensors, Tensor(a!) out) -> ()",
    "flatten_accumulate": (
        "flatten_accumulate(Tensor[] tensors, Tensor(a!) out, float scale=1.0, Tensor(b!)? nonfinite=None) -> ()"
    ),
    "checksum": "checksum(Tensor[] tensors) -> Tensor",
    "sum_chunks": "sum_chunks(Tensor chunks, Tensor(a!) out, float scale=1.0) -> ()",
}

_C: Optional[ModuleType] = None
FALLBACK_REASON: Optional[str] = None
#: Ops served by the reference although the extension is loaded (it was built
#: from sources that predate them); empty after a fresh build.
REFERENCE_OPS: Tuple[str, ...] = ()
_fallback_lib = None
_cuda_fallback_lib = None

AHEAD_OF_TIME = "ahead of time"
#: How the extension was had: AHEAD_OF_TIME, "compiled at import", "cache hit"; None: the reference.
ORIGIN: Optional[str] = None
#: The loaded library's path, and its cache key when it came from the cache.
EXT_PATH: Optional[str] = None
CACHE_KEY: Optional[str] = None
#: Why a CUDA torch has no CUDA kernels (nvcc was missing); CUDA tensors then take the reference.
CUDA_MISSING: Optional[str] = None
#: setup.py writes this beside the library it builds: the torch it was built for.
AOT_RECORD = "_C.build.json"
#: Seconds spent finding (or compiling) the cached build, the library's loading aside.
LOOKUP_SECONDS: Optional[float] = None


def _register_reference(names, kind: str = "DEF") -> None:
    global _fallback_lib
    from . import reference

    lib = torch.library.Library("fastcoll", kind)
    for name in names:
        lib.define(SCHEMAS[name])
        lib.impl(name, getattr(reference, name), "CompositeExplicitAutograd")
    _fallback_lib = lib  # the registrations live as long as this object


def _defined(name: str) -> bool:
    try:
        getattr(torch.ops.fastcoll, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip() not in ("", "0")


def _aot_mismatch(path: str) -> Optional[str]:
    """Why the ahead-of-time library at ``path`` was built for another torch (its record says so), else None."""
    try:
        with open(os.path.join(os.path.dirname(path), AOT_RECORD)) as f:
            record = json.load(f)
        if record.get("size") != os.path.getsize(path):
            return None  # the record describes another file (the library was replaced): no verdict
    except (OSError, ValueError, AttributeError):
        return None
    if (record.get("torch"), record.get("torch_git")) != (torch.__version__, torch.version.git_version):
        return f"the ahead-of-time build {path} is for torch {record.get('torch')}, not {torch.__version__}"
    built_from = record.get("sources")
    if built_from is not None:
        from ..extension import key
        from ..extension.errors import ExtensionUnavailable

        try:
            csrc = key.find_sources()
            now = key.hash_sources(csrc)
        except (ExtensionUnavailable, OSError):
            return None  # no sources to compare with: the record's torch is all there is to check
        if now != built_from:
            return f"the ahead-of-time build {path} was compiled from other sources than {csrc} (edited since)"
    return None


def _load_ahead_of_time() -> Tuple[Optional[ModuleType], Optional[str]]:
    """fastcoll._C built by setup.py, or None and why it is not usable (None: there is none).

    Looked for in this package's own folder only: an import hook of another installation (an
    editable install of another checkout) must not lend its build to this one.
    """
    package = sys.modules[__package__.rpartition(".")[0]]
    found = importlib.machinery.PathFinder.find_spec(f"{package.__name__}._C", list(package.__path__))
    if found is None or not found.origin:
        return None, None
    mismatch = _aot_mismatch(found.origin)
    if mismatch:
        return None, mismatch
    try:
        return _import_library(found.origin), None  # loading the library runs its TORCH_LIBRARY registrations
    except ImportError as exc:  # built against another torch
        return None, f"the ahead-of-time build {found.origin} could not be imported ({exc})"


def _import_library(path: str) -> ModuleType:
    """Import the library at ``path`` as fastcoll._C."""
    name = f"{__package__.rpartition('.')[0]}._C"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)  # the dlopen: runs the TORCH_LIBRARY registrations
    spec.loader.exec_module(module)
    sys.modules[name] = module
    sys.modules[name.rpartition(".")[0]]._C = module
    return module


def _load_from_cache() -> ModuleType:
    """The extension from the build cache, compiled into it first if needed (fastcoll.extension.jit)."""
    global ORIGIN, EXT_PATH, CACHE_KEY, CUDA_MISSING, LOOKUP_SECONDS
    from ..extension import jit

    start = time.perf_counter()
    got = jit.ensure()
    LOOKUP_SECONDS = time.perf_counter() - start  # on a cache hit: what the cache adds to the import
    try:
        module = _import_library(got.path)
    except ImportError:  # replaced while this process looked (`python -m fastcoll.extension --force`): load what is there now
        got = jit.ensure()
        try:
            module = _import_library(got.path)
        except ImportError:  # damaged, though its size is right: build it again, once
            got = jit.ensure(force=True)
            module = _import_library(got.path)
    ORIGIN, EXT_PATH, CACHE_KEY, CUDA_MISSING = got.how, got.path, got.plan.key, got.plan.cuda_missing
    return module


def _running_build_cli() -> bool:
    """Whether this process is ``python -m fastcoll.extension``, which compiles itself (and reports how it went)."""
    argv = list(getattr(sys, "orig_argv", []))
    return any(a == "-m" and b == "fastcoll.extension" for a, b in zip(argv, argv[1:])) or "-mfastcoll.extension" in argv


def _load() -> None:
    global _C, FALLBACK_REASON, REFERENCE_OPS, ORIGIN, EXT_PATH
    quiet = False
    if _flag("FASTCOLL_NO_EXT"):
        FALLBACK_REASON = "FASTCOLL_NO_EXT is set"
    else:
        _C, why_not = _load_ahead_of_time()
        if _C is not None:
            ORIGIN, EXT_PATH = AHEAD_OF_TIME, getattr(_C, "__file__", None)
        elif os.environ.get("FASTCOLL_JIT", "1").strip() == "0":
            FALLBACK_REASON = (why_not or "there is no ahead-of-time build (fastcoll._C)") + " and FASTCOLL_JIT=0"
        elif _running_build_cli():
            FALLBACK_REASON, quiet = "this process is python -m fastcoll.extension", True
        else:
            try:
                _C = _load_from_cache()
            except Exception as exc:  # ExtensionUnavailable: no compiler, a compile error...; or anything else
                if _flag("FASTCOLL_REQUIRE_EXT"):
                    raise ImportError(f"fastcoll: FASTCOLL_REQUIRE_EXT=1, but {exc}") from exc
                FALLBACK_REASON = str(exc) if why_not is None else f"{why_not}; and {exc}"
    stores.apply(_C)  # the CPU kernels' streaming-store threshold, from the machine or the override
    if _C is None:
        if _flag("FASTCOLL_REQUIRE_EXT") and not quiet and not _flag("FASTCOLL_NO_EXT"):
            raise ImportError(f"fastcoll: FASTCOLL_REQUIRE_EXT=1, but {FALLBACK_REASON}")
        if not quiet:
            warnings.warn(
                f"fastcoll: using the pure-PyTorch reference ops (correct, not fused) because {FALLBACK_REASON}. "
                "FASTCOLL_REQUIRE_EXT=1 makes this an error.",
                RuntimeWarning,
                stacklevel=3,
            )
        _register_reference(SCHEMAS)
        return
    REFERENCE_OPS = tuple(name for name in SCHEMAS if not _defined(name))
    if REFERENCE_OPS:
        warnings.warn(
            f"fastcoll: the compiled extension has no {', '.join(REFERENCE_OPS)} (it was built from older "
            "sources); using the pure-PyTorch reference for them. Rebuild with `pip install --no-build-isolation -e .`.",
            RuntimeWarning,
            stacklevel=3,
        )
        _register_reference(REFERENCE_OPS, "FRAGMENT")
    _cover_missing_cuda_kernels()


def _cover_missing_cuda_kernels() -> None:
    """A CUDA torch with a CPU-only build (no nvcc): CUDA tensors take the reference ops.

    The warning comes with the compile, and at every import on a machine with a GPU.
    """
    global _cuda_fallback_lib, CUDA_MISSING
    if torch.version.cuda is None or _C is None or _C.build_info().get("cuda_kernels"):
        return
    from . import reference

    CUDA_MISSING = CUDA_MISSING or f"the extension was built without CUDA kernels for torch {torch.__version__}"
    lib = torch.library.Library("fastcoll", "IMPL")
    for name in SCHEMAS:
        if name not in REFERENCE_OPS:
            lib.impl(name, getattr(reference, name), "CUDA")
    _cuda_fallback_lib = lib
    if ORIGIN == "compiled at import" or torch.cuda.is_available():  # said once when built; then where it matters
        warnings.warn(
            f"fastcoll: CUDA kernels missing: {CUDA_MISSING}; CUDA tensors use the pure-PyTorch reference ops",
            RuntimeWarning,
            stacklevel=4,
        )


def _check_devices(op: str, tensors, flat, flat_name: str) -> None:
    # A list mixing meta and real tensors dispatches to the fake kernels; they
    # must still reject it rather than silently doing nothing (same words as
    # the kernels' check in csrc/ops.cpp).
    for i, t in enumerate(tensors):
        if t.device != flat.device:
            raise RuntimeError(
                f"{op}: tensors[{i}] is on {t.device} but {flat_name} is on {flat.device}; move them to one device"
            )


def _register_fakes() -> None:
    # Both ops only mutate their outputs and return nothing, so the fake
    # (meta) kernels have nothing to compute beyond the device check; they
    # let torch.compile trace the ops.
    @torch.library.register_fake("fastcoll::flatten_scale")
    def _flatten_scale_fake(tensors, out, scale=1.0):
        _check_devices("fastcoll.flatten_scale", tensors, out, "out")
        return None

    @torch.library.register_fake("fastcoll::unflatten_scale")
    def _unflatten_scale_fake(flat, tensors, scale=1.0):
        _check_devices("fastcoll.unflatten_scale", tensors, flat, "flat")
        return None

    # The health ops: the same device checks, plus the metadata checks of their
    # small tensors (dtype, number of elements, device; overlaps need memory).
    from .reference import check_health_args, check_sum_chunks

    @torch.library.register_fake("fastcoll::flatten_scale_ex")
    def _flatten_scale_ex_fake(tensors, out, scale=1.0, scale_by=None, nonfinite=None):
        _check_devices("fastcoll.flatten_scale_ex", tensors, out, "out")
        check_health_args("fastcoll.flatten_scale_ex", out.device, scale_by=scale_by, nonfinite=nonfinite)
        return None

    @torch.library.register_fake("fastcoll::unflatten_scale_ex")
    def _unflatten_scale_ex_fake(flat, tensors, scale=1.0, sumsq=None):
        _check_devices("fastcoll.unflatten_scale_ex", tensors, flat, "flat")
        check_health_args("fastcoll.unflatten_scale_ex", flat.device, sumsq=sumsq)
        return None

    @torch.library.register_fake("fastcoll::sum_of_squares")
    def _sum_of_squares_fake(tensors, out):
        _check_devices("fastcoll.sum_of_squares", tensors, out, "out")
        check_health_args("fastcoll.sum_of_squares", out.device, sumsq=out, sumsq_name="out")
        return None

    @torch.library.register_fake("fastcoll::flatten_accumulate")
    def _flatten_accumulate_fake(tensors, out, scale=1.0, nonfinite=None):
        _check_devices("fastcoll.flatten_accumulate", tensors, out, "out")
        check_health_args("fastcoll.flatten_accumulate", out.device, nonfinite=nonfinite)
        return None

    # sum_chunks: every check but the overlap one needs only metadata (reference.check_sum_chunks).
    @torch.library.register_fake("fastcoll::sum_chunks")
    def _sum_chunks_fake(chunks, out, scale=1.0):
        check_sum_chunks(chunks, out, overlap=False)
        return None

    # checksum returns a new int64 tensor, one value per tensor, on the tensors' device.
    @torch.library.register_fake("fastcoll::checksum")
    def _checksum_fake(tensors):
        if len(tensors) == 0:
            return torch.empty(0, dtype=torch.int64)
        _check_devices("fastcoll.checksum", tensors, tensors[0], "tensors[0]")
        return tensors[0].new_empty((len(tensors),), dtype=torch.int64)


_load()
_register_fakes()
