"""Never hang silently: stall detection and diagnosis for fastcoll's synchronization (issue #12).

Pieces, from the hot path out:

* :class:`SyncState` (``state.py``): per process group, where this rank is
  (iteration, phase, collectives issued with a ring of the last few, what it
  waits for, parameters still without gradients), written with plain
  attribute writes by the training thread;
* :class:`StateBoard` (``board.py``): publishes the state to the group's
  store from a daemon thread (at most once per iteration/second, and on
  demand when a rank diagnoses), reads every rank's;
* :func:`diagnose` (``diagnosis.py``) and the culprit rules (``verdict.py``):
  gather, agree on one first line, report, :class:`StallError`;
* :func:`wait_or_diagnose`, :class:`Watchdog`, :class:`StallGuard` and the
  per-group registry (``wait.py``): how a wait becomes a diagnosis;
* the timeout rule (``timeout.py``): ``FASTCOLL_STALL_TIMEOUT``, else half
  the process group's timeout capped at 300 s; 0 disables;
* last words (``abort.py``): when gloo aborts the process from its own
  thread (a collective received more bytes than it expects: a collective
  issued on some ranks only), a C++ terminate handler says on stderr which
  collective received what from whom, publishes the rank's state marked
  ``aborted`` and announces it, so every other rank diagnoses at once and
  names the rank with the extra collective, and keeps the process (and a
  store it hosts) alive until they have read it. Installed once with the
  first board; ``FASTCOLL_STALL_ABORT_HOOK=0`` disables it.

Wiring, in short: the reducer builds its ``Communicator(group, world_size,
force, stall_timeout=..., device=...)`` (None: the default rule; the
communicator then holds ``guard``, a :class:`StallGuard`, and ``state``, the
group's :class:`SyncState`), waits with ``comm.wait(handle, what)`` instead
of ``handle.wait()``, and marks the phases on ``comm.state``
(``begin_forward``, ``begin_backward``, ``end_backward(missing)``,
``end_iteration``). Collectives outside the reducer go through
:func:`run_collective` (start, number, wait) or :func:`protected_wait`.
Labels (``what``) must be the same on every rank: they are compared.
After a :class:`StallError` the process group is not to be used again.
"""

from __future__ import annotations

from .board import KEY_PREFIX, StateBoard, StoreUnreachable
from .diagnosis import TRACE_DIR_ENV, default_grace, diagnose
from .errors import StallError, is_peer_failure, is_timeout
from .state import BACKWARD, FINISHED_BACKWARD, FORWARD, OUTSIDE, SyncState, describe_phase
from .timeout import default_stall_timeout, env_stall_timeout, process_group_timeout, resolve_stall_timeout
from .verdict import culprit_line, render_report
from .wait import (
    WAIT_SLICE_S,
    PeerAborted,
    StallGuard,
    Watchdog,
    backend_of,
    board_for,
    guard_for,
    protected_wait,
    run_collective,
    set_group_stall_timeout,
    state_for,
    wait_or_diagnose,
)

__all__ = [
    "BACKWARD",
    "FINISHED_BACKWARD",
    "FORWARD",
    "KEY_PREFIX",
    "OUTSIDE",
    "TRACE_DIR_ENV",
    "WAIT_SLICE_S",
    "PeerAborted",
    "StallError",
    "StallGuard",
    "StateBoard",
    "StoreUnreachable",
    "SyncState",
    "Watchdog",
    "backend_of",
    "board_for",
    "culprit_line",
    "default_grace",
    "default_stall_timeout",
    "describe_phase",
    "diagnose",
    "env_stall_timeout",
    "guard_for",
    "is_peer_failure",
    "is_timeout",
    "process_group_timeout",
    "protected_wait",
    "render_report",
    "resolve_stall_timeout",
    "run_collective",
    "set_group_stall_timeout",
    "state_for",
    "wait_or_diagnose",
]
