"""Running ``bucket_cap_mb="auto"`` inside the reducer: the protocol around :class:`~fastcoll.reducer.autotune.AutoTuner`.

The policy (candidates, schedule, decision) is :mod:`.autotune`'s; this is the
part that touches the process group and the clock, and keeps every rank on
the same layout at every forward:

1. At the first forward after the ready-order rebuild (every rank has rank
   0's order), every rank times a few all-reduces of two sizes; rank 0's
   cost model and its last backward compute time are broadcast, so every rank
   builds the same candidate list.
2. At every later synchronized forward, the iteration that just ended is
   observed (its exposed synchronization time and step time, from the
   :class:`~fastcoll.reducer.timeline.Timeline`), and the schedule says which
   candidate layout to run next; the schedule is the same on every rank.
3. When the schedule is done, rank 0 decides, broadcasts the index, and every
   rank installs the chosen layout at that same forward and keeps it.

Collectives happen only at forward starts, in the same order on every rank.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional

import torch

from .autotune import AutoTuner, CostModel, autotune_steps
from .comm import Communicator

__all__ = ["LayoutTuning"]

_LOG = logging.getLogger("fastcoll")
_PROBE_BYTES = (256 * 1024, 4 * 1024 * 1024)
_PROBE_REPEATS = 3


def _probe_cost(comm: Communicator, device: torch.device, dtype: torch.dtype) -> CostModel:
    """Time all-reduces of two sizes on this rank (every rank runs the same ones)."""
    points = []
    for nbytes in _PROBE_BYTES:
        t = torch.zeros(max(1, nbytes // dtype.itemsize), dtype=dtype, device=device)
        comm.wait(comm.all_reduce(t, "autotune probe"), "autotune probe")  # warm-up
        times = []
        for _ in range(_PROBE_REPEATS):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            comm.wait(comm.all_reduce(t, "autotune probe"), "autotune probe")
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        points.append((float(nbytes), sorted(times)[len(times) // 2]))
    return CostModel.fit(points)


class LayoutTuning:
    """The autotuning state of one reducer (``bucket_cap_mb="auto"``)."""

    def __init__(self) -> None:
        self.tuner: Optional[AutoTuner] = None
        self._seen = 0  # Timeline.committed when the last observation was taken
        self._running = False  # a tuned iteration is under way

    @property
    def frozen(self) -> bool:
        return self.tuner is not None and self.tuner.frozen

    def report(self) -> List[Dict[str, Any]]:
        """The measured candidates and the choice (empty before tuning starts)."""
        return [] if self.tuner is None else self.tuner.report()

    def next_layout(self, r: Any) -> Optional[List[List[int]]]:
        """At a synchronized forward after the rebuild: the layout to run now (None: keep the current one).

        ``r`` is the :class:`~fastcoll.reducer.Reducer` (its comm, timeline, usage, bucket set).
        """
        tl = r.timeline
        if self.tuner is None:
            self._start(r)
        elif self._running:  # one observation per tuned forward on every rank (None when the iteration did not complete here)
            times = tl.last_times() if tl.committed > self._seen else None
            self.tuner.observe(*(times if times is not None else (None, None)))
        self._seen = tl.committed
        tuner = self.tuner
        if tuner.measured_all:
            k = tuner.decide() if r.rank == 0 else 0
            if r.comm.active:
                t = torch.tensor([k], dtype=torch.int64, device=r.usage.device)
                r.comm.broadcast(t, "autotune decision", group_src=0)
                k = int(t.item())
            tuner.freeze(k)
            self._running = False
            if r.rank == 0:
                _LOG.info("fastcoll.DDP: bucket_cap_mb='auto': %s", tuner.summary())
            return tuner.layout(k)
        self._running = True
        k = tuner.next_candidate()
        return None if k is None else tuner.layout(k)

    def _start(self, r: Any) -> None:
        s = r._set
        device = r.usage.device
        dtype = s.buckets[0].comm.dtype if s.buckets else torch.float32
        cost = _probe_cost(r.comm, device, dtype) if r.comm.active else None
        times = r.timeline.iterations()
        backward_s = times[-1]["backward_end_us"] / 1e6 if times and times[-1].get("backward_end_us") else None
        if r.comm.active:
            floats = (cost.to_list() if cost is not None else []) + [backward_s or 0.0]
            t = torch.tensor(floats, dtype=torch.float64, device=device)
            r.comm.broadcast(t, "autotune cost model", group_src=0)
            values = t.tolist()
            cost, backward_s = CostModel.from_list(values[:-1]), (values[-1] or None)
        self.tuner = AutoTuner(
            s.specs, s.rebuild_order or list(range(len(s.specs) - 1, -1, -1)), s.first_bucket_bytes, s.bucket_cap_bytes,
            budget=autotune_steps() - r.usage.iterations - 1, cost=cost, backward_s=backward_s,
        )  # fmt: skip
