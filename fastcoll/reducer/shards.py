"""How buckets are divided among ranks: the one place the shard ranges are computed.

A sharded optimizer (:class:`fastcoll.ShardedOptimizer`) divides every
dense bucket into ``world_size`` contiguous ranges of equal length, the
bucket padded at its end so that the ranges are equal (Megatron's
distributed-optimizer layout, on fastcoll's buckets). Rank ``r`` owns range
``r``: it is the output of the bucket's reduce-scatter on that rank, the
part of the optimizer state that rank keeps, and the input of the
parameters' all-gather. A parameter that straddles a range boundary is
split: each rank steps 1-D pieces of it, in the parameter's memory order.

Everything here is a pure function of the bucket layout (the parameters'
element counts in bucket order) and the world size, so every rank computes
the same ranges, and a checkpoint written at one world size can be read at
another (:func:`pieces_of`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

__all__ = [
    "ALIGN_BYTES", "BucketShards", "Piece", "ShardLayout", "aligned_first", "flat_view", "padded_numel", "pieces_of",
]  # fmt: skip

#: A parameter whose bytes are a multiple of this keeps every later parameter of its bucket at such an offset.
ALIGN_BYTES = 128

#: Padding may take this share of a bucket (or :data:`PAD_MIN_ELEMENTS`, whichever is larger).
PAD_SHARE = 0.01
PAD_MIN_ELEMENTS = 256


def padded_numel(numel: int, world_size: int, element_size: int) -> int:
    """The bucket length every rank's range divides evenly: a multiple of ``world_size`` times an alignment.

    Each range starts 16-byte aligned when that costs at most
    ``max(1 % of the bucket, 256 elements)`` of padding; otherwise the
    alignment is halved until it does (down to one element, where the
    padding is below ``world_size`` elements).
    """
    if numel == 0:
        return 0
    bound = max(int(numel * PAD_SHARE), PAD_MIN_ELEMENTS)
    align = max(16 // max(element_size, 1), 1)
    while True:
        unit = world_size * align
        padded = -(-numel // unit) * unit
        if padded - numel <= bound or align == 1:
            return padded
        align //= 2


def aligned_first(indices: Sequence[int], nbytes: Sequence[int]) -> List[int]:
    """A bucket's parameters (``indices``) reordered: those of a multiple of :data:`ALIGN_BYTES` first, each group in order.

    Every parameter of the first group then starts at a multiple of
    :data:`ALIGN_BYTES` in the bucket (a parameter buffer keeps their
    alignment, :mod:`fastcoll.optim.param_buffer`); odd-sized ones go last,
    where they shift nothing. ``nbytes[i]``: parameter ``i``'s size in bytes.
    """
    return [i for i in indices if nbytes[i] % ALIGN_BYTES == 0] + [i for i in indices if nbytes[i] % ALIGN_BYTES]


@dataclass(frozen=True)
class Piece:
    """The part of one parameter inside one rank's range of its bucket.

    Attributes:
        param: The parameter's index in the reducer.
        lo, hi: Its elements ``[lo, hi)`` in the parameter's memory order.
        at: Where they start within the rank's range of the bucket.
    """

    param: int
    lo: int
    hi: int
    at: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class BucketShards:
    """One bucket's ranges: ``padded`` elements, ``shard`` per rank; this rank's starts at ``start``."""

    pos: int
    numel: int
    padded: int
    shard: int
    start: int


def pieces_of(sizes: Sequence[int], param_indices: Sequence[int], padded: int, world_size: int, rank: int) -> List[Piece]:
    """The pieces of rank ``rank``'s range of a bucket holding parameters of ``sizes`` elements (in bucket order)."""
    shard = padded // world_size
    lo_r, hi_r = rank * shard, (rank + 1) * shard
    out = []
    offset = 0
    for idx, n in zip(param_indices, sizes):
        lo, hi = max(offset, lo_r), min(offset + n, hi_r)
        if lo < hi:
            out.append(Piece(idx, lo - offset, hi - offset, lo - lo_r))
        offset += n
        if offset >= hi_r:
            break
    return out


class ShardLayout:
    """Every dense bucket's ranges and this rank's pieces, for one bucket layout and world size.

    Args:
        buckets: ``(pos, param_indices, sizes, padded)`` per dense bucket, in reduction order; ``padded``
            as the buckets were allocated (:func:`padded_numel` of their gradients' element size).
        world_size, rank: The group's.
    """

    def __init__(self, buckets: Sequence[Tuple[int, Sequence[int], Sequence[int], int]], world_size: int, rank: int):
        self.world_size = world_size
        self.rank = rank
        self.buckets: List[BucketShards] = []
        self.pieces: List[List[Piece]] = []  # per entry of ``buckets``
        for pos, idxs, sizes, padded in buckets:
            numel = sum(sizes)
            if padded % world_size or padded < numel:
                raise ValueError(f"bucket {pos}: {padded} padded elements cannot be divided among {world_size} ranks")
            shard = padded // world_size
            self.buckets.append(BucketShards(pos, numel, padded, shard, rank * shard))
            self.pieces.append(pieces_of(sizes, idxs, padded, world_size, rank) if padded else [])

    def padded(self, pos: int) -> int:
        """The padded length of bucket ``pos`` (its own length when it is not sharded)."""
        for b in self.buckets:
            if b.pos == pos:
                return b.padded
        raise KeyError(pos)


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as a 1-D view in memory order (``t`` dense and non-overlapping, any strides)."""
    if t.is_contiguous():
        return t.view(-1)
    return t.as_strided((t.numel(),), (1,), t.storage_offset())
