"""Loads the compiled extension, or registers the pure-PyTorch fallback.

Either way, after import ``torch.ops.fastcoll.flatten_scale`` and
``torch.ops.fastcoll.unflatten_scale`` exist with the same schema, so the rest
of the package never needs to know which implementation is active.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType
from typing import Optional

import torch

# The schemas, shared by the C++ TORCH_LIBRARY block (csrc/ops.cpp) and the
# Python fallback below. Keep the two in sync; tests/test_ops.py checks it.
SCHEMAS = {
    "flatten_scale": "flatten_scale(Tensor[] tensors, Tensor(a!) out, float scale=1.0) -> ()",
    "unflatten_scale": "unflatten_scale(Tensor flat, Tensor(a!)[] tensors, float scale=1.0) -> ()",
}

_C: Optional[ModuleType] = None
FALLBACK_REASON: Optional[str] = None
_fallback_lib = None


def _register_reference() -> None:
    global _fallback_lib
    from . import _reference

    lib = torch.library.Library("fastcoll", "DEF")
    for name, schema in SCHEMAS.items():
        lib.define(schema)
        lib.impl(name, getattr(_reference, name), "CompositeExplicitAutograd")
    _fallback_lib = lib  # the registrations live as long as this object


def _load() -> None:
    global _C, FALLBACK_REASON
    if os.environ.get("FASTCOLL_NO_EXT", "0") not in ("", "0"):
        FALLBACK_REASON = "FASTCOLL_NO_EXT is set"
    else:
        try:
            from . import _C as compiled  # loading the library runs its TORCH_LIBRARY registrations

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
        _register_reference()


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


_load()
_register_fakes()
