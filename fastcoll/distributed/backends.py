"""Which devices a process group's backend handles, and where its collectives run.

The device rule (:func:`pick_comm_device`): for a backend that handles CPU
tensors (gloo, mpi, a ``"cpu:gloo,cuda:nccl"`` mapping) collectives of data
that starts on the CPU (pickled objects, the agreement records) run on the
CPU. For a CUDA-only backend (nccl) they run on, in this order of preference:

1. the device of the CUDA tensors passed to the helper (``reduce_mean``,
   ``all_reduce_dict``, ``allreduce_grads``, ``pad_to_largest_tensor``);
2. the device the process group is bound to (``ProcessGroup.bound_device_id``,
   set by ``init_process_group(device_id=...)``);
3. ``torch.cuda.current_device()``.

So a script that keeps its tensors on ``cuda:{local_rank}`` but never calls
``torch.cuda.set_device`` still communicates on its own GPU, not on cuda:0.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from .process import Group, is_distributed

__all__ = [
    "CPU",
    "all_reduce_flat",
    "backend_name",
    "bound_device",
    "comm_device",
    "flat_buffer",
    "group_supports",
    "pick_comm_device",
    "release_buffers",
    "supports_device",
]

CPU = torch.device("cpu")


def backend_name(group: Group = None) -> str:
    """The group's backend in lower case ("gloo", "nccl", "cpu:gloo,cuda:nccl"); "" when not distributed."""
    if not is_distributed():
        return ""
    return str(dist.get_backend(group)).lower()


def _mapped_types(backend: str) -> list:
    """Device types of a per-device mapping such as ``"cpu:gloo,cuda:nccl"``."""
    return [part.split(":")[0].strip() for part in backend.split(",")]


def supports_device(backend: str, device: torch.device) -> bool:
    """Whether ``backend`` runs collectives on tensors of ``device``'s type (a pure function).

    Args:
        backend: A backend name as :func:`backend_name` returns it.
        device: The tensors' device.

    Returns:
        True for gloo on CPU or CUDA, nccl on CUDA, mpi on CPU, a mapping that
        lists the device type, and any unknown backend (torch decides).
    """
    if ":" in backend:
        return device.type in _mapped_types(backend)
    if backend == "nccl":
        return device.type == "cuda"
    if backend == "gloo":
        return device.type in ("cpu", "cuda")
    if backend == "mpi":
        return device.type == "cpu"
    return True


def group_supports(device: torch.device, group: Group = None) -> bool:
    """Whether the group's backend can run collectives on tensors of ``device``."""
    return supports_device(backend_name(group), device)


def _cuda_only(backend: str) -> bool:
    """Whether the backend needs CUDA tensors (nccl, or a mapping with cuda but no cpu entry)."""
    if ":" in backend:
        types = _mapped_types(backend)
        return "cuda" in types and "cpu" not in types
    return backend == "nccl"


def pick_comm_device(
    backend: str,
    tensor_devices: Iterable[torch.device] = (),
    bound: torch.device | None = None,
    current: int | None = None,
) -> torch.device:
    """The device collectives run on (a pure function; see the module docstring for the rule).

    Args:
        backend: A backend name as :func:`backend_name` returns it.
        tensor_devices: Devices of the tensors being reduced (may be empty).
        bound: The group's bound device (``ProcessGroup.bound_device_id``), or None.
        current: ``torch.cuda.current_device()``, or None when CUDA is not available.

    Returns:
        CPU for backends that handle CPU tensors; otherwise the first CUDA
        tensor device, else ``bound``, else ``cuda:{current}`` (CPU when
        ``current`` is None).
    """
    if not _cuda_only(backend):
        return CPU
    for device in tensor_devices:
        if device.type == "cuda":
            return device if device.index is not None else torch.device("cuda", current or 0)
    if bound is not None and bound.type == "cuda":
        return bound
    if current is None:
        return CPU
    return torch.device("cuda", current)


