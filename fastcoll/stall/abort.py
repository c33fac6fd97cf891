"""Last words of a process that gloo aborts: say which collective received what from whom, and let the others know.

gloo checks each message it receives against the size the receiving
collective expects; a larger one (a collective issued on some ranks only,
of another size) fails an enforce in gloo's own transport thread, the C++
exception leaves that thread, and ``std::terminate`` aborts the process.
No Python signal handler runs then (``SIGABRT`` is raised by ``abort()``
before the main thread could run one), and when the aborted process hosts
the store (rank 0 under ``init_method="tcp://..."``) the store dies with
it: the survivors could neither read its state nor one another's.

So fastcoll installs a C++ terminate handler (through ``ctypes`` on
libstdc++'s ``std::set_terminate``; Linux, libstdc++ loaded by torch) when
the first stall board is created. The handler does nothing unless the
exception comes from gloo and a stall board exists; then, on gloo's
thread, before the abort:

1. it writes to stderr which collective of this rank was in flight and
   what gloo says it received (``what()`` of the exception, read on
   x86-64; elsewhere the type only: gloo's own message follows anyway);
2. it publishes this rank's state marked ``aborted`` (with that
   collective and the sizes) and announces the abort on the store
   (:meth:`~fastcoll.stall.board.StateBoard.announce_abort`): every live
   rank's board thread sees it within its poll interval, and its waits end
   at once in a diagnosis (:func:`fastcoll.stall.wait_or_diagnose`), where
   this rank's record counts as an answer and its collectives as a vote, so
   the rank that issued the extra collective is named with a majority;
3. it reads the other ranks' answers and writes to stderr from whom the
   data came (the ranks whose collective at that sequence number differs,
   :func:`fastcoll.stall.verdict.mismatch_sources`);
4. it keeps the process (and so a store it hosts) alive until every other
   rank has read what it needs (:meth:`~fastcoll.stall.board.StateBoard.hold_for_readers`,
   the same wait as the store host's after its own diagnosis) or ``linger``
   seconds passed, writes the first line the survivors agreed on, and hands over
   to the previous terminate handler (libstdc++'s prints gloo's message and
   aborts).

Meanwhile this process's sockets stay open, so the survivors learn of the
abort from the store, not from a broken connection; a wait of this
process's own training thread that ends meanwhile is held (:func:`hold`)
so that it neither diagnoses nor exits while its last words are written.
Nothing here runs on the hot path: the handler is installed once.
``FASTCOLL_STALL_ABORT_HOOK=0`` disables it.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import platform
import re
import threading
import time
import weakref
from typing import Any, Callable, Dict, Optional, Tuple

from .board import LINGER_CAP_S

__all__ = ["ENV", "aborting", "hold", "install", "installed", "register", "uninstall"]

ENV = "FASTCOLL_STALL_ABORT_HOOK"

_HANDLER = ctypes.CFUNCTYPE(None)
_lock = threading.Lock()
_boards: "weakref.WeakSet[Any]" = weakref.WeakSet()
_cb: Optional[Any] = None  # our handler (kept alive: libstdc++ holds a raw pointer to it)
_prev: Optional[int] = None  # the handler we replaced
_libstd: Optional[Any] = None
_owner: Optional[int] = None  # the thread writing the last words
_aborting = threading.Event()
_finished = threading.Event()
_atexit_registered = False

#: gloo's enforce on a received message: "op.preamble.length <= op.nbytes. 668 vs 228".
_SIZES = re.compile(r"op\.preamble\.length <= op\.nbytes\.\s*(\d+)\s*vs\s*(\d+)")


def _disabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("0", "false", "no", "off")


def _stdlib() -> Optional[Any]:
    """libstdc++ as already loaded by torch (never loads it)."""
    global _libstd
    if _libstd is None:
        try:
            _libstd = ctypes.CDLL("libstdc++.so.6", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except (OSError, AttributeError):
            return None
    return _libstd


def installed() -> bool:
    """Whether fastcoll's terminate handler is the one in force."""
    lib = _stdlib()
    if lib is None or _cb is None:
        return False
    try:
        get = lib._ZSt13get_terminatev
        get.restype = ctypes.c_void_p
        return get() == ctypes.cast(_cb, ctypes.c_void_p).value
    except AttributeError:
        return False


