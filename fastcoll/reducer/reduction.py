"""The ways a bucket is reduced, one class each: all-reduce, comm hook, sparse sum.

Each way has

* ``start(bucket, how, done)``: pack the bucket (:class:`~fastcoll.reducer.bucket.PackArgs`) and issue its collective(s)
  (in the bucket's turn, in index order on every rank); returns an
  :class:`InFlight` reduction;
* ``start_zeros(bucket, zeros, how)``: issue the same collectives with zeros, for a
  rank that has joined (run out of inputs) and replays a backward (``how``:
  the pack factor the ranks still training use, for reductions whose joined
  ranks compute part of the result);

and the :class:`InFlight` object it returns has ``settle()`` (the second
collective of a two-phase reduction, issued in bucket order: at the next
bucket's start and, for the last, at the start of finalize, before anything
whose order differs between ranks), ``after_used_map()`` (the
second phase some reductions issue after the used-parameter all-reduce) and
``finish(used, sumsq)`` (wait, then write the result into the gradients,
with the sum of squares of what was written into ``sumsq`` when given; a
replayed one only waits). The reducer never asks which way a bucket goes.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import ops
from ..distributed.sparse import SparseExchange, empty_sparse_grad
from .bucket import GradBucket, MainGradBucket, PackArgs, pack_range
from .comm import DONE, Communicator
from .hooks import call_hook, hook_result
from .timeline import Timeline

__all__ = [
    "AccumAllReduce", "AccumReduceScatter", "AllReduce", "CommHook", "InFlight", "Pooled", "ReduceScatter", "ShardGrads",
    "Skipped", "SparseSum", "ZeroBuffers",
]  # fmt: skip


class InFlight:
    """A reduction under way. This base class is the replayed kind: it only waits."""

    __slots__ = ("handle", "timeline", "comm", "what")

    def __init__(self, handle: Any, timeline: Optional[Timeline] = None, comm: Optional[Communicator] = None, what: str = ""):
        self.handle = handle
        self.timeline = timeline
        self.comm = comm
        self.what = what

    def wait(self) -> Any:
        """Wait for the handle (bounded by the stall timeout when the communicator has one)."""
        return self.handle.wait() if self.comm is None else self.comm.wait(self.handle, self.what)

    def settle(self) -> None:
        """Issue the second collective of a two-phase reduction, once (nothing, for most)."""

    def after_used_map(self) -> None:
        """Issue what comes after the used-parameter all-reduce (nothing, for most)."""

    def finish(self, used: Optional[Sequence[bool]], sumsq: Optional[torch.Tensor] = None) -> None:
        """Wait for the reduction (and write it back; not for a replay)."""
        self.wait()


class Skipped(InFlight):
    """A bucket whose parameters are all unused on every rank (``skip_all_reduce_unused_params``): no collective.

    Its gradients are left as they are; they count towards the norm as the
    gradients of globally unused parameters do (:meth:`GradHealth.add_outside`).
    """

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(DONE)

    def finish(self, used: Optional[Sequence[bool]], sumsq: Optional[torch.Tensor] = None) -> None:
        if sumsq is not None:
            sumsq.zero_()


class ZeroBuffers:
    """The zeros a join replay sends: one buffer per (device, dtype), the size of the largest bucket, reused.

    A replayed collective receives the training ranks' sum (and a comm hook
    may write into its buffer), so each use must complete before the buffer
    is zeroed again for the next: the replay waits for each. The joined rank
    thus issues its bucket collectives one after another, still in bucket order.
    """

    def __init__(self) -> None:
        self._bufs: Dict[Tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def get(self, device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """``numel`` zeros: a prefix of the shared buffer, zeroed again."""
        key = (device, dtype)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._bufs[key] = torch.zeros(numel, dtype=dtype, device=device)
            return buf
        return buf[:numel].zero_()


# ------------------------------------------------------------------ all-reduce


def _write_back(
    tl: Timeline, b: GradBucket, src: torch.Tensor, used: Optional[Sequence[bool]], sumsq: Optional[torch.Tensor]
) -> None:
    tl.completed(b.pos)
    tl.writeback_start(b.pos)
    b.write_back(src, used, sumsq=sumsq)
    tl.writeback_end(b.pos)


def _packed(tl: Timeline, b: GradBucket, how: PackArgs, done: Optional[Sequence[int]]) -> None:
    tl.pack_start(b.pos)
    b.pack(how, done)
    tl.pack_end(b.pos)


class _Reduced(InFlight):
    __slots__ = ("bucket",)

    def __init__(self, bucket: GradBucket, handle: Any, timeline: Timeline, comm: Communicator):
        super().__init__(handle, timeline, comm, f"bucket {bucket.pos}")
        self.bucket = bucket

    def finish(self, used: Optional[Sequence[bool]], sumsq: Optional[torch.Tensor] = None) -> None:
        self.wait()
        _write_back(self.timeline, self.bucket, self.bucket.comm, used, sumsq)


class AllReduce:
    """Pack scaled by 1/divisor (cast to the wire dtype), one SUM all-reduce, unpack (cast back)."""

    def __init__(self, comm: Communicator, timeline: Timeline):
        self.comm = comm
        self.timeline = timeline

    def start(self, b: GradBucket, how: PackArgs, done: Optional[Sequence[int]]) -> InFlight:
        _packed(self.timeline, b, how, done)
        self.timeline.issued(b.pos)  # stamped before the call: the collective may complete before it returns
        handle = self.comm.all_reduce(b.comm, f"bucket {b.pos}") if b.numel else DONE
        self.timeline.watch(handle, b.pos)  # "completed" when the collective completes, not when finalize waits
        return _Reduced(b, handle, self.timeline, self.comm)

    def start_zeros(self, b: GradBucket, zeros: ZeroBuffers, how: PackArgs) -> InFlight:
        if b.numel:
            zeros_in = zeros.get(b.device, b.comm.dtype, b.numel)
            self.comm.wait(self.comm.all_reduce(zeros_in, f"bucket {b.pos}"), f"bucket {b.pos}")
        return InFlight(DONE)


# ------------------------------------------------------------- reduce-scatter


class ShardGrads:
    """This rank's range of every sharded bucket's reduced gradients, kept between backwards until zeroed (and, by
    ``zero_grad(set_to_none=True)``, freed where the range has memory of its own outside a gradient pool).

    ``grads[pos]`` holds bucket ``pos``'s range (``shard`` elements, the
    gradients' dtype); a synchronized backward writes it, or adds to it when
    it was not zeroed since the last one (gradients accumulate until
    ``zero_grad``, as ``.grad`` does). ``free_local`` drops each parameter's
    local ``.grad`` once its bucket is packed.
    """

    def __init__(
        self,
        grads: Dict[int, Optional[torch.Tensor]],
        own: Dict[int, Tuple[int, torch.dtype, torch.device]],
        free_local: bool,
        in_place: Sequence[int] = (),
    ):
        #: Per bucket position (in bucket order), its range: a tensor, or None while released.
        self.grads = grads
        #: (numel, dtype, device) of the ranges that ``zero_grad`` frees, allocated at the first reduction after it.
        self._own = own
        self.free_local = free_local
        #: Buckets whose range is this rank's range of the bucket itself (float32 main gradients, reduce-scattered
        #: in place): the rest of the bucket is zeroed after the reduction, and the range is set aside while
        #: the next backwards accumulate into the bucket (:meth:`set_aside`).
        self.in_place = set(in_place)
        self._aside: Dict[int, torch.Tensor] = {}
        #: The ranges hold gradients a later synchronized backward must add to.
        self.filled = False
        #: The ranges are zeros not written yet (``zero_grad(set_to_none=False)``): a read writes them
        #: (:meth:`readable`), a synchronized backward writes its gradients as into empty ranges.
        self.zeros = False
        #: Per in-place bucket reduced since its last zeroing: the parts of its buffer outside the range, which
        #: hold this rank's share of the others' ranges (zeroed by the bucket's zeroing, or before a backward).
        self._rest: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    def zero(self) -> None:
        """Forget the kept gradients (the next synchronized backward writes them afresh).

        The in-place ranges are not touched here: they are zeroed with their buckets, which the caller zeroes
        next (:meth:`Reducer.zero_main_grads`; a bucket whose memory an all-gather uses, once it is written).
        """
        self.filled = self.zeros = False
        self._aside, self._rest = {}, {}

    def zero_lazily(self) -> None:
        """``zero_grad(set_to_none=False)``: every range holds zeros, written only if read before a backward."""
        self._aside = {}
        self.filled, self.zeros = False, True

    def readable(self) -> bool:
        """The ranges hold gradients to read: reduced ones, or zeros (written now if they were pending)."""
        if self.zeros:
            torch._foreach_zero_([self.target(pos) for pos in self.grads])
            self.filled, self.zeros = True, False
        return self.filled

    def written(self) -> None:
        """A synchronized backward wrote (or added) its reduced gradients into every range."""
        self.filled, self.zeros = True, False

    def release(self) -> None:
        """``zero_grad(set_to_none=True)``: forget the kept gradients and free the ranges of their own (as torch frees
        ``.grad``); the next synchronized backward allocates them again."""
        self.filled = self.zeros = False
        self._aside = {}
        for pos in self._own:
            self.grads[pos] = None

    def target(self, pos: int) -> torch.Tensor:
        """Bucket ``pos``'s range, allocated if it was released (its values then undefined: the reduction writes it)."""
        g = self.grads[pos]
        if g is None:
            numel, dtype, device = self._own[pos]
            g = self.grads[pos] = torch.empty(numel, dtype=dtype, device=device)
        return g

    def ranges(self) -> List[Optional[torch.Tensor]]:
        """Every bucket's range in bucket order (None: released)."""
        return list(self.grads.values())

    def reduced_in_place(self, pos: int, padded: torch.Tensor) -> None:
        """In-place bucket ``pos`` (whose whole buffer is ``padded``) was reduced: outside its range it holds the
        others' partial sums until a zeroing (the bucket's, or :meth:`set_aside` before a backward adds to it)."""
        g = self.grads[pos]
        start = g.storage_offset() - padded.storage_offset()
        self._rest[pos] = (padded[:start], padded[start + g.numel() :])

    def set_aside(self) -> None:
        """Before backwards accumulate into in-place buckets: the parts outside their ranges zeroed where a reduction
        left partial sums there, and ranges still holding reduced gradients moved out.

        Pending zeros need no keeping: the synchronized backward writes the ranges as empty ones.
        """
        self.zeros = False
        for before, after in self._rest.values():
            before.zero_()
            after.zero_()
        self._rest = {}
        if self.filled and not self._aside:
            for pos in self.in_place:
                g = self.grads[pos]
                self._aside[pos] = g.clone()
                g.zero_()

    def take_aside(self, pos: int) -> Optional[torch.Tensor]:
        return self._aside.pop(pos, None)


