"""Pure-PyTorch implementation of the fused ops.

This module is the oracle the tests compare the C++/CUDA kernels against, and
the implementation ``torch.ops.fastcoll.*`` falls back to when the compiled
extension is not available. It mirrors the C++ argument checks (same exception
types, same culprit named in the message) so that error behaviour does not
depend on which implementation is loaded.

Layout rule shared with the kernels: a dense, non-overlapping tensor occupies
exactly ``numel`` consecutive elements of memory starting at ``data_ptr()``;
its elements are packed into the flat buffer in that memory order. A view of
the flat buffer with the same sizes and strides (see ``ops.bucket_views``)
therefore round-trips.

Messages start with the public op's name, ``fastcoll.flatten_scale: `` or
``fastcoll.unflatten_scale: ``, then say what is wrong and how to fix it, in
the same words as csrc/ops.cpp.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ._dtypes import SUPPORTED_DTYPES, SUPPORTED_NAMES, dtype_name, is_dense

# ``is_dense`` is also imported from here by fastcoll.ops (bucket_views).
__all__ = ["flatten_scale", "unflatten_scale", "is_dense"]


def _check_dtype(op: str, t: torch.Tensor, what: str) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: {what} has dtype {dtype_name(t.dtype)}; supported dtypes are {SUPPORTED_NAMES}")


def _check_strided(op: str, t: torch.Tensor, what: str) -> None:
    if t.layout != torch.strided:
        raise TypeError(f"{op}: {what} has layout {t.layout}; only strided (dense) tensors are supported")


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _check_flat(op: str, flat: torch.Tensor, name: str) -> None:
    _check_strided(op, flat, name)
    _check_dtype(op, flat, name)
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(
            f"{op}: {name} must be a 1-D contiguous tensor, got shape {tuple(flat.shape)} "
            f"with strides {tuple(flat.stride())}; pass a 1-D contiguous buffer"
        )


def _validate(
    op: str, tensors: Sequence[torch.Tensor], flat: torch.Tensor, flat_name: str, list_name: str, writes_list: bool
) -> list[int]:
    """Check arguments of either op; return each tensor's element offset in ``flat``.

    Raises before anything is written; ``op`` ("fastcoll.flatten_scale" or
    "fastcoll.unflatten_scale") starts every message. ``writes_list`` is True
    for the unflatten direction, where the listed tensors are destinations and
    must not overlap one another.
    """
    if len(tensors) == 0:
        raise ValueError(f"{op}: {list_name} is empty; pass at least one tensor")
    _check_flat(op, flat, flat_name)
    offsets: list[int] = []
    total = 0
    for i, t in enumerate(tensors):
        what = f"{list_name}[{i}]"
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {what} is a {type(t).__name__}, not a tensor")
        _check_strided(op, t, what)
        if t.device != flat.device:
            raise RuntimeError(
                f"{op}: {what} is on {t.device} but {flat_name} is on {flat.device}; move them to one device"
            )
        _check_dtype(op, t, what)
        if not is_dense(t):
            raise ValueError(
                f"{op}: {what} (shape {tuple(t.shape)}, strides {tuple(t.stride())}) is not dense and "
                "non-overlapping; make it .contiguous() first"
            )
        offsets.append(total)
        total += t.numel()
    if total != flat.numel():
        raise ValueError(
            f"{op}: the {list_name} hold {total} elements in total but {flat_name} has {flat.numel()}; "
            f"{flat_name} must have exactly as many"
        )
    # Aliasing: a tensor may sit exactly in its own slot of the flat buffer (an
    # in-place scale, as with gradient_as_bucket_view); any other overlap with the
    # flat buffer would read data the op has already overwritten.
    flat_lo, flat_hi = _byte_range(flat)
    fsize = flat.element_size()
    ranges = []
    for i, t in enumerate(tensors):
        if t.numel() == 0:
            continue
        lo, hi = _byte_range(t)
        if lo < flat_hi and flat_lo < hi:
            in_slot = t.dtype == flat.dtype and lo == flat_lo + offsets[i] * fsize
            if not in_slot:
                raise ValueError(
                    f"{op}: {list_name}[{i}] overlaps {flat_name} outside its own slot "
                    f"(elements {offsets[i]}..{offsets[i] + t.numel()}); the op would read overwritten data: "
                    "use separate memory, or exactly that slot (fastcoll.bucket_views) for an in-place scale"
                )
        ranges.append((lo, hi, i))
    if writes_list and len(ranges) > 1:
        ranges.sort()
        for (lo_a, hi_a, ia), (lo_b, _, ib) in zip(ranges, ranges[1:]):
            if lo_b < hi_a:
                raise ValueError(
                    f"{op}: {list_name}[{min(ia, ib)}] and {list_name}[{max(ia, ib)}] overlap in memory; "
                    "destinations must not share memory"
                )
    return offsets


def _memory_order(t: torch.Tensor) -> torch.Tensor:
    """1-D view of a dense tensor's elements in memory order."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def _opmath(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in (a, b) else torch.float32


def flatten_scale(tensors: Sequence[torch.Tensor], out: torch.Tensor, scale: float = 1.0) -> None:
    """Reference ``fastcoll::flatten_scale``: pack ``tensors * scale`` into ``out``."""
    offsets = _validate("fastcoll.flatten_scale", tensors, out, "out", "tensors", writes_list=False)
    with torch.no_grad():
        for t, off in zip(tensors, offsets):
            n = t.numel()
            if n == 0:
                continue
            src = _memory_order(t).to(_opmath(t.dtype, out.dtype))
            out[off : off + n].copy_(src * scale)


def unflatten_scale(flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float = 1.0) -> None:
    """Reference ``fastcoll::unflatten_scale``: write slices of ``flat * scale`` into ``tensors``."""
    offsets = _validate("fastcoll.unflatten_scale", tensors, flat, "flat", "tensors", writes_list=True)
    with torch.no_grad():
        for t, off in zip(tensors, offsets):
            n = t.numel()
            if n == 0:
                continue
            src = flat[off : off + n].to(_opmath(t.dtype, flat.dtype))
            _memory_order(t).copy_(src * scale)
