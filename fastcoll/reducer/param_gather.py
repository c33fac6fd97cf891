"""The parameters' all-gather of a sharded bucket layout, never read stale: the bucket's second exchange.

A bucket divided among the ranks (:meth:`Reducer.shard`) has two exchanges,
both owned here in the reducer layer: the gradients' reduction
(:mod:`.reduction`) and, after whoever owns the ranges (a sharded optimizer)
updated this rank's range of the parameters, their all-gather. Each bucket's range is
all-gathered (``all_gather_into_tensor``, in place). Where the parameters live
in a flat buffer of the bucket's layout (:mod:`.param_buffer`), that buffer is
gathered into directly: this rank's range is already there (float32 masters
are rounded into it: the pack), and the other ranges land in the parameters.
Other parameters (staged) have their pieces packed (one fused call per run of
them) into the rank's range of the buffer, or of a staging buffer where the
bucket has none, and the gathered values are then written into them (one
fused call per run).

:meth:`ParamGather.start_bucket` issues one bucket's all-gather; without
overlap :meth:`ParamGather.end_step` waits for them all. With overlap, they
run on into the next forward: a forward
pre-hook on every module that registers parameters waits for the buckets
holding exactly those parameters, so a module never runs on stale weights,
whatever order modules are registered, called or bucketed in (waiting for
"the next bucket in order" instead was Megatron's stale-weight bug). Three
nets catch what module hooks cannot see:

* a forward with gradients disabled (evaluation) waits for everything first;
* at the end of a forward with gradients, a parameter whose all-gather is
  still pending but that the outputs depend on (read in the forward of a
  module that does not register it) raises an error: its value was stale;
* the first gradient of a backward, the next ``step()``, ``state_dict()``
  and ``verify_replicas()`` wait for everything (:meth:`finish`).

With :attr:`ParamGather.record_times` on (for profiling), each step also records, per bucket, when it was stepped, packed,
issued, completed (the collective's own completion callback, on the backend's
thread), waited for and written into the parameters.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence, Set

import torch
from torch import nn

from .. import ops
from .._backref import BackRef
from .bucket import MainGradBucket, for_each_run
from .timeline import profiler_active
from .usage import unreachable_parameters

__all__ = ["ParamGather"]

_ns = time.perf_counter_ns
_is_compiling: Callable[[], bool] = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)


class ParamGather:
    """The parameters' all-gathers of a sharded reducer's buckets.

    Args:
        reducer: The model's reducer (its buckets, shard ranges and communicator).
        stepped: Per reducer parameter index, whether the optimizer steps it (only those are written back).
        stages: Per sharded bucket position, the staging buffer (``padded`` elements of the parameters' dtype),
            or the bucket's parameter buffer, or None: a slot of the reducer's gradient buffer pool
            (:mod:`.pool`), drawn at the bucket's pack and given back once written into the parameters (when
            every slot is lent, the oldest pending all-gather of a drawn slot is waited for and written first;
            a bucket larger than a slot gets a stage of its own for that all-gather).
        overlap: Leave the all-gathers running after :meth:`end_step`; modules wait for their own.
        borrowed: Per bucket position, a gradient buffer whose memory the stage reuses (float32 main
            gradients, consumed by the step): zeroed once the parameters are written, ready to accumulate.
        moved: Reducer indices of the parameters that live in their bucket's stage (nothing to write back).
    """

    reducer = BackRef()  # the reducer holds this object: no cycle back to it

    def __init__(
        self,
        reducer: Any,
        stepped: Sequence[bool],
        stages: Dict[int, torch.Tensor],
        overlap: bool,
        borrowed: Optional[Dict[int, torch.Tensor]] = None,
        moved: Collection[int] = (),
    ):
        self.reducer = reducer
        # What the all-gathers need, held here: one still pending when the reducer is freed (its module kept, the
        # fastcoll.DDP deleted) is still waited for and written by the module's hooks and state_dict.
        self.comm = reducer.comm
        self.layout = reducer.shards
        self.buckets = {pos: reducer.buckets[pos] for pos in stages}
        moved = set(moved)
        #: Per bucket position, per slot: written back after the all-gather (stepped, not living in the stage).
        self.staged = {pos: [stepped[i] and i not in moved for i in reducer.buckets[pos].param_indices] for pos in stages}
        self.borrowed = borrowed or {}
        self.stepped = list(stepped)
        self.stages = stages
        self.pool = reducer.pool
        self._drawn: Dict[int, Any] = {}  # bucket position -> (pool slot, stage view) while its all-gather is pending
        self.overlap = overlap
        self._pending: Dict[int, Any] = {}  # bucket position -> all-gather handle
        self._hooks: List[Any] = []
        #: Record :attr:`times` at every :meth:`start` (off by default: a few ``perf_counter_ns`` calls per bucket).
        self.record_times = False
        #: With :attr:`record_times`, the last step's events per bucket position, ``time.perf_counter_ns()``
        #: values filled in as they happen: ``step`` (the optimizer's step of the bucket's pieces begins), ``pack``
        #: (packing begins), ``issued`` (the all-gather call returned), ``completed`` (the collective finished,
        #: where its handle has a future), ``wait`` / ``waited`` (a wait for it began / returned on the training
        #: thread) and ``written`` (the parameters hold the gathered values). A new dict per :meth:`start`, so a
        #: caller may keep the previous one.
        self.times: Dict[int, Dict[str, int]] = {}

    def borrowing(self) -> Set[int]:
        """Buckets whose gradient memory holds an all-gather not yet written into the parameters."""
        return {pos for pos in self._pending if pos in self.borrowed}

    @property
    def pending(self) -> bool:
        """Some all-gathers were issued and not yet written into the parameters."""
        return bool(self._pending)

    # ------------------------------------------------------------------ issue

    def order(self) -> List[int]:
        """The positions of the buckets to all-gather, in the order every rank issues them: the last bucket first.

        Buckets are in reduction order, the reverse of the forward's, whose first modules wait for the last buckets.
        """
        return [bs.pos for bs in reversed(self.layout.buckets) if bs.padded]

    def begin_step(self) -> None:
        """Before the ranges are updated: the last step's all-gathers written; a fresh record of times."""
        self.finish()
        if self.record_times:
            self.times = {}

    def mark(self, pos: int, event: str) -> None:
        """With :attr:`record_times`: ``event`` of bucket ``pos`` happens now."""
        if self.record_times:
            self.times.setdefault(pos, {})[event] = _ns()

    def start_bucket(self, pos: int, values: Sequence[Optional[torch.Tensor]]) -> None:
        """Pack this rank's range of bucket ``pos`` and issue its all-gather (every rank, in :meth:`order`).

        ``values``: per piece of this rank's range (in order), the 1-D values to pack there, or None where the
        range holds them already (a parameter living in the bucket's buffer).
        """
        layout = self.layout
        k = next(j for j, bs in enumerate(layout.buckets) if bs.pos == pos)
        bs, pieces = layout.buckets[k], layout.pieces[k]
        self.mark(pos, "pack")
        stage = self.stages[pos]
        if stage is None:
            stage = self._draw(pos)
        own = stage[bs.start : bs.start + bs.shard]
        if pieces:
            at = [pc.at for pc in pieces]
            end = pieces[-1].at + pieces[-1].numel
            present = [v is not None for v in values]
            for_each_run(present, at, end, lambda a, z, lo, hi: ops.flatten_scale(values[a:z], own[lo:hi]))
        b = self.buckets[pos]
        if pos in self.borrowed and isinstance(b, MainGradBucket):
            b.consumed = True  # its memory holds the parameters now: a backward must not accumulate onto it
        handle = self.comm.all_gather(stage, own, f"parameters of bucket {pos}")
        self._pending[pos] = handle
        if self.record_times:
            self.mark(pos, "issued")
            _record_completion(handle, self.times[pos])

    def _draw(self, pos: int) -> torch.Tensor:
        """A stage for bucket ``pos`` from the pool (the oldest drawn all-gather written first when none is free)."""
        b = self.buckets[pos]
        nbytes = b.padded * b.dtype.itemsize
        if not self.pool.fits(nbytes):  # larger than a slot: a stage of its own, for this all-gather only
            stage = torch.empty(b.padded, dtype=b.dtype, device=b.device)
            self._drawn[pos] = (None, stage)
            return stage
        while self.pool.full:
            self.wait([next(p for p in self._pending if p in self._drawn and self._drawn[p][0] is not None)])
        slot = self.pool.take()
        stage = slot[:nbytes].view(b.dtype)
        self._drawn[pos] = (slot, stage)
        return stage

    def end_step(self) -> None:
        """After every bucket's all-gather was issued: without overlap, wait for them all.

        With overlap too while torch's profiler records on this thread and the backend runs the all-gathers on threads
        that record into it (gloo): a profiler stopped with one still running (a schedule's ``prof.step()`` right
        after the optimizer's) crashes the process, in torch.
        """
        if not self.overlap or (self.comm.records_on_own_threads and profiler_active()):
            self.finish()

    # ------------------------------------------------------------------- wait

    def wait(self, positions: Sequence[int]) -> None:
        """Wait for the all-gathers of buckets ``positions`` (those pending) and write them into the parameters."""
        for pos in positions:
            handle = self._pending.pop(pos, None)
            if handle is not None:
                times = self.times.get(pos) if self.record_times else None
                if times is not None:
                    times["wait"] = _ns()
                self.comm.wait(handle, f"parameters of bucket {pos}")
                if times is not None:
                    times["waited"] = _ns()
                self._write(pos)
                if times is not None:
                    times["written"] = _ns()

    def finish(self) -> None:
        """Wait for every pending all-gather (in bucket order) and write them all into the parameters."""
        if self._pending:
            self.wait(sorted(self._pending))

    def _write(self, pos: int) -> None:
        b = self.buckets[pos]
        staged = self.staged[pos]
        drawn = self._drawn.pop(pos, None)
        if any(staged):
            stage = self.stages[pos] if drawn is None else drawn[1]
            params = [p.detach() for p in b.params]
            for_each_run(staged, b.offsets, b.numel, lambda a, z, lo, hi: ops.unflatten_scale(stage[lo:hi], params[a:z]))
        owner = self.borrowed.get(pos)
        if owner is not None:
            owner.zero_()
        if drawn is not None and drawn[0] is not None:
            self.pool.give(drawn[0])

    # ------------------------------------------------------------------ hooks

    def install_hooks(self, module: nn.Module) -> None:
        """A forward pre-hook on every module registering stepped parameters: it waits for their buckets."""
        bucket_of = self.reducer._set.bucket_of
        index = {id(p): i for i, p in enumerate(self.reducer.params)}
        for m in module.modules():
            positions: Set[int] = set()
            for p in m.parameters(recurse=False):
                i = index.get(id(p))
                if i is not None and self.stepped[i]:
                    positions.add(bucket_of[i])
            if positions:
                self._hooks.append(m.register_forward_pre_hook(self._hook_for(sorted(positions))))

    def _hook_for(self, positions: List[int]) -> Callable[..., None]:
        def hook(_module: nn.Module, _inputs: Any) -> None:
            # Inside a compiled graph nothing waits (the wrapper finished every all-gather before it ran).
            if self._pending and not _is_compiling():
                self.wait(positions)

        return hook

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def before_forward(self) -> None:
        """At the wrapper's forward: with gradients disabled (evaluation, no stale check possible), wait for everything."""
        if self._pending and not torch.is_grad_enabled():
            self.finish()

    def check_after_forward(self, outputs: Any) -> None:
        """Raise if the outputs depend on a parameter whose all-gather was still pending (it was read stale).

        Raises:
            RuntimeError: naming the parameters.
        """
        if not self._pending:
            return
        r = self.reducer
        waiting = [i for pos in self._pending for i in r.buckets[pos].param_indices if self.stepped[i]]
        index = {id(r.params[i]): k for k, i in enumerate(waiting)}
        unreached = set(unreachable_parameters(outputs, index, len(waiting)))
        stale = [r.names[waiting[k]] for k in range(len(waiting)) if k not in unreached]
        if stale:
            self.finish()
            shown = ", ".join(stale[:10]) + (f", ... ({len(stale)} in all)" if len(stale) > 10 else "")
            raise RuntimeError(
                f"fastcoll.ShardedOptimizer: this forward read {shown} before their all-gather after the last step "
                "had completed (they are read by a module that does not register them, whose forward pre-hook "
                "therefore did not wait). The outputs are computed from stale weights. Call opt.finish_param_sync() "
                "before such a forward, or construct the optimizer with overlap_param_gather=False (the default)."
            )


def _record_completion(handle: Any, times: Dict[str, int]) -> None:
    """Set ``times["completed"]`` when ``handle``'s collective completes (no-op for a handle without a future)."""
    get_future = getattr(handle, "get_future", None)
    if get_future is None:
        return
    try:
        fut = get_future()
    except RuntimeError:  # a backend without futures
        return
    fut.add_done_callback(lambda _fut: times.__setitem__("completed", _ns()))
