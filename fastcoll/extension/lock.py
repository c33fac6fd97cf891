"""The build lock: one process compiles a key, the others wait, then load its result.

A POSIX (fcntl) lock on ``<key>.lock``. The kernel drops it when its holder
exits, however it exits: a killed build leaves the file, never the lock. NFS
carries these locks between the nodes that share a cache (home directories).
The holder writes its pid, host and start time into the file, so a waiting
process can say whom it waits for. A holder that is alive but stuck is waited
for at most ``FASTCOLL_LOCK_TIMEOUT`` seconds (default 1800), then the waiting
process gives up with a message naming the lock file. Where the file system
has no locks (ENOLCK: NFS mounted ``nolock``) builds go ahead unlocked: each
builds in a folder of its own and publishes by rename, so results stay whole.

The file is never deleted: a process could otherwise lock a name whose file
another process has just replaced.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
from typing import Callable, Iterator

from .errors import LockTimeout

DEFAULT_TIMEOUT = 1800.0
_REMIND_EVERY = 300.0
_BUSY = (errno.EACCES, errno.EAGAIN)
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


def timeout() -> float:
    """``FASTCOLL_LOCK_TIMEOUT``: the longest wait for another process's build, in seconds."""
    value = os.environ.get("FASTCOLL_LOCK_TIMEOUT", "").strip()
    try:
        return float(value) if value else DEFAULT_TIMEOUT
    except ValueError:
        raise ValueError(f"fastcoll: FASTCOLL_LOCK_TIMEOUT={value!r} is not a number of seconds") from None


def holder(path: str) -> str:
    """Who holds (or last held) the lock, as its note says: ``pid N on host H since T``."""
    try:
        with open(path) as f:
            note = f.read().strip()
    except OSError:
        note = ""
    return note or "another process"


@contextlib.contextmanager
def acquire(path: str, wait_limit: float, on_wait: Callable[[str], None], poll: float = 0.2) -> Iterator[bool]:
    """Hold the lock at ``path`` for the ``with`` block.

    Args:
        path: The lock file (created if missing).
        wait_limit: Seconds to wait for another holder before giving up.
        on_wait: Called with a message when this process starts waiting (and every 5 minutes after).
        poll: Seconds between attempts.

    Yields:
        Whether this process had to wait for another one.

    Raises:
        LockTimeout: Another process held the lock for ``wait_limit`` seconds.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    locked = waited = False
    try:
        start = last_note = time.monotonic()
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
                break
            except OSError as exc:
                if exc.errno in _UNSUPPORTED:
                    on_wait(f"file locks are not supported where {path} lives; building without the lock")
                    break
                if exc.errno not in _BUSY:
                    raise
            now = time.monotonic()
            if not waited or now - last_note >= _REMIND_EVERY:
                verb = "waiting" if not waited else f"still waiting ({now - start:.0f} s)"
                on_wait(f"{verb} for {holder(path)}, which is compiling this extension (lock file: {path})")
                waited, last_note = True, now
            if now - start >= wait_limit:
                raise LockTimeout(
                    f"gave up after {wait_limit:.0f} s waiting for {holder(path)} to finish compiling (lock file: {path})",
                    "If that process is stuck, end it; FASTCOLL_LOCK_TIMEOUT sets the wait",
                )
            time.sleep(poll)
        if locked:
            note = f"pid {os.getpid()} on host {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
            os.ftruncate(fd, 0)
            os.pwrite(fd, note.encode(), 0)
        yield waited
    finally:
        if locked:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # a note left behind names a process that no longer holds the lock
            fcntl.lockf(fd, fcntl.LOCK_UN)
        os.close(fd)