def install() -> bool:
    """Install the terminate handler (once per process); False where it cannot be (or is disabled)."""
    global _cb, _prev, _atexit_registered
    if _disabled() or platform.system() != "Linux":
        return False
    with _lock:
        if _cb is not None:
            return True
        lib = _stdlib()
        if lib is None:
            return False
        try:
            set_t = lib._ZSt13set_terminatePFvvE
        except AttributeError:
            return False
        set_t.restype = ctypes.c_void_p
        set_t.argtypes = [ctypes.c_void_p]
        cb = _HANDLER(_on_terminate)
        _cb = cb
        _prev = set_t(ctypes.cast(cb, ctypes.c_void_p))
        if not _atexit_registered:
            atexit.register(_at_exit)
            _atexit_registered = True
    return True


def uninstall() -> None:
    """Put the previous terminate handler back, if ours is still in force (at exit: no Python after finalization)."""
    global _cb
    with _lock:
        lib = _stdlib()
        if lib is None or _cb is None:
            return
        if installed():
            set_t = lib._ZSt13set_terminatePFvvE
            set_t.restype = ctypes.c_void_p
            set_t.argtypes = [ctypes.c_void_p]
            set_t(_prev)
        _cb = None


def register(board: Any) -> bool:
    """Report on ``board`` (a :class:`~fastcoll.stall.board.StateBoard`) if gloo aborts this process; installs the handler."""
    if not install():
        return False
    _boards.add(board)
    return True


def aborting() -> bool:
    """Whether gloo is aborting this process (its last words are being written)."""
    return _aborting.is_set()


def hold() -> None:
    """If gloo is aborting this process, block the calling thread until it is gone (bounded); else return at once.

    A training thread whose wait ended (timed out, or failed) calls this
    before diagnosing: the process is about to end by ``abort()``, and a
    StallError raised meanwhile could let the script exit under the thread
    writing the last words.
    """
    if not _aborting.is_set() or threading.get_ident() == _owner:
        return
    _finished.wait(LINGER_CAP_S + 10.0)
    time.sleep(5.0)  # the handler aborts right after it finished


def _at_exit() -> None:
    hold()
    uninstall()


# ------------------------------------------------------------ the handler


def _on_terminate() -> None:
    try:
        _last_words()
    except BaseException:  # noqa: BLE001 - never let Python errors stand between gloo and abort()
        pass
    _chain()


def _chain() -> None:
    prev = _prev
    if prev:
        _HANDLER(prev)()  # libstdc++'s verbose handler: prints gloo's message, aborts
    os.abort()


