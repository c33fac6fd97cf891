"""A reduce-scatter for two gloo ranks from one send and one receive (gloo has none of its own).

gloo's ``reduce_scatter_tensor`` runs an all-reduce underneath: each rank sends
about the whole buffer and receives it back reduced. Between two ranks, each one
can instead send the other its half and receive the other's values of its own half:
half the traffic, then one add. The sum is ``a + b``, bitwise what the all-reduce
gives (floating-point addition of two values is commutative). Measured on this
project's 2-core box (25 MiB): 0.6-0.7x the time of gloo's in-place all-reduce.
With more ranks the order of the sum would differ from the all-reduce's (and from
torch DDP's), which bfloat16 shows, and where the range is part of the buffer
itself (float32 main gradients reduced in place) the peer's half would need a
temporary: there the communicator keeps the in-place all-reduce.

gloo's send and receive handles have no futures, so one daemon thread per process
waits for them in issue order, adds, and completes a :class:`torch.futures.Future`
that the reducer waits on (under the stall guard, like any other collective).
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["reduce_scatter_pair"]

_Item = Tuple[List[dist.Work], Callable[[], None], torch.futures.Future]
_queue: "queue.SimpleQueue[_Item]" = queue.SimpleQueue()
_thread: Optional[threading.Thread] = None
_lock = threading.Lock()


def _serve() -> None:
    while True:
        _run(*_queue.get())  # in a call of its own: the item's Works and buffers go when it returns


def _run(works: List[dist.Work], finish: Callable[[], None], fut: torch.futures.Future) -> None:
    try:
        for w in works:
            w.wait()
        finish()
    except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
        fut.set_exception(e)
    else:
        fut.set_result(None)


def _submit(works: List[dist.Work], finish: Callable[[], None]) -> torch.futures.Future:
    global _thread
    fut: torch.futures.Future = torch.futures.Future()
    with _lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_serve, name="fastcoll-p2p-reduce-scatter", daemon=True)
            _thread.start()
    _queue.put((works, finish, fut))
    return fut


def reduce_scatter_pair(
    out: torch.Tensor, inp: torch.Tensor, group: Optional[dist.ProcessGroup], rank: int
) -> torch.futures.Future:
    """Start a SUM reduce-scatter of ``inp`` (two equal halves) into ``out`` (half ``rank``) between 2 ranks.

    The peer's values of this rank's half are received straight into ``out``
    (memory of its own, not in ``inp``), which then adds this rank's: no
    temporary. ``inp`` is only read.

    Returns:
        A future, complete once ``out`` holds the sum.
    """
    n = out.numel()
    peer = 1 - rank
    works = [
        dist.isend(inp[peer * n : (peer + 1) * n], group=group, group_dst=peer),
        dist.irecv(out, group=group, group_src=peer),
    ]
    own = inp[rank * n : (rank + 1) * n]

    def finish() -> None:
        with torch.no_grad():
            out.add_(own)  # theirs + own: exactly own + theirs

    return _submit(works, finish)
