"""Fused multi-tensor ops: pack many tensors into one flat buffer and back.

These are the per-byte work of gradient synchronization. ``flatten_scale``
copies every gradient into a flat bucket, multiplied by a scale (typically
``1 / world_size``) and cast to the bucket's dtype, in one call;
``unflatten_scale`` writes a reduced bucket back into the gradients.
Both dispatch to ``torch.ops.fastcoll.*``: the C++/CUDA kernels when the
extension is built, the pure-PyTorch reference otherwise.
"""

from __future__ import annotations

from typing import List, Sequence

import torch

from . import _loader, _reference

__all__ = ["flatten_scale", "unflatten_scale", "bucket_views", "total_numel", "implementation"]


def flatten_scale(tensors: Sequence[torch.Tensor], out: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Write ``tensors``, one after another, into ``out``, each multiplied by ``scale``.

    Each tensor's elements go in its own memory order (so a channels_last
    tensor round-trips through a view of ``out`` with the same strides). The
    multiply is done in float32 (float64 when either side is float64) and the
    result is cast to ``out.dtype``.

    Args:
        tensors: Dense tensors of float32/float16/bfloat16/float64, on ``out``'s
            device; zero-element tensors are skipped.
        out: 1-D contiguous tensor whose numel equals the sum of the inputs'.
        scale: Factor applied to every element; 1.0 is a pure copy.

    Returns:
        ``out``.

    Raises:
        ValueError, TypeError, RuntimeError: on bad input, naming the offending
            tensor index, before anything is written.
    """
    torch.ops.fastcoll.flatten_scale(list(tensors), out, float(scale))
    return out


def unflatten_scale(flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float = 1.0) -> None:
    """Write consecutive slices of ``flat``, times ``scale``, into ``tensors`` in place.

    The inverse of :func:`flatten_scale`: slice ``i`` is cast to
    ``tensors[i].dtype`` and written in that tensor's memory order.

    Args:
        flat: 1-D contiguous source tensor.
        tensors: Dense, mutually non-overlapping destinations on ``flat``'s device.
        scale: Factor applied to every element; 1.0 is a pure copy.

    Raises:
        ValueError, TypeError, RuntimeError: on bad input, naming the offending
            tensor index, before anything is written.
    """
    torch.ops.fastcoll.unflatten_scale(flat, list(tensors), float(scale))


def total_numel(tensors: Sequence[torch.Tensor]) -> int:
    """Number of elements a flat buffer needs to hold ``tensors``."""
    return sum(t.numel() for t in tensors)


def bucket_views(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Views of ``flat`` shaped and strided like each tensor of ``like``, back to back.

    View ``i`` covers the same elements of ``flat`` that :func:`flatten_scale`
    writes tensor ``i`` to, so gradients can live inside a bucket.

    Args:
        flat: 1-D contiguous buffer with exactly ``total_numel(like)`` elements.
        like: Dense tensors whose shapes and strides the views take.

    Returns:
        One view per tensor of ``like``.
    """
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(
            f"fastcoll.bucket_views: flat must be 1-D contiguous, got shape {tuple(flat.shape)} "
            f"with strides {tuple(flat.stride())}; pass a 1-D contiguous buffer"
        )
    views: List[torch.Tensor] = []
    offset = flat.storage_offset()
    for i, t in enumerate(like):
        if not _reference.is_dense(t):
            raise ValueError(
                f"fastcoll.bucket_views: like[{i}] (shape {tuple(t.shape)}, strides {tuple(t.stride())}) "
                "is not dense and non-overlapping; make it .contiguous() first"
            )
        stride = t.stride() if t.numel() > 0 else torch.empty(t.shape).stride()
        views.append(flat.as_strided(t.shape, stride, offset))
        offset += t.numel()
    used = offset - flat.storage_offset()
    if used != flat.numel():
        raise ValueError(
            f"fastcoll.bucket_views: like holds {used} elements in total but flat has {flat.numel()}; "
            "size flat with fastcoll.ops.total_numel(like)"
        )
    return views


def implementation() -> str:
    """'extension' when the compiled kernels are loaded, else 'reference'."""
    return "extension" if _loader._C is not None else "reference"
