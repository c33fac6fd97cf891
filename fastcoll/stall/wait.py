"""Waiting without hanging: timed waits, the CUDA watchdog, and the per-group registry.

Two ways to wait, chosen per group by :class:`StallGuard`:

* **blocking** (gloo, any host-blocking backend): :func:`wait_or_diagnose`
  waits for the Work with the stall timeout (``Work.wait(timedelta)``; a
  ``torch.futures.Future`` through a done-callback and an Event), in slices
  of at most :data:`WAIT_SLICE_S` (a wait that completes in its first slice,
  as every healthy one does, costs what one bounded wait costs). A timeout,
  an error meaning a peer is gone, or, between two slices, a peer's
  announcement that the backend is aborting it
  (:attr:`StateBoard.peer_abort`, :mod:`fastcoll.stall.abort`) becomes a
  diagnosis and a :class:`StallError`. In torch 2.13 a gloo wait that timed
  out leaves the Work and the group intact (a later wait can still
  complete: the slices rely on it), but fastcoll raises once the stall
  timeout has passed anyway: the job is stalled;
* **watchdog** (NCCL): the training thread never blocks on the host to
  watch. :class:`Watchdog`'s thread polls the outstanding Works'
  ``is_completed()``; when the oldest is older than the timeout (or failed
  because a peer is gone) it diagnoses, aborts the process group (so the
  stuck kernels end), and the training thread's next
  :meth:`StallGuard.wait`/:meth:`StallGuard.check` raises the StallError.
"""

from __future__ import annotations

import collections
import datetime
import os
import threading
import time
import weakref
from typing import Any, Callable, Deque, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from . import abort as _abort
from .board import StateBoard
from .diagnosis import diagnose
from .errors import StallError, is_peer_failure, is_timeout
from .state import SyncState
from .timeout import resolve_stall_timeout
from .verdict import aborted_text

__all__ = [
    "WAIT_SLICE_S",
    "PeerAborted",
    "StallGuard",
    "Watchdog",
    "board_for",
    "guard_for",
    "protected_wait",
    "backend_of",
    "run_collective",
    "state_for",
    "wait_or_diagnose",
]


#: Longest one host wait lasts before this rank looks again at its peers' abort announcements (seconds).
WAIT_SLICE_S = 1.0


#: The base class of every future: ``torch.futures.collect_all`` and ``Future.then`` return this class itself, which
#: is no ``torch.futures.Future`` (a subclass) and would otherwise be waited for without a bound.
_FUTURE = torch._C.Future


class _TimedOut(Exception):
    pass


class PeerAborted(RuntimeError):
    """A peer announced that the backend is aborting its process (the cause of a diagnosis)."""


def _peer_aborted(board: Optional[StateBoard]) -> Optional[PeerAborted]:
    info = None if board is None else board.peer_abort
    if info is None:
        return None
    return PeerAborted(aborted_text(int(info.get("rank", info.get("group_rank", -1))), info))


def _verdict_settled(board: Optional[StateBoard]) -> bool:
    """Whether a rank's diagnosis has settled the group's verdict (the board's thread keeps it once read)."""
    return board is not None and board.seen_verdict is not None


def _timed_wait(work: Any, timeout: float) -> Any:
    """``work.wait()`` bounded by ``timeout`` seconds; raises _TimedOut (or the backend's timeout error)."""
    if isinstance(work, _FUTURE):
        if not work.done():
            ev = threading.Event()
            work.add_done_callback(lambda _f: ev.set())
            if not ev.wait(timeout):
                raise _TimedOut()
        return work.wait()
    if isinstance(work, dist.Work):
        return work.wait(datetime.timedelta(seconds=timeout))
    return work.wait()


def _completed(work: Any) -> bool:
    try:
        if isinstance(work, _FUTURE):
            return work.done()
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001
        return False