class _Scattered(InFlight):
    __slots__ = ("bucket", "out", "target", "add", "shards")

    def __init__(self, bucket: GradBucket, handle: Any, timeline: Timeline, comm: Communicator, out, target, add, shards):
        super().__init__(handle, timeline, comm, f"bucket {bucket.pos}")
        self.bucket = bucket
        self.out = out
        self.target = target
        self.add = add
        self.shards = shards

    def finish(self, used: Optional[Sequence[bool]], sumsq: Optional[torch.Tensor] = None) -> None:
        self.wait()
        self.land(sumsq)

    def land(self, sumsq: Optional[torch.Tensor]) -> None:
        """The reduced range is in ``out``: move it into the target (or add it), tidy the bucket."""
        b = self.bucket
        self.timeline.completed(b.pos)
        with torch.no_grad():
            if self.add:
                self.target.add_(self.out)
            elif self.out is not self.target:
                self.target.copy_(self.out)
            if b.pos in self.shards.in_place:
                self.shards.reduced_in_place(b.pos, b.flat_padded)  # (the next backward or zero_grad zeroes the rest)
                aside = self.shards.take_aside(b.pos)
                if aside is not None:
                    self.target.add_(aside)
            elif isinstance(b, MainGradBucket) and not b.pooled:
                b.zero()  # its sum is in the range now (a pooled bucket's buffer goes back instead)
        self.sum_squares(sumsq)

    def sum_squares(self, sumsq: Optional[torch.Tensor]) -> None:
        """The sum of squares of the range (what it holds now) into ``sumsq``, when given."""
        if sumsq is not None:
            ops.sum_of_squares([self.target], out=sumsq)


