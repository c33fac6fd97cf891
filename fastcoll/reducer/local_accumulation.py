"""The reducer between synchronized backwards (``no_sync``): what its hooks do with each gradient.

Nothing is communicated. The backward's parameters are counted as used; with float32 main gradients
(``main_grad_dtype``) the 16-bit gradients are added into them, a large one as soon as it is final, the
others at the end of that backward, so that the next synchronized backward reduces the sum of every
micro-batch.
"""

from __future__ import annotations

import warnings
from typing import Any, List, Optional

import torch

from .kept_grads import KeptGradients
from .pool import GradBufferPool
from .reduction import ShardGrads

__all__ = ["LocalAccumulation"]


class LocalAccumulation:
    """The hook body of backwards that are not synchronized (a mixin of :class:`~fastcoll.reducer.core.Reducer`)."""

    main_buckets: list
    usage: Any
    shard_grads: Optional[ShardGrads]
    kept: Optional[KeptGradients]
    pool: Optional[GradBufferPool]

    def _init_local_accumulation(self) -> None:
        self._idle_queued = False  # a no_sync backward's accumulation into the main gradients is queued
        self._idle_arrived: List[int] = []  # parameters that no_sync backward added into their main gradients already
        #: A backward under ``no_sync`` left local gradients that no synchronized backward has reduced yet.
        self.unsynchronized = False
        #: A forward through the wrapper has run with gradients enabled (:meth:`prepare_for_forward`), or the
        #: warning of :meth:`_warn_never_forwarded` was given.
        self.forwarded = False

    def _on_idle_grad(self, idx: int) -> None:
        """Hook body between synchronized backwards (``no_sync``): count the use; a large 16-bit gradient goes into
        its float32 main gradient now, the others at the end of the backward (:meth:`_accumulate_idle`)."""
        self.unsynchronized = True
        if not self.forwarded:
            self._warn_never_forwarded()
        if self.usage.tracking_use:
            self.usage.local_used[idx] = 1
        if not self.main_buckets:
            return
        if not self._idle_queued:
            self._idle_queued = True
            self.ensure_buffers()
            self.before_accumulating()  # (the parameters' all-gathers may still use the buckets)
            if self.shard_grads is not None:
                self.shard_grads.set_aside()
            torch.autograd.Variable._execution_engine.queue_callback(self._accumulate_idle)
        slot = self._eager_slots[idx]
        if slot is not None and self._set.buckets[self._bucket_of[idx]].accumulate_one(self._slot_pos[idx], slot):
            self._idle_arrived.append(idx)

    def _warn_never_forwarded(self) -> None:
        """Once: gradients arrive and no forward has gone through the wrapper (the unwrapped module was called)."""
        self.forwarded = True
        warnings.warn(
            "fastcoll.DDP: a backward computed gradients of the wrapped module's parameters, but no forward has gone "
            "through the DDP wrapper yet: was the unwrapped module called (model(x) instead of ddp(x), or "
            "ddp.module(x))? Such gradients are not averaged across ranks (torch DDP does not average them either); "
            "they are added into the next synchronized backward's. Run the forward through the wrapper",
            stacklevel=4,
        )

    def _accumulate_idle(self) -> None:
        """End of a ``no_sync`` backward: its 16-bit gradients not added yet go into the float32 main gradients."""
        self._idle_queued = False
        arrived, self._idle_arrived = self._idle_arrived, []
        for b in self.main_buckets:
            if self.pool is not None:
                self.pool.hold(b)  # kept until the synchronizing backward's reduce-scatter
            arrived += b.accumulate()
        if self.kept is not None:
            self.kept.after_local_backward(arrived)