def wait_or_diagnose(
    work: Any,
    state: SyncState,
    timeout: float,
    board: StateBoard,
    what: Optional[str] = None,
    seq: Optional[int] = None,
    *,
    grace: Optional[float] = None,
) -> Any:
    """Wait for ``work`` at most ``timeout`` seconds; on a stall or a dead peer, diagnose and raise.

    Args:
        work: A ``torch.distributed.Work``, a ``torch.futures.Future`` or
            anything with ``wait()`` (waited without a bound).
        state: This rank's state on the group (``waiting`` is set meanwhile).
        timeout: Seconds (> 0).
        board: The group's board.
        what: What is awaited ("bucket 3"), for the report.
        seq: Its sequence number (default: the last issued).
        grace: Seconds the diagnosis waits for the other ranks' answers.

    Returns:
        What ``work.wait()`` returns.

    Raises:
        StallError: after ``timeout`` seconds, at once when the backend
            reports a dead peer (the cause chained), or within a poll when a
            peer's diagnosis has settled the group's verdict (a peer with a
            shorter timeout).
        Exception: any other error of the collective, unchanged.
    """
    since = time.time()
    prev = state.waiting
    state.waiting = (state.seq if seq is None else seq, what or "a collective", since)
    deadline = since + timeout
    try:
        while True:
            left = deadline - time.time()
            try:
                return _timed_wait(work, max(0.001, min(left, WAIT_SLICE_S)))
            except _TimedOut:
                pass
            except StallError:
                raise
            except Exception as exc:
                fatal = is_peer_failure(exc)
                if not (fatal or is_timeout(exc)):
                    raise
                if not fatal and _completed(work):
                    # The Work completed as our slice ran out: its own outcome decides (a result, or the
                    # backend's error, e.g. its own timeout), not the slice's timeout.
                    try:
                        return work.wait()
                    except Exception as failed:  # noqa: BLE001 (any error of a completed Work is its failure)
                        fatal, exc = True, failed
                if fatal:
                    # A dead peer, or a Work that failed: shown as the cause.
                    _abort.hold()
                    raise diagnose(board, timeout, cause=exc, waited=time.time() - since, grace=grace) from exc
                # Our slice ran out (the Work is still pending).
            _abort.hold()  # gloo is aborting this very process: its last words are being written
            if time.time() >= deadline:
                break
            cause = _peer_aborted(board)
            if cause is not None:
                raise diagnose(board, timeout, cause=cause, waited=time.time() - since, grace=grace)
            if _verdict_settled(board):
                break  # a peer with a shorter timeout has diagnosed the stall: report it now, not at our deadline
        raise diagnose(board, timeout, cause=None, waited=time.time() - since, grace=grace)
    finally:
        state.waiting = prev


class Watchdog:
    """Polls outstanding Works from a thread; on a stall diagnoses, aborts, and arms the error.

    Args:
        state: This rank's state on the group.
        board: The group's board.
        timeout: Seconds an issued collective may stay incomplete.
        abort: Called once after the diagnosis (e.g. ``group.abort`` for
            NCCL, so stuck kernels end); None: nothing.
        poll: Seconds between polls (default ``min(1, timeout / 10)``).
        grace: Passed to :func:`diagnose`.
        start: Start the thread now (tests drive :meth:`poll_once` instead).
    """

    def __init__(
        self,
        state: SyncState,
        board: Optional[StateBoard],
        timeout: float,
        *,
        abort: Optional[Callable[[], Any]] = None,
        poll: Optional[float] = None,
        grace: Optional[float] = None,
        diagnose_fn: Optional[Callable[..., StallError]] = None,
        start: bool = True,
    ):
        self.state = state
        self.board = board
        self.timeout = float(timeout)
        self.abort = abort
        self.poll = float(poll) if poll is not None else max(0.01, min(1.0, self.timeout / 10.0))
        self.grace = grace
        self._diagnose = diagnose_fn or (lambda **kw: diagnose(self.board, self.timeout, grace=self.grace, **kw))
        self._outstanding: Deque[Tuple[Any, int, str, float]] = collections.deque()
        #: The StallError the training thread raises at its next wait/check; None while healthy.
        self.error: Optional[StallError] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if start:
            self.start()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fastcoll-stall-watchdog", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=2.0)

    # training thread -------------------------------------------------------

    def track(self, work: Any, seq: int, what: str) -> None:
        """Watch ``work`` (collective ``seq``) from now on. Cheap: one deque append."""
        self._outstanding.append((work, seq, what, time.time()))

    def check(self) -> None:
        """Raise the armed StallError, if any."""
        err = self.error
        if err is not None:
            raise err

    # watchdog thread -------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            if self.poll_once() is not None:
                return

    def poll_once(self, now: Optional[float] = None) -> Optional[StallError]:
        """One poll: drop completed Works, diagnose if the oldest is too old or failed. Returns the error once armed."""
        if self.error is not None:
            return self.error
        dq = self._outstanding
        cause: Optional[BaseException] = None
        while dq:
            work, seq, what, t = dq[0]
            if not _completed(work):
                break
            exc = _work_exception(work)
            if exc is not None and is_peer_failure(exc):
                cause = exc
                self.state.waiting = (seq, what, t)
                break
            dq.popleft()
        now = time.time() if now is None else now
        if not dq:
            if self.state.waiting is not None and cause is None:
                self.state.waiting = None
            return None
        if cause is None:
            cause = _peer_aborted(self.board)
        work, seq, what, t = dq[0]
        w = self.state.waiting
        if w is None or w[0] != seq:
            self.state.waiting = (seq, what, t)
        if cause is None and now - t <= self.timeout and not _verdict_settled(self.board):
            return None
        _abort.hold()
        err = self._diagnose(cause=cause, waited=now - t)
        self.error = err
        if self.abort is not None:
            try:
                self.abort()
            except Exception:  # noqa: BLE001 - the error is armed either way
                pass
        return err


