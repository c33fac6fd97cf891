"""One rank's synchronization state, written by the training thread with plain attribute writes.

A :class:`SyncState` exists per process group (:func:`fastcoll.stall.state_for`),
shared by every fastcoll caller on that group (the DDP reducer's
Communicator, the ``fastcoll.dist`` helpers), so its ``seq`` numbers the
group's fastcoll collectives the same way on every rank of a healthy job.

The hot path never takes a lock: the training thread assigns attributes and
one list slot; the board's thread reads them (each read is atomic under the
GIL) and may see a state a few microseconds old, which a stall report does
not care about.
"""

from __future__ import annotations

import os
import socket
import time
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = [
    "BACKWARD",
    "FINISHED_BACKWARD",
    "FORWARD",
    "OUTSIDE",
    "RING",
    "SyncState",
    "describe_phase",
]

#: Phases as they appear in a report (``waiting for <what>`` is derived from :attr:`SyncState.waiting`).
OUTSIDE = "outside fastcoll"
FORWARD = "forward"
BACKWARD = "backward"
FINISHED_BACKWARD = "finished backward"

#: How many of the last collectives a state keeps.
RING = 8

#: How many parameter names a state keeps when gradients are missing.
MAX_MISSING = 10

_time = time.time
_crc32 = zlib.crc32
#: Encoded collective signatures, memoized (a job issues a few distinct ones, over and over).
_SIGNATURES: Dict[tuple, bytes] = {}


class SyncState:
    """Where this rank is: iteration, phase, collectives issued, what it waits for.

    Writers (training thread): :meth:`note` for every collective issued on the
    group, :meth:`begin_forward`, :meth:`begin_backward`, :meth:`end_backward`,
    :meth:`end_iteration`, and the ``waiting`` attribute set around a blocking
    wait. Reader (any thread): :meth:`snapshot`.
    """

    __slots__ = (
        "iteration", "phase", "seq", "waiting", "missing", "n_missing", "updated",
        "urgent", "history", "_ring", "pid", "host", "rank", "group_rank",
    )  # fmt: skip

    def __init__(self, rank: int = 0, group_rank: int = 0):
        self.iteration = 0
        self.phase = OUTSIDE
        #: Collectives issued on the group by fastcoll (1 for the first).
        self.seq = 0
        #: ``(seq, what, since)`` while blocked on (or, under the watchdog, owed) a collective; else None.
        self.waiting: Optional[Tuple[int, str, float]] = None
        self.missing: Tuple[str, ...] = ()
        self.n_missing = 0
        self.updated = _time()
        #: Set by writers whose change should be published soon (gradients missing); the board clears it.
        self.urgent = False
        #: CRC32 chained over every collective's signature: equal on ranks that issued the same collectives.
        self.history = 0
        self._ring: List[Optional[tuple]] = [None] * RING
        self.pid = os.getpid()
        self.host = socket.gethostname()
        self.rank = rank
        self.group_rank = group_rank

    # ------------------------------------------------------------ hot path

    def note(self, kind: str, what: str, numel: int, dtype: Any) -> int:
        """Record one collective issued on the group; returns its sequence number.

        ``what`` must be the same on every rank for the same collective (no
        rank-dependent text): it enters the history hash that stall reports
        compare across ranks. The element count of an ``all_gather`` is not
        hashed (a gather may carry each rank's own count).
        """
        seq = self.seq + 1
        key = (kind, what, dtype, numel)
        sig = _SIGNATURES.get(key)
        if sig is None:
            sig = f"{kind}|{what}|{dtype}|{-1 if kind == 'all_gather' else numel}".encode()
            if len(_SIGNATURES) < 4096:
                _SIGNATURES[key] = sig
        h = _crc32(sig, self.history)
        self.history = h
        self._ring[seq % RING] = (seq, kind, what, numel, dtype, _time(), h)
        self.seq = seq
        return seq

    def begin_forward(self, iteration: Optional[int] = None) -> None:
        """A forward that may be followed by a synchronized backward starts (``iteration`` default: previous + 1)."""
        self.iteration = self.iteration + 1 if iteration is None else iteration
        self.phase = FORWARD
        self.missing = ()
        self.n_missing = 0
        self.updated = _time()

    def begin_backward(self) -> None:
        """The first gradient hook of the iteration fired."""
        self.phase = BACKWARD
        self.updated = _time()

    def end_backward(self, missing: Sequence[str] = ()) -> None:
        """The autograd backward ended; ``missing``: names of parameters still without a gradient."""
        self.phase = FINISHED_BACKWARD
        if missing:
            self.missing = tuple(missing[:MAX_MISSING])
            self.n_missing = len(missing)
            self.urgent = True
        self.updated = _time()

    def end_iteration(self) -> None:
        """The synchronized iteration is closed: back outside fastcoll."""
        self.phase = OUTSIDE
        self.missing = ()
        self.n_missing = 0
        self.updated = _time()

    # -------------------------------------------------------------- readers

    def last_collectives(self) -> List[tuple]:
        """The kept collectives, oldest first: ``(seq, kind, what, numel, dtype, wall time, history hash)``."""
        ring = self._ring[:]  # one C-level copy: atomic under the GIL
        return sorted((c for c in ring if c is not None), key=lambda c: c[0])

    def snapshot(self, now: Optional[float] = None) -> Dict[str, Any]:
        """A JSON-able record of this state (ages relative to ``now``, wall clock)."""
        now = _time() if now is None else now
        waiting = self.waiting
        ring = [
            [c[0], c[1], c[2], int(c[3]), _dtype_name(c[4]), round(max(0.0, now - c[5]), 3), c[6]]
            for c in self.last_collectives()
        ]
        return {
            "rank": self.rank,
            "group_rank": self.group_rank,
            "pid": self.pid,
            "host": self.host,
            "t": now,
            "iteration": self.iteration,
            "phase": self.phase,
            "seq": self.seq,
            "history": self.history,
            "waiting": None
            if waiting is None
            else {"seq": waiting[0], "what": waiting[1], "for": round(max(0.0, now - waiting[2]), 3)},
            "ring": ring,
            "missing": list(self.missing),
            "n_missing": self.n_missing,
            "updated_ago": round(max(0.0, now - self.updated), 3),
        }


def _dtype_name(dtype: Any) -> str:
    s = str(dtype)
    return s[6:] if s.startswith("torch.") else s


def describe_phase(rec: Dict[str, Any]) -> str:
    """``waiting for bucket 3 (collective #7)`` / ``forward`` / ... of a record, with its iteration."""
    w = rec.get("waiting")
    if w:
        where = f"waiting for {w['what'] or 'a collective'} (collective #{w['seq']})"
    else:
        where = rec.get("phase") or OUTSIDE
    it = rec.get("iteration", 0)
    if not it:
        return where
    if not w and where == OUTSIDE:
        return f"{where} (after iteration {it})"
    return f"{where} of iteration {it}"
