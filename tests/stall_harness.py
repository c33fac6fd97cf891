"""Run a function on gloo ranks where some ranks are expected to die, hang or linger.

:func:`run_stall_ranks` is :func:`multiproc.run_ranks` for stall tests: a
rank may SIGKILL itself (its outcome is ``dead``), sleep for minutes (it is
killed once the ranks the test needs have reported: ``killed``), or finish
and linger so its board thread can still answer the others' stall requests.
Every rank process is SIGKILLed and reaped before the call returns, whatever
happens, so no rank outlives the test. The store is a FileStore (one that
survives any rank, as torchrun's agent store does), or a TCPStore hosted by
rank 0 (``store="tcp"``; ``store="tcp-init"`` makes it through
``init_method="tcp://..."``) to test the store host's death, or a TCPStore
hosted by the test process itself (``store="tcp-agent"``, as torchrun's
agent hosts it: it survives every rank). With
``exit_on_report=True`` a rank's process ends as soon as it has reported,
as a script's does on an uncaught StallError (taking a TCPStore it hosts
with it). With
``capture_stderr=True`` each rank's stderr (file descriptor 2: the C++
runtime's messages too) is kept and returned in its outcome.
"""

from __future__ import annotations

import datetime
import os
import queue
import shutil
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, Iterable, NamedTuple, Optional

from multiproc import forkserver_context


class Outcome(NamedTuple):
    kind: str  #: "ok", "error", "dead" (exited without reporting) or "killed" (still running at the end)
    value: Any  #: the return value, the error text, or the exit code
    elapsed: float  #: seconds from the start of the run to the report (parent's clock)
    stderr: str = ""  #: the rank's stderr, with capture_stderr=True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    fn, rank, world_size, store_kind, store_arg, args, results, pg_timeout, env, linger_s, stderr_path=None, exit_on_report=False
):
    import faulthandler

    if stderr_path is not None:
        fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)

    import torch
    import torch.distributed as dist

    faulthandler.enable()
    parent = os.getppid()
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        pg_t = datetime.timedelta(seconds=pg_timeout)
        if store_kind == "tcp-init":  # init_process_group's own TCPStore, hosted by rank 0's process
            url = f"tcp://127.0.0.1:{store_arg}"
            dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world_size, timeout=pg_t)
        else:
            if store_kind in ("tcp", "tcp-agent"):
                master = store_kind == "tcp" and rank == 0
                store = dist.TCPStore("127.0.0.1", store_arg, world_size, master, timeout=datetime.timedelta(seconds=30))
            else:
                store = dist.FileStore(store_arg, world_size)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=pg_t)
        out = fn(rank, world_size, *args)
        results.put((rank, True, out))
    except BaseException as exc:  # noqa: BLE001 - report everything
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    if exit_on_report:
        # As a script whose StallError goes uncaught: the process (and a TCPStore it hosts) ends right after.
        results.close()
        results.join_thread()
        os._exit(0)
    # Linger: the board thread keeps answering the others' stall requests, and a
    # TCPStore hosted here stays up. The parent kills every rank at the end; should
    # it die first, the rank leaves when orphaned, or after linger_s at the latest.
    deadline = time.monotonic() + linger_s
    while time.monotonic() < deadline and os.getppid() == parent:
        time.sleep(0.2)
    os._exit(0)


