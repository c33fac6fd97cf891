"""StallError and the backend failures that mean "a peer is gone"."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

__all__ = ["StallError", "is_peer_failure", "is_timeout"]


class StallError(RuntimeError):
    """A rank waited too long in fastcoll's gradient synchronization, or a peer is gone.

    ``str(err)`` is the whole report; its first line names the culprit(s) and
    is the same on every live rank.

    Attributes:
        first_line: The report's first line.
        report: The whole report.
        culprits: Global ranks named by the first line (empty when none could be named).
        data: The JSON-able diagnosis (every rank's gathered state, this rank's view).
    """

    def __init__(self, report: str, first_line: str, culprits: List[int], data: Optional[Dict[str, Any]] = None):
        super().__init__(report)
        self.report = report
        self.first_line = first_line
        self.culprits = list(culprits)
        self.data = data or {}

    def __reduce__(self):
        return (StallError, (self.report, self.first_line, self.culprits, self.data))


#: Substrings of backend errors raised when a peer process died or its connection broke.
_PEER_FAILURE = (
    "connection closed by peer",
    "connection reset",
    "broken pipe",
    "connection refused",
    "remote worker crashing",
    "remote process exited",
    "nccl error",
    "ncclremoteerror",
    "ncclsystemerror",
    "nccl communicator was aborted",
    "communicator was aborted",
    "process group was aborted",
    "socket timeout",
    "read error",
    "write error",
)

_TIMEOUT = ("timed out", "timeout")


def is_peer_failure(exc: BaseException) -> bool:
    """Whether a collective's error says a peer is gone (or the communicator was torn down)."""
    text = str(exc).lower()
    return any(p in text for p in _PEER_FAILURE)


def is_timeout(exc: BaseException) -> bool:
    """Whether a collective's error is a timeout (``Work.wait(timeout)`` or the backend's own)."""
    text = str(exc).lower()
    return any(p in text for p in _TIMEOUT)