def _work_exception(work: Any) -> Optional[BaseException]:
    try:
        if isinstance(work, _FUTURE):
            if work.done():
                try:
                    work.value()
                except Exception as exc:  # noqa: BLE001
                    return exc
            return None
        exc = work.exception()
        return exc if isinstance(exc, BaseException) else None
    except Exception:  # noqa: BLE001
        return None


# --------------------------------------------------------------- registry

_lock = threading.RLock()
_states: "weakref.WeakKeyDictionary[Any, SyncState]" = weakref.WeakKeyDictionary()
_boards: "weakref.WeakKeyDictionary[Any, StateBoard]" = weakref.WeakKeyDictionary()
_guards: "weakref.WeakKeyDictionary[Any, Dict[Tuple[float, str], StallGuard]]" = weakref.WeakKeyDictionary()
#: A group's own stall timeout: the one given explicitly to the last fastcoll.DDP built on it (set_group_stall_timeout).
_group_timeouts: "weakref.WeakKeyDictionary[Any, float]" = weakref.WeakKeyDictionary()
_local_state: Optional[SyncState] = None


def _group(group: Any) -> Any:
    """The ProcessGroup object for ``group`` (None: the default group); None when not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if group is None:
        from torch.distributed import distributed_c10d as c10d

        return c10d._get_default_group()
    return group


def state_for(group: Any = None) -> SyncState:
    """The :class:`SyncState` of ``group`` (None: the default group), shared by every fastcoll caller on it."""
    global _local_state
    pg = _group(group)
    with _lock:
        if pg is None:
            if _local_state is None:
                _local_state = SyncState()
            return _local_state
        st = _states.get(pg)
        if st is None:
            st = SyncState(rank=dist.get_rank(), group_rank=dist.get_rank(pg))
            _states[pg] = st
        return st


def board_for(group: Any = None, **kwargs: Any) -> StateBoard:
    """The :class:`StateBoard` of ``group``, on its store (created and started at the first call; ``kwargs`` then go to it)."""
    from torch.distributed import distributed_c10d as c10d

    pg = _group(group)
    if pg is None:
        raise RuntimeError("fastcoll.stall: no process group is initialized")
    with _lock:
        b = _boards.get(pg)
        if b is None:
            store = c10d._get_process_group_store(pg)
            ranks = dist.get_process_group_ranks(pg)
            b = StateBoard(state_for(pg), store, dist.get_rank(pg), dist.get_world_size(pg), ranks, **kwargs)
            _boards[pg] = b
            weakref.finalize(pg, b.close)
            _abort.register(b)  # last words if gloo aborts this process (installed once; off the hot path)
        return b


def _backend_name(pg: Any) -> str:
    try:
        return str(dist.get_backend(pg)).lower()
    except Exception:  # noqa: BLE001
        return ""


def backend_of(pg: Any, device: Any = None) -> str:
    """The backend running ``pg``'s collectives on ``device`` (default: CPU), lower case: "gloo", "nccl", ..."""
    if pg is None:
        return ""
    dev = torch.device("cpu" if device is None else device)
    try:
        return str(pg._get_backend(dev).name()).lower()
    except Exception:  # noqa: BLE001 - no backend for this device type in the group: its only one
        return _backend_name(pg)


