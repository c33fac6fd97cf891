"""When each bucket's gradients became ready, were packed, communicated and written back: the last iterations.

:class:`Timeline` keeps a ring of the last ``capacity`` (default 8)
synchronized iterations. Per bucket it records the gradient-ready times of the
bucket's first and last parameter, pack start/end, collective issued /
completed and write-back start/end; per iteration the forward start, the
backward start (first gradient hook), the end of backward compute (the
autograd engine's end-of-backward callback) and the end of the iteration;
also the end of the forward (the reducer armed for backward) and the start of
the first bucket's reduction, which torch DDP's runtime logging statistics
need (:mod:`.runtime_log`).
From those:

* exposed synchronization time = last write-back end - backward compute end
  (the part of gradient synchronization the backward did not hide);
* step time = end of the iteration - forward start (forward, backward and
  synchronization; no optimizer or data loading, so layout changes are
  compared on what they change).

It is what ``fastcoll.DDP.sync_timeline()`` returns (:meth:`Timeline.iterations`),
what ``export_chrome_trace`` writes (:meth:`Timeline.to_chrome_trace`) and what
the autotuner measures (:meth:`Timeline.last_times`).

Integration (calls the reducer makes; ``b`` is the bucket's position)::

    prepare_for_forward, after any layout change   tl.begin_iteration(len(buckets))
    prepare_for_backward, first thing              tl.forward_end()
    _start_backward (first hook)                   tl.backward_start()
    _on_grad, once the bucket position is known    tl.ready(b, idx)     (every gradient; idx: the parameter)
    reduction start                                tl.pack_start(b); b.pack(...); tl.pack_end(b)
                                                   handle = all_reduce(...); tl.issued(b)
                                                   tl.watch(handle, b)  (optional: true completion time)
    _on_backward_end, first thing                  tl.backward_end()
    _finalize                                      tl.finalize_start()
      per bucket                                   handle.wait(); tl.completed(b)
                                                   tl.writeback_start(b); write_back(...); tl.writeback_end(b)
                                                   tl.finalize_end()
    _end_iteration                                 tl.end_iteration()

``completed`` keeps the first time recorded in the iteration, so calling it
after ``wait()`` is harmless when :meth:`Timeline.watch` already saw the
collective finish (on gloo's thread: the real completion time, not when
finalize got round to waiting for it). Every method is safe to call when
recording is off or no iteration is open (a no-op then). Iterations are committed by :meth:`end_iteration`: one that never
ends (a forward without backward, an unfinished backward) is overwritten by
the next :meth:`begin_iteration` and never reported.

Cost: iteration-level times (8 per iteration) are always recorded; with
``enabled=False`` nothing per bucket or per gradient is, so those calls cost an
attribute test. When enabled, an event is one ``time.perf_counter_ns()`` and one
store into a list preallocated per ring slot (``ready`` stores twice), no
resetting between iterations: a time older than the slot's iteration start is
stale and reads as "not recorded". Lists are reallocated only when the number
of buckets grows. The int that ``perf_counter_ns`` returns is the only object
created per event (:meth:`Timeline.watch` adds a closure per bucket).
Measured cost: about 0.1-0.2 µs per event on a 2-core CPU, i.e. tens of µs
per step for hundreds of parameters.

Profiler ranges: whenever a ``torch.profiler`` session is active (tested with
``torch._C._autograd._profiler_enabled()``, the C flag record_function itself
relies on, about 30 ns), ``pack_start/pack_end`` open and close a
``record_function`` range ``fastcoll.bucket[k].pack``, ``writeback_start/end``
one named ``fastcoll.bucket[k].unpack`` and ``finalize_start/end`` one named
``fastcoll.finalize``, whether or not the timeline records. :func:`profiler_range`
is the same as a context manager for other call sites (a shared no-op object
when no profiler runs).

Clocks: times are ``time.perf_counter_ns()``; on Linux that is
CLOCK_MONOTONIC, shared by all processes of a host, so traces of the ranks of
one host line up when exported with the same ``origin_ns``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["NULL_RANGE", "Timeline", "bucket_range_name", "profiler_active", "profiler_range"]

_ns = time.perf_counter_ns

#: Whether a torch profiler session is active on this thread (what record_function checks itself).
profiler_active = torch._C._autograd._profiler_enabled

# Per-bucket event kinds, in the order they happen to one bucket.
BUCKET_EVENTS = (
    "ready_first",
    "ready_last",
    "pack_start",
    "pack_end",
    "issued",
    "completed",
    "writeback_start",
    "writeback_end",
)
_READY_FIRST, _READY_LAST, _PACK_START, _PACK_END, _ISSUED, _COMPLETED, _WB_START, _WB_END = range(8)
# Iteration-level times (the last two: the forward's end, the first bucket's reduction start).
_FORWARD, _BACKWARD_START, _BACKWARD_END, _FINALIZE_START, _FINALIZE_END, _END, _FORWARD_END, _COMM_START = range(8)
_N_TIMES = 8


class _NullRange:
    """The range :func:`profiler_range` returns when no profiler runs: does nothing."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


