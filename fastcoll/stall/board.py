"""This rank's state on the process group's store, out of band of the (possibly stuck) collectives.

Keys, under ``fastcoll/stall/`` in the group's store (the store that
``init_process_group`` made; a ``PrefixStore`` per group, so groups do not
collide):

* ``state/<group rank>``: the rank's latest :meth:`SyncState.snapshot`, JSON
  (a few hundred bytes), plus ``answer`` (the last stall request it answered)
  and ``stalled`` (set once the rank itself diagnoses);
* ``req``: a counter every diagnosing rank increments: "answer now";
* ``verdict``: the first line of the first diagnosis (compare-and-set: the
  first writer wins, every later diagnosing rank adopts it);
* ``read/<group rank>``: set once the rank holds the settled verdict and
  every rank's record (its diagnosis read them, or its board thread kept a
  copy): from then on it no longer needs the store. A process that may host
  the store keeps it up until every rank it knows alive has set this key
  (:meth:`StateBoard.hold_for_readers`): the store host after its own
  diagnosis (:func:`fastcoll.stall.diagnose`), a rank the backend is
  aborting before it dies (:mod:`fastcoll.stall.abort`);
* ``abort``: set by a rank the backend is aborting (:mod:`fastcoll.stall.abort`):
  who, in which collective, what the backend said.

A daemon thread per board, with its own store connection, publishes the
state when the iteration changed (at most once per ``min_interval``
seconds: at most one small write per iteration), right away when a writer
set ``state.urgent`` or called :meth:`StateBoard.poke`, and whenever ``req``
grew (an answer). Between requests it reads ``req`` every ``poll`` seconds:
one small read, nothing on the collectives' wire. Only when ``req`` grew
does it also look for ``abort``: a peer being aborted sets
:attr:`StateBoard.peer_abort`, which ends this rank's waits at once. From
the first request on, the thread also looks for the verdict at each poll
until it is settled, then keeps a copy of it and of every rank's record and
sets ``read/<rank>`` (unless its own rank is diagnosing, which sets it
once it has read): a rank waiting in fastcoll then diagnoses at once,
whatever its own timeout, and a rank whose diagnosis comes later (it was
stuck outside fastcoll) reports that verdict even when the store has gone
with its host meanwhile.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .state import SyncState

__all__ = ["KEY_PREFIX", "LINGER_CAP_S", "StateBoard", "StoreUnreachable", "store_host_of"]

KEY_PREFIX = "fastcoll/stall/"
ABORT_KEY = KEY_PREFIX + "abort"
READ_PREFIX = KEY_PREFIX + "read/"
REQ_KEY = KEY_PREFIX + "req"
VERDICT_KEY = KEY_PREFIX + "verdict"


#: Longest a process that may host the store stays for the other ranks' reads (seconds).
LINGER_CAP_S = 30.0


class StoreUnreachable(RuntimeError):
    """The store could not be read or written (its host is gone)."""


def store_host_of(store: Any) -> Optional[int]:
    """The rank hosting ``store`` (0 for a TCPStore, as ``init_process_group`` sets it up), None for a file or hash store."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return None
    seen = 0
    while store is not None and seen < 8:
        if isinstance(store, dist.TCPStore):
            return 0
        store = getattr(store, "underlying_store", None)
        seen += 1
    return None


