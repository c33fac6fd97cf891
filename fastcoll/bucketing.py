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

Per-bucket caps: ``cap_bytes`` may also be a sequence of byte caps, one per
bucket of each (device, dtype) group in reduction order, the last one
repeating (``[1 MiB, 4 MiB, 16 MiB]``: the group's first bucket closes at
1 MiB, its second at 4 MiB, every later one at 16 MiB); ``first_cap_bytes`` is
then ignored, since the list already says what the first bucket gets.
:func:`bucket_caps_from_mb` turns the user's ``bucket_cap_mb`` (a number of
MiB, a list of them, or ``"auto"``) into what :func:`assign_buckets` takes, with
fastcoll.DDP's error messages; :func:`caps_to_mb` goes back, for reports.

Messages that must stay under a hard byte limit (coalesced broadcasts, the
buckets of :func:`fastcoll.dist.allreduce_grads`) use :func:`split_by_bytes`
instead, where the item that would cross the cap starts the next group.

This module is pure bookkeeping (no tensors are allocated, nothing is
communicated), so every rank that feeds it the same inputs gets the same
layout.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Dict, Hashable, List, Optional, Sequence, Tuple, Union

import torch

__all__ = [
    "AUTO",
    "DEFAULT_CAP_MB",
    "MIB",
    "Caps",
    "ParamSpec",
    "assign_buckets",
    "bucket_caps_from_mb",
    "caps_to_mb",
    "order_from_ready",
    "reverse_registration_order",
    "split_by_bytes",
]

MIB = 1024 * 1024

#: ``bucket_cap_mb`` when the user gives none (torch DDP's default).
DEFAULT_CAP_MB = 25.0
#: The ``bucket_cap_mb`` value that asks for autotuned buckets.
AUTO = "auto"

#: Byte caps as :func:`assign_buckets` takes them: one cap, or one per bucket (the last repeating).
Caps = Union[int, Sequence[int]]


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
    cap_bytes: Caps,
    alone_above: Optional[int] = None,
) -> List[List[int]]:
    """Group parameter indices into buckets.

    Args:
        specs: One spec per parameter, indexed by parameter index.
        order: A permutation of ``range(len(specs))``: the order in which
            gradients are expected to become ready.
        first_cap_bytes: Byte cap of the first bucket of every (device, dtype)
            group when ``cap_bytes`` is one number; ignored when it is a sequence.
        cap_bytes: Byte cap of every later bucket; or a non-empty sequence of
            byte caps, the k-th for the k-th bucket of each (device, dtype)
            group in reduction order, the last repeating for the buckets
            beyond the list. Sparse parameters' buckets (always one parameter)
            do not count.
        alone_above: Bytes above which a parameter gets a bucket of its own
            (the open bucket closes before it, the next starts after it), so
            that no gradient waits for its gradient nor it for another;
            None: no such rule.

    Returns:
        Buckets in reduction order, each a list of parameter indices in
        ``order``. Buckets are sorted by the position (in ``order``) of their
        last parameter, i.e. by when they are expected to be complete, so that
        launching them in index order does not hold back a finished bucket
        behind an unfinished one of another dtype.

    Raises:
        ValueError: if ``order`` is not a permutation, a cap is not positive
            or the cap sequence is empty.
    """
    n = len(specs)
    if sorted(order) != list(range(n)):
        raise ValueError(f"fastcoll.bucketing: order must be a permutation of range({n})")
    if isinstance(cap_bytes, numbers.Integral):
        if first_cap_bytes <= 0 or cap_bytes <= 0:
            raise ValueError("fastcoll.bucketing: bucket caps must be positive")
        caps = [int(first_cap_bytes), int(cap_bytes)]
    else:
        caps = [int(c) for c in cap_bytes]
        if not caps or min(caps) <= 0:
            raise ValueError(f"fastcoll.bucketing: bucket caps must be a non-empty list of positive byte counts, got {caps!r}")
    last = len(caps) - 1
    position = {idx: pos for pos, idx in enumerate(order)}
    open_buckets: Dict[Hashable, Tuple[List[int], int, int]] = {}  # key -> (indices, bytes, cap)
    closed: dict[Hashable, int] = {}  # key -> buckets closed so far (selects the next cap)
    done: List[List[int]] = []

    def close(key: Hashable, members: List[int]) -> int:
        """Bucket ``members`` of ``key`` is complete; returns the cap of that key's next bucket."""
        done.append(members)
        closed[key] = closed.get(key, 0) + 1
        return caps[min(closed[key], last)]

    for idx in order:
        spec = specs[idx]
        if spec.sparse:
            done.append([idx])
            continue
        members, size, cap = open_buckets.get(spec.key, ([], 0, caps[0]))
        nbytes = spec.numel * spec.element_size
        alone = alone_above is not None and nbytes > alone_above
        if alone and members:  # the open bucket closes before it
            members, size, cap = [], 0, close(spec.key, members)
        members.append(idx)
        size += nbytes
        if size >= cap or alone:
            open_buckets[spec.key] = ([], 0, close(spec.key, members))
        else:
            open_buckets[spec.key] = (members, size, cap)
    done.extend(members for members, _, _ in open_buckets.values() if members)
    done.sort(key=lambda members: position[members[-1]])
    return done


def _positive_mib(value: object) -> bool:
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(value)  # type: ignore[arg-type]
        and value > 0  # type: ignore[operator]
    )


def _mib_to_bytes(mib: float) -> int:
    # A positive cap is at least one byte (a tiny cap: one parameter per bucket).
    return max(1, int(mib * MIB))


def bucket_caps_from_mb(value: object) -> int | list[int] | str:
    """Parse and check the user's ``bucket_cap_mb``.

    Args:
        value: None (the default, :data:`DEFAULT_CAP_MB`), a positive finite
            number of MiB, a non-empty list or tuple of them (per-bucket caps
            in reduction order, the last repeating), or the string ``"auto"``.

    Returns:
        The cap in bytes (an int: ``first_bucket_mb`` still caps the first
        bucket), a list of byte caps (``first_bucket_mb`` does not apply), or
        :data:`AUTO`. A positive cap below one byte counts as one byte.

    Raises:
        ValueError: ``fastcoll.DDP: bucket_cap_mb must be ...; got ...`` for
            anything else: zero, negative, NaN or infinite numbers, booleans,
            an empty list, a list with a bad entry, other strings.
    """
    if value is None:
        return _mib_to_bytes(DEFAULT_CAP_MB)
    if isinstance(value, str):
        if value == AUTO:
            return AUTO
    elif isinstance(value, (list, tuple)):
        if value and all(_positive_mib(v) for v in value):
            return [_mib_to_bytes(float(v)) for v in value]
        bad = next((v for v in value if not _positive_mib(v)), None)
        what = "an empty list" if not value else f"an entry {bad!r}"
        raise ValueError(
            "fastcoll.DDP: bucket_cap_mb must be a non-empty list of positive numbers of MiB (one cap per "
            f"bucket in reduction order, the last repeating); got {what} in {value!r}"
        )
    elif _positive_mib(value):
        return _mib_to_bytes(float(value))  # type: ignore[arg-type]
    raise ValueError(
        f'fastcoll.DDP: bucket_cap_mb must be a positive number of MiB, a non-empty list of them or "auto"; got {value!r}'
    )


def caps_to_mb(caps: Caps) -> float | list[float]:
    """Byte caps as MiB (rounded to 1/1000 MiB), for logs and reports."""
    if isinstance(caps, numbers.Integral):
        return round(int(caps) / MIB, 3)
    return [round(int(c) / MIB, 3) for c in caps]


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
