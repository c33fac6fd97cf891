"""The extension for the running torch: from the cache, or compiled once into it.

:func:`ensure` is what ``import fastcoll`` runs when no ahead-of-time build is
usable, and what ``python -m fastcoll.extension`` runs to fill the cache early. A
cache hit costs a stat and two small file reads. A miss takes the key's lock
(lock.py), looks again (another process may have built it meanwhile), compiles
in a folder of its own (compile.py) and publishes the result by rename
(cache.py); processes that waited load what the first one built.
"""

from __future__ import annotations

import os
import resource
import shutil
import socket
import sys
import time
from typing import Callable, NamedTuple, Optional

import torch

from . import cache, compile, key, lock, toolchain
from .errors import BuildFailed, ExtensionUnavailable

CACHE_HIT = "cache hit"
COMPILED = "compiled at import"


class Obtained(NamedTuple):
    """A usable build: where it is, how it was had, and what it was built for."""

    path: str  #: the library
    how: str  #: CACHE_HIT or COMPILED
    plan: key.Plan
    entry: cache.Entry
    seconds: Optional[float]  #: compile time, when this process compiled it


def say(message: str) -> None:
    """Print one line, ``fastcoll: <message>``, to stderr."""
    print(f"fastcoll: {message}", file=sys.stderr, flush=True)


def ensure(report: Callable[[str], None] = say, force: bool = False, retry_failed: bool = False) -> Obtained:
    """The cached build for the running torch, compiled first if there is none.

    Args:
        report: Takes the progress lines (start, end, waiting for another process).
        force: Compile even if a valid build is cached.
        retry_failed: Compile even if the last build of this key failed (otherwise that failure is raised again).

    Returns:
        The build, valid for this key (not yet loaded).

    Raises:
        ExtensionUnavailable: No sources, no compiler, an unwritable cache, a failed build
            (BuildFailed), or another process's build outlasting FASTCOLL_LOCK_TIMEOUT (LockTimeout).
    """
    plan = key.plan()
    entry = cache.Entry(cache.root(), plan.key)
    if not force and entry.valid():
        return Obtained(entry.lib, CACHE_HIT, plan, entry, None)
    if entry.failed() and not retry_failed:
        raise _earlier_failure(entry)
    try:
        entry.make_dirs()
    except OSError as exc:
        raise ExtensionUnavailable(
            f"the cache directory {entry.ext} cannot be written ({exc.strerror})",
            "Set FASTCOLL_CACHE_DIR to a writable directory",
        ) from None
    with lock.acquire(entry.lock, lock.timeout(), report) as waited:
        if entry.valid() and not force:
            return Obtained(entry.lib, CACHE_HIT, plan, entry, None)
        if waited and entry.failed() and not retry_failed:
            raise _earlier_failure(entry)
        toolchain.find_cxx()  # only here: a process without one may still load what another built
        return _build(plan, entry, report)


def _build(plan: key.Plan, entry: cache.Entry, report: Callable[[str], None]) -> Obtained:
    kernels = f"CPU and CUDA ({plan.cuda_archs}) kernels" if plan.with_cuda else "CPU kernels"
    if plan.cuda_missing:
        kernels += ", no CUDA kernels: nvcc not found"
    takes = "several minutes: nvcc" if plan.with_cuda else "about 2 min on 2 cores"
    report(
        f"compiling the C++ extension ({kernels}) for torch {torch.__version__} with {toolchain.max_jobs()} jobs "
        f"into {entry.dir}; this happens once per torch, Python and fastcoll version ({takes}). "
        "To do it ahead of time: python -m fastcoll.extension"
    )
    start, cpu_start = time.monotonic(), _children_cpu_seconds()
    build_dir = entry.new_build_dir()
    try:
        lib = compile.run(plan, build_dir)
        seconds = time.monotonic() - start
        entry.publish(
            lib,
            dict(
                plan.inputs,
                seconds=round(seconds, 1),
                cpu_seconds=round(_children_cpu_seconds() - cpu_start, 1),  # the compilers' CPU time, all jobs
                built_by=f"pid {os.getpid()} on host {socket.gethostname()}",
                built_at=time.strftime("%Y-%m-%d %H:%M:%S"),
            ),
        )
    except BuildFailed as exc:
        with open(exc.log, errors="replace") as f:
            entry.record_failure(f.read())
        raise BuildFailed(exc.cause, exc.fix, log=entry.failed_log) from None
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
    report(f"compiled the extension in {seconds:.0f} s: {entry.lib}")
    return Obtained(entry.lib, COMPILED, plan, entry, seconds)


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # every finished descendant: the worker, ninja, compilers
    return usage.ru_utime + usage.ru_stime


def _earlier_failure(entry: cache.Entry) -> BuildFailed:
    with open(entry.failed_log, errors="replace") as f:
        first = compile.first_error(f.read())
    return BuildFailed(
        f"an earlier compile of this extension failed: {first}",
        "Fix the cause shown in the log, then run `python -m fastcoll.extension` to compile again",
        log=entry.failed_log,
    )