class ReduceScatter:
    """Pack scaled by 1/divisor (cast to the wire dtype), one SUM reduce-scatter into this rank's range; no write-back.

    The reduced values exist only in this rank's range (:class:`ShardGrads`),
    which the sharded optimizer steps; the local ``.grad`` of the bucket's
    parameters is released once packed (unless ``free_local`` is off).
    """

    def __init__(self, comm: Communicator, timeline: Timeline, shards: ShardGrads):
        self.comm = comm
        self.timeline = timeline
        self.shards = shards

    def _release_local(self, b: GradBucket) -> None:
        """The packed bucket's local ``.grad`` go (with ``free_local``), before its range is allocated: a peak holds
        one or the other."""
        if self.shards.free_local:
            for p in b.params:
                p.grad = None

    def start(self, b: GradBucket, how: PackArgs, done: Optional[Sequence[int]]) -> InFlight:
        _packed(self.timeline, b, how, done)
        self._release_local(b)
        target = self.shards.target(b.pos)
        in_place = b.pos in self.shards.in_place
        add = self.shards.filled and not in_place  # (an in-place range was set aside, and is added back at the end)
        if in_place and b.comm_padded is b.flat_padded:
            out = target  # reduce-scattered in place: the range is a view of the bucket
        else:
            out = target if target.dtype == b.comm.dtype and not add else torch.empty_like(target, dtype=b.comm.dtype)
        self.timeline.issued(b.pos)
        handle = self.comm.reduce_scatter(out, b.comm_padded, f"bucket {b.pos}") if b.numel else DONE
        self.timeline.watch(handle, b.pos)
        return _Scattered(b, handle, self.timeline, self.comm, out, target, add, self.shards)

    def start_zeros(self, b: GradBucket, zeros: ZeroBuffers, how: PackArgs) -> InFlight:
        if b.numel:
            out = torch.empty(b.padded // self.comm.world_size, dtype=b.comm.dtype, device=b.device)
            inp = zeros.get(b.device, b.comm.dtype, b.padded)
            self.comm.wait(self.comm.reduce_scatter(out, inp, f"bucket {b.pos}"), f"bucket {b.pos}")
        return InFlight(DONE)


# ------------------------------------------- 16-bit wire, float32 accumulation


def _wire_and_scale(how: PackArgs) -> Tuple[PackArgs, float]:
    """The pack of a one-rounding reduction and the factor of its sum.

    The pack only casts to the wire dtype (and checks for NaN/Inf); 1/divisor
    is applied by the sum, before its one rounding (:func:`fastcoll.ops.sum_chunks`), so
    16-bit gradients travel exactly as they are. A device divisor
    (``scale_by``) stays in the pack, as without ``comm_accum_dtype``.
    """
    if how.scale_by is not None:
        return how, 1.0
    return how._replace(scale=1.0), how.scale


def _exchange(comm: Communicator, b: GradBucket, src: torch.Tensor) -> Tuple[torch.Tensor, Any]:
    """Issue the all-to-all of ``src`` (``b.padded`` 16-bit values, N ranges); returns the receive buffer and handle."""
    recv = torch.empty(b.padded, dtype=src.dtype, device=b.device)
    return recv, comm.all_to_all(recv, src, f"bucket {b.pos}")


def _sum_received(comm: Communicator, b: GradBucket, recv: torch.Tensor, out: torch.Tensor, scale: float) -> None:
    """The sum of every rank's values of this rank's range, times ``scale``, into ``out`` (one rounding to float32)."""
    with torch.no_grad():
        ops.sum_chunks(recv.view(comm.world_size, b.padded // comm.world_size), out, scale)


def _own_range(comm: Communicator, padded: torch.Tensor) -> torch.Tensor:
    """This rank's range of a bucket-long buffer (its ``world_size`` equal ranges, :mod:`.shards`)."""
    shard = padded.numel() // comm.world_size
    return padded[comm.rank * shard : (comm.rank + 1) * shard]


class _Gathered(_Reduced):
    """Phase one: the all-to-all; :meth:`settle`: the float32 sum into this rank's range, the all-gather."""

    __slots__ = ("recv", "scale")

    def __init__(self, bucket: GradBucket, handle: Any, recv: Optional[torch.Tensor], scale: float, timeline, comm):
        super().__init__(bucket, handle, timeline, comm)
        self.recv = recv  # None once settled
        self.scale = scale

    def _into(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Where the all-gather lands (the bucket's wire buffer) and this rank's range of it."""
        return self.bucket.comm_padded, _own_range(self.comm, self.bucket.comm_padded)

    def settle(self) -> None:
        if self.recv is None:
            return
        b, comm = self.bucket, self.comm
        self.wait()
        gathered, own = self._into()
        _sum_received(comm, b, self.recv, own, self.scale)
        self.recv = None
        self.handle = comm.all_gather(gathered, own, f"bucket {b.pos}")
        if self.timeline is not None:
            self.timeline.watch(self.handle, b.pos)

    def finish(self, used: Optional[Sequence[bool]], sumsq: Optional[torch.Tensor] = None) -> None:
        self.settle()
        super().finish(used, sumsq)


class AccumAllReduce(AllReduce):
    """All-reduce with 16-bit values on the wire, summed exactly (``comm_accum_dtype``): two roundings whatever N.

    The pack casts to the 16-bit wire dtype (unscaled); an all-to-all sends
    each rank its range of every rank's bucket; :func:`fastcoll.ops.sum_chunks`
    sums them in float64 in rank order, times 1/divisor, rounds once to
    float32 and from there to 16 bits into this rank's range of the wire
    buffer; an all-gather of the 16-bit ranges
    (its second phase, :meth:`InFlight.settle`) completes the bucket, which
    is unpacked as after an all-reduce. A ring all-reduce in 16 bits rounds
    N-1 times.

    The all-gather of bucket k is issued when bucket k+1 starts (the last
    one's by the reducer at the start of finalize), in bucket order on every
    rank: that start waits for bucket k's all-to-all (usually complete by
    then: it was issued a bucket's worth of backward earlier).
    """

    def __init__(self, comm: Communicator, timeline: Timeline):
        super().__init__(comm, timeline)
        self._last: Optional[InFlight] = None  # the last bucket started: its second phase is due at the next start

    def _started(self, f: InFlight) -> InFlight:
        last, self._last = self._last, f
        if last is not None:
            last.settle()  # a no-op when finalize settled it already
        return f

    def start(self, b: GradBucket, how: PackArgs, done: Optional[Sequence[int]]) -> InFlight:
        pack, scale = _wire_and_scale(how)
        _packed(self.timeline, b, pack, done)
        self.timeline.issued(b.pos)
        if not b.numel:
            return _Gathered(b, DONE, None, scale, self.timeline, self.comm)
        recv, handle = _exchange(self.comm, b, b.comm_padded)
        return self._started(_Gathered(b, handle, recv, scale, self.timeline, self.comm))

    def start_zeros(self, b: GradBucket, zeros: ZeroBuffers, how: PackArgs) -> InFlight:
        if not b.numel:
            return InFlight(DONE)
        recv, handle = _exchange(self.comm, b, torch.zeros(b.padded, dtype=b.comm.dtype, device=b.device))
        return self._started(_ZeroGathered(b, handle, recv, _wire_and_scale(how)[1], self.comm))


class _ZeroGathered(_Gathered):
    """A joined rank's replay of :class:`_Gathered`: the same two collectives, into buffers of its own.

    The training ranks' values of this rank's range still arrive here: their
    sum (times the training ranks' ``scale``) is this rank's share of the
    all-gather, as on a training rank; nothing is written back.
    """

    __slots__ = ()

    def __init__(self, bucket: GradBucket, handle: Any, recv: Optional[torch.Tensor], scale: float, comm: Communicator):
        super().__init__(bucket, handle, recv, scale, None, comm)

    def _into(self) -> Tuple[torch.Tensor, torch.Tensor]:
        gathered = torch.empty(self.bucket.padded, dtype=self.recv.dtype, device=self.bucket.device)
        return gathered, _own_range(self.comm, gathered)

    def finish(self, used: Optional[Sequence[bool]], sumsq: Optional[torch.Tensor] = None) -> None:
        self.settle()
        self.wait()


class _ScatterSummed(_Scattered):
    """The all-to-all of :class:`AccumReduceScatter`; at finish, the sum into the range (then as a reduce-scatter)."""

    __slots__ = ("recv", "scale")

    def finish(self, used: Optional[Sequence[bool]], sumsq: Optional[torch.Tensor] = None) -> None:
        self.wait()
        if self.recv is not None:
            _sum_received(self.comm, self.bucket, self.recv, self.out, self.scale)
        self.land(sumsq)


class AccumReduceScatter(ReduceScatter):
    """Reduce-scatter with 16-bit values on the wire, summed exactly (``comm_accum_dtype``): one rounding.

    An all-to-all of the 16-bit bucket (the bytes of a reduce-scatter), then
    :func:`fastcoll.ops.sum_chunks` into this rank's range: float32 ranges
    (main gradients, float32 parameters) receive the float64 sum rounded
    once to float32; 16-bit ranges receive that rounded once more.
    """

    def start(self, b: GradBucket, how: PackArgs, done: Optional[Sequence[int]]) -> InFlight:
        pack, scale = _wire_and_scale(how)
        _packed(self.timeline, b, pack, done)
        self._release_local(b)
        target = self.shards.target(b.pos)
        in_place = b.pos in self.shards.in_place
        add = self.shards.filled and not in_place
        direct = not add and target.dtype in (torch.float32, b.comm.dtype) and target.is_contiguous()
        out = target if direct else torch.empty(target.shape, dtype=torch.float32, device=b.device)
        self.timeline.issued(b.pos)
        recv, handle = _exchange(self.comm, b, b.comm_padded) if b.numel else (None, DONE)
        self.timeline.watch(handle, b.pos)
        f = _ScatterSummed(b, handle, self.timeline, self.comm, out, target, add, self.shards)
        f.recv, f.scale = recv, scale
        return f

    def start_zeros(self, b: GradBucket, zeros: ZeroBuffers, how: PackArgs) -> InFlight:
        if b.numel:
            _, handle = _exchange(self.comm, b, torch.zeros(b.padded, dtype=b.comm.dtype, device=b.device))
            self.comm.wait(handle, f"bucket {b.pos}")
        return InFlight(DONE)


# ------------------------------------------------------- pooled bucket buffers


class _PooledInFlight(InFlight):
    """A reduce-scatter whose bucket borrowed its buffers from the pool: they go back when it has landed."""

    __slots__ = ("inner", "bucket", "pool", "done")

    def __init__(self, inner: _Scattered, bucket: GradBucket, pool: Any):
        super().__init__(DONE)
        self.inner = inner
        self.bucket = bucket
        self.pool = pool
        self.done = False

    def settle(self) -> None:
        self.inner.settle()

    def after_used_map(self) -> None:
        self.inner.after_used_map()

    def retire(self) -> None:
        """Before the end of backward (the pool is short of buffers): wait, land the range, give the buffers back."""
        if not self.done:
            self.inner.finish(None, None)
            self.done = True
            self.pool.release(self.bucket)

    def finish(self, used: Optional[Sequence[bool]], sumsq: Optional[torch.Tensor] = None) -> None:
        if self.done:  # retired early: only the norm is left
            self.inner.sum_squares(sumsq)
            return
        self.inner.finish(used, sumsq)
        self.done = True
        self.pool.release(self.bucket)


class _Chunk:
    """One chunk of a bucket too large for a pool buffer: its reduce-scatter into a slice of the range."""

    __slots__ = ("handle", "out", "target", "add", "slot", "pool", "comm", "what", "done")

    def __init__(self, handle: Any, out: torch.Tensor, target: torch.Tensor, add: bool, slot: torch.Tensor, pool: Any,
                 comm: Communicator, what: str):  # fmt: skip
        self.handle, self.out, self.target, self.add = handle, out, target, add
        self.slot, self.pool, self.comm, self.what = slot, pool, comm, what
        self.done = False

    def retire(self) -> None:
        """Wait, land the slice, give the buffer back."""
        if self.done:
            return
        self.comm.wait(self.handle, self.what)
        with torch.no_grad():
            if self.add:
                self.target.add_(self.out)
            elif self.out.data_ptr() != self.target.data_ptr():
                self.target.copy_(self.out)
        self.done = True
        self.pool.give(self.slot)


class _ChunkedInFlight(InFlight):
    """The chunks of one bucket; finished when every chunk has landed."""

    __slots__ = ("chunks", "bucket", "target", "done")

    def __init__(self, bucket: GradBucket, target: torch.Tensor, timeline: Timeline):
        super().__init__(DONE, timeline)
        self.chunks: List[_Chunk] = []
        self.bucket = bucket
        self.target = target
        self.done = False

    def retire(self) -> None:
        for c in self.chunks:
            c.retire()
        self.done = True

    def finish(self, used: Optional[Sequence[bool]], sumsq: Optional[torch.Tensor] = None) -> None:
        if not self.done:
            self.retire()
            self.timeline.completed(self.bucket.pos)
        if sumsq is not None:
            ops.sum_of_squares([self.target], out=sumsq)


class Pooled:
    """A reduce-scatter (or its one-rounding variant) of buckets whose full-size buffers come from a pool.

    ``start`` lends the bucket a slot (:class:`~fastcoll.reducer.pool.GradBufferPool`), first retiring the
    oldest of its reductions still in flight when every slot is lent; the slot goes back once the range
    has landed. Retiring issues no collective, so every rank still issues the same ones in the same order.

    A bucket larger than a slot (one parameter larger than the bucket cap) is packed and reduce-scattered
    in chunks (plain reduce-scatter only): chunk j carries the j-th slice of every rank's range, each
    chunk in a slot of its own, so the pool's bound holds whatever the largest parameter.
    """

    def __init__(self, inner: ReduceScatter, pool: Any):
        self.inner = inner
        self.pool = pool
        self._live: List[Any] = []  # started (whole buckets or chunks), in order

    def _free_one(self) -> None:
        """Retire the oldest reduction (or chunk) still holding a slot."""
        self._live = [f for f in self._live if not f.done]
        if not self._live:
            raise RuntimeError(f"fastcoll: internal error: all {self.pool.bound} gradient pool buffers are lent")
        self._live.pop(0).retire()

    def start(self, b: GradBucket, how: PackArgs, done: Optional[Sequence[int]]) -> InFlight:
        if not self.pool.has(b) and self.pool.chunked(b):
            return self._start_chunked(b, how)
        while self.pool.full and not self.pool.has(b):
            self._free_one()
        self.pool.attach(b)
        f = _PooledInFlight(self.inner.start(b, how, done), b, self.pool)
        self._live.append(f)
        return f

    def _start_chunked(self, b: GradBucket, how: PackArgs) -> InFlight:
        inner, comm, world = self.inner, self.inner.comm, self.inner.comm.world_size
        shards = inner.shards
        target = shards.target(b.pos)
        shard = target.numel()
        wire = b.wire_dtype
        per = self.pool.chunk_elements(b)  # elements of each rank's range per chunk
        add = shards.filled
        f = _ChunkedInFlight(b, target, inner.timeline)
        inner.timeline.pack_start(b.pos)
        for lo in range(0, shard, per):
            n = min(per, shard - lo)
            while self.pool.full:
                self._free_one()
            slot = self.pool.take()
            buf, wbuf = b.pool_views(slot, world * n)
            for q in range(world):
                start = q * shard + lo
                w = None if wbuf is None else wbuf[q * n : (q + 1) * n]
                pack_range(b, start, start + n, buf[q * n : (q + 1) * n], how, w)
            send = buf if wbuf is None else wbuf
            direct = not add and target.dtype == wire
            out = target[lo : lo + n] if direct else torch.empty(n, dtype=wire, device=b.device)
            what = f"bucket {b.pos} (chunk {lo // per})"
            handle = comm.reduce_scatter(out, send, what) if n else DONE
            c = _Chunk(handle, out, target[lo : lo + n], add, slot, self.pool, comm, what)
            f.chunks.append(c)
            self._live.append(c)
        inner.timeline.pack_end(b.pos)
        inner.timeline.issued(b.pos)
        inner._release_local(b)  # (after the chunks' packs, which read them)
        return f

    def start_zeros(self, b: GradBucket, zeros: ZeroBuffers, how: PackArgs) -> InFlight:
        return self.inner.start_zeros(b, zeros, how)


# ------------------------------------------------------------------- comm hook


class _Hooked(InFlight):
    __slots__ = ("bucket", "hook")

    def __init__(self, bucket: GradBucket, handle: Any, hook: Callable, timeline: Timeline, comm: Communicator):
        super().__init__(handle, timeline, comm, f"bucket {bucket.pos} (comm hook)")
        self.bucket = bucket
        self.hook = hook

    def finish(self, used: Optional[Sequence[bool]], sumsq: Optional[torch.Tensor] = None) -> None:
        _write_back(self.timeline, self.bucket, hook_result(self.hook, self.bucket, self.wait()), used, sumsq)


class CommHook:
    """Pack without scaling, call the hook, unpack its future's value.

    The hook divides by the world size itself; a user divisor d is folded into the pack as world_size/d.
    """

    def __init__(self, comm: Communicator, hook: Callable, state: Any, timeline: Timeline):
        self.comm = comm
        self.hook = hook
        self.state = state
        self.timeline = timeline

    def start(self, b: GradBucket, how: PackArgs, done: Optional[Sequence[int]]) -> InFlight:
        _packed(self.timeline, b, how, done)
        gseq = self.comm.note_hook(f"bucket {b.pos}", b.flat)
        self.timeline.issued(b.pos)
        fut = call_hook(self.hook, self.state, b)
        self.timeline.watch(fut, b.pos)
        if self.comm.guard is not None:
            self.comm.guard.issued(fut, gseq, f"bucket {b.pos} (comm hook)")
        return _Hooked(b, fut, self.hook, self.timeline, self.comm)

    def start_zeros(self, b: GradBucket, zeros: ZeroBuffers, how: PackArgs) -> InFlight:
        z = GradBucket(b.pos, b.count, b.param_indices, b.params, b.names, buffer=zeros.get(b.device, b.dtype, b.numel))
        self.comm.note_hook(f"bucket {b.pos}", z.flat)
        self.comm.wait(call_hook(self.hook, self.state, z), f"bucket {b.pos} (comm hook)")
        return InFlight(DONE)


# ----------------------------------------------------------------- sparse sum


class _SparseSummed(InFlight):
    __slots__ = ("bucket", "replay")

    def __init__(self, bucket: GradBucket, handle: Any, timeline: Timeline, replay: bool = False):
        super().__init__(handle, timeline)  # a SparseExchange, or the scaled gradient itself (no collective)
        self.bucket = bucket
        self.replay = replay

    def after_used_map(self) -> None:
        if isinstance(self.handle, SparseExchange):
            self.handle.start_gather()

    def finish(self, used: Optional[Sequence[bool]], sumsq: Optional[torch.Tensor] = None) -> None:
        h = self.handle
        reduced = h.result() if isinstance(h, SparseExchange) else h
        if self.replay:
            return
        self.timeline.completed(self.bucket.pos)
        p = self.bucket.params[0]
        if used is None or used[0]:
            p.grad = reduced
        # else unused on every rank: the gradient stays as it was
        if sumsq is not None:
            values = [] if p.grad is None else [p.grad.coalesce()._values().contiguous()]
            if values and values[0].numel():
                ops.sum_of_squares(values, out=sumsq)
            else:
                sumsq.zero_()


class SparseSum:
    """A sparse gradient scaled by 1/divisor and summed as a sparse tensor (:class:`fastcoll.distributed.sparse.SparseExchange`).

    A parameter that got no gradient contributes an empty sparse tensor, so
    every rank issues the same collectives.
    """

    def __init__(self, comm: Communicator, timeline: Timeline):
        self.comm = comm
        self.timeline = timeline

    def _exchange(self, b: GradBucket, grad: torch.Tensor) -> Any:
        if not self.comm.active:
            return grad
        return SparseExchange(grad, self.comm.world_size, self.comm.all_gather, self.comm.wait, f"bucket {b.pos} (sparse)")

    def start(self, b: GradBucket, how: PackArgs, done: Optional[Sequence[int]]) -> InFlight:
        p, name = b.params[0], b.names[0]
        g = p.grad
        if g is None:
            g = empty_sparse_grad(p)
        elif not g.is_sparse:
            raise RuntimeError(
                f"fastcoll.DDP: parameter '{name}' belongs to an nn.Embedding/EmbeddingBag with sparse=True but its "
                f"gradient has layout {g.layout}; keep sparse=True for the module's lifetime or wrap it again"
            )
        with torch.no_grad():
            g = g.coalesce()
            if how.nonfinite is not None:
                how.nonfinite.bitwise_or_((~torch.isfinite(g._values())).any().to(torch.int32))
            scaled = g * how.scale if how.scale_by is None else g * (how.scale * how.scale_by.reshape(()).to(g.dtype))
        self.timeline.issued(b.pos)
        exchange = self._exchange(b, scaled)
        return _SparseSummed(b, exchange, self.timeline)

    def start_zeros(self, b: GradBucket, zeros: ZeroBuffers, how: PackArgs) -> InFlight:
        return _SparseSummed(b, self._exchange(b, empty_sparse_grad(b.params[0])), self.timeline, replay=True)
