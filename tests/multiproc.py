"""Run a function on several gloo ranks in separate processes, with a hard timeout.

Every multi-rank test goes through :func:`run_ranks`: it starts ``world_size``
processes (forkserver with torch preloaded, so a start costs a fork rather
than a torch import), gives each one intra-op thread and a process group over
a FileStore in a fresh temporary file, calls ``fn(rank, world_size, *args)``
and returns the per-rank results in rank order. If any rank raises, the
exception text of every failing rank is re-raised in the parent; if the ranks
do not finish within ``timeout`` seconds they are killed and the test fails,
so a hang costs seconds, not CI's whole budget.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from typing import Any, Callable, List

_CTX = None


def forkserver_context():
    """The multiprocessing context of the rank processes: forkserver, with torch and fastcoll preloaded."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "fastcoll"])
    return _CTX


class RankError(RuntimeError):
    """One or more ranks raised; ``messages`` maps rank to its exception text."""

    def __init__(self, messages: dict):
        self.messages = messages
        text = "\n".join(f"--- rank {r} ---\n{m}" for r, m in sorted(messages.items()))
        super().__init__(f"{len(messages)} rank(s) failed:\n{text}")


def _worker(fn, rank, world_size, store_path, args, results, pg_timeout, init_pg, env):
    import faulthandler

    import torch
    import torch.distributed as dist

    faulthandler.enable()  # a rank killed by a signal prints its Python stack to the test's stderr

    os.environ.update(env)
    torch.set_num_threads(1)
    if _teardown_can_deadlock(torch):
        dist.destroy_process_group = _yield_gil_first(dist.destroy_process_group)
    try:
        if init_pg:
            store = dist.FileStore(store_path, world_size)
            dist.init_process_group(
                "gloo",
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=pg_timeout),
            )
        out = fn(rank, world_size, *args)
        # Plain pickle copies tensors into the message; the queue's own pickler would
        # share their memory through this process, which may have exited by the time
        # the parent unpickles.
        results.put((rank, True, pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)))
    except BaseException as exc:  # report everything, including assertion failures
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        # Send the result before tearing down: the queue's feeder thread needs the
        # GIL, which a blocked destroy_process_group may hold (see _teardown_can_deadlock).
        results.close()
        results.join_thread()
        if init_pg and dist.is_initialized() and not _teardown_can_deadlock(torch):
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _teardown_can_deadlock(torch) -> bool:
    """Whether destroying a gloo process group can deadlock in this torch.

    Before torch 2.8 (pytorch/pytorch#154976) ``~ProcessGroupGloo`` joins its
    worker threads while holding the GIL; a worker that is still dropping the
    last reference to a finished collective's tensors needs the GIL too, so
    about one 3-rank run in five hung there (seen on torch 2.6.0). A rank
    process ends with ``os._exit``, which runs no destructors, so skipping the
    teardown there loses nothing.
    """
    return torch.__version__ < "2.8"


def _yield_gil_first(destroy: Callable[..., Any]) -> Callable[..., Any]:
    """``destroy_process_group`` for tests that call it themselves, on such a torch.

    Sleeping first releases the GIL, so gloo's worker threads drop the finished
    work before the destructor joins them; without it the deadlock above shows
    up in those tests too.
    """

    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.1)
        return destroy(*args, **kwargs)

    return destroy_process_group


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 90.0,
    pg_timeout: float = 30.0,
    init_pg: bool = True,
    env: dict | None = None,
) -> List[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    Args:
        fn: A module-level (picklable) function.
        world_size: Number of ranks.
        *args: Picklable arguments passed to every rank.
        timeout: Seconds before the whole run is declared hung and killed.
        pg_timeout: The process group's own collective timeout, in seconds.
        init_pg: Create the default process group before calling ``fn``.
        env: Extra environment variables set in each rank.

    Returns:
        The per-rank return values, in rank order.

    Raises:
        RankError: if any rank raised (message holds every failing rank's traceback).
        TimeoutError: if the ranks did not all finish within ``timeout``.
    """
    ctx = forkserver_context()
    tmpdir = tempfile.mkdtemp(prefix="fastcoll_test_")
    store_path = os.path.join(tmpdir, "store")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, r, world_size, store_path, args, results, pg_timeout, init_pg, dict(env or {})),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    collected: dict = {}
    errors: dict = {}
    try:
        deadline = time.monotonic() + timeout
        while len(collected) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(collected) - set(errors))
                detail = f"; failures so far: {RankError(errors)}" if errors else ""
                if errors:
                    raise RankError(errors)
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f}s{detail}")
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in collected and r not in errors]
                for r in dead:
                    errors[r] = f"process exited with code {procs[r].exitcode} without reporting"
                continue
            (collected if ok else errors)[rank] = pickle.loads(payload) if ok else payload
            if not ok:
                # Peers of a failed rank may be stuck in a collective; give them a
                # short grace period to report their own error, then stop waiting.
                deadline = min(deadline, time.monotonic() + min(pg_timeout, 15.0) + 5.0)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        import shutil

        shutil.rmtree(tmpdir, ignore_errors=True)
    if errors:
        raise RankError(errors)
    return [collected[r] for r in range(world_size)]