def _weak_abort(pg: Any) -> Callable[[], None]:
    ref = weakref.ref(pg)

    def abort() -> None:
        g = ref()
        if g is not None:
            g.abort()

    return abort


class StallGuard:
    """Stall protection for one caller on one group: the group's state and board, a timeout, a way to wait.

    Args:
        group: The process group (None: the default group).
        timeout: Seconds (> 0).
        mode: ``"blocking"`` (timed host waits: gloo), ``"watchdog"`` (a
            polling thread, the training thread never blocks to watch: NCCL),
            or ``"auto"``: blocking when the group runs ``device``'s
            collectives on gloo (see :func:`backend_of`), watchdog otherwise
            (NCCL; and backends whose ``Work.wait`` may not take a timeout).
        abort: For the watchdog: called after its diagnosis (default:
            ``group.abort()`` under NCCL, nothing otherwise).
        device: The device of the tensors communicated (decides "auto").
    """

    def __init__(
        self,
        group: Any,
        timeout: float,
        *,
        mode: str = "auto",
        abort: Optional[Callable[[], Any]] = None,
        device: Any = None,
    ):
        if timeout <= 0:
            raise ValueError("fastcoll.stall.StallGuard: timeout must be > 0 (a disabled guard is None)")
        pg = _group(group)  # not kept: the registry holds guards weakly keyed by their group
        self.timeout = float(timeout)
        self.state = state_for(pg)
        self.board = board_for(pg)
        backend = backend_of(pg, device)
        nccl = "nccl" in backend
        if mode == "auto":
            mode = "blocking" if backend in ("gloo", "") else "watchdog"
        if mode not in ("blocking", "watchdog"):
            raise ValueError(f"fastcoll.stall.StallGuard: mode={mode!r}; use 'auto', 'blocking' or 'watchdog'")
        self.mode = mode
        self.watchdog: Optional[Watchdog] = None
        if mode == "watchdog":
            if abort is None and nccl:
                abort = _weak_abort(pg)
            self.watchdog = Watchdog(self.state, self.board, self.timeout, abort=abort)
        self._seq_of: Dict[int, Tuple[int, str]] = {}

    def issued(self, work: Any, seq: int, what: str) -> None:
        """Tell the guard about a collective just started (its handle, sequence number, label)."""
        wd = self.watchdog
        if wd is not None:
            wd.track(work, seq, what)
            return
        m = self._seq_of
        if len(m) > 1024:
            m.clear()
        m[id(work)] = (seq, what)

    def wait(self, work: Any, what: Optional[str] = None) -> Any:
        """Wait for ``work`` under stall protection; returns what ``work.wait()`` returns."""
        wd = self.watchdog
        if wd is not None:
            wd.check()
            return work.wait()
        info = self._seq_of.pop(id(work), None)
        if info is None:
            return wait_or_diagnose(work, self.state, self.timeout, self.board, what)
        return wait_or_diagnose(work, self.state, self.timeout, self.board, info[1] if what is None else what, info[0])

    def publish(self) -> bool:
        """Publish the state now, from the calling thread (one store write): for rare events a dying rank
        must leave behind, such as parameters found without gradients at the end of a backward."""
        return self.board.publish()

    def check(self) -> None:
        """Raise the watchdog's StallError if it has fired (no-op in blocking mode)."""
        wd = self.watchdog
        if wd is not None:
            wd.check()


def set_group_stall_timeout(group: Any, stall_timeout: Optional[float]) -> None:
    """Make ``stall_timeout`` the one fastcoll's waits on ``group`` use when given none (the fastcoll.dist helpers).

    fastcoll.DDP calls this with an explicit ``stall_timeout``, so that a
    rank in a helper's collective (a barrier, a metrics all-reduce) reports
    as soon as its peers in the DDP's. Every rank builds the same DDPs in the
    same order, so every rank resolves the same timeout. None: the default
    rule again.

    Args:
        group: The process group (None: the default group); nothing happens when not distributed.
        stall_timeout: Seconds (0 disables), or None.

    Raises:
        ValueError: for a negative or non-numeric value.
    """
    pg = _group(group)
    if pg is None:
        return
    with _lock:
        if stall_timeout is None:
            _group_timeouts.pop(pg, None)
        else:
            _group_timeouts[pg] = resolve_stall_timeout(stall_timeout, pg)


