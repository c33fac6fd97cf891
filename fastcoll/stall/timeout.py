"""How long a rank may wait inside fastcoll's synchronization before it diagnoses a stall.

``stall_timeout`` (seconds): None means the default, 0 disables. The default
is ``FASTCOLL_STALL_TIMEOUT`` when set, else half the process group's own
timeout, capped at 300 s (so fastcoll diagnoses before the backend's timeout
kills the job: gloo's default is 30 min, NCCL's 10 min).
"""

from __future__ import annotations

import datetime
import math
import os
from typing import Any, Optional

__all__ = [
    "DEFAULT_CAP_S",
    "ENV",
    "default_stall_timeout",
    "env_stall_timeout",
    "process_group_timeout",
    "resolve_stall_timeout",
]

ENV = "FASTCOLL_STALL_TIMEOUT"
DEFAULT_CAP_S = 300.0
#: torch's default process group timeout (used when a group's cannot be read).
_TORCH_DEFAULT_S = 1800.0


def _check(value: Any, what: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"fastcoll: {what}={value!r} is not a number of seconds; use a number >= 0 (0 disables)") from None
    if math.isnan(v) or v < 0:
        raise ValueError(f"fastcoll: {what}={value!r} must be >= 0 seconds (0 disables)")
    return v


def env_stall_timeout() -> Optional[float]:
    """``FASTCOLL_STALL_TIMEOUT`` in seconds, or None when unset/empty.

    Raises:
        ValueError: if it is set to something other than a number >= 0.
    """
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    return _check(value, ENV)


def process_group_timeout(group: Any = None) -> float:
    """The process group's collective timeout in seconds (``init_process_group(timeout=...)``).

    Read from the group's backend options (torch keeps it there, per
    backend); torch's default for the backend when it cannot be read.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not (dist.is_available() and dist.is_initialized()):
        return _TORCH_DEFAULT_S
    pg = group if group is not None else c10d._get_default_group()
    for dev in ("cpu", "cuda"):
        try:
            td = pg._get_backend(torch.device(dev)).options._timeout
        except Exception:  # noqa: BLE001 - no backend for this device, or an options type without it
            continue
        if isinstance(td, datetime.timedelta) and td.total_seconds() > 0:
            return td.total_seconds()
    try:
        td = c10d._get_default_timeout(dist.get_backend(pg))
        return td.total_seconds()
    except Exception:  # noqa: BLE001
        return _TORCH_DEFAULT_S


def default_stall_timeout(group: Any = None, pg_timeout: Optional[float] = None) -> float:
    """The default: ``FASTCOLL_STALL_TIMEOUT`` if set, else ``min(pg_timeout / 2, 300)``.

    Args:
        group: Process group whose timeout to read (None: the default group).
        pg_timeout: Use this group timeout (seconds) instead of reading it.
    """
    env = env_stall_timeout()
    if env is not None:
        return env
    pg = process_group_timeout(group) if pg_timeout is None else float(pg_timeout)
    return min(pg / 2.0, DEFAULT_CAP_S)


def resolve_stall_timeout(stall_timeout: Optional[float], group: Any = None, pg_timeout: Optional[float] = None) -> float:
    """Seconds to wait before diagnosing; 0.0 means disabled.

    Args:
        stall_timeout: The user's value: None for the default, 0 to disable,
            else seconds (a ``datetime.timedelta`` is accepted too).
        group: Process group (for the default).
        pg_timeout: The group's timeout in seconds, if already known.

    Raises:
        ValueError: for a negative or non-numeric value.
    """
    if stall_timeout is None:
        return default_stall_timeout(group, pg_timeout)
    if isinstance(stall_timeout, datetime.timedelta):
        stall_timeout = stall_timeout.total_seconds()
    if isinstance(stall_timeout, bool):
        raise ValueError(f"fastcoll: stall_timeout={stall_timeout!r} is not a number of seconds; use a number >= 0 (0 disables)")
    return _check(stall_timeout, "stall_timeout")
