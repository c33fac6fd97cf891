"""A bounded pool of full-size bucket buffers: the gradient memory of ``grad_buffers="pool"`` (ZeRO-2).

With the gradients reduce-scattered (each rank keeps only its range of every
bucket, :class:`~fastcoll.reducer.reduction.ShardGrads`), a bucket's full-size
buffers (the flat gradient buffer it packs into, with main gradients the
float32 main buffer, and a separate 16-bit wire buffer when there is one) are
needed only from the bucket's pack to the end of its reduce-scatter, and the
parameters' all-gather of a bucket without a parameter buffer needs a
bucket-long stage only from its pack to its write-back. This pool lends both.

It holds at most :attr:`GradBufferPool.bound` slots of :attr:`GradBufferPool.slot_bytes`
each (the largest bucket's need), allocated on first use and kept. Whoever
draws a slot while all are lent first retires its own oldest user (waits for
that bucket's reduce-scatter or all-gather and finishes it), so the number of
live slots never exceeds the bound: a bound of ``k`` lets ``k - 1`` reductions
stay in flight while the next bucket packs.

Gradient accumulation under ``no_sync`` with float32 main gradients
(``accumulate="full"``) keeps a buffer of each main-gradient bucket from the
first local backward to the end of the synchronizing reduce-scatter:
those are allocated outside the pool (:meth:`GradBufferPool.hold`), counted in
:attr:`GradBufferPool.held`, and freed after it.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from .bucket import GradBucket, MainGradBucket

__all__ = ["ACCUMULATE", "GradBufferPool"]

#: How gradients accumulate over micro-batches with pooled buffers: every backward is reduce-scattered into the
#: ranges (``no_sync`` does not skip it), or ``no_sync`` backwards accumulate into full-size buffers kept until the
#: synchronizing backward's reduce-scatter.
ACCUMULATE = ("reduce_scatter", "full")


class GradBufferPool:
    """The slots lent to pooled buckets (see the module docstring).

    Args:
        buckets: The reducer's buckets (pooled dense ones, built with ``pooled=True``).
        bound: The most slots lent at once (at least 1).
        device: Where the slots live.
        stage_bytes: Bytes a parameter all-gather stage needs (the largest bucket's padded parameters).
    """

    def __init__(self, buckets: Sequence[GradBucket], bound: int, device: torch.device, stage_bytes: int = 0):
        if bound < 1:
            raise ValueError(f"fastcoll: a gradient buffer pool needs at least 1 buffer, got {bound}")
        self.bound = int(bound)
        self.device = device
        #: Bytes of every slot: the largest need of any pooled bucket (gradients or all-gather stage).
        self.slot_bytes = max([b.pool_nbytes for b in buckets if b.pooled] + [stage_bytes, 0])
        self._free: List[torch.Tensor] = []
        self._lent: Dict[int, Tuple[torch.Tensor, bool]] = {}  # bucket position -> (storage, held outside the bound)
        #: Slots lent now, and the most ever lent at once (never above :attr:`bound`).
        self.live = 0
        self.peak = 0
        #: Accumulation buffers held now outside the bound (``accumulate="full"`` under ``no_sync``), and the most.
        self.held = 0
        self.peak_held = 0

    @property
    def nbytes(self) -> int:
        """Bytes the slots allocated so far take (at most ``bound * slot_bytes``)."""
        return (len(self._free) + self.live) * self.slot_bytes

    @property
    def full(self) -> bool:
        """Every slot is lent: the next draw must first retire a user."""
        return self.live >= self.bound

    def take(self) -> torch.Tensor:
        """Lend a slot (1-D uint8 of :attr:`slot_bytes`).

        Raises:
            RuntimeError: every slot is lent (the caller retires one of its users first).
        """
        if self.full:
            raise RuntimeError(f"fastcoll: internal error: all {self.bound} gradient pool buffers are lent")
        self.live += 1
        self.peak = max(self.peak, self.live)
        return self._free.pop() if self._free else torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)

    def give(self, slot: torch.Tensor) -> None:
        """Take back a slot lent by :meth:`take`."""
        self.live -= 1
        self._free.append(slot)

    def has(self, b: GradBucket) -> bool:
        """Bucket ``b`` has its buffers now."""
        return b.pos in self._lent

    def attach(self, b: GradBucket) -> None:
        """Give bucket ``b`` a slot for its pack and reduction (nothing when it holds its buffers already)."""
        if b.pos not in self._lent:
            self._lend(b, self.take(), held=False)

    def hold(self, b: GradBucket) -> None:
        """Give main-gradient bucket ``b`` an accumulation buffer outside the bound (until :meth:`release`)."""
        if b.pos not in self._lent:
            self.held += 1
            self.peak_held = max(self.peak_held, self.held)
            self._lend(b, torch.empty(b.pool_nbytes, dtype=torch.uint8, device=self.device), held=True)

    def _lend(self, b: GradBucket, storage: torch.Tensor, held: bool) -> None:
        self._lent[b.pos] = (storage, held)
        b.attach(storage)
        if isinstance(b, MainGradBucket):
            b.zero()  # an accumulation starts at 0

    def release(self, b: GradBucket) -> None:
        """Bucket ``b``'s reduction ended (or its accumulation was dropped): its buffers go back."""
        lent = self._lent.pop(b.pos, None)
        if lent is None:
            return
        b.detach()
        if lent[1]:
            self.held -= 1
        else:
            self.give(lent[0])

    def release_held(self, buckets: Sequence[GradBucket]) -> None:
        """Drop the accumulation buffers of ``buckets`` (``zero_grad`` during an accumulation)."""
        for b in buckets:
            if b.pos in self._lent and self._lent[b.pos][1]:
                self.release(b)
