"""The reducer's one door to the process group.

Every collective the reducer issues (bucket all-reduces, the used-parameter
all-reduce, the layout broadcast) goes through :class:`Communicator`, which

* skips the collective at world size 1 unless ``FASTCOLL_FORCE_COLLECTIVES=1``
  (then a world of one issues exactly what a larger world issues), returning a
  :class:`Done` handle so callers never test for a missing handle;
* numbers the collectives (the per-rank sequence number a stall report compares
  across ranks) and tells its listeners, so tests and tools observe what was
  issued without patching the reducer;
* records each collective in the group's :class:`fastcoll.stall.SyncState`
  (shared with the ``fastcoll.dist`` helpers on the same group: its ``seq``
  numbers the group's collectives, the communicator's own ``seq`` counts only
  the reducer's), and waits through :meth:`Communicator.wait`: with a stall
  timeout, a wait that outlasts it, or fails because a peer is gone, raises
  :class:`fastcoll.stall.StallError` with a report gathered from every rank;
  without one (``stall_timeout=0``, the default here) it is a plain
  ``handle.wait()``.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from ..distributed._agree import bytes_to_tensor, tensor_to_bytes
from ..ops.dtypes import as_real
from ..stall import SyncState, guard_for, state_for
from . import p2p

__all__ = ["Collective", "Communicator", "Done"]


class Done:
    """The handle of a collective that was not needed (world size 1): already complete."""

    __slots__ = ()

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


DONE = Done()

# torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor (the old names warn).
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Collective(NamedTuple):
    """One collective as issued: what listeners receive."""

    seq: int  #: 1 for the first collective this communicator issued
    kind: str  #: "all_reduce", "reduce_scatter", "all_to_all", "all_gather", "broadcast" or "comm_hook"
    what: str  #: e.g. "bucket 3", "used parameters", "layout"
    numel: int
    dtype: torch.dtype


class Communicator:
    """Collectives over one process group, numbered and observable.

    Args:
        group: The process group (None: the default group).
        world_size: Its size.
        force: Issue collectives even at world size 1.
        stall_timeout: Seconds a :meth:`wait` may take before diagnosing a
            stall (None: the default rule of
            :func:`fastcoll.stall.resolve_stall_timeout`; 0: no protection,
            the default here so that a bare Communicator starts no thread).
        device: The device of the reduced tensors: CUDA tensors on NCCL are
            watched from a thread instead of waited for with a timeout.
    """

    def __init__(
        self,
        group: Optional[dist.ProcessGroup],
        world_size: int,
        force: bool = False,
        *,
        stall_timeout: Optional[float] = 0,
        device: Optional[torch.device] = None,
    ):
        self.group = group
        self.world_size = world_size
        #: Where :meth:`all_gather_object` stages its bytes (the group's backend must reach it).
        self.device = torch.device("cpu") if device is None else torch.device(device)
        #: False when collectives are skipped (a world of one, not forced).
        self.active = world_size > 1 or force
        self.seq = 0
        self._listeners: List[Callable[[Collective], None]] = []
        #: The group's synchronization state (shared with every fastcoll caller on the group).
        self.state: SyncState = state_for(group)
        #: The stall guard, or None when unprotected (then :meth:`wait` is a plain wait).
        self.guard = guard_for(group, stall_timeout, device=device) if self.active and stall_timeout != 0 else None
        # gloo's reduce-scatter and all-gather copy their whole buffer through temporaries (its reduce-scatter is
        # an all-reduce underneath): on gloo the reduce-scatter is an in-place all-reduce, or between 2 ranks one
        # send and one receive of a half each (.p2p: half the traffic, the same sum), and the all-gather in-place
        # broadcasts (no temporaries, half the time of gloo's own on 25 MiB).
        self.in_place_emulation = self.active and dist.is_available() and dist.is_initialized() and _is_gloo(group)
        # An emulated collective's handle is a future over the Works it is made of. gloo completes a Work's future
        # before the Work itself (whose end it records into that profiler then): :meth:`wait` waits for them too.
        self._works_behind: Dict[int, Tuple[Any, List[Any]]] = {}  # id(future) -> (future, its Works)
        self.rank = dist.get_rank(group) if self.active and dist.is_available() and dist.is_initialized() else 0

    @property
    def records_on_own_threads(self) -> bool:
        """The backend runs each collective on a thread of its own that records into the torch profiler of the thread
        that issued it (gloo): a collective still running when that profiler stops corrupts the process's heap."""
        return self.in_place_emulation

    def add_listener(self, fn: Callable[[Collective], None]) -> Callable[[], None]:
        """Call ``fn(collective)`` for every collective issued from now on; returns a function that removes it."""
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn) if fn in self._listeners else None

    def _record(self, kind: str, what: str, t: torch.Tensor) -> int:
        """Number one collective; returns its sequence number in the group's :class:`SyncState`."""
        self.seq += 1
        if self.guard is not None:
            self.guard.check()  # the watchdog fired: raise before issuing more
        gseq = self.state.note(kind, what, t.numel(), t.dtype)
        if self._listeners:
            c = Collective(self.seq, kind, what, t.numel(), t.dtype)
            for fn in list(self._listeners):
                fn(c)
        return gseq

    def all_reduce(self, t: torch.Tensor, what: str, op: Any = None) -> Any:
        """Start an all-reduce of ``t`` in place (``op``: SUM by default); returns its handle (pass it to :meth:`wait`)."""
        if not self.active:
            return DONE
        gseq = self._record("all_reduce", what, t)
        work = dist.all_reduce(t, op=dist.ReduceOp.SUM if op is None else op, group=self.group, async_op=True)
        if self.guard is not None:
            self.guard.issued(work, gseq, what)
        return work

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, what: str) -> Any:
        """Start a SUM reduce-scatter of ``inp`` (``world_size`` equal ranges) into ``out`` (this rank's range).

        Returns the handle to pass to :meth:`wait`.

        At world size 1 (not forced) ``out`` is ``inp``'s copy and nothing is issued.
        """
        if not self.active:
            out.copy_(inp)
            return DONE
        gseq = self._record("reduce_scatter", what, inp)
        if self.in_place_emulation and not inp.is_cuda:
            apart = out.untyped_storage().data_ptr() != inp.untyped_storage().data_ptr()
            if self.world_size == 2 and apart:  # (in place, the peer's half would need a temporary: keep memory flat)
                work = p2p.reduce_scatter_pair(out, inp, self.group, self.rank)
            else:
                work = dist.all_reduce(inp, group=self.group, async_op=True)
                own = inp[self.rank * out.numel() : (self.rank + 1) * out.numel()]
                if own.data_ptr() != out.data_ptr():
                    work = self._behind(work.get_future().then(lambda _f: out.copy_(own)), [work])
        else:
            # Complex buckets as their floats: torch.distributed views complex tensors as real in its all-reduce,
            # all-to-all and broadcast, not in every backend's reduce-scatter and all-gather.
            work = _REDUCE_SCATTER(as_real(out), as_real(inp), group=self.group, async_op=True)
        if self.guard is not None:
            self.guard.issued(work, gseq, what)
        return work

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, what: str) -> Any:
        """Start an all-to-all of ``world_size`` equal ranges; returns its handle (pass it to :meth:`wait`).

        Range ``r`` of ``inp`` goes to rank ``r``; range ``r`` of ``out`` comes
        from rank ``r`` (``out`` then holds every rank's values of this rank's
        range, in rank order). At world size 1 (not forced) ``out`` is ``inp``'s
        copy and nothing is issued.
        """
        if not self.active:
            out.copy_(inp)
            return DONE
        gseq = self._record("all_to_all", what, inp)
        work = dist.all_to_all_single(as_real(out), as_real(inp), group=self.group, async_op=True)
        if self.guard is not None:
            self.guard.issued(work, gseq, what)
        return work

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, what: str) -> Any:
        """Start an all-gather of every rank's ``inp`` into ``out`` (rank order); returns its handle.

        At world size 1 (not forced) ``out`` receives ``inp`` unless ``inp`` is already its view, and nothing is issued.
        """
        if not self.active:
            if inp.data_ptr() != out.data_ptr():
                out.copy_(inp)
            return DONE
        gseq = self._record("all_gather", what, out)
        if self.in_place_emulation and not out.is_cuda:
            n = inp.numel()
            if inp.data_ptr() != out[self.rank * n :].data_ptr():
                out[self.rank * n : (self.rank + 1) * n].copy_(inp)
            works = [
                dist.broadcast(out[r * n : (r + 1) * n], group=self.group, group_src=r, async_op=True)
                for r in range(self.world_size)
            ]
            work = self._behind(torch.futures.collect_all([w.get_future() for w in works]), works)
        else:
            work = _ALL_GATHER(as_real(out), as_real(inp), group=self.group, async_op=True)
        if self.guard is not None:
            self.guard.issued(work, gseq, what)
        return work

    def broadcast(self, t: torch.Tensor, what: str, group_src: int = 0) -> None:
        """Broadcast ``t`` in place from group rank ``group_src`` and wait for it."""
        if not self.active:
            return
        gseq = self._record("broadcast", what, t)
        if self.guard is None:
            dist.broadcast(t, group=self.group, group_src=group_src)
            return
        work = dist.broadcast(t, group=self.group, group_src=group_src, async_op=True)
        self.guard.issued(work, gseq, what)
        self.guard.wait(work, what)

    def wait(self, handle: Any, what: Optional[str] = None) -> Any:
        """Wait for a handle returned by :meth:`all_reduce` (or a comm hook's future); returns what its ``wait()`` returns.

        Unprotected: exactly ``handle.wait()``. Protected: bounded by the
        stall timeout; raises :class:`fastcoll.stall.StallError` on a stall
        or a dead peer (every live rank raises, with the same first line).
        """
        out = handle.wait() if self.guard is None else self.guard.wait(handle, what)
        if self._works_behind:
            for w in self._works_behind.pop(id(handle), (None, ()))[1]:
                w.wait()  # finished already, or about to: ends its record in a profiler before that profiler may stop
        return out

    def _behind(self, fut: Any, works: List[Any]) -> Any:
        """``fut``, a future over ``works``: :meth:`wait` returns once the Works have finished too."""
        if len(self._works_behind) > 1024:  # handles dropped unwaited (a failed step): their Works ended long ago
            self._works_behind.clear()
        self._works_behind[id(fut)] = (fut, works)  # the future kept with its id: no other handle can take that id
        return fut

    def check(self) -> None:
        """Raise the watchdog's :class:`fastcoll.stall.StallError` if it fired (cheap; no-op when unprotected or blocking)."""
        if self.guard is not None:
            self.guard.check()

    def all_gather_object(self, obj: Any, what: str) -> List[Any]:
        """Every rank's picklable ``obj``, in rank order (blocking).

        Two all-gathers of bytes (the sizes, then the padded pickles), waited for as :meth:`wait` waits: under
        stall protection a rank that never joins is diagnosed, not waited for until the group's timeout. At world
        size 1 (not forced) ``[obj]`` and nothing is issued.
        """
        if not self.active:
            return [obj]
        payload = pickle.dumps(obj)
        sizes = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
        own = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        self.wait(self.all_gather(sizes, own, f"{what} (sizes)"), what)
        counts = sizes.tolist()
        n = max(counts)
        out = torch.empty(self.world_size * n, dtype=torch.uint8, device=self.device)
        self.wait(self.all_gather(out, bytes_to_tensor(payload, self.device, n), what), what)
        return [pickle.loads(tensor_to_bytes(out[r * n :], counts[r])) for r in range(self.world_size)]

    def note_hook(self, what: str, t: torch.Tensor) -> int:
        """Record a comm hook call (the hook issues its own collectives); returns its sequence number in the group."""
        return self._record("comm_hook", what, t)


def _is_gloo(group: Optional[dist.ProcessGroup]) -> bool:
    try:
        return dist.get_backend(group) == "gloo"
    except Exception:  # noqa: BLE001 - a group whose backend cannot be told: use the collectives as they are
        return False
