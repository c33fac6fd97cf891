"""The gradient reducer behind :class:`fastcoll.DDP`: readiness, launch order, finalize, join replay.

Life of one synchronized iteration::

    forward (DDP)   prepare_for_forward()   raise if the previous backward left
                                            buckets unreduced; rebuild the
                                            layout once (rank 0's order wins)
                    prepare_for_backward()  arm the hooks (phase ARMED); search
                                            for unused params (ParameterUsage)
    backward        post-accumulate-grad hook per parameter -> _on_grad()
                      first hook: phase BACKWARD, queue _on_backward_end on
                      the engine, mark the unused parameters ready
                      large CPU gradient final -> GradBucket.pack_one() writes
                      it into its slot while it is still in cache
                      bucket complete -> _advance() launches every complete
                      bucket in index order: its reduction (reduction.py)
                      packs it with one fused flatten_scale (scale
                      1/divisor, cast to the wire dtype) and issues the
                      all-reduce, or calls the comm hook, or starts the
                      sparse exchange; after the last bucket, the
                      used-parameter all-reduce (when usage is tracked)
    end of backward _on_backward_end() -> _finalize(): wait for the used map,
                    then each bucket's reduction writes back with one fused
                    unflatten_scale (casting from the wire dtype);
                    _end_iteration() closes the iteration (phase IDLE)

Collectives are issued in exactly this order on every rank, all through one
:class:`~fastcoll.reducer.comm.Communicator`: [layout broadcast (once)], then
per backward: bucket 0, 1, ..., B-1 (or whatever the comm hook issues for
each, in that order; a sparse bucket's row-count all-gather), then the
used-parameter all-reduce (only when usage is tracked), then the sparse
buckets' row all-gathers. The buffer broadcast of the forward (and, under
``join()``, the join protocol's all-reduces) is issued by
:class:`fastcoll.DDP` before the module runs. A rank that has joined (run out
of inputs) issues the same backward collectives with zeros through
:meth:`Reducer.replay_joined_backward`, and closes the iteration with the
same :meth:`Reducer._end_iteration`.

Low-precision communication (``comm_dtype``): the division by ``divisor``
happens in the pack, in float32, before the single rounding to the 16-bit
wire dtype; the all-reduce then sums per-rank shares of the mean, so the
result and every partial sum are bounded by the largest per-rank gradient
magnitude: nothing overflows float16 while every rank's gradients are within
its range (a naive sum-then-divide overflows at 65504 / world_size).
"""

from __future__ import annotations

import enum
import math
import threading
import warnings
import weakref
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from .._knobs import force_collectives
from ..bucketing import Caps
from ..ops.dtypes import check_comm_accum_dtype, check_comm_dtype
from .bucket import PackArgs
from .bucket_layout import ReducerLayout
from .comm import Communicator
from .health import Divisor, GradHealth
from .layout import BucketSet
from .local_accumulation import LocalAccumulation
from .reduction import CommHook, Skipped, ZeroBuffers
from .runtime_log import RuntimeLog
from .settings import ReducerSettings
from .sharding import ReducerSharding
from .timeline import Timeline
from .tuning import LayoutTuning
from .usage import ParameterUsage

__all__ = ["Phase", "Reducer"]


class Phase(enum.Enum):
    """Where the reducer is in an iteration."""

    IDLE = "idle"  #: between iterations: hooks are ignored
    ARMED = "armed"  #: prepare_for_backward ran; no gradient hook has fired yet
    BACKWARD = "backward"  #: hooks firing; the end-of-backward callback is queued
    UNFINISHED = "unfinished"  #: the backward ended with buckets unreduced (raised at the next forward)


_IDLE, _ARMED, _BACKWARD, _UNFINISHED = Phase.IDLE, Phase.ARMED, Phase.BACKWARD, Phase.UNFINISHED


def _remove_handles(handles: List[Any]) -> None:
    for h in handles:
        h.remove()
    handles.clear()


def _make_hook(ref: "weakref.ReferenceType[Reducer]", idx: int, lock: Optional[threading.Lock]) -> Callable:
    # The hook holds the reducer weakly so a dropped DDP wrapper does not keep
    # reducing gradients of a module that has been re-wrapped.
    # Between synchronized backwards (no_sync micro-batches) a gradient only
    # counts as use, as in torch's reducer: a parameter used in any backward
    # since the last synchronized one is averaged at the next.
    if lock is None:

        def hook(_param: torch.Tensor) -> None:
            r = ref()
            if r is not None:
                if r._phase is not _IDLE:
                    r._on_grad(idx)
                else:
                    r._on_idle_grad(idx)

    else:

        def hook(_param: torch.Tensor) -> None:
            r = ref()
            if r is not None:
                with lock:
                    if r._phase is not _IDLE:
                        r._on_grad(idx)
                    else:
                        r._on_idle_grad(idx)

    return hook


