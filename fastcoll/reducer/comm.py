"""The reducer's one door to the process group.

Every collective the reducer issues (bucket all-reduces, the used-parameter
all-reduce, the layout broadcast) goes through :class:`Communicator`, which

* skips the collective at world size 1 unless ``FASTCOLL_FORCE_COLLECTIVES=1``
  (then a world of one issues exactly what a larger world issues), returning a
  :class:`Done` handle so callers never test for a missing handle;
* numbers the collectives (the per-rank sequence number a stall report compares
  across ranks) and tells its listeners, so tests and tools observe what was
  issued without patching the reducer.
"""

from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional

import torch
import torch.distributed as dist

__all__ = ["Collective", "Communicator", "Done"]


class Done:
    """The handle of a collective that was not needed (world size 1): already complete."""

    __slots__ = ()

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


DONE = Done()


class Collective(NamedTuple):
    """One collective as issued: what listeners receive."""

    seq: int  #: 1 for the first collective this communicator issued
    kind: str  #: "all_reduce", "broadcast", "all_gather" or "comm_hook"
    what: str  #: e.g. "bucket 3", "used parameters", "layout"
    numel: int
    dtype: torch.dtype


class Communicator:
    """Collectives over one process group, numbered and observable.

    Args:
        group: The process group (None: the default group).
        world_size: Its size.
        force: Issue collectives even at world size 1.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], world_size: int, force: bool = False):
        self.group = group
        self.world_size = world_size
        #: False when collectives are skipped (a world of one, not forced).
        self.active = world_size > 1 or force
        self.seq = 0
        self._listeners: List[Callable[[Collective], None]] = []

    def add_listener(self, fn: Callable[[Collective], None]) -> Callable[[], None]:
        """Call ``fn(collective)`` for every collective issued from now on; returns a function that removes it."""
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn) if fn in self._listeners else None

    def _record(self, kind: str, what: str, t: torch.Tensor) -> None:
        self.seq += 1
        if self._listeners:
            c = Collective(self.seq, kind, what, t.numel(), t.dtype)
            for fn in list(self._listeners):
                fn(c)

    def all_reduce(self, t: torch.Tensor, what: str) -> Any:
        """Start a SUM all-reduce of ``t`` in place; returns its handle (``wait()``)."""
        if not self.active:
            return DONE
        self._record("all_reduce", what, t)
        return dist.all_reduce(t, group=self.group, async_op=True)

    def broadcast(self, t: torch.Tensor, what: str, group_src: int = 0) -> None:
        """Broadcast ``t`` in place from group rank ``group_src`` and wait for it."""
        if not self.active:
            return
        self._record("broadcast", what, t)
        dist.broadcast(t, group=self.group, group_src=group_src)

    def note_hook(self, what: str, t: torch.Tensor) -> None:
        """Record a comm hook call (the hook issues its own collectives)."""
        self._record("comm_hook", what, t)

    def note_gather(self, what: str, t: torch.Tensor) -> None:
        """Record a sparse exchange (all-gathers issued by :class:`fastcoll._sparse.SparseExchange`)."""
        self._record("all_gather", what, t)