NULL_RANGE = _NullRange()


def profiler_range(name: str) -> Any:
    """``torch.autograd.profiler.record_function(name)`` when a profiler is active, else a shared no-op context."""
    if profiler_active():
        return torch.autograd.profiler.record_function(name)
    return NULL_RANGE


def bucket_range_name(k: int, what: str) -> str:
    """The profiler range name of bucket ``k``'s ``what`` (``pack`` or ``unpack``): ``fastcoll.bucket[k].pack``."""
    return f"fastcoll.bucket[{k}].{what}"


class _Slot:
    """One iteration of the ring: 8 iteration-level times and 8 per-bucket lists."""

    __slots__ = ("ev", "n", "seq", "t")

    def __init__(self) -> None:
        self.seq = -1
        self.n = 0
        self.t = [0] * _N_TIMES
        self.ev: list[list[int]] = [[] for _ in BUCKET_EVENTS]

    def reserve(self, n: int) -> None:
        if len(self.ev[0]) < n:
            self.ev = [[0] * n for _ in BUCKET_EVENTS]
        self.n = n


class Timeline:
    """Ring of the last ``capacity`` iterations' per-bucket event times.

    Args:
        capacity: How many committed iterations to keep (>= 1).
        enabled: Record per-bucket and per-gradient events (iteration-level
            times are always recorded); can be changed between iterations.

    Attributes:
        enabled: See above. Changing it takes effect at the next :meth:`begin_iteration`.
        comm_names: Optional per-bucket name of the communication ("all-reduce",
            "comm hook", "all-gather"); used by :meth:`to_chrome_trace` (default "all-reduce").
        ready_order: None, or a list :meth:`ready` appends each gradient's
            parameter index to (whether or not recording is enabled); the
            reducer's :class:`~fastcoll.reducer.runtime_log.RuntimeLog` sets
            it for the iterations it samples.
    """

    def __init__(self, capacity: int = 8, enabled: bool = True):
        if capacity < 1:
            raise ValueError(f"fastcoll.Timeline: capacity must be at least 1, got {capacity}")
        self.capacity = int(capacity)
        self.enabled = bool(enabled)
        self.comm_names: Sequence[str] | None = None
        self.ready_order: list[int] | None = None
        self._slots = [_Slot() for _ in range(self.capacity)]
        self._head = 0  # the slot the open (or next) iteration writes
        self._committed = 0  # iterations committed so far
        self._open = False
        self._rec = False  # per-bucket recording on for the open iteration
        self._ranges: dict[tuple[int, int], Any] = {}  # open profiler ranges: (kind, bucket) -> record_function
        self._bind(self._slots[0])

    def _bind(self, slot: _Slot) -> None:
        self._slot = slot
        self._t = slot.t
        ev = slot.ev
        self._first, self._last = ev[_READY_FIRST], ev[_READY_LAST]
        self._ev = ev
        self._t0 = slot.t[_FORWARD]

    # ----------------------------------------------------------- iteration level

    def begin_iteration(self, n_buckets: int) -> None:
        """A synchronized forward starts with ``n_buckets`` buckets; an iteration left open is dropped."""
        slot = self._slots[self._head]
        slot.reserve(n_buckets)
        t = slot.t
        t0 = _ns()
        t[_FORWARD] = t0
        for i in range(1, _N_TIMES):
            t[i] = 0
        slot.seq = self._committed
        self._bind(slot)
        self._open = True
        self._rec = self.enabled
        self._ranges.clear()

    def forward_end(self) -> None:
        """The forward ended: the reducer is armed for a synchronized backward (torch DDP's backward compute start)."""
        if self._open:
            self._t[_FORWARD_END] = _ns()

    def backward_start(self) -> None:
        """The first gradient hook of the iteration fired."""
        if self._open and not self._t[_BACKWARD_START]:
            self._t[_BACKWARD_START] = _ns()

    def backward_end(self) -> None:
        """The autograd engine finished the backward's compute (its end-of-backward callback)."""
        if self._open:
            self._t[_BACKWARD_END] = _ns()

    def finalize_start(self) -> None:
        """The reducer starts waiting for collectives and writing back (``fastcoll.finalize`` range)."""
        if self._open:
            self._t[_FINALIZE_START] = _ns()
        if profiler_active():
            self._range_open(-1, -1, "fastcoll.finalize")

    def finalize_end(self) -> None:
        """Every bucket is written back."""
        if self._open:
            self._t[_FINALIZE_END] = _ns()
        if self._ranges:
            self._range_close(-1, -1)

    def end_iteration(self) -> None:
        """Close and commit the open iteration (a no-op when none is open)."""
        if not self._open:
            return
        self._t[_END] = _ns()
        self._open = self._rec = False
        self._committed += 1
        self._head = (self._head + 1) % self.capacity
        if self._ranges:  # a range left open by an exception: close it rather than leak it
            for key in list(self._ranges):
                self._range_close(*key)

    # -------------------------------------------------------------- per bucket

    def ready(self, b: int, idx: int = -1) -> None:
        """A gradient of bucket ``b`` (of parameter ``idx``) became ready; call for every gradient.

        The first and the last time per bucket are kept; ``idx`` is appended
        to :attr:`ready_order` when that is a list.
        """
        if self._rec:
            t = _ns()
            if self._first[b] < self._t0:
                self._first[b] = t
            self._last[b] = t
        order = self.ready_order
        if order is not None:
            order.append(idx)

    def _comm_start(self) -> None:
        # The first bucket reduction of the iteration starts (an iteration-level time, always recorded).
        if self._open and not self._t[_COMM_START]:
            self._t[_COMM_START] = _ns()

    def pack_start(self, b: int) -> None:
        """Bucket ``b``'s reduction starts with its pack (the first one of an iteration is its communication start)."""
        self._comm_start()
        if self._rec:
            self._ev[_PACK_START][b] = _ns()
        if profiler_active():
            self._range_open(_PACK_START, b, bucket_range_name(b, "pack"))

    def pack_end(self, b: int) -> None:
        if self._ranges:
            self._range_close(_PACK_START, b)
        if self._rec:
            self._ev[_PACK_END][b] = _ns()

    def issued(self, b: int) -> None:
        """Bucket ``b``'s collective was issued (the call returned its handle)."""
        self._comm_start()
        if self._rec:
            self._ev[_ISSUED][b] = _ns()

    def completed(self, b: int) -> None:
        """Bucket ``b``'s collective completed; the first call of the iteration counts.

        Call it after ``wait()`` returns (an upper bound of the completion);
        :meth:`watch` calls it earlier, from the collective's own completion.
        """
        if self._rec:
            done = self._ev[_COMPLETED]
            if done[b] < self._t0:
                done[b] = _ns()

    def watch(self, handle: Any, b: int) -> None:
        """Record bucket ``b``'s completion when ``handle`` completes (a ``Work`` or a ``torch.futures.Future``).

        Adds a done-callback to the handle's future (gloo runs it on its own
        thread as the all-reduce finishes), so ``completed`` is the real
        completion rather than the time ``wait()`` returned in finalize. A
        handle without a future (world size 1) is ignored. Only when recording.
        """
        if not self._rec:
            return
        fut = handle if hasattr(handle, "add_done_callback") else getattr(handle, "get_future", None)
        if fut is None:
            return
        if not hasattr(fut, "add_done_callback"):
            try:
                fut = fut()
            except RuntimeError:  # a backend without futures
                return
        done, t0 = self._ev[_COMPLETED], self._t0  # this iteration's list, even if the callback runs late

        def callback(_fut: Any) -> None:
            if done[b] < t0:
                done[b] = _ns()

        fut.add_done_callback(callback)

    def writeback_start(self, b: int) -> None:
        if self._rec:
            self._ev[_WB_START][b] = _ns()
        if profiler_active():
            self._range_open(_WB_START, b, bucket_range_name(b, "unpack"))

    def writeback_end(self, b: int) -> None:
        if self._ranges:
            self._range_close(_WB_START, b)
        if self._rec:
            self._ev[_WB_END][b] = _ns()

    def _range_open(self, kind: int, b: int, name: str) -> None:
        rf = torch.autograd.profiler.record_function(name)
        rf.__enter__()
        self._ranges[(kind, b)] = rf

    def _range_close(self, kind: int, b: int) -> None:
        rf = self._ranges.pop((kind, b), None)
        if rf is not None:
            rf.__exit__(None, None, None)

    # ------------------------------------------------------------------ reading

    @property
    def committed(self) -> int:
        """Iterations committed since construction (or :meth:`clear`)."""
        return self._committed

    def clear(self) -> None:
        """Forget every recorded iteration."""
        self._slots = [_Slot() for _ in range(self.capacity)]
        self._head = self._committed = 0
        self._open = self._rec = False
        self._ranges.clear()
        self._bind(self._slots[0])

    def _committed_slots(self) -> list[_Slot]:
        k = min(self._committed, self.capacity)
        start = (self._head - k) % self.capacity
        return [self._slots[(start + i) % self.capacity] for i in range(k)]

    def last_iteration_ns(self) -> tuple[int, dict[str, int]] | None:
        """``(seq, times)`` of the last committed iteration (None: none yet), recorded even when disabled.

        ``seq`` is its :meth:`iterations` number; ``times`` maps ``forward_start``,
        ``forward_end``, ``backward_start``, ``backward_end``, ``comm_start``
        (the first bucket's reduction), ``finalize_start``, ``finalize_end``
        and ``end`` to ``perf_counter_ns`` times, each only when it was recorded.
        """
        if not self._committed:
            return None
        slot = self._slots[(self._head - 1) % self.capacity]
        t = slot.t
        named = (
            ("forward_start", _FORWARD), ("forward_end", _FORWARD_END), ("backward_start", _BACKWARD_START),
            ("backward_end", _BACKWARD_END), ("comm_start", _COMM_START), ("finalize_start", _FINALIZE_START),
            ("finalize_end", _FINALIZE_END), ("end", _END),
        )  # fmt: skip
        return slot.seq, {name: t[i] for name, i in named if t[i] and t[i] >= t[_FORWARD]}

    def last_times(self) -> tuple[float, float] | None:
        """``(exposed_sync_s, step_s)`` of the last committed iteration (None: none yet); recorded even when disabled."""
        if not self._committed:
            return None
        slot = self._slots[(self._head - 1) % self.capacity]
        return _exposed_ns(slot) / 1e9, (slot.t[_END] - slot.t[_FORWARD]) / 1e9

    def iterations(self) -> list[dict[str, Any]]:
        """The committed iterations in the ring, oldest first.

        Each is a dict; times in microseconds (float) relative to the
        iteration's backward start (its first gradient hook; the forward
        start when no hook fired), None when not recorded:

        * ``iteration``: 0 for the first iteration committed;
        * ``n_buckets``; ``t0_ns``: the backward start on ``perf_counter_ns``'s clock;
        * ``forward_start_us`` (negative), ``backward_start_us`` (0.0),
          ``backward_end_us``, ``finalize_start_us``, ``finalize_end_us``,
          ``sync_end_us`` (the last write-back end; the iteration's end when no
          write-back was recorded), ``end_us``;
        * ``exposed_sync_us`` = ``sync_end_us - backward_end_us`` (>= 0);
          ``step_us`` = ``end_us - forward_start_us``;
        * ``buckets``: per bucket (empty when recording was off), a dict with
          ``bucket`` and ``<event>_us`` for every event of :data:`BUCKET_EVENTS`
          (``ready_first``, ``ready_last``, ``pack_start``, ``pack_end``,
          ``issued``, ``completed``, ``writeback_start``, ``writeback_end``).
        """
        return [_iteration_dict(s) for s in self._committed_slots()]

    # ------------------------------------------------------------ chrome trace

    def to_chrome_trace(self, rank: int = 0, origin_ns: int | None = None) -> dict[str, Any]:
        """The ring as a Chrome / Perfetto trace (``chrome://tracing``, ui.perfetto.dev).

        One process per rank (``pid = rank``), one thread per lane: ``forward /
        backward`` (forward, backward compute, exposed sync), ``gradients ready``
        (``bucket k ready``, first to last gradient), ``pack`` (``bucket k pack``),
        ``communication`` (``bucket k all-reduce``, issued to completed) and
        ``write-back`` (``bucket k write-back``). ``ts`` in microseconds from
        ``origin_ns`` (default: the oldest iteration's forward start); pass the
        same origin for every rank of a host to line their traces up.
        """
        slots = self._committed_slots()
        if origin_ns is None:
            origin_ns = min((s.t[_FORWARD] for s in slots), default=0)
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
            {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
        ]
        for tid, lane in enumerate(LANES):
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": lane}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid, "args": {"sort_index": tid}})

        def span(name: str, tid: int, a: int, b: int, args: dict[str, Any] | None = None) -> None:
            if a and b and b >= a:
                ev = {
                    "name": name,
                    "cat": "fastcoll",
                    "ph": "X",
                    "pid": rank,
                    "tid": tid,
                    "ts": (a - origin_ns) / 1e3,
                    "dur": (b - a) / 1e3,
                }
                if args:
                    ev["args"] = args
                events.append(ev)

        comm = self.comm_names
        for s in slots:
            t = s.t
            it = {"iteration": s.seq}
            bstart = t[_BACKWARD_START] or t[_FORWARD]
            span("forward", 0, t[_FORWARD], bstart, it)
            span("backward", 0, bstart, t[_BACKWARD_END], it)
            exposed = _exposed_ns(s)
            if t[_BACKWARD_END]:
                span("exposed sync", 0, t[_BACKWARD_END], t[_BACKWARD_END] + exposed, {**it, "exposed_us": exposed / 1e3})
            for k in range(s.n):
                ev = [v if v >= t[_FORWARD] else 0 for v in (kind[k] for kind in s.ev)]
                args = {**it, "bucket": k}
                span(f"bucket {k} ready", 1, ev[_READY_FIRST], ev[_READY_LAST], args)
                span(f"bucket {k} pack", 2, ev[_PACK_START], ev[_PACK_END], args)
                what = comm[k] if comm is not None and k < len(comm) else "all-reduce"
                span(f"bucket {k} {what}", 3, ev[_ISSUED], ev[_COMPLETED], args)
                span(f"bucket {k} write-back", 4, ev[_WB_START], ev[_WB_END], args)
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"producer": "fastcoll", "rank": rank}}

    def export_chrome_trace(self, path: str | Path, rank: int = 0, origin_ns: int | None = None) -> Path:
        """Write :meth:`to_chrome_trace` as JSON to ``path``; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_chrome_trace(rank, origin_ns), f)
        return path


#: The lanes (Chrome trace threads, Gantt chart rows) of one rank, top to bottom.
LANES = ("forward / backward", "gradients ready", "pack", "communication", "write-back")


def _sync_end_ns(slot: _Slot) -> int:
    t0 = slot.t[_FORWARD]
    wb = slot.ev[_WB_END]
    last = max((wb[k] for k in range(slot.n)), default=0)
    return last if last >= t0 and last else slot.t[_END]


def _exposed_ns(slot: _Slot) -> int:
    end = slot.t[_BACKWARD_END]
    if not end:
        return 0
    return max(0, _sync_end_ns(slot) - end)


def _iteration_dict(slot: _Slot) -> dict[str, Any]:
    t = slot.t
    t0 = slot.t[_FORWARD]
    zero = t[_BACKWARD_START] or t0

    def rel(v: int) -> float | None:
        return None if not v or v < t0 else (v - zero) / 1e3

    buckets = []
    if any(kind[k] >= t0 for kind in slot.ev for k in range(slot.n)):  # anything recorded per bucket
        for k in range(slot.n):
            d: dict[str, Any] = {"bucket": k}
            for kind, name in enumerate(BUCKET_EVENTS):
                d[f"{name}_us"] = rel(slot.ev[kind][k])
            buckets.append(d)
    return {
        "iteration": slot.seq,
        "n_buckets": slot.n,
        "t0_ns": zero,
        "forward_start_us": rel(t[_FORWARD]),
        "backward_start_us": rel(t[_BACKWARD_START]),
        "backward_end_us": rel(t[_BACKWARD_END]),
        "finalize_start_us": rel(t[_FINALIZE_START]),
        "finalize_end_us": rel(t[_FINALIZE_END]),
        "sync_end_us": rel(_sync_end_ns(slot)),
        "end_us": rel(t[_END]),
        "exposed_sync_us": _exposed_ns(slot) / 1e3,
        "step_us": (t[_END] - t0) / 1e3,
        "buckets": buckets,
    }
