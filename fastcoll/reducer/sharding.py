"""The reducer's sharded side: buckets divided among the ranks, the gradients kept for them, the parameters' all-gather.

:meth:`ReducerSharding.shard` fixes the layout and divides every bucket
(:mod:`.shards`); from then on the reducer also owns the bucket's second
exchange, the parameters' all-gather (:mod:`.param_gather`), and the
gradients it keeps outside ``.grad`` (:mod:`.kept_grads`). Whoever updates the
ranges (:class:`fastcoll.ShardedOptimizer`) calls this API; the reducer calls
nobody back.
"""

from __future__ import annotations

from typing import Any, Collection, Dict, Iterable, Optional, Sequence, Set

import torch

from .bucket import MainGradBucket
from .kept_grads import KeptGradients
from .param_gather import ParamGather
from .pool import GradBufferPool, pooled_layout
from .reduction import ShardGrads
from .shards import ShardLayout, aligned_first

__all__ = ["ReducerSharding", "storage_bytes"]


def storage_bytes(tensors: Iterable[Any], seen: Set[int]) -> int:
    """Bytes of the storages of ``tensors`` not in ``seen`` (data pointers; each counted once, views too), added to it."""
    new = {st.data_ptr(): st.nbytes() for st in (t.untyped_storage() for t in tensors if torch.is_tensor(t))
           if st.data_ptr() not in seen and st.nbytes() > 0}  # fmt: skip
    seen.update(new)
    return sum(new.values())


