"""Communication hooks: checking them when registered, calling them, and checking what they return.

A comm hook has torch DDP's contract: ``hook(state, bucket) -> Future`` is
called once per bucket per synchronized backward, in bucket index order, with
a :class:`fastcoll.GradBucket` holding the bucket's gradients *not* divided
by the world size; the future's value (one tensor, or a list holding one,
with the bucket's number of elements in any floating dtype) is what gets
written back into the gradients. The reducer calls hooks through
:func:`call_hook` and reads their results through :func:`hook_result`, so
every message about a misbehaving hook is written here. Registration on the
wrapper is :class:`fastcoll.ddp.comm_hooks.CommHookRegistration`.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..ops.dtypes import as_real

__all__ = [
    "call_hook",
    "check_comm_hook",
    "describe_value",
    "hook_name",
    "hook_result",
]

_WHO = "fastcoll.DDP"


def hook_name(hook: Any) -> str:
    """A printable name of ``hook`` (its qualified name; ``partial(name)`` for functools.partial)."""
    name = getattr(hook, "__qualname__", None) or getattr(hook, "__name__", None)
    if name is None and hasattr(hook, "func"):  # functools.partial
        name = f"partial({hook_name(hook.func)})"
    return repr(name or type(hook).__name__)


def describe_value(v: Any) -> str:
    """What ``v`` is, for a message: a tensor's shape/dtype/device, a sequence's length and element types, a type name."""
    if isinstance(v, torch.Tensor):
        return f"a Tensor (shape {tuple(v.shape)}, dtype {v.dtype}, device {v.device})"
    if isinstance(v, (list, tuple)):
        return f"a {type(v).__name__} of {len(v)} element(s) ({', '.join(type(x).__name__ for x in v[:4])})"
    return "None" if v is None else f"a {type(v).__module__}.{type(v).__qualname__}"


def call_hook(hook: Callable, state: Any, bucket: Any) -> torch.futures.Future:
    """Call ``hook(state, bucket)``; returns its future, checked to be one."""
    bucket.reset_hook_buffer()
    fut = hook(state, bucket)
    if not isinstance(fut, torch._C.Future):
        raise TypeError(
            f"{_WHO}: the comm hook {hook_name(hook)} returned {describe_value(fut)} for bucket "
            f"{bucket.pos}; a comm hook must return a torch.futures.Future whose value is the reduced bucket "
            "(one tensor with the bucket's number of elements), e.g. "
            "dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])"
        )
    return fut


def hook_result(hook: Callable, bucket: Any, value: Any) -> torch.Tensor:
    """The hook's future value for ``bucket`` as a flat tensor to write back, checked."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    n = bucket.numel
    if bucket.dtype.is_complex and isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() == 2 * n:
        # torch's hooks reduce a complex bucket's buffer() as its floats: read them as complex values again
        value = torch.view_as_complex(value.reshape(-1, 2).to(as_real(bucket.flat).dtype))
    if (
        not isinstance(value, torch.Tensor)
        or not (value.is_floating_point() or value.is_complex())
        or value.numel() != bucket.numel
        or value.device != bucket.device
    ):
        raise TypeError(
            f"{_WHO}: the comm hook {hook_name(hook)} completed bucket {bucket.pos} with "
            f"{describe_value(value)}; expected one floating-point tensor of "
            f"{f'{2 * n} (the real view of its {n} complex elements)' if bucket.dtype.is_complex else n} elements on "
            f"{bucket.device} (or a list holding exactly one)"
        )
    flat = bucket.flat
    if value is flat or (value.dtype == flat.dtype and value.data_ptr() == flat.data_ptr() and value.is_contiguous()):
        return flat
    return value.reshape(-1) if value.is_contiguous() else value.contiguous().reshape(-1)


# ----------------------------------------------------------------- registration checks


def _annotation_name(a: Any) -> str:
    return str(a).strip("'\" ").split("[", 1)[0].rsplit(".", 1)[-1]


def _is_bucket_annotation(a: Any) -> bool:
    if a is inspect.Parameter.empty or a is typing.Any or a is object:
        return True
    if isinstance(a, type):
        from .bucket import GradBucket

        return issubclass(a, (GradBucket, dist.GradBucket))
    if isinstance(a, str):
        return _annotation_name(a) in ("GradBucket", "Bucket", "Any", "object")
    return False


def _is_tensor_annotation(a: Any) -> bool:
    if a is torch.Tensor or a is typing.Any:
        return True
    if isinstance(a, str):
        return _annotation_name(a) in ("Tensor", "Any")
    origin = typing.get_origin(a)
    if origin in (list, tuple, typing.List, typing.Tuple, Sequence):
        args = [x for x in typing.get_args(a) if x is not Ellipsis]
        return not args or all(_is_tensor_annotation(x) for x in args)
    return False


def _is_future_annotation(a: Any) -> bool:
    if a is inspect.Signature.empty or a is typing.Any:
        return True
    if isinstance(a, str):
        text = a.replace(" ", "")
        if _annotation_name(text) != "Future":
            return False
        inner = text.split("[", 1)[1].rsplit("]", 1)[0] if "[" in text else ""
        return not inner or "Tensor" in inner or inner == "Any"
    if isinstance(a, type) and issubclass(a, torch._C.Future):
        return True
    origin = typing.get_origin(a)
    if isinstance(origin, type) and issubclass(origin, torch._C.Future):
        args = typing.get_args(a)
        return not args or _is_tensor_annotation(args[0])
    return False


def _signature(hook: Any) -> "inspect.Signature | None":
    try:
        return inspect.signature(hook, eval_str=True)
    except (NameError, SyntaxError, TypeError, AttributeError):
        try:
            return inspect.signature(hook)
        except (TypeError, ValueError):
            return None
    except ValueError:  # builtins without a signature
        return None


def check_comm_hook(hook: Any) -> None:
    """Validate a comm hook as torch DDP does, minus its false rejections.

    Accepts functools.partial objects and any name for the second parameter.

    Raises:
        TypeError: ``hook`` is not callable or cannot take ``(state, bucket)``.
        ValueError: its annotations are not a GradBucket and a Future of a tensor.
    """
    if not callable(hook):
        raise TypeError(f"{_WHO}: the communication hook must be callable, got {type(hook).__name__}")
    sig = _signature(hook)
    if sig is None:
        return
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
    required = [p for p in positional if p.default is p.empty]
    required_kw = [p for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    if (len(positional) < 2 and not varargs) or len(required) > 2 or required_kw:
        raise TypeError(
            f"{_WHO}: the communication hook {hook_name(hook)} must be callable as hook(state, bucket); its signature is {sig}"
        )
    if len(positional) >= 2 and not _is_bucket_annotation(positional[1].annotation):
        raise ValueError(
            f"{_WHO}: the communication hook {hook_name(hook)}: its bucket parameter "
            f"'{positional[1].name}' is annotated {positional[1].annotation!r}; it should be dist.GradBucket "
            "(or fastcoll.GradBucket), or not annotated"
        )
    if not _is_future_annotation(sig.return_annotation):
        raise ValueError(
            f"{_WHO}: the communication hook {hook_name(hook)}: return annotation "
            f"{sig.return_annotation!r} should be torch.futures.Future[torch.Tensor] (or none)"
        )
