"""Clipping a sharded optimizer's gradients by their global norm, with one small all-reduce."""

from __future__ import annotations

import math
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import ops

__all__ = ["clip_grad_norm"]


def clip_grad_norm(
    ranges: List[torch.Tensor],
    held: List[torch.Tensor],
    comm: Any,
    device: torch.device,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    whole: Optional[List[torch.Tensor]] = None,
    foreach: Optional[bool] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``torch.nn.utils.clip_grad_norm_``'s contract over gradients divided among the ranks.

    Args:
        ranges: This rank's share of the gradients: together, the ranks' ranges are every gradient once.
        held: What this rank scales (its share, or every gradient it holds).
        comm: The reducer's communicator (the all-reduce goes through it, numbered and stall-protected).
        device: Where the norm is computed.
        max_norm, norm_type, error_if_nonfinite, foreach: As torch's.
        whole: Every parameter's gradient, whole, in parameter order, when this rank holds all of them (one
            rank): the norm is then torch's own (``torch.nn.utils.get_total_norm``), bit for bit, with no
            collective; ``ranges`` are not read.

    Returns:
        The total norm (0-dim float32), bitwise the same on every rank (from ``whole``, or one all-reduce),
        and the coefficient the gradients were multiplied by.
    """
    if whole is not None:
        norm = torch.nn.utils.get_total_norm(whole, norm_type, error_if_nonfinite, foreach)
    else:
        norm = _norm_of_ranges(ranges, comm, device, float(norm_type), error_if_nonfinite)
    # torch's coefficient, and its multiplication: by the float32 coefficient, whatever the gradients' dtype.
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    by_device: dict = {}
    for g in held:
        by_device.setdefault(g.device, []).append(g)
    for dev, grads in by_device.items():
        torch._foreach_mul_(grads, coef.to(dev))
    return norm, coef


def _norm_of_ranges(
    ranges: List[torch.Tensor], comm: Any, device: torch.device, norm_type: float, error_if_nonfinite: bool
) -> torch.Tensor:
    """The norm of every rank's ``ranges`` together: float64 sums, one all-reduce."""
    if norm_type == math.inf:
        local = max((g.abs().max().to(torch.float64) for g in ranges if g.numel()), default=None)
        total = (local if local is not None else torch.zeros((), dtype=torch.float64, device=device)).reshape(1)
        _all_reduce(comm, total, dist.ReduceOp.MAX)
    else:
        total = torch.zeros(1, dtype=torch.float64, device=device)
        if norm_type == 2.0:
            if ranges:
                ops.sum_of_squares(ranges, out=total)
        else:
            for g in ranges:
                total += g.to(torch.float64).abs().pow(norm_type).sum()
        _all_reduce(comm, total, dist.ReduceOp.SUM)
        total = total.pow(1.0 / norm_type)
    norm = total.reshape(()).to(torch.float32)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    return norm


def _all_reduce(comm: Any, t: torch.Tensor, op: Optional[Any]) -> None:
    comm.wait(comm.all_reduce(t, "gradient norm", op=op), "gradient norm")