class ReducerSharding:
    """The sharded side of :class:`~fastcoll.reducer.core.Reducer` (a mixin: it uses the reducer's state)."""

    shards: Optional[ShardLayout]
    buckets: list
    params: list
    shard_grads: Optional[ShardGrads]
    kept: Optional[KeptGradients]
    param_gather: Optional[ParamGather]
    main_buckets: list
    unsynchronized: bool
    pool: Optional[GradBufferPool]
    accumulate: Optional[str]
    _pool_bound: int

    def _init_unsharded(self) -> None:
        """The sharded side's state before any optimizer divides the buckets (from the reducer's ``__init__``)."""
        self._shard_world = 0  # > 0 once a sharded optimizer divides the buckets among that many ranks
        self._pool_bound = 0
        #: The pool lending the sharded buckets their full-size buffers (``grad_buffers="pool"``), else None.
        self.pool = None
        #: With the pool: how micro-batches accumulate (:data:`~fastcoll.reducer.pool.ACCUMULATE`), else None.
        self.accumulate = None
        #: The ranges of the buckets among ranks, once a sharded optimizer divided them (:meth:`shard`).
        self.shards = None
        #: This rank's range of the reduced gradients when they are reduce-scattered (``grads="sharded"``).
        self.shard_grads = None
        #: The gradients kept outside ``.grad`` once sharded (:meth:`shard`), and the parameters' all-gathers.
        self.kept = None
        self.param_gather = None

    def memory_usage(self) -> Dict[str, int]:
        """Bytes of the buffers this reducer holds now, by kind; each storage counted once, by the first kind holding it.

        ``buckets``: the flat bucket buffers (float32 with main gradients; with the pool, those lent now);
        ``comm_buffers``: wire buffers apart from them (a narrower ``comm_dtype`` with gradients as bucket views);
        ``grad_ranges``: this rank's ranges of the
        reduced gradients (``grads="sharded"``); ``param_stages``: the all-gather stages of the parameters (not the
        parameters' own storage, where a flat parameter buffer receives the all-gather).
        """
        seen: Set[int] = set()
        storage_bytes(self.params, seen)  # the parameters' own storages are not the reducer's (a flat parameter buffer)
        kept, gather = self.shard_grads, self.param_gather
        kinds = {"buckets": [b.flat_padded for b in self.buckets], "comm_buffers": [b.comm_padded for b in self.buckets],
                 "grad_ranges": list(kept.grads.values()) if kept is not None else [],
                 "param_stages": list(gather.stages.values()) if gather is not None else []}  # fmt: skip
        return {kind: storage_bytes(tensors, seen) for kind, tensors in kinds.items()}

    def shard(
        self, sharded_grads: bool, advice: str = "", pool_buffers: int = 0, accumulate: Optional[str] = None
    ) -> ShardLayout:
        """Divide every dense bucket among the ranks, for whoever updates the ranges; returns the ranges.

        The layout is fixed from here on: a ready-order rebuild still due
        happens now (a collective, as at a forward), later ones and tuning
        never. The buckets are reallocated padded (:mod:`.shards`). With
        ``sharded_grads`` each bucket is reduce-scattered instead of
        all-reduced: the reduced gradients exist only in this rank's range
        (:attr:`shard_grads`, in the gradients' dtype: float32 for main
        gradients), never in ``.grad``; :attr:`kept` presents the kept
        gradients in ``.grad``, and ``advice`` is what its refusals tell the
        user to do instead. Between iterations only.

        ``pool_buffers`` > 0 (with ``sharded_grads``): the buckets' full-size buffers exist only from their
        pack to the end of their reduce-scatter, lent by a pool of that many (:attr:`pool`, :mod:`.pool`),
        and each rank keeps only its ranges; ``accumulate`` says what ``no_sync`` does then
        (:data:`~fastcoll.reducer.pool.ACCUMULATE`): ``"reduce_scatter"`` reduces every backward.

        Raises:
            RuntimeError: already sharded, a comm hook is registered, the layout is being tuned, or a bucket is sparse.
        """
        self._check_idle("shard the buckets")
        if self.shards is not None:
            raise RuntimeError(
                "fastcoll.ShardedOptimizer: this model's buckets are already divided (by another ShardedOptimizer); "
                "build one over all its parameters (param groups can hold different hyperparameters)"
            )
        if self._hook is not None:
            raise RuntimeError("fastcoll.ShardedOptimizer: the model has a comm hook; a sharded optimizer takes none")
        if self._tuning is not None:
            raise RuntimeError(
                "fastcoll.ShardedOptimizer: the model's bucket_cap_mb is 'auto'; the optimizer state is divided along "
                "the buckets, so their layout must be fixed: pass a fixed bucket_cap_mb (e.g. the one "
                "model.tuning_report() chose)"
            )
        sparse = [self.names[i] for b in self._set.buckets if b.sparse for i in b.param_indices]
        if sparse:
            raise RuntimeError(f"fastcoll.ShardedOptimizer: parameters with sparse gradients cannot be sharded: {sparse}")
        self.rebuild_buckets()
        self._set.order.stop()
        self._shard_world = self.world_size
        if pool_buffers and sharded_grads:
            self._pool_bound = int(pool_buffers)
            self.accumulate = accumulate
        # The buckets again, padded to be divided, each with its odd-sized parameters last (the others aligned).
        nbytes = [p.numel() * p.element_size() for p in self.params]
        s = self._set  # pooled: the caps count the pooled buffers' bytes, a parameter above the cap alone (.pool)
        layout = (
            pooled_layout(s.buckets, s.specs, s.first_bucket_bytes, s.bucket_cap_bytes) if self._pool_bound else self.layout()
        )
        self._install_layout([aligned_first(b, nbytes) for b in layout])
        buckets = self._set.buckets
        self.shards = ShardLayout(
            [(b.pos, b.param_indices, [p.numel() for p in b.params], b.padded) for b in buckets], self.world_size, self.rank
        )
        if sharded_grads:
            grads, own, in_place = {}, {}, []
            for bs in self.shards.buckets:
                b = buckets[bs.pos]
                if isinstance(b, MainGradBucket) and not b.pooled:  # the float32 bucket's own range (Megatron's layout)
                    grads[bs.pos] = b.flat_padded[bs.start : bs.start + bs.shard]
                    in_place.append(bs.pos)
                else:  # (float32 for main gradients: pooled buckets keep only their ranges)
                    dtype = b.main_dtype if isinstance(b, MainGradBucket) else b.dtype
                    if b.pooled:  # kept: freeing them beside the pool's buffers doubled a CPU step (accumulate="full")
                        grads[bs.pos] = torch.zeros(bs.shard, dtype=dtype, device=self.usage.device)
                    else:
                        grads[bs.pos], own[bs.pos] = None, (bs.shard, dtype, self.usage.device)  # at its first reduction
            self.shard_grads = ShardGrads(grads, own, free_local=not self.health.check_nonfinite, in_place=in_place)
            self._index_reductions()  # the dense buckets are reduce-scattered from now on
            self.health.watched = self.shard_grads.ranges
        self.kept = KeptGradients(self, advice)
        return self.shards

    def enable_param_gather(
        self,
        stepped: Sequence[bool],
        stages: Dict[int, torch.Tensor],
        overlap: bool,
        borrowed: Dict[int, torch.Tensor],
        moved: Collection[int],
        module: Any,
    ) -> ParamGather:
        """The parameters' all-gathers of the sharded buckets (see :class:`~fastcoll.reducer.param_gather.ParamGather`).

        With ``overlap``, a forward pre-hook on every module of ``module`` registering parameters of a sharded
        bucket waits for exactly those buckets.
        """
        gather = ParamGather(self, stepped, stages, overlap, borrowed, moved)
        if overlap:
            gather.install_hooks(module)
        self.param_gather = gather
        return gather

    def before_accumulating(self) -> None:
        """Before a backward accumulates into the buckets: the all-gathers written, resets seen, nothing consumed."""
        if self.param_gather is not None:
            self.param_gather.finish()
        if self.kept is not None:
            self.kept.before_accumulating()
        if any(b.consumed for b in self.main_buckets):
            raise RuntimeError(
                "fastcoll: call opt.zero_grad() between step() and the next backward (or model.zero_grad()). The step "
                "consumed the float32 main gradients: their memory holds the parameters' all-gather, so they cannot "
                "accumulate across steps as .grad would"
            )

    def main_grad(self, idx: int) -> torch.Tensor:
        """Parameter ``idx``'s float32 main gradient: a view of its bucket (the reduced value after a synchronized backward).

        Raises:
            RuntimeError: there are no main gradients, or they are reduce-scattered (each rank holds a range).
        """
        self.ensure_buffers()
        b = self._set.buckets[self._set.bucket_of[idx]]
        if not isinstance(b, MainGradBucket):
            raise RuntimeError(
                f"fastcoll.DDP.main_grad: '{self.names[idx]}' has no float32 main gradient (construct the wrapper with "
                "main_grad_dtype=torch.float32; parameters already float32 keep theirs in .grad)"
            )
        if self.shard_grads is not None:
            raise RuntimeError(
                "fastcoll.DDP.main_grad: the main gradients are reduce-scattered (grads='sharded'): "
                "each rank holds its range only; use opt.clip_grad_norm_ / model.grad_norm() for the norm"
            )
        if b.consumed:
            raise RuntimeError(
                "fastcoll.DDP.main_grad: the optimizer's step() consumed the main gradients (their memory holds the "
                "parameters' all-gather); read them between backward and step()"
            )
        return b.views[self._set.slot_pos[idx]]

    @property
    def reduces_every_backward(self) -> bool:
        """Every backward is reduced, ``no_sync`` ones too (pooled buffers with ``accumulate="reduce_scatter"``)."""
        return self.accumulate == "reduce_scatter"

    def zero_main_grads(self, busy: Collection[int] = ()) -> None:
        """Start a new accumulation of the main gradients (``busy``: buckets whose memory is in use now, zeroed later)."""
        if self.pool is not None:
            self.pool.release_held(self.main_buckets)  # the pooled ones have no memory of their own
            return
        for b in self.main_buckets:
            if b.pos not in busy:
                b.zero()

    def zero_kept_grads(self, set_to_none: bool = True) -> None:
        """Reset the gradients kept outside ``.grad`` (main gradients, reduced ranges), as ``zero_grad`` does ``.grad``."""
        if self.kept is not None:
            # (buckets whose memory holds a pending all-gather are zeroed once it is written)
            self.kept.zero(set_to_none)
        else:
            self.zero_main_grads()
            self.unsynchronized = False
