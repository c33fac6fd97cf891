"""Loads the compiled extension, or registers the pure-PyTorch fallback.

Either way, after import every op of SCHEMAS (``torch.ops.fastcoll.flatten_scale``,
``unflatten_scale``, ``flatten_scale_ex``, ``unflatten_scale_ex``,
``sum_of_squares``, ``checksum``) exists with the same schema, so the rest of the package
never needs to know which implementation is active. An extension built from
older sources that lacks some of them gets the reference for those (listed in
REFERENCE_OPS, with a warning) rather than failing to import.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType
from typing import Optional, Tuple

import torch

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
}

_C: Optional[ModuleType] = None
FALLBACK_REASON: Optional[str] = None
#: Ops served by the reference although the extension is loaded (it was built
#: from sources that predate them); empty after a fresh build.
REFERENCE_OPS: Tuple[str, ...] = ()
_fallback_lib = None


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


def _load() -> None:
    global _C, FALLBACK_REASON, REFERENCE_OPS
    if os.environ.get("FASTCOLL_NO_EXT", "0") not in ("", "0"):
        FALLBACK_REASON = "FASTCOLL_NO_EXT is set"
    else:
        try:
            from .. import _C as compiled  # loading the library runs its TORCH_LIBRARY registrations

            _C = compiled
        except ImportError as exc:  # not built, or built against another torch
            FALLBACK_REASON = f"the compiled extension fastcoll._C could not be imported ({exc})"
    if _C is None:
        warnings.warn(
            f"fastcoll: using the pure-PyTorch reference ops because {FALLBACK_REASON}; "
            "they are correct but not fused. Build with `pip install --no-build-isolation -e .`.",
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
    from .reference import check_health_args

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

    # checksum returns a new int64 tensor, one value per tensor, on the tensors' device.
    @torch.library.register_fake("fastcoll::checksum")
    def _checksum_fake(tensors):
        if len(tensors) == 0:
            return torch.empty(0, dtype=torch.int64)
        _check_devices("fastcoll.checksum", tensors, tensors[0], "tensors[0]")
        return tensors[0].new_empty((len(tensors),), dtype=torch.int64)


_load()
_register_fakes()