def _warn_if_create_graph(grad: Optional[torch.Tensor]) -> None:
    """Warn (as torch DDP does) when a backward builds a graph of its gradients: ``backward(create_graph=True)``."""
    if grad is not None and grad.requires_grad:
        warnings.warn(
            "fastcoll.DDP: backward(create_graph=True): the gradients are averaged across ranks, but their autograd "
            "graph is each rank's own: a higher-order gradient taken through them is not synchronized and does not "
            "see the averaging (torch DDP warns of the same)",
            stacklevel=3,
        )


def _register_hooks(reducer: "Reducer") -> List[Any]:
    """A post-accumulate-grad hook per parameter, holding the reducer weakly; their handles."""
    lock = threading.Lock() if len({p.device for p in reducer.params}) > 1 else None  # hooks of several devices' threads
    ref = weakref.ref(reducer)
    return [p.register_post_accumulate_grad_hook(_make_hook(ref, i, lock)) for i, p in enumerate(reducer.params)]


class Reducer(ReducerSettings, ReducerLayout, ReducerSharding, LocalAccumulation):
    """Bucketed, overlapped gradient averaging for a list of parameters.

    Args:
        params: Parameters to reduce (requires_grad, floating, one device type).
        names: Qualified name of each parameter, for messages and :meth:`bucket_info`.
        process_group: Group to reduce over (None: default group).
        bucket_cap_bytes: Byte cap of every bucket but the first of each (device, dtype), or a list of caps per bucket.
        first_bucket_bytes: Byte cap of the first bucket of each (device, dtype).
        find_unused_parameters: Search the autograd graph from the outputs
            each iteration and mark unreached parameters ready.
        gradient_as_bucket_view: Make ``param.grad`` a view into its bucket.
        static_graph: The set of used parameters and the number of times each
            one's gradient is accumulated never change: learn them in the first
            iteration and skip the search afterwards.
        comm_dtype: None, ``torch.float16`` or ``torch.bfloat16``: wider
            buckets are packed (cast and scaled in one pass) into a buffer of
            this dtype, all-reduced in it and unpacked (upcast) in one pass.
        sparse_params: Indices of parameters whose gradients are sparse
            (``nn.Embedding(sparse=True)`` weights): each gets a bucket of its
            own and its gradient is scaled and summed as a sparse tensor.
        compute_grad_norm: Gradient health (:mod:`.health`): the norm from the write-back.
        check_nonfinite: Gradient health (:mod:`.health`): flag NaN/Inf in the pack.
        record_timeline: Record per-bucket event times (:mod:`.timeline`).
        autotune: Tune the bucket layout while training (``bucket_cap_mb="auto"``, :mod:`.tuning`);
            ``bucket_cap_bytes`` is then the default the tuner starts from.
        stall_timeout: Seconds a wait for a collective may take before every
            rank diagnoses the stall (:mod:`fastcoll.stall`); None: the default
            rule; 0 (the default for a bare Reducer): no protection.
        skip_unused_buckets: A bucket whose parameters are all unused in an
            iteration (found unreachable, or learned unused by a static graph)
            issues no collective and keeps its gradients (torch DDP's
            ``skip_all_reduce_unused_params``). Every rank must find the same
            parameters unused, or the ranks' collectives no longer match.
        main_grad_dtype: None or ``torch.float32``: the buckets of 16-bit
            parameters accumulate every backward's gradients in float32
            (:class:`~fastcoll.reducer.bucket.MainGradBucket`), ``no_sync``
            ones included; the reduced values stay there (:meth:`main_grad`),
            not in ``.grad``.
        comm_accum_dtype: None, or ``torch.float32`` with a 16-bit
            ``comm_dtype``: each dense bucket's 16-bit values are exchanged by
            an all-to-all and summed in float64, rounded once to float32, on
            the rank that owns each range (:class:`~fastcoll.reducer.reduction.AccumAllReduce`,
            :class:`~fastcoll.reducer.reduction.AccumReduceScatter`): one
            rounding for a reduce-scatter, two for an all-reduce, whatever
            the world size.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        process_group: Optional[dist.ProcessGroup] = None,
        *,
        bucket_cap_bytes: Caps = 25 * 1024 * 1024,
        first_bucket_bytes: int = 1024 * 1024,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        comm_dtype: Optional[torch.dtype] = None,
        sparse_params: Sequence[int] = (),
        compute_grad_norm: bool = False,
        check_nonfinite: bool = False,
        record_timeline: bool = True,
        autotune: bool = False,
        stall_timeout: Optional[float] = 0,
        skip_unused_buckets: bool = False,
        main_grad_dtype: Optional[torch.dtype] = None,
        comm_accum_dtype: Optional[torch.dtype] = None,
    ):
        self.params: List[torch.Tensor] = list(params)
        self.names: List[str] = list(names)
        n = len(self.params)
        if n == 0:
            raise ValueError("fastcoll.Reducer: no parameters to reduce")
        check_comm_dtype(comm_dtype)
        check_comm_accum_dtype(comm_accum_dtype, comm_dtype)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.comm = Communicator(
            process_group, self.world_size, force_collectives(), stall_timeout=stall_timeout, device=self.params[0].device
        )
        #: Run-time divisor folded into the pack: gradients are averaged over this many ranks.
        self.divisor: float = float(self.world_size)
        self.bucket_cap_bytes: Caps = (
            bucket_cap_bytes if isinstance(bucket_cap_bytes, int) else [int(c) for c in bucket_cap_bytes]
        )
        self.first_bucket_bytes = int(first_bucket_bytes)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.skip_unused_buckets = bool(skip_unused_buckets)
        self.main_grad_dtype: Optional[torch.dtype] = main_grad_dtype
        self._init_local_accumulation()
        self._init_unsharded()
        self.comm_dtype: Optional[torch.dtype] = comm_dtype
        #: None, or torch.float32: the dense buckets' 16-bit values are summed into float32 (:meth:`_index_reductions`).
        self.comm_accum_dtype: Optional[torch.dtype] = comm_accum_dtype
        self._sparse = [False] * n
        for i in sparse_params:
            self._sparse[i] = True
        self.usage = ParameterUsage(
            self.params, self.comm, self.params[0].device, self.find_unused_parameters, bool(static_graph)
        )
        # A dynamic graph (find_unused without static_graph) has no one ready order to learn from.
        self._set = BucketSet(
            self.params, self.names, self._sparse, self.first_bucket_bytes, self.bucket_cap_bytes,
            self.gradient_as_bucket_view, record_order=not self.usage.searching,
        )  # fmt: skip
        self._hook: Optional[CommHook] = None
        self._phase = _IDLE
        self.timeline = Timeline(enabled=bool(record_timeline))
        #: torch DDP's logging data recorded while training (sampled times, the last error).
        self.runtime_log = RuntimeLog()
        self._tuning = LayoutTuning() if autotune else None
        self.health = GradHealth(bool(compute_grad_norm), bool(check_nonfinite), self.params[0].device)
        self._user_divisor: Divisor = None
        self._how = PackArgs()
        self._install_layout(self._set.initial_layout(), lazy=True)  # buffers at first need (ensure_buffers)

        self._handles: List[Any] = _register_hooks(self)
        self._finalizer = weakref.finalize(self, _remove_handles, self._handles)

    @property
    def static_graph(self) -> bool:
        return self.usage.static_graph

    @property
    def reducing(self) -> bool:
        """A backward is being reduced (started, or ended with buckets left): no reconfiguration now."""
        return self._phase is _BACKWARD or self._phase is _UNFINISHED

    # ---------------------------------------------------------------- forward

    def prepare_for_forward(self) -> None:
        """Start of a forward that may be followed by a synchronized backward.

        Raises:
            RuntimeError: if the previous synchronized backward left some
                parameters without gradients, naming them.
        """
        if self.reducing:
            self._raise_unfinished()
        self.forwarded = True
        if self.kept is not None:
            self.kept.reconcile(at_step=False)  # resets since the last backward (the guards stay in .grad)
        self.prepare_layout()
        self.timeline.begin_iteration(len(self._set.buckets))
        self.comm.state.begin_forward(self.usage.iterations)

    def prepare_for_backward(self, outputs: Optional[Any] = None) -> None:
        """Arm the hooks for the next backward.

        Args:
            outputs: The forward's output (any nesting); searched for
                parameters that cannot receive a gradient when unused
                parameters are being found dynamically; ignored otherwise.
        """
        if self.closed:
            return
        self.timeline.forward_end()
        self._phase = _ARMED
        self._reset_progress()
        self.usage.begin_iteration(outputs)
        self._set.order.restart()
        self.runtime_log.forward_end(self.timeline, self.usage.graph_static)

    # --------------------------------------------------------------- backward

    def _on_grad(self, idx: int) -> None:
        """Hook body: parameter ``idx``'s gradient has been accumulated."""
        if self._phase is not _BACKWARD:
            self._start_backward(idx)
        usage = self.usage
        observed = self._set.order.observed
        if usage.learning_static_graph:
            usage.hook_counts[idx] += 1
            if observed is not None:
                observed.append(idx)
            return
        rem = usage.remaining[idx]
        if rem <= 0:
            self._raise_marked_twice(idx)
        usage.remaining[idx] = rem - 1
        if usage.track_used:
            usage.local_used[idx] = 1
        pos = self._bucket_of[idx]
        self.timeline.ready(pos, idx)
        if rem == 1:
            if observed is not None:
                observed.append(idx)
            slot = self._eager_slots[idx]
            if slot is not None and self._set.buckets[pos].pack_one(
                self._slot_pos[idx], slot, self._how.with_flag(self.health.flag(pos))
            ):
                self._packed[idx] = 1
                self._n_packed[pos] += 1
        left = self._pending[pos] - 1
        self._pending[pos] = left
        if left == 0 and pos == self._next_bucket:
            self._advance()

    def _start_backward(self, idx: int) -> None:
        """The first gradient hook of a backward (parameter ``idx``'s)."""
        self.ensure_buffers()  # (a backward without the wrapper's forward)
        first = self._phase is _ARMED  # not a second backward after an unfinished one
        if first:
            try:
                self.before_accumulating()
            except BaseException:
                self._phase = _IDLE  # refused before anything was reduced: the next forward starts afresh
                raise
        self._phase = _BACKWARD
        if first:
            self.unsynchronized = False
            if self.shard_grads is not None:
                self.shard_grads.set_aside()
            self._how = self._pack_args()
            self.health.begin_iteration()
            self.timeline.backward_start()
            self.comm.state.begin_backward()
            _warn_if_create_graph(self.params[idx].grad)
        torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        if first:
            usage = self.usage
            for idx in usage.unused:
                usage.remaining[idx] = 0
                self._pending[self._bucket_of[idx]] -= 1
            if not usage.learning_static_graph:
                self._advance()

    def _advance(self) -> None:
        """Launch, in index order, every complete bucket not launched yet; after the last, the used-parameter map."""
        buckets = self._set.buckets
        i = self._next_bucket
        nb = len(buckets)
        while i < nb and self._pending[i] == 0:
            self._next_bucket = i + 1
            b = buckets[i]
            if self.skip_unused_buckets and self.usage.all_unused(b.param_indices):
                self._inflight[i] = Skipped()
            else:
                done = [self._packed[j] for j in b.param_indices] if self._n_packed[i] else None
                self._inflight[i] = self._reductions[i].start(b, self._how.with_flag(self.health.flag(i)), done)
            i += 1
        if i == nb and self.usage.track_used and not self.usage.used_map_started:
            self.usage.start_used_map()

    def _on_backward_end(self) -> None:
        """Engine callback at the end of a backward in which hooks fired."""
        self._phase = _UNFINISHED
        self.timeline.backward_end()
        if self.usage.learning_static_graph:
            # The learning backward launched nothing: everything it counted is ready now.
            self.usage.learn_from_hooks()
            self._pending = [0] * len(self._set.buckets)
            self._advance()
        elif self.usage.searching and self._next_bucket < len(self._set.buckets):
            self._mark_unreached()
        if self._next_bucket < len(self._set.buckets):
            # Some gradients are missing: raised at the next forward; published now, so
            # that a stall report on the other ranks names them even if this rank dies.
            self.comm.state.end_backward(self.unfinished_names())
            if self.comm.guard is not None:
                self.comm.guard.publish()
            return
        self.comm.state.end_backward()
        self._finalize()

    def _mark_unreached(self) -> None:
        """End of a backward with unused parameters searched: the parameters it did not reach are ready.

        They were reachable from the forward's outputs, but the loss did not
        depend on those outputs (a head whose output the loss ignores). torch's
        reducer gets them through its output sink, whose backward sends them
        undefined gradients: each counts as ready, contributes its ``.grad``
        as it stands (zeros when None) and is locally used only if it has a
        ``.grad``. The same here, at the end of backward.
        """
        usage, params = self.usage, self.params
        for idx in usage.unfinished():
            if params[idx].grad is not None:
                usage.local_used[idx] = 1
            self._pending[self._bucket_of[idx]] -= usage.remaining[idx]
            usage.remaining[idx] = 0
        self._advance()

    def _finalize(self) -> None:
        usage, health = self.usage, self.health
        self.timeline.finalize_start()
        for f in self._inflight:  # second phases still due (comm_accum_dtype), in bucket order, on every rank alike
            f.settle()
        health.find_local_nonfinite(self._set.buckets)  # before write-back, while local values are in the gradients
        pairs = list(zip(self._set.buckets, self._inflight))
        if usage.used_map_started:
            # Buckets whose gradients all arrived here do not depend on the
            # global map: queue their write-backs before the host reads it.
            rest = []
            for b, f in pairs:
                if not b.sparse and usage.used_here(b.param_indices):
                    f.finish(None, health.slot(b.pos))
                else:
                    rest.append((b, f))
            pairs = rest
        usage.finish_used_map()
        for _, f in pairs:
            f.after_used_map()
        used = usage.global_used
        for b, f in pairs:
            f.finish(None if used is None else [used[i] for i in b.param_indices], health.slot(b.pos))
        if used is not None and health.sums is not None:  # gradients kept by parameters unused everywhere count too
            health.add_outside(
                [p.grad for i, p in enumerate(self.params) if not used[i] and not self._sparse[i] and p.grad is not None]
            )
        shards = self.shard_grads
        if shards is not None:
            shards.written()
            if not shards.free_local:  # kept for the non-finite blame above; the reduced values are in the ranges
                for p in self.params:
                    p.grad = None
        total = health.finish(self.params, self._sum_over_ranks if shards is not None else None)
        if self.kept is not None:
            self.kept.after_backward()
            health.refresh_snapshot(self.params)  # the guards and agreed values are the gradients the norm describes
        self.timeline.finalize_end()
        self._end_iteration(joined=False)
        if total is not None and not math.isfinite(total.item()):  # one read (a tensor isfinite + bool costs two ops)
            self.health.raise_nonfinite(self.comm, self.process_group, self._set.buckets, self.usage.iterations)

    def _sum_over_ranks(self, t: torch.Tensor) -> None:
        """SUM-all-reduce ``t`` in place and wait (the sharded gradients' sum of squares: one small collective)."""
        self.comm.wait(self.comm.all_reduce(t, "gradient norm"), "gradient norm")

    def _end_iteration(self, joined: bool) -> None:
        """Close a synchronized iteration: the one place shared by training ranks and join replays."""
        learned = self.usage.learning_static_graph
        self.usage.end_iteration()
        if learned:
            self._count_expected()
        self._set.order.end_iteration(joined)
        self.timeline.end_iteration()
        if not joined:
            self.runtime_log.end_iteration(self)
        self.comm.state.end_iteration()
        self._inflight = [None] * len(self._set.buckets)
        self._phase = _IDLE

    # ------------------------------------------------------------------- join

    def replay_joined_backward(self) -> None:
        """On a rank that has run out of inputs: issue one synchronized backward's collectives with zeros.

        Same collectives, same order as on the ranks still training (each
        bucket's reduction started with zeros, the used-parameter all-reduce
        when usage is tracked, the sparse row gathers); this rank's gradients
        are left untouched. The iteration then closes as a trained one does
        (:meth:`_end_iteration`), so every rank agrees on what the next
        iteration issues.
        """
        self.ensure_buffers()
        zeros = ZeroBuffers()
        how = self._pack_args()  # the training ranks' factor (the divisor is set by the join protocol)
        usage = self.usage
        inflight = [
            Skipped() if self.skip_unused_buckets and usage.all_unused(b.param_indices) else r.start_zeros(b, zeros, how)
            for b, r in zip(self._set.buckets, self._reductions)
        ]
        if usage.searching or usage.learning_static_graph:
            usage.start_used_map(joined=True)
        for f in inflight:
            f.settle()
        usage.finish_used_map()
        for f in inflight:
            f.after_used_map()
        for f in inflight:
            f.finish(None)
        self._end_iteration(joined=True)
