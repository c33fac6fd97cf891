"""gloo's collectives and torch's profiler: what fastcoll waits for before a profiler may stop.

gloo runs each collective on a thread of its own that records into the torch profiler of the thread that issued it,
and completes the collective's future before the Work itself (whose record it ends then). A profiler stopped while
such a thread still records corrupted the process's heap (CI: a rank aborted in torch.profiler's teardown, about one
run in 150). fastcoll's emulated collectives on gloo (the in-place all-gather, the reduce-scatter through an
all-reduce) hand out a future over several Works; :meth:`Communicator.wait` must return only once those Works have
finished too. A Work that finishes well after its future, as gloo's do by a few microseconds, shows whether it does.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist
from multiproc import run_ranks

LATE_S = 0.3


class LateWork:
    """A real Work whose ``wait()`` returns ``LATE_S`` after its future completed (gloo's order, drawn out)."""

    def __init__(self, work: dist.Work, finished: list):
        self.work, self.finished = work, finished
        self.index = len(finished)
        finished.append(False)
        self._done = threading.Event()
        work.get_future().add_done_callback(lambda _f: threading.Timer(LATE_S, self._finish).start())

    def _finish(self) -> None:
        self.finished[self.index] = True
        self._done.set()

    def get_future(self) -> torch.futures.Future:
        return self.work.get_future()

    def wait(self, timeout=None) -> bool:
        self._done.wait()
        return self.work.wait()


def late_worker(rank: int, world: int, kind: str, stall_timeout: float) -> list:
    from fastcoll.reducer.comm import Communicator

    finished: list = []
    for name in ("broadcast", "all_reduce"):
        real = getattr(dist, name)
        setattr(dist, name, lambda *a, _real=real, **k: LateWork(_real(*a, **k), finished))
    comm = Communicator(None, world, force=True, stall_timeout=stall_timeout)
    assert comm.in_place_emulation
    inp = torch.arange(4.0 * world)
    out = torch.empty(4 * world) if kind == "all_gather" else torch.empty(4)
    if kind == "all_gather":
        handle = comm.all_gather(out, inp[4 * rank : 4 * rank + 4].clone(), "parameters of bucket 0")
    else:
        handle = comm.reduce_scatter(out, inp, "bucket 0")
    t0 = time.monotonic()
    comm.wait(handle, "bucket 0")
    return [finished, time.monotonic() - t0 >= LATE_S * 0.9, out.tolist()]


@pytest.mark.parametrize("stall_timeout", [0, 30])
@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
def test_wait_returns_once_the_works_behind_an_emulated_collective_finished(kind, stall_timeout):
    world = 3  # 3 ranks: the reduce-scatter is an all-reduce and a copy (at 2 it is .p2p's, which waits the Works)
    results = run_ranks(late_worker, world, kind, stall_timeout, timeout=60)
    for rank, (finished, waited, out) in enumerate(results):
        assert finished and all(finished), (rank, finished)
        assert waited, rank
        if kind == "all_gather":
            assert out == [float(i) for i in range(4 * world)]
        else:
            assert out == [world * float(i) for i in range(4 * rank, 4 * rank + 4)]