def guard_for(
    group: Any = None, stall_timeout: Optional[float] = None, *, mode: str = "auto", device: Any = None
) -> Optional[StallGuard]:
    """The guard for ``group`` and ``stall_timeout``, or None when disabled (0) or not distributed.

    ``stall_timeout`` None: the group's own (:func:`set_group_stall_timeout`),
    else the default rule.

    Guards are cached per (group, resolved timeout, mode, device type): the
    dist helpers' calls share one. ``device``: the tensors' device (picks the
    watchdog for CUDA tensors on NCCL).
    """
    pg = _group(group)
    if pg is None:
        return None
    if stall_timeout is None:
        stall_timeout = _group_timeouts.get(pg)
    timeout = resolve_stall_timeout(stall_timeout, pg)
    if timeout <= 0:
        return None
    with _lock:
        per = _guards.get(pg)
        if per is None:
            per = {}
            _guards[pg] = per
        key = (timeout, mode, None if device is None else torch.device(device).type)
        g = per.get(key)
        if g is None:
            g = StallGuard(pg, timeout, mode=mode, device=device)
            per[key] = g
        return g


def protected_wait(
    work: Any, group: Any = None, what: Optional[str] = None, stall_timeout: Optional[float] = None, device: Any = None
) -> Any:
    """``work.wait()`` under the group's stall protection (the default timeout rule unless given): for fastcoll.dist helpers."""
    g = guard_for(group, stall_timeout, device=device)
    if g is None:
        return work.wait()
    return g.wait(work, what)


def outstanding(state: SyncState) -> list:
    """``(seq, what)`` of the collectives issued on ``state``'s group and not yet waited for, oldest first.

    From the group's guards: started Works a blocking guard has not been
    asked to wait for yet, the watchdog's outstanding ones; plus the one
    the training thread waits for. Only the last :data:`~fastcoll.stall.state.RING`
    sequence numbers count (a Work never waited for, after an error, is
    not in flight). For the abort path: which collective received a message.
    """
    from .state import RING

    low = state.seq - RING
    found = {}
    w = state.waiting
    if w is not None:
        found[w[0]] = w[1]
    with _lock:
        per_groups = [dict(per) for per in _guards.values()]
    for per in per_groups:
        for g in per.values():
            if g.state is not state:
                continue
            if g.watchdog is not None:
                items = [(e[1], e[2]) for e in list(g.watchdog._outstanding)]
            else:
                items = list(g._seq_of.values())
            for seq, what in items:
                found.setdefault(seq, what)
    return sorted((s, w) for s, w in found.items() if s > low)


def _after_fork_in_child() -> None:
    global _local_state, _lock
    _lock = threading.RLock()
    _states.clear()
    _boards.clear()
    _guards.clear()
    _group_timeouts.clear()
    _local_state = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def run_collective(
    start: Callable[[], Any],
    kind: str,
    what: str,
    tensor: "torch.Tensor",
    group: Any = None,
    stall_timeout: Optional[float] = None,
) -> Any:
    """Number, start and wait for one collective under stall protection: the one call a fastcoll.dist helper needs.

    Args:
        start: Starts the collective and returns its Work (``async_op=True``).
        kind: "all_reduce", "broadcast", "all_gather", ...
        what: A label equal on every rank ("reduce_mean", "agree").
        tensor: The tensor communicated (its size and dtype are recorded).
        group: The process group (None: the default group).
        stall_timeout: Seconds; None: the default rule; 0: no protection.

    Returns:
        What the Work's ``wait()`` returns.
    """
    seq = state_for(group).note(kind, what, tensor.numel(), tensor.dtype)
    work = start()
    g = guard_for(group, stall_timeout, device=tensor.device)
    if g is None:
        return work.wait()
    g.issued(work, seq, what)
    return g.wait(work)
