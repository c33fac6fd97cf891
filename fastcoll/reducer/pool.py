"""A bounded pool of full-size bucket buffers: the gradient memory of ``grad_buffers="pool"`` (ZeRO-2).

With the gradients reduce-scattered (each rank keeps only its range of every
bucket, :class:`~fastcoll.reducer.reduction.ShardGrads`), a bucket's full-size
buffers (the flat gradient buffer it packs into, with main gradients the
float32 main buffer, and a separate 16-bit wire buffer when there is one) are
needed only from the bucket's pack to the end of its reduce-scatter, and the
parameters' all-gather of a bucket without a parameter buffer needs a
bucket-long stage only from its pack to its write-back. This pool lends both.

Pooled buckets are cut by :func:`pooled_layout`: the cap counts the bytes of
their buffers (float32 main gradients: 4 per parameter), and a parameter
larger than the cap (GPT-2's embedding) has a bucket of its own. The pool
holds at most :attr:`GradBufferPool.bound` slots of :attr:`GradBufferPool.slot_bytes`
each, allocated on first use and kept: the largest bucket's need, or, when a
bucket is larger than the cap (that one parameter), the need of a chunk of
the cap's size; such a bucket is reduced in slot-sized chunks
(:class:`~fastcoll.reducer.reduction.Pooled`). Whoever
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

from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..bucketing import Caps, ParamSpec, assign_buckets
from .bucket import GradBucket, MainGradBucket

__all__ = ["ACCUMULATE", "GradBufferPool", "largest_cap", "pooled_layout"]

#: How gradients accumulate over micro-batches with pooled buffers: every backward is reduce-scattered into the
#: ranges (``no_sync`` does not skip it), or ``no_sync`` backwards accumulate into full-size buffers kept until the
#: synchronizing backward's reduce-scatter.
ACCUMULATE = ("reduce_scatter", "full")


def _oversize(b: GradBucket, cap_bytes: int) -> bool:
    """Bucket ``b`` holds a parameter whose buffers exceed the bucket cap (its size is that parameter's, not the cap's)."""
    return any(p.numel() * b.elem_bytes > cap_bytes for p in b.params)


def pooled_layout(buckets: Sequence[GradBucket], specs: Sequence[ParamSpec], first_cap_bytes: int, caps: Caps) -> List[List[int]]:
    """The buckets of a pooled reducer: the caps count the bytes of the buffers a slot holds, not the parameters'.

    With float32 main gradients of a 16-bit model a bucket's buffer takes 4 bytes per parameter (6 with a separate
    16-bit wire buffer), so ``bucket_cap_mb`` of them is half the parameters of a persistent bucket, and the slots
    are about ``bucket_cap_mb`` each. A parameter larger than the cap gets a bucket of its own (reduced in
    chunks): no smaller gradient then waits for its gradient to be packed. ``buckets``: the current layout
    (its order and each parameter's bytes per element in a pooled buffer).
    """
    elem = {i: b.elem_bytes for b in buckets for i in b.param_indices}
    order = [i for b in buckets for i in b.param_indices]
    pooled = [replace(s, element_size=elem[i]) for i, s in enumerate(specs)]
    return assign_buckets(pooled, order, first_cap_bytes, caps, alone_above=largest_cap(caps))


def largest_cap(caps: Caps) -> int:
    """The bucket cap above which a parameter is alone in its bucket and reduced in chunks (a list's largest)."""
    return max(caps) if isinstance(caps, (list, tuple)) else int(caps)


class GradBufferPool:
    """The slots lent to pooled buckets (see the module docstring).

    Args:
        buckets: The reducer's buckets (pooled dense ones, built with ``pooled=True``).
        bound: The most slots lent at once (at least 1).
        device: Where the slots live.
        world_size: The ranks the buckets are divided among.
        cap_bytes: The bucket cap (bytes of parameters), when buckets larger than it may be reduced in chunks;
            None: every slot holds the largest bucket.
    """

    def __init__(
        self, buckets: Sequence[GradBucket], bound: int, device: torch.device, world_size: int = 1,
        cap_bytes: Optional[int] = None,
    ):  # fmt: skip
        if bound < 1:
            raise ValueError(f"fastcoll: a gradient buffer pool needs at least 1 buffer, got {bound}")
        self.bound = int(bound)
        self.device = device
        self.world_size = world_size
        self.chunking = cap_bytes is not None
        pooled = [b for b in buckets if b.pooled]
        needs = [b.pool_nbytes for b in pooled]
        if cap_bytes is not None:  # a bucket holding a parameter larger than the cap is reduced in cap-sized chunks
            needs = [self._cap_need(b, cap_bytes) if _oversize(b, cap_bytes) else b.pool_nbytes for b in pooled]
        #: Bytes of every slot (see the module docstring).
        self.slot_bytes = max(needs + [0])
        self._free: List[torch.Tensor] = []
        self._lent: Dict[int, Tuple[torch.Tensor, bool]] = {}  # bucket position -> (storage, held outside the bound)
        #: Slots lent now, and the most ever lent at once (never above :attr:`bound`).
        self.live = 0
        self.peak = 0
        #: Accumulation buffers held now outside the bound (``accumulate="full"`` under ``no_sync``), and the most.
        self.held = 0
        self.peak_held = 0

    def _cap_need(self, b: GradBucket, cap_bytes: int) -> int:
        """Bytes of a chunk of bucket ``b`` taking about ``cap_bytes`` of buffers (whole ranks' slices)."""
        per = max(1, -(-cap_bytes // (b.elem_bytes * self.world_size)))
        return per * self.world_size * b.elem_bytes + 64

    def chunked(self, b: GradBucket) -> bool:
        """Bucket ``b`` does not fit a slot: it is reduced in chunks."""
        return self.chunking and b.pool_nbytes > self.slot_bytes

    def chunk_elements(self, b: GradBucket) -> int:
        """Elements of each rank's range that one chunk of bucket ``b`` carries."""
        return max(1, (self.slot_bytes - 64) // (self.world_size * b.elem_bytes))

    def fits(self, nbytes: int) -> bool:
        """A slot can hold ``nbytes`` (an all-gather stage; a larger one is allocated for its all-gather alone)."""
        return nbytes <= self.slot_bytes

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
