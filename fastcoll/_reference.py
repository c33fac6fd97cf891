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
"""

from __future__ import annotations

from typing import Sequence

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _check_dtype(t: torch.Tensor, what: str) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"fastcoll: {what} has dtype {_dtype_name(t.dtype)}; supported dtypes are "
            "float32, float16, bfloat16 and float64"
        )


def _check_strided(t: torch.Tensor, what: str) -> None:
    if t.layout != torch.strided:
        raise TypeError(f"fastcoll: {what} has layout {t.layout}; only strided (dense) tensors are supported")


def is_dense(t: torch.Tensor) -> bool:
    """True when ``t``'s elements fill ``numel`` consecutive memory slots, each once.

    Same rule as ATen's ``is_non_overlapping_and_dense``: sorted by stride,
    every dimension's stride equals the product of the sizes inside it.
    """
    if t.numel() <= 1:
        return True
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _check_flat(flat: torch.Tensor, name: str) -> None:
    _check_strided(flat, name)
    _check_dtype(flat, name)
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(
            f"fastcoll: {name} must be a 1-D contiguous tensor, got shape {tuple(flat.shape)} "
            f"with strides {tuple(flat.stride())}"
        )


def _validate(
    tensors: Sequence[torch.Tensor], flat: torch.Tensor, flat_name: str, list_name: str, writes_list: bool
) -> list[int]:
    """Check arguments of either op; return each tensor's element offset in ``flat``.

    Raises before anything is written. ``writes_list`` is True for the unflatten
    direction, where the listed tensors are destinations and must not overlap
    one another.
    """
    if len(tensors) == 0:
        raise ValueError(f"fastcoll: {list_name} is empty; pass at least one tensor")
    _check_flat(flat, flat_name)
    offsets: list[int] = []
    total = 0
    for i, t in enumerate(tensors):
        what = f"{list_name}[{i}]"
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fastcoll: {what} is a {type(t).__name__}, not a tensor")
        _check_strided(t, what)
        if t.device != flat.device:
            raise RuntimeError(f"fastcoll: {what} is on {t.device} but {flat_name} is on {flat.device}")
        _check_dtype(t, what)
        if not is_dense(t):
            raise ValueError(
                f"fastcoll: {what} (shape {tuple(t.shape)}, strides {tuple(t.stride())}) is not dense and "
                "non-overlapping; make it .contiguous() first"
            )
        offsets.append(total)
        total += t.numel()
    if total != flat.numel():
        raise ValueError(
            f"fastcoll: the {list_name} hold {total} elements in total but {flat_name} has {flat.numel()}"
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
                    f"fastcoll: {list_name}[{i}] overlaps {flat_name} outside its own slot "
                    f"(elements {offsets[i]}..{offsets[i] + t.numel()}); the op would read overwritten data"
                )
        ranges.append((lo, hi, i))
    if writes_list and len(ranges) > 1:
        ranges.sort()
        for (lo_a, hi_a, ia), (lo_b, _, ib) in zip(ranges, ranges[1:]):
            if lo_b < hi_a:
                raise ValueError(
                    f"fastcoll: {list_name}[{min(ia, ib)}] and {list_name}[{max(ia, ib)}] overlap in memory; "
                    "destinations must be distinct"
                )
    return offsets


def _memory_order(t: torch.Tensor) -> torch.Tensor:
    """1-D view of a dense tensor's elements in memory order."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def _opmath(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in (a, b) else torch.float32


def flatten_scale(tensors: Sequence[torch.Tensor], out: torch.Tensor, scale: float = 1.0) -> None:
    """Reference ``fastcoll::flatten_scale``: pack ``tensors * scale`` into ``out``."""
    offsets = _validate(tensors, out, "out", "tensors", writes_list=False)
    with torch.no_grad():
        for t, off in zip(tensors, offsets):
            n = t.numel()
            if n == 0:
                continue
            src = _memory_order(t).to(_opmath(t.dtype, out.dtype))
            out[off : off + n].copy_(src * scale)


def unflatten_scale(flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float = 1.0) -> None:
    """Reference ``fastcoll::unflatten_scale``: write slices of ``flat * scale`` into ``tensors``."""
    offsets = _validate(tensors, flat, "flat", "tensors", writes_list=True)
    with torch.no_grad():
        for t, off in zip(tensors, offsets):
            n = t.numel()
            if n == 0:
                continue
            src = flat[off : off + n].to(_opmath(t.dtype, flat.dtype))
            _memory_order(t).copy_(src * scale)
