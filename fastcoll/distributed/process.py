"""Who am I, how many of us are there: process information and barriers.

Every function works without an initialized process group, as a world of
size one, so a script runs unchanged in a plain process and under a launcher.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from .._knobs import force_collectives

__all__ = [
    "Group",
    "distributed_available",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "is_distributed",
    "is_module_wrapper",
    "parse_int",
    "rank_zero_only",
    "synchronize",
]

F = TypeVar("F", bound=Callable[..., Any])
#: A process group argument: None means the default group.
Group = Optional["dist.ProcessGroup"]


def parse_int(name: str, value: str, who: str = "fastcoll.dist") -> int:
    """Parse the integer environment variable ``name``.

    Args:
        name: The variable's name (for the message).
        value: Its value.
        who: The public function to name in the message.

    Returns:
        The integer.

    Raises:
        ValueError: if ``value`` is not an integer (naming the variable and its value).
    """
    try:
        return int(str(value).strip())
    except ValueError:
        raise ValueError(
            f"{who}: environment variable {name}={value!r} is not an integer; set it to an integer or unset it"
        ) from None


def distributed_available() -> bool:
    """Whether torch.distributed is usable right now.

    Returns:
        True when PyTorch was built with distributed support and the default
        process group has been initialized.
    """
    return dist.is_available() and dist.is_initialized()


def is_distributed() -> bool:
    """Whether this process is part of an initialized default process group.

    Returns:
        True when torch.distributed is available and initialized (also for a
        world of size one).
    """
    return distributed_available()


def get_rank(group: Group = None) -> int:
    """Rank of this process.

    Args:
        group: Process group to query; the default group when None.

    Returns:
        The rank within ``group``, or 0 when no process group is initialized.
    """
    if not is_distributed():
        return 0
    return dist.get_rank(group)


def get_world_size(group: Group = None) -> int:
    """Number of processes.

    Args:
        group: Process group to query; the default group when None.

    Returns:
        The size of ``group``, or 1 when no process group is initialized.
    """
    if not is_distributed():
        return 1
    return dist.get_world_size(group)


def collectives_needed(group: Group = None) -> bool:
    """Whether a helper must issue its collectives: a world of more than one, or ``FASTCOLL_FORCE_COLLECTIVES=1``.

    Without a process group nothing is ever communicated.
    """
    return is_distributed() and (dist.get_world_size(group) > 1 or force_collectives())


def get_local_rank() -> int:
    """Rank of this process among the processes on its machine.

    Read from the ``LOCAL_RANK`` environment variable, which ``torchrun`` sets
    and :func:`fastcoll.dist.init_dist` sets for every launcher.

    Returns:
        The local rank, or 0 when ``LOCAL_RANK`` is not set.

    Raises:
        ValueError: if ``LOCAL_RANK`` is set but is not an integer.
    """
    value = os.environ.get("LOCAL_RANK")
    if value is None or value.strip() == "":
        return 0
    return parse_int("LOCAL_RANK", value, "fastcoll.dist.get_local_rank")


def synchronize(group: Group = None) -> None:
    """Block until every process of the group has reached this call (a barrier).

    A no-op when not distributed or when the group has a single process. On a
    CUDA backend the barrier runs on the group's communication device (see
    :func:`fastcoll.distributed.backends.comm_device`). It is numbered and
    waited for under stall protection, as every fastcoll.dist collective: a
    rank that never reaches it, or that issues another collective instead, is
    named in a :class:`fastcoll.StallError` on every rank.

    Args:
        group: Process group to synchronize; the default group when None.
    """
    if not collectives_needed(group):
        return
    from ..stall import run_collective
    from .backends import comm_device  # backends imports this module

    device = comm_device(group)
    ids = [device.index] if device.type == "cuda" else None

    def start() -> Any:
        return dist.barrier(group=group, async_op=True, device_ids=ids)

    run_collective(start, "barrier", "fastcoll.dist.synchronize", torch.empty(0, device=device), group)


def rank_zero_only(func: F) -> F:
    """Decorator: run ``func`` on global rank 0 only.

    On every other rank the decorated function does nothing and returns None.
    The rank is looked up at call time, so decorating before
    :func:`fastcoll.dist.init_dist` is fine. In a single process the function
    always runs.

    Args:
        func: The function to guard.

    Returns:
        The wrapped function.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if get_rank() == 0:
            return func(*args, **kwargs)
        return None

    return wrapper  # type: ignore[return-value]


def _wrapper_types() -> tuple[type, ...]:
    """The data-parallel wrapper classes :func:`is_module_wrapper` recognises."""
    # fastcoll.DDP subclasses torch's DistributedDataParallel: recognised without importing fastcoll.ddp,
    # which imports this package.
    types = [torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel]
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - distributed-less builds
        pass
    else:
        types.append(FullyShardedDataParallel)
    return tuple(types)


def is_module_wrapper(module: Any) -> bool:
    """Whether ``module`` is a data-parallel wrapper around another module.

    Recognised wrappers are :class:`torch.nn.DataParallel`,
    :class:`torch.nn.parallel.DistributedDataParallel`,
    ``FullyShardedDataParallel``, ``fastcoll.DDP`` and subclasses of any of
    them. Modules that only forward to an inner module (the result of
    ``torch.compile``) are looked through, so ``torch.compile(DDP(model))``
    is a wrapper too, however deeply such layers nest.

    Args:
        module: The object to check.

    Returns:
        True when ``module`` is (or transparently wraps) a data-parallel wrapper.
    """
    wrappers = _wrapper_types()
    seen = set()
    while isinstance(module, torch.nn.Module) and id(module) not in seen:
        seen.add(id(module))
        if isinstance(module, wrappers):
            return True
        inner = module.__dict__.get("_orig_mod")  # torch.compile's OptimizedModule
        if inner is None:
            inner = module.__dict__.get("_modules", {}).get("_orig_mod")
        if inner is None:
            return False
        module = inner
    return False