def _write(text: str) -> None:
    try:
        os.write(2, (text.rstrip("\n") + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


def _demangle(name: str) -> str:
    """``N4gloo13EnforceNotMetE`` -> ``gloo::EnforceNotMet`` (nested names only; anything else as is)."""
    name = name.lstrip("*")
    if not (name.startswith("N") and name.endswith("E")):
        return name
    parts, i, body = [], 0, name[1:-1]
    while i < len(body):
        j = i
        while j < len(body) and body[j].isdigit():
            j += 1
        if j == i:
            return name
        n = int(body[i:j])
        parts.append(body[j : j + n])
        i = j + n
    return "::".join(parts)


def _exception_info() -> Tuple[str, Optional[str]]:
    """The current C++ exception's type name and, where it can be read safely, its ``what()``."""
    lib = _stdlib()
    if lib is None:
        return "", None
    try:
        cur_type = lib.__cxa_current_exception_type
        cur_type.restype = ctypes.c_void_p
        ti = cur_type()
        if not ti:
            return "", None
        raw = ctypes.c_char_p(ctypes.c_void_p.from_address(ti + 8).value).value or b""
        name = raw.decode("ascii", "replace")
    except (AttributeError, ValueError, OSError):
        return "", None
    # what(): gloo's exceptions derive from std::exception alone (what() is the vtable's third slot). The
    # exception object comes from std::current_exception(), whose std::exception_ptr is returned through a
    # hidden pointer: in %rdi on x86-64 (SysV); not attempted elsewhere.
    if platform.machine() not in ("x86_64", "AMD64") or not name.lstrip("*").startswith("N4gloo"):
        return _demangle(name), None
    try:
        cur = lib._ZSt17current_exceptionv
        cur.restype = ctypes.c_void_p
        cur.argtypes = [ctypes.c_void_p]
        box = ctypes.c_void_p(0)
        cur(ctypes.addressof(box))  # one reference leaked: the process is ending
        obj = box.value
        if not obj:
            return _demangle(name), None
        vtable = ctypes.c_void_p.from_address(obj).value
        what = ctypes.CFUNCTYPE(ctypes.c_char_p, ctypes.c_void_p)(ctypes.c_void_p.from_address(vtable + 16).value)
        text = what(obj)
        return _demangle(name), None if text is None else text.decode("utf-8", "replace")
    except (AttributeError, ValueError, OSError):
        return _demangle(name), None


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    if text.startswith("[") and "] " in text[:200]:
        text = text.split("] ", 1)[1]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _last_words() -> None:
    global _owner
    me = threading.get_ident()
    with _lock:
        first = _owner is None
        if first:
            _owner = me
    if not first:  # another gloo thread is writing them: let it finish (it aborts the process)
        _finished.wait(LINGER_CAP_S + 10.0)
        return
    try:
        boards = [b for b in list(_boards) if b is not None]
        if not boards or _disabled():
            return
        name, what = _exception_info()
        if "gloo" not in name and "gloo" not in (what or ""):
            return  # not gloo's: leave it to the previous handler
        _aborting.set()
        t0 = time.monotonic()
        for board in boards:
            _report(board, name, what, t0 + board.linger_s())
    finally:
        _finished.set()


def _in_flight(board: Any) -> Dict[str, Any]:
    """This rank's collective in flight: the oldest issued and not yet waited for (the one gloo was receiving)."""
    from .state import _dtype_name
    from .wait import outstanding

    st = board.state
    try:
        pending = outstanding(st)
    except Exception:  # noqa: BLE001
        pending = []
    seq, label = pending[0] if pending else (st.seq, None)
    info: Dict[str, Any] = {"seq": seq}
    for c in st.last_collectives():
        if c[0] == seq:
            info.update(kind=c[1], what=c[2], numel=int(c[3]), dtype=_dtype_name(c[4]))
    if "what" not in info and label is not None:
        info["what"] = label
    return info


def _report(board: Any, name: str, what: Optional[str], deadline: float) -> None:
    from .verdict import aborted_text, mismatch_sources

    st = board.state
    info: Dict[str, Any] = {"by": "gloo", "type": name or None}
    info.update(_in_flight(board))
    m = _SIZES.search(what or "")
    if m:
        info["received"], info["expected"] = int(m.group(1)), int(m.group(2))
    if what:
        info["error"] = _short(what)
    _write(
        f"fastcoll: {aborted_text(st.rank, info).replace(' was aborted', ' is being aborted', 1)} "
        f"(pid {st.pid} on {st.host}; {name or 'a C++ exception'}); telling the other ranks and asking them "
        "which collective sent it (gloo's own message follows)"
    )
    lock = None
    try:
        store, lock = board.abort_store()
        req = board.announce_abort(info, store)
    except Exception as exc:  # noqa: BLE001
        _write(f"fastcoll: rank {st.rank} could not tell the other ranks: the store is unreachable ({_short(str(exc))})")
        _release(lock)
        return
    try:
        answer_by = min(deadline, time.monotonic() + 3.0 + 2.0 * float(board.poll))
        records = _await(lambda: _answers(board, store, req), answer_by)
        if records is not None:
            _odd, sentence = mismatch_sources(
                records, board.group_rank, board.rank_map, info.get("received"), info.get("expected")
            )
            _write(f"fastcoll: {sentence}")
        board.hold_for_readers(range(board.world_size), deadline, store, step=0.1)
        verdict = _safe(lambda: board.verdict_through(store))
    finally:
        _release(lock)
    if verdict and verdict.get("line"):
        _write(f"fastcoll: first line the other ranks agreed on: {verdict['line']}")
    else:
        _write("fastcoll: the other ranks settled no verdict in time")


def _release(lock: Any) -> None:
    if lock is not None:
        try:
            lock.release()
        except RuntimeError:
            pass


def _safe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001
        return None


def _await(fn: Callable[[], Any], deadline: float, step: float = 0.1) -> Any:
    """Call ``fn`` until it returns something (not None) or ``deadline``; the last value read either way."""
    last = None
    while True:
        try:
            got = fn()
        except Exception:  # noqa: BLE001 - the store went away meanwhile
            return last
        if isinstance(got, tuple):
            ready, last = got
        else:
            ready, last = got is not None, got
        if ready or time.monotonic() >= deadline:
            return last
        time.sleep(step)


def _answers(board: Any, store: Any, req: int) -> Tuple[bool, Dict[int, Optional[Dict[str, Any]]]]:
    records = board.read_records(store)
    me = board.group_rank
    ready = all(
        r == me or (rec and (rec.get("stalled") or rec.get("aborted") or int(rec.get("answer") or 0) >= req))
        for r, rec in records.items()
    )
    return ready, records


def _after_fork_in_child() -> None:
    global _lock, _owner
    _lock = threading.Lock()
    _boards.clear()
    _owner = None
    _aborting.clear()
    _finished.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
