"""The reducer's bucket layout: installing one, the one rebuild from the ready order, autotuning's layouts.

Every change of layout goes through :meth:`ReducerLayout._install_layout`,
which re-derives everything that depends on it (main-gradient buckets,
health slots, the reduction of each bucket, the expected gradient counts and
the per-iteration progress).
"""

from __future__ import annotations

from typing import Any, List, Optional

from .bucket import GradBucket, MainGradBucket
from .pool import GradBufferPool, largest_cap
from .reduction import AccumAllReduce, AccumReduceScatter, AllReduce, InFlight, Pooled, ReduceScatter, SparseSum

__all__ = ["ReducerLayout"]


class ReducerLayout:
    """The layout side of :class:`~fastcoll.reducer.core.Reducer` (a mixin: it uses the reducer's state)."""

    _set: Any
    _hook: Any
    _tuning: Any
    _pool_bound: int  # > 0: the dense buckets borrow their buffers from a pool of that many (:mod:`.pool`)
    pool: Optional[GradBufferPool]

    @property
    def buckets(self) -> List[GradBucket]:
        """The buckets, in reduction order."""
        return self._set.buckets

    def _install_layout(self, layout: List[List[int]], lazy: bool = False) -> None:
        accum = self.comm_accum_dtype is not None
        # One-rounding reductions divide every bucket among the ranks, as a sharded optimizer does (.shards).
        pad_world = self._shard_world or (self.world_size if accum else 0)
        pooled = self._pool_bound > 0
        self._eager_slots, self.main_buckets, self.pool = [], [], None  # nothing of ours keeps the old buffers alive
        self._set.install(
            layout, self.comm_dtype, pad_world, self.main_grad_dtype, early_packs=not accum, pooled=pooled, lazy=lazy
        )
        if pooled:  # (one-rounding reductions are not chunked: their slots hold the largest bucket)
            cap = None if accum else largest_cap(self.bucket_cap_bytes)
            self.pool = GradBufferPool(self._set.buckets, self._pool_bound, self.usage.device, self.world_size, cap)
        self.main_buckets = [b for b in self._set.buckets if isinstance(b, MainGradBucket)]
        self.health.resize(len(self._set.buckets))
        self._index_reductions()
        self._count_expected()
        self._reset_progress()

    def ensure_buffers(self) -> None:
        """Allocate the bucket buffers the construction deferred (at the first forward, backward or read of them).

        A sharded optimizer built before the first forward installs its own layout first, so the construction's
        full-size buffers (float32 ones with main gradients) never exist; pooled buckets never get their own.
        """
        if self._set.deferred:
            self._set.materialize()
            self._eager_slots = self._set.eager_slots

    def _index_reductions(self) -> None:
        accum = self.comm_accum_dtype is not None
        if self.shard_grads is not None:
            dense = (AccumReduceScatter if accum else ReduceScatter)(self.comm, self.timeline, self.shard_grads)
            if self.pool is not None:
                dense = Pooled(dense, self.pool)
        elif self._hook is not None:
            dense = self._hook
        else:
            dense = (AccumAllReduce if accum else AllReduce)(self.comm, self.timeline)
        sparse = SparseSum(self.comm, self.timeline)
        self._reductions = [sparse if b.sparse else dense for b in self._set.buckets]

    def _count_expected(self) -> None:
        expected = self.usage.expected
        self._bucket_expected = [sum(expected[i] for i in b.param_indices) for b in self._set.buckets]

    def _reset_progress(self) -> None:
        """Per-iteration bucket state (gradients still missing, reductions in flight, early packs).

        Also binds the lookups the gradient hook needs.
        """
        s = self._set
        nb = len(s.buckets)
        self._pending = self._bucket_expected[:]
        self._inflight: List[Optional[InFlight]] = [None] * nb
        self._n_packed = [0] * nb
        self._packed = bytearray(len(self.params))
        self._next_bucket = 0
        self._bucket_of, self._eager_slots, self._slot_pos = s.bucket_of, s.eager_slots, s.slot_pos

    def rebuild_buckets(self) -> bool:
        """Rebuild the layout from the recorded ready order, once; rank 0's order wins.

        Collective (a broadcast) when a rebuild is pending; every rank has one
        pending after the same iteration, since the order is recorded during
        the first synchronized backward.

        Returns:
            True if a rebuild took place (even one that kept the layout).
        """
        layout = self._set.next_layout(self.comm, self.usage.device)
        if layout is None:
            return False
        if layout != self.layout():
            self._install_layout(layout)
        return True

    def prepare_layout(self) -> None:
        """Layout changes due at a forward, on every rank alike (joined ranks too): the one rebuild, then autotuning steps."""
        self.rebuild_buckets()
        if self._tuning is not None and self._set.order.rebuilt and not self._tuning.frozen and not self.closed:
            layout = self._tuning.next_layout(self)
            if layout is not None and layout != self.layout():
                self._install_layout(layout)
        self.ensure_buffers()