def bound_device(group: Group = None) -> torch.device | None:
    """The device the group is bound to (``init_process_group(device_id=...)``), or None."""
    if not is_distributed():
        return None
    pg = group if group is not None else dist.group.WORLD
    device = getattr(pg, "bound_device_id", None)
    return device if isinstance(device, torch.device) else None


def comm_device(group: Group = None, tensors: Iterable[torch.Tensor] = ()) -> torch.device:
    """The device the group's collectives run on, for a call that reduces ``tensors``.

    Applies :func:`pick_comm_device` to this process's state. CUDA is not
    touched for backends that handle CPU tensors.

    Args:
        group: Process group; the default group when None.
        tensors: The tensors the calling helper reduces (may be empty).
    """
    backend = backend_name(group)
    if not _cuda_only(backend):
        return CPU
    current = torch.cuda.current_device() if torch.cuda.is_available() else None
    return pick_comm_device(backend, (t.device for t in tensors), bound_device(group), current)


_BUFFERS = threading.local()


def flat_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D buffer for ``allreduce_grads``; on CPU reused between calls of the same thread.

    Fresh multi-megabyte CPU allocations are returned to the OS when freed, so
    every call would pay for page-faulting them in again (more than the copy
    itself). CUDA memory comes from torch's caching allocator and is not kept.
    """
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    cache = getattr(_BUFFERS, "cache", None)
    if cache is None:
        cache = _BUFFERS.cache = {}
    buf = cache.get(dtype)
    if buf is None or buf.numel() < numel:
        cache.pop(dtype, None)  # free the old one before allocating the new one
        buf = cache[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


def release_buffers() -> None:
    """Free the CPU buffers :func:`fastcoll.dist.allreduce_grads` keeps between calls (in this thread)."""
    _BUFFERS.cache = {}


def all_reduce_flat(
    flat: torch.Tensor, group: Group, async_op: bool = False, device: torch.device | None = None, what: str = "fastcoll.dist"
) -> Any | None:
    """SUM-all-reduce ``flat`` in place, staging it through the communication device if needed.

    Args:
        flat: A contiguous tensor.
        group: Process group; the default group when None.
        async_op: Return the work handle instead of waiting (only when no
            staging is needed; a staged reduce always completes before returning).
        device: Where to stage ``flat`` when the backend cannot use its device;
            ``comm_device(group, [flat])`` when None.

    Returns:
        The work handle for an asynchronous reduce, else None.
    """
    if group_supports(flat.device, group):
        work = start_collective(
            lambda: dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True), "all_reduce", what, flat, group
        )
        if async_op:
            return work
        finish_collective(work, group, what, flat.device)
        return None
    staged = flat.to(device if device is not None else comm_device(group, [flat]), copy=True)
    work = start_collective(
        lambda: dist.all_reduce(staged, op=dist.ReduceOp.SUM, group=group, async_op=True), "all_reduce", what, staged, group
    )
    finish_collective(work, group, what, staged.device)
    flat.copy_(staged)
    return None


def start_collective(start: Callable[[], Any], kind: str, what: str, tensor: torch.Tensor, group: Group) -> Any:
    """Number a collective in the group's stall state, start it (``start`` returns its Work) and let the stall guard watch it.

    ``what`` must be the same on every rank (it is compared in stall reports).
    Wait for the returned Work with :func:`finish_collective`.
    """
    from ..stall import guard_for, state_for

    seq = state_for(group).note(kind, what, tensor.numel(), tensor.dtype)
    work = start()
    guard = guard_for(group, None, device=tensor.device)
    if guard is not None:
        guard.issued(work, seq, what)
    return work


def finish_collective(work: Any, group: Group, what: str, device: torch.device) -> Any:
    """Wait for a Work from :func:`start_collective`, bounded by the stall timeout (:class:`fastcoll.StallError` on a stall)."""
    from ..stall import protected_wait

    return protected_wait(work, group, what, None, device)
