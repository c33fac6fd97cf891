"""On a stall: gather every rank's state out of band, agree on the culprit, build the StallError.

:func:`diagnose` runs on every rank that stalls (a wait that timed out, a
collective that failed because a peer is gone, or the watchdog finding
outstanding work too old):

1. publish this rank's state marked ``stalled`` (what it waited for, how
   long, why) and bump the request counter, so every live rank's board
   thread answers within its poll interval;
2. read every rank's record until all have answered or ``grace`` seconds
   passed (a rank that has not answered by then: "no answer");
3. compute the first line from the records (:func:`~fastcoll.stall.verdict.culprit_line`)
   and offer it to the store with compare-and-set: the first diagnosing
   rank's line wins and every rank adopts it, so the first line is the same
   on every live rank even when ranks read the store at different moments;
4. tell the store it has read what it needs; the rank that hosts the store
   (rank 0 under ``init_method="tcp://..."``) then waits until every rank
   that answered has read too, or holds a copy its board thread kept
   (:meth:`~fastcoll.stall.board.StateBoard.hold_for_readers`, bounded), so
   that a survivor whose own diagnosis starts later, or ends later, still
   names the culprit after the host's process has ended with its
   StallError (a rank that gloo is aborting waits the same way:
   :mod:`fastcoll.stall.abort`);
5. build the report, print it to stderr (once per process), write it as JSON
   to ``$FASTCOLL_TRACE_DIR/stall-rank<r>.json`` when that is set, and return
   the :class:`StallError` for the caller to raise.

A rank gloo aborted, whose last words were published, answered: its record
(marked ``aborted``) counts, with its collectives. When the store cannot be
reached (its host, rank 0, is gone) every survivor reports its own state
under the same first line, "rank 0 (the store host) is unreachable"; unless
its board thread had kept the verdict and the records once settled (it does
after any stall request: the store host's process ended after the first
survivors settled, e.g. with its own StallError), then that verdict and
those records.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any, Dict, Optional, Tuple

from .board import StateBoard, StoreUnreachable
from .errors import StallError
from .verdict import culprit_line, render_report, store_unreachable_line

__all__ = ["TRACE_DIR_ENV", "default_grace", "diagnose"]

TRACE_DIR_ENV = "FASTCOLL_TRACE_DIR"

_emitted_lock = threading.Lock()
_emitted = False


def default_grace(timeout: float, poll: float) -> float:
    """Seconds a diagnosing rank waits for the others' answers: long enough for a few polls, at most 10 s."""
    return min(10.0, max(3.0, 4.0 * poll, 0.05 * float(timeout or 0.0)))


def _short(exc: Optional[BaseException], limit: int = 240) -> Optional[str]:
    if exc is None:
        return None
    text = " ".join(str(exc).split())
    # gloo prefixes "[/path/to/pair.cc:553] "; keep the message.
    if text.startswith("[") and "] " in text[:200]:
        text = text.split("] ", 1)[1]
    # ... and appends advice that does not apply here.
    text = text.split(" This is typically caused by", 1)[0]
    text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _gather_verdict(board: StateBoard, stalled: Dict[str, Any], grace: float, t0: float) -> Tuple[Any, ...]:
    """Publish this rank's stall, collect the others' answers within ``grace``, agree on the first line.

    Returns:
        (records per rank, ranks that answered, first line, culprits, rank whose line was adopted, store reachable).
    """
    state = board.state
    me = board.group_rank
    records: Dict[int, Optional[Dict[str, Any]]] = {}
    answered = {me}
    reachable = board.publish(stalled=stalled)
    line = ""
    culprits: list = []
    verdict_by: Optional[int] = None
    if reachable:
        try:
            req = board.request()
            deadline = t0 + grace
            while True:
                records = board.read_all()
                answered = {me} | {
                    r
                    for r, rec in records.items()
                    if rec and (rec.get("stalled") or rec.get("aborted") or int(rec.get("answer") or 0) >= req)
                }
                if len(answered) >= board.world_size or time.time() >= deadline:
                    break
                time.sleep(0.05)
            line, culprits = culprit_line(records, answered, board.rank_map)
            verdict = board.settle({"line": line, "culprits": culprits, "by": state.rank})
            line = str(verdict.get("line", line))
            culprits = list(verdict.get("culprits", culprits))
            verdict_by = verdict.get("by")
            board.done()
            if board.store_host is not None and board.store_host == state.rank:
                board.hold_for_readers(sorted(answered), time.monotonic() + board.linger_s())
        except StoreUnreachable:
            reachable = False
    if not reachable:
        own = board._record()
        own["answer"] = None
        kept, seen = board.seen_verdict, board.seen_records
        if kept and kept.get("line") and seen:
            # The store died after the first survivors settled; this rank's board thread kept both.
            line, culprits, verdict_by = str(kept["line"]), list(kept.get("culprits") or []), kept.get("by")
            records = dict(seen)
            records[me] = own
            answered = {me} | {
                r for r, rec in records.items() if rec and (rec.get("stalled") or rec.get("aborted") or rec.get("answer"))
            }
        else:
            line, culprits = store_unreachable_line(board.store_host)
            records, answered = {me: own}, {me}
    return records, answered, line, culprits, verdict_by, reachable