def run_stall_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    need: Optional[Iterable[int]] = None,
    timeout: float = 120.0,
    pg_timeout: float = 120.0,
    store: str = "file",
    env: Optional[dict] = None,
    capture_stderr: bool = False,
    exit_on_report: bool = False,
) -> Dict[int, Outcome]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; returns each rank's :class:`Outcome`.

    Args:
        need: Ranks whose outcome (a report or their death) ends the run (default: all).
        timeout: Seconds before the run is declared hung (TimeoutError, every rank killed).
        pg_timeout: The process group's own timeout.
        store: "file" (FileStore), "tcp" (TCPStore hosted by rank 0), "tcp-init"
            (``init_method="tcp://..."``: the TCPStore that makes, hosted by rank 0) or
            "tcp-agent" (a TCPStore hosted by this process, as torchrun's agent does).
        env: Extra environment variables in every rank.
        capture_stderr: Keep each rank's stderr (in its outcome's ``stderr``) instead of letting it through.
        exit_on_report: A rank's process ends as soon as it has reported (as a script ends on an uncaught
            StallError, taking a TCPStore it hosts with it) instead of lingering until the run ends.
    """
    ctx = forkserver_context()
    tmpdir = tempfile.mkdtemp(prefix="fastcoll_stall_")
    server = None
    if store == "tcp-agent":
        import torch.distributed as dist

        server = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
        store_arg: Any = server.port
    else:
        store_arg = _free_port() if store in ("tcp", "tcp-init") else os.path.join(tmpdir, "store")
    err_paths = [os.path.join(tmpdir, f"stderr-{r}") if capture_stderr else None for r in range(world_size)]
    results = ctx.Queue()
    need = set(range(world_size) if need is None else need)
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                fn,
                r,
                world_size,
                store,
                store_arg,
                args,
                results,
                pg_timeout,
                dict(env or {}),
                timeout,
                err_paths[r],
                exit_on_report,
            ),
            daemon=True,
        )
        for r in range(world_size)
    ]
    t0 = time.monotonic()
    out: Dict[int, Outcome] = {}
    try:
        for p in procs:
            p.start()
        deadline = t0 + timeout
        while not need <= set(out):
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(need - set(out))} did not report within {timeout:.0f}s; so far: {out}")
            try:
                rank, ok, payload = results.get(timeout=0.2)
                out[rank] = Outcome("ok" if ok else "error", payload, time.monotonic() - t0)
            except queue.Empty:
                pass
            for r, p in enumerate(procs):
                if r not in out and p.exitcode is not None:
                    # Drain a report that raced with the exit before calling it dead.
                    try:
                        while True:
                            rank, ok, payload = results.get_nowait()
                            out[rank] = Outcome("ok" if ok else "error", payload, time.monotonic() - t0)
                    except queue.Empty:
                        pass
                    if r not in out:
                        out[r] = Outcome("dead", p.exitcode, time.monotonic() - t0)
        # Reports that arrived meanwhile from ranks the test did not need.
        try:
            while True:
                rank, ok, payload = results.get(timeout=0.05)
                out.setdefault(rank, Outcome("ok" if ok else "error", payload, time.monotonic() - t0))
        except queue.Empty:
            pass
    finally:
        started = [p for p in procs if p.pid is not None]
        for p in started:
            if p.is_alive():
                p.kill()
        for r, p in enumerate(procs):
            if p.pid is not None:
                p.join(timeout=10)
            if r not in out:
                out[r] = Outcome("killed", p.exitcode, time.monotonic() - t0)
        if capture_stderr:
            for r, path in enumerate(err_paths):
                try:
                    with open(path, encoding="utf-8", errors="replace") as f:
                        out[r] = out[r]._replace(stderr=f.read())
                except OSError:
                    pass
        results.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
        del server
    alive = [p.pid for p in procs if p.pid is not None and p.is_alive()]
    assert not alive, f"rank processes {alive} outlived the run"
    return out


def survivors_agree(out: Dict[int, Outcome], ranks: Iterable[int]):
    """Each of ``ranks`` returned (``ok``) a StallError's data, a dict whose "line" is its first line, and the
    lines are the same: returns (their data in the order of ``ranks``, that line)."""
    ranks = list(ranks)
    res = [out[r].value for r in ranks]
    assert all(out[r].kind == "ok" and out[r].value for r in ranks), out
    line = res[0]["line"]
    assert all(x["line"] == line for x in res), [x["line"] for x in res]
    return res, line