def _clone(store: Any, timeout_s: float) -> Any:
    """A store handle with its own connection (TCPStore clients are per thread here), ops bounded by ``timeout_s``."""
    try:
        s = store.clone()
    except Exception:  # noqa: BLE001 - stores without clone(): share the handle
        s = store
    try:
        s.set_timeout(datetime.timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001
        pass
    return s


class StateBoard:
    """Publishes one rank's :class:`SyncState` to the group's store and reads every rank's.

    Args:
        state: This rank's state.
        store: The process group's store (see :func:`fastcoll.stall.board_for`).
        group_rank: This rank in the group.
        world_size: The group's size.
        rank_map: Global rank of each group rank (identity when None).
        poll: Seconds between two reads of the request counter (default
            0.5 s, longer in very large groups).
        min_interval: Least seconds between two routine publications.
        store_host: Rank hosting the store (None: a file store; default: found from ``store``).
        op_timeout: Bound on one store operation, seconds.
        start: Start the daemon thread now.
    """

    def __init__(
        self,
        state: SyncState,
        store: Any,
        group_rank: int,
        world_size: int,
        rank_map: Optional[Sequence[int]] = None,
        *,
        poll: Optional[float] = None,
        min_interval: float = 1.0,
        store_host: Any = "auto",
        op_timeout: float = 5.0,
        start: bool = True,
    ):
        self.state = state
        self.group_rank = int(group_rank)
        self.world_size = int(world_size)
        self.rank_map: List[int] = list(range(world_size)) if rank_map is None else list(rank_map)
        self.poll = float(poll) if poll is not None else min(2.0, 0.5 * max(1.0, world_size / 512))
        self.min_interval = float(min_interval)
        self.store_host = store_host_of(store) if store_host == "auto" else store_host
        self.op_timeout = float(op_timeout)
        self._store = store  # kept for the abort path's own connection (abort_store)
        self._fg = _clone(store, op_timeout)
        self._bg = _clone(store, op_timeout)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._poked = False
        self._stalled: Optional[Dict[str, Any]] = None
        self._answered = 0
        self._req_seen = False
        self._present: set = set()
        #: Store writes and request polls so far (for overhead checks).
        self.writes = 0
        self.polls = 0
        #: The store failure that stopped the thread, if any.
        self.failed: Optional[BaseException] = None
        #: Set when the backend is aborting this process (see :mod:`fastcoll.stall.abort`): published with the state.
        self.aborted: Optional[Dict[str, Any]] = None
        #: Another rank's ``abort`` announcement, once this rank's thread has seen it (ends this rank's waits).
        self.peer_abort: Optional[Dict[str, Any]] = None
        #: After a peer's abort: the verdict and every rank's records as last read (the store may die next).
        self.seen_verdict: Optional[Dict[str, Any]] = None
        self.seen_records: Optional[Dict[int, Optional[Dict[str, Any]]]] = None
        self._thread: Optional[threading.Thread] = None
        if start:
            self.start()

    # --------------------------------------------------------------- thread

    def start(self) -> None:
        """Start the publishing thread (idempotent)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=f"fastcoll-stall-board-{self.group_rank}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread (it may finish one store operation first)."""
        self._stop.set()
        self._wake.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=2.0)

    def poke(self) -> None:
        """Publish the state soon (from the thread), e.g. after gradients were found missing."""
        self._poked = True
        self._wake.set()

    def _run(self) -> None:
        store = self._bg
        last_iter: Optional[int] = None
        last_t = 0.0
        while not self._stop.is_set():
            try:
                st = self.state
                now = time.time()
                # The first iteration is published without waiting out min_interval after the initial state.
                due = now - last_t >= self.min_interval or self.writes <= 1
                if st.urgent or self._poked or (st.iteration != last_iter and due):
                    st.urgent = False
                    self._poked = False
                    last_iter, last_t = st.iteration, now
                    self._write(store)
                req = self._read_req(store)
                if req > self._answered:
                    self._answered = req
                    self._write(store)
                    if self.peer_abort is None:
                        self._look_for_abort(store)
                if self._answered and self.seen_verdict is None:
                    self._keep_verdict(store)
            except Exception as exc:  # noqa: BLE001 - the store is gone: stop quietly, diagnose() will say so
                self.failed = exc
                return
            self._wake.wait(self.poll)
            self._wake.clear()

    # ---------------------------------------------------------------- store

    def _key(self, r: int) -> str:
        return f"{KEY_PREFIX}state/{r}"

    def _record(self) -> Dict[str, Any]:
        rec = self.state.snapshot()
        rec["answer"] = self._answered
        rec["stalled"] = self._stalled
        if self.aborted is not None:
            rec["aborted"] = self.aborted
        return rec

    def _look_for_abort(self, store: Any) -> None:
        """After a request: did a peer announce that the backend is aborting it? (one check; rare)"""
        if not store.check([ABORT_KEY]):
            return
        try:
            info = json.loads(bytes(store.get(ABORT_KEY)).decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            return
        if isinstance(info, dict) and info.get("group_rank") != self.group_rank:
            self.peer_abort = info

    def _keep_verdict(self, store: Any) -> None:
        """After a stall request: copy the verdict and the records once settled, then say so (the store's host may go next)."""
        if not store.check([VERDICT_KEY]):
            return
        try:
            verdict = json.loads(bytes(store.get(VERDICT_KEY)).decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            return
        self.seen_records = self._read_records(store)
        self.seen_verdict = verdict
        if self._stalled is None:  # a rank diagnosing says so itself once it has read (done()): its report is whole
            store.set(self._read_key(self.group_rank), "1")

    def _read_key(self, r: int) -> str:
        return f"{READ_PREFIX}{r}"

    def _write(self, store: Any) -> None:
        store.set(self._key(self.group_rank), json.dumps(self._record(), separators=(",", ":")))
        self.writes += 1

    def _read_req(self, store: Any) -> int:
        self.polls += 1
        key = REQ_KEY
        if not self._req_seen:
            if not store.check([key]):
                return 0
            self._req_seen = True
        return int(store.get(key))

    def publish(self, stalled: Optional[Dict[str, Any]] = None) -> bool:
        """Write this rank's state now (from the calling thread); ``stalled`` marks it as diagnosing.

        Returns:
            False if the store could not be written (``failed`` says why).
        """
        if stalled is not None:
            self._stalled = stalled
        try:
            with self._lock:
                self._write(self._fg)
            return True
        except Exception as exc:  # noqa: BLE001
            self.failed = exc
            return False

    def request(self) -> int:
        """Ask every rank to answer now; returns the request number to wait for.

        Raises:
            StoreUnreachable: if the store cannot be reached.
        """
        try:
            with self._lock:
                n = int(self._fg.add(REQ_KEY, 1))
        except Exception as exc:  # noqa: BLE001
            self.failed = exc
            raise StoreUnreachable(str(exc)) from exc
        self._wake.set()  # our own thread answers too (harmless)
        return n

    def read_all(self) -> Dict[int, Optional[Dict[str, Any]]]:
        """Every group rank's latest record (None where none was ever written).

        Raises:
            StoreUnreachable: if the store cannot be reached.
        """
        keys = [self._key(r) for r in range(self.world_size)]
        try:
            with self._lock:
                missing = [k for k in keys if k not in self._present]
                if missing and not self._fg.check(missing):
                    for k in missing:
                        if self._fg.check([k]):
                            self._present.add(k)
                else:
                    self._present.update(missing)
                have = [k for k in keys if k in self._present]
                values = self._fg.multi_get(have) if have else []
        except Exception as exc:  # noqa: BLE001
            self.failed = exc
            raise StoreUnreachable(str(exc)) from exc
        return self._decode(have, values)

    def _read_records(self, store: Any) -> Dict[int, Optional[Dict[str, Any]]]:
        """:meth:`read_all` through ``store`` (another thread's connection), without the lock; store errors propagate."""
        keys = [self._key(r) for r in range(self.world_size)]
        have = keys if store.check(keys) else [k for k in keys if store.check([k])]
        return self._decode(have, store.multi_get(have) if have else [])

    def _decode(self, keys: List[str], values: Sequence[Any]) -> Dict[int, Optional[Dict[str, Any]]]:
        out: Dict[int, Optional[Dict[str, Any]]] = {r: None for r in range(self.world_size)}
        for k, v in zip(keys, values):
            try:
                out[int(k.rsplit("/", 1)[1])] = json.loads(bytes(v).decode("utf-8"))
            except (ValueError, UnicodeDecodeError):
                pass
        return out

    def settle(self, verdict: Dict[str, Any]) -> Dict[str, Any]:
        """Offer ``verdict`` as the stall's verdict; returns the one in force (the first offered).

        Raises:
            StoreUnreachable: if the store cannot be reached.
        """
        mine = json.dumps(verdict, separators=(",", ":"))
        try:
            with self._lock:
                got = self._fg.compare_set(VERDICT_KEY, "", mine)
        except Exception as exc:  # noqa: BLE001
            self.failed = exc
            raise StoreUnreachable(str(exc)) from exc
        try:
            return json.loads(bytes(got).decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            return verdict

    def done(self) -> None:
        """Say that this rank has read the verdict and the records (a process hosting the store may go); best effort."""
        try:
            with self._lock:
                self._fg.set(self._read_key(self.group_rank), "1")
        except Exception as exc:  # noqa: BLE001
            self.failed = exc

    def linger_s(self) -> float:
        """How long a process that may host the store waits for the others' reads, at most: a few polls of
        their board threads and a wait slice, plus a margin for a loaded machine; at most :data:`LINGER_CAP_S`."""
        from .wait import WAIT_SLICE_S

        return min(LINGER_CAP_S, 12.0 + 4.0 * self.poll + 2.0 * WAIT_SLICE_S)

    def readers(self, ranks: Sequence[int], store: Any = None) -> set:
        """Which of the group ranks ``ranks`` hold the verdict and the records (:meth:`done`, or a kept copy).

        Through ``store`` (another thread's connection, without the lock) or this board's foreground one.
        Store errors propagate.
        """
        keys = [self._read_key(r) for r in ranks]
        if store is None:
            with self._lock:
                return self._readers(self._fg, ranks, keys)
        return self._readers(store, ranks, keys)

    @staticmethod
    def _readers(store: Any, ranks: Sequence[int], keys: List[str]) -> set:
        if not keys or store.check(keys):
            return set(ranks)
        return {r for r, k in zip(ranks, keys) if store.check([k])}

    def hold_for_readers(self, ranks: Sequence[int], deadline: float, store: Any = None, step: float = 0.05) -> set:
        """Keep this process (and a store it hosts) up until every rank of ``ranks`` has read what it needs.

        The one place where a rank waits for the others' reads, for whichever
        process may take the store with it. Returns at ``deadline``
        (``time.monotonic()``) at the latest, or when the store fails.

        Returns:
            The ranks that had not read by then (empty when all did).
        """
        pending = set(ranks) - {self.group_rank}
        while pending:
            try:
                pending -= self.readers(sorted(pending), store)
            except Exception as exc:  # noqa: BLE001 - the store is gone: nobody can read it any more
                self.failed = exc
                return pending
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(step)
        return pending

    # ------------------------------------------------- the backend aborts us

    def abort_store(self) -> Tuple[Any, Optional[threading.Lock]]:
        """A store connection for the abort path, and the lock to release after (None: a connection of its own).

        The foreground connection (already connected, operations bounded by
        ``op_timeout``) when its lock can be had within ``op_timeout``; else
        a new connection (another thread holds the foreground one, stuck).
        """
        if self._lock.acquire(timeout=self.op_timeout + 1.0):
            return self._fg, self._lock
        return _clone(self._store, self.op_timeout), None

    def announce_abort(self, info: Dict[str, Any], store: Any) -> int:
        """The backend is aborting this process: publish the state with ``info``, announce it, ask every rank to answer.

        Called from :mod:`fastcoll.stall.abort` on the thread that is aborting
        the process, with the connection :meth:`abort_store` gave it.
        Returns the request number the answers carry. Store errors propagate.
        """
        self.aborted = info
        store.set(self._key(self.group_rank), json.dumps(self._record(), separators=(",", ":")))
        who = {"rank": self.state.rank, "group_rank": self.group_rank}
        store.set(ABORT_KEY, json.dumps({**info, **who}, separators=(",", ":")))
        n = int(store.add(REQ_KEY, 1))
        self.writes += 1
        return n

    def read_records(self, store: Any) -> Dict[int, Optional[Dict[str, Any]]]:
        """Every rank's record through ``store`` (the abort path's connection); store errors propagate."""
        return self._read_records(store)

    def verdict_through(self, store: Any) -> Optional[Dict[str, Any]]:
        """The settled verdict, if any (through ``store``)."""
        if not store.check([VERDICT_KEY]):
            return None
        try:
            return json.loads(bytes(store.get(VERDICT_KEY)).decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            return None