def diagnose(
    board: StateBoard,
    timeout: float,
    *,
    cause: Optional[BaseException] = None,
    waited: Optional[float] = None,
    grace: Optional[float] = None,
    trace_dir: Optional[str] = None,
) -> StallError:
    """Gather every rank's state and build this rank's :class:`StallError` (returned, not raised).

    Args:
        board: This rank's board on the group.
        timeout: The stall timeout in force (for the report).
        cause: The backend error that triggered the diagnosis (a dead peer), if any.
        waited: Seconds this rank waited before diagnosing.
        grace: Seconds to wait for the other ranks' answers (:func:`default_grace` when None).
        trace_dir: Where to write ``stall-rank<r>.json`` (default ``$FASTCOLL_TRACE_DIR``; none when unset).
    """
    state = board.state
    me = board.group_rank
    t0 = time.time()
    grace = default_grace(timeout, board.poll) if grace is None else float(grace)
    w = state.waiting
    stalled = {
        "seq": None if w is None else w[0],
        "what": None if w is None else w[1],
        "waited": None if waited is None else round(float(waited), 3),
        "cause": _short(cause),
        "timeout": timeout,
    }
    records, answered, line, culprits, verdict_by, reachable = _gather_verdict(board, stalled, grace, t0)
    now = time.time()
    what = f"collective #{stalled['seq']} ({stalled['what']})" if stalled["seq"] is not None else "a collective"
    header = f"fastcoll stall report from rank {state.rank} (stall_timeout {timeout:g} s)"
    if verdict_by is not None and verdict_by != state.rank:
        header += f"; first line as agreed by rank {verdict_by}"
    footer = [f"  this rank waited {waited or 0.0:.1f} s for {what}"]
    if cause is not None:
        footer[0] += f"; cause: {stalled['cause']}"
    if not reachable:
        footer.append(f"  store error: {_short(board.failed)}")
    data: Dict[str, Any] = {
        "first_line": line,
        "culprits": culprits,
        "rank": state.rank,
        "group_rank": me,
        "world_size": board.world_size,
        "rank_map": board.rank_map,
        "stall_timeout": timeout,
        "waited": stalled["waited"],
        "waiting_for": {"seq": stalled["seq"], "what": stalled["what"]},
        "cause": stalled["cause"],
        "store_reachable": reachable,
        "answered": sorted(answered),
        "records": {str(r): rec for r, rec in sorted(records.items())},
        "time": now,
        "diagnosis_s": round(now - t0, 3),
    }
    trace_dir = os.environ.get(TRACE_DIR_ENV) if trace_dir is None else trace_dir
    path = _trace_path(trace_dir, state.rank)
    if path:
        footer.append(f"  JSON trace: {path}")
    report = render_report(line, records, answered, me=me, now=now, rank_map=board.rank_map, header=header, footer=footer)
    data["report"] = report
    err = StallError(report, line, culprits, data)
    _emit(err, path)
    return err


def _trace_path(trace_dir: Optional[str], rank: int) -> Optional[str]:
    if not trace_dir:
        return None
    return os.path.join(trace_dir, f"stall-rank{rank}.json")


def _emit(err: StallError, path: Optional[str]) -> None:
    """Print the report to stderr and write the JSON trace: the first diagnosis of this process only."""
    global _emitted
    with _emitted_lock:
        if _emitted:
            return
        _emitted = True
    try:
        sys.stderr.write(err.report + "\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - a closed stderr must not hide the StallError
        pass
    if path:
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(err.data, f, indent=1, default=str)
            os.replace(tmp, path)
        except OSError as exc:
            try:
                sys.stderr.write(f"fastcoll stall: could not write {path}: {exc}\n")
            except Exception:  # noqa: BLE001
                pass


def _reset_emitted() -> None:
    """Tests: let the next diagnosis print and write again."""
    global _emitted
    with _emitted_lock:
        _emitted = False
