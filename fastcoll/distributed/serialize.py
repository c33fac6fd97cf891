"""Picklable objects as uint8 tensors, and back.

:func:`obj2tensor`, :func:`tensor2obj`, :func:`serialize_to_tensor` and
:func:`pad_to_largest_tensor`, the building blocks of the object collectives.
"""

from __future__ import annotations

import pickle
import warnings
from typing import Any

import torch

from ._agree import agree, bytes_to_tensor
from .backends import comm_device
from .process import Group, collectives_needed

__all__ = [
    "LARGE_PAYLOAD_BYTES",
    "dumps",
    "obj2tensor",
    "pad_to_largest_tensor",
    "serialize_to_tensor",
    "tensor2obj",
    "type_name",
]

#: Serialized objects larger than this trigger a warning (1 GiB).
LARGE_PAYLOAD_BYTES = 1 << 30


def type_name(obj: Any) -> str:
    """The qualified name of ``obj``'s type, without ``builtins.``."""
    cls = type(obj)
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def dumps(obj: Any, what: str) -> bytes:
    """Pickle ``obj``, warning when the result exceeds :data:`LARGE_PAYLOAD_BYTES`.

    Args:
        obj: The object.
        what: Public name of the caller, for messages (``fastcoll.dist.broadcast``).

    Returns:
        The pickled bytes.

    Raises:
        TypeError: if ``obj`` cannot be pickled (naming its type).
    """
    try:
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # PicklingError, TypeError, AttributeError (local objects), ...
        raise TypeError(f"{what}: cannot pickle an object of type {type_name(obj)} ({exc}); send picklable data instead") from exc
    if len(payload) > LARGE_PAYLOAD_BYTES:
        warnings.warn(
            f"{what}: the serialized {type_name(obj)} is {len(payload) / (1 << 30):.2f} GiB; "
            "sending it through a collective needs that much memory on every rank and may be slow",
            RuntimeWarning,
            stacklevel=3,
        )
    return payload


def obj2tensor(pyobj: Any, device: str | torch.device | None = None) -> torch.Tensor:
    """Serialize a picklable object into a 1-D uint8 tensor.

    Args:
        pyobj: Any picklable object.
        device: Where to put the tensor. None picks the device the default
            process group communicates on (see
            :func:`fastcoll.distributed.backends.comm_device`; CPU when not distributed).

    Returns:
        The pickled bytes as a uint8 tensor.

    Raises:
        TypeError: if ``pyobj`` cannot be pickled (the message names its type).
    """
    payload = dumps(pyobj, "fastcoll.dist.obj2tensor")
    return bytes_to_tensor(payload, comm_device() if device is None else torch.device(device))


def tensor2obj(tensor: torch.Tensor) -> Any:
    """Deserialize an object from a tensor made by :func:`obj2tensor`.

    Args:
        tensor: The serialized bytes, on any device (non-uint8 tensors are read
            as their raw bytes).

    Returns:
        The unpickled object.

    Raises:
        TypeError: if ``tensor`` is not a tensor.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"fastcoll.dist.tensor2obj: expected a tensor, got {type_name(tensor)}")
    t = tensor.detach().cpu().contiguous().reshape(-1)
    if t.dtype != torch.uint8:
        t = t.view(torch.uint8)
    return pickle.loads(t.numpy().tobytes())


def serialize_to_tensor(data: Any) -> torch.Tensor:
    """Serialize a picklable object into a uint8 tensor on the default group's communication device.

    Args:
        data: Any picklable object.

    Returns:
        A 1-D uint8 tensor (on CUDA for an NCCL default group, else on CPU).

    Raises:
        TypeError: if ``data`` cannot be pickled (the message names its type).
    """
    return bytes_to_tensor(dumps(data, "fastcoll.dist.serialize_to_tensor"), comm_device())


def pad_to_largest_tensor(tensor: torch.Tensor, group: Group = None) -> tuple[list[int], torch.Tensor]:
    """Zero-pad a 1-D tensor to the largest length any rank has.

    Args:
        tensor: The local tensor (flattened if not 1-D), typically from
            :func:`serialize_to_tensor`. Ranks may pass different lengths.
        group: Process group; the default group when None.

    Returns:
        Every rank's original length, in group-rank order, and the local tensor
        zero-padded to the largest of them, on the group's communication
        device (the tensor's own device when it is a CUDA tensor and the
        backend needs CUDA).
    """
    flat = tensor.reshape(-1)
    if not collectives_needed(group):
        return [flat.numel()], flat
    device = comm_device(group, [flat])
    flat = flat.to(device)
    rows = agree("fastcoll.dist.pad_to_largest_tensor", group=group, values=[flat.numel()], device=device)
    sizes = [row[0] for row in rows]
    longest = max(sizes)
    if flat.numel() < longest:
        flat = torch.cat([flat, flat.new_zeros(longest - flat.numel())])
    return sizes, flat
