"""Assignment of parameters to gradient buckets.

A bucket holds parameters of one (device, dtype) whose gradients are packed
into one flat buffer and reduced with one collective. Parameters are visited
in the order their gradients are expected to become ready (reverse
registration order at first, the observed order after the first iteration);
each (device, dtype) group fills an open bucket until it reaches its byte cap
(the first bucket of a group has the small ``first_cap_bytes`` so that
communication starts early in backward; later ones have ``cap_bytes``). The
parameter that crosses the cap still joins the bucket, so a tiny cap gives one
parameter per bucket. A parameter with sparse gradients always has a bucket
of its own.

Messages that must stay under a hard byte limit (coalesced broadcasts, the
buckets of :func:`fastcoll.dist.allreduce_grads`) use :func:`split_by_bytes`
instead, where the item that would cross the cap starts the next group.

This module is pure bookkeeping (no tensors are allocated, nothing is
communicated), so every rank that feeds it the same inputs gets the same
layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Hashable, List, Sequence, Tuple

import torch

__all__ = ["ParamSpec", "assign_buckets", "reverse_registration_order", "order_from_ready", "split_by_bytes", "MIB"]

MIB = 1024 * 1024


@dataclass(frozen=True)
class ParamSpec:
    """What bucketing needs to know about one parameter.

    Attributes:
        numel: Number of elements.
        element_size: Bytes per element.
        key: Grouping key; parameters share a bucket only when keys are equal
            (in practice ``(device, dtype)``).
        sparse: The parameter gets sparse gradients (``nn.Embedding(sparse=True)``):
            it always has a bucket of its own, as in torch DDP.
    """

    numel: int
    element_size: int
    key: Hashable
    sparse: bool = False

    @classmethod
    def of(cls, p: torch.Tensor, sparse: bool = False) -> "ParamSpec":
        """The spec of tensor ``p``, keyed by its (device, dtype)."""
        return cls(p.numel(), p.element_size(), (str(p.device), p.dtype), sparse)


def reverse_registration_order(n: int) -> List[int]:
    """The initial reduction order: parameter indices ``n-1, ..., 0``."""
    return list(range(n - 1, -1, -1))


def order_from_ready(observed: Sequence[int], n: int) -> List[int]:
    """A full reduction order from an observed gradient-ready order.

    Args:
        observed: Parameter indices in the order their gradients became ready;
            duplicates are ignored after the first occurrence.
        n: Number of parameters.

    Returns:
        A permutation of ``range(n)``: the observed indices first, then the
        parameters never observed, in reverse registration order.
    """
    seen = bytearray(n)
    order: List[int] = []
    for i in observed:
        if 0 <= i < n and not seen[i]:
            seen[i] = 1
            order.append(i)
    order.extend(i for i in range(n - 1, -1, -1) if not seen[i])
    return order


def assign_buckets(
    specs: Sequence[ParamSpec],
    order: Sequence[int],
    first_cap_bytes: int,
    cap_bytes: int,
) -> List[List[int]]:
    """Group parameter indices into buckets.

    Args:
        specs: One spec per parameter, indexed by parameter index.
        order: A permutation of ``range(len(specs))``: the order in which
            gradients are expected to become ready.
        first_cap_bytes: Byte cap of the first bucket of every (device, dtype) group.
        cap_bytes: Byte cap of every later bucket.

    Returns:
        Buckets in reduction order, each a list of parameter indices in
        ``order``. Buckets are sorted by the position (in ``order``) of their
        last parameter, i.e. by when they are expected to be complete, so that
        launching them in index order does not hold back a finished bucket
        behind an unfinished one of another dtype.

    Raises:
        ValueError: if ``order`` is not a permutation or a cap is not positive.
    """
    n = len(specs)
    if sorted(order) != list(range(n)):
        raise ValueError(f"fastcoll.bucketing: order must be a permutation of range({n})")
    if first_cap_bytes <= 0 or cap_bytes <= 0:
        raise ValueError("fastcoll.bucketing: bucket caps must be positive")
    position = {idx: pos for pos, idx in enumerate(order)}
    open_buckets: Dict[Hashable, Tuple[List[int], int, int]] = {}  # key -> (indices, bytes, cap)
    done: List[List[int]] = []
    for idx in order:
        spec = specs[idx]
        if spec.sparse:
            done.append([idx])
            continue
        members, size, cap = open_buckets.get(spec.key, ([], 0, first_cap_bytes))
        members.append(idx)
        size += spec.numel * spec.element_size
        if size >= cap:
            done.append(members)
            open_buckets[spec.key] = ([], 0, cap_bytes)
        else:
            open_buckets[spec.key] = (members, size, cap)
    done.extend(members for members, _, _ in open_buckets.values() if members)
    done.sort(key=lambda members: position[members[-1]])
    return done


def split_by_bytes(sizes: Sequence[int], cap: float) -> List[List[int]]:
    """Greedy runs of consecutive indices whose byte ``sizes`` sum to at most ``cap``.

    A size that does not fit starts the next run; one larger than ``cap`` has
    a run of its own. ``cap <= 0``: a single run.
    """
    if cap <= 0:
        return [list(range(len(sizes)))]
    runs: List[List[int]] = []
    used = 0
    for i, nbytes in enumerate(sizes):
        if not runs or (runs[-1] and used + nbytes > cap):
            runs.append([])
            used = 0
        runs[-1].append(i)
        used += nbytes
    return runs
