"""What ``p.grad`` holds when the gradients are reduce-scattered: a tensor that refuses to be read.

With ``ShardedOptimizer(grads="sharded")`` the synchronized gradient of a
parameter exists only as ranges spread over the ranks; no rank has the whole.
Leaving ``p.grad`` as None would make ``torch.nn.utils.clip_grad_norm_``
return 0 and clip nothing, and a logging loop skip every parameter: silently
wrong. So each parameter's ``.grad`` becomes a :class:`ShardedGradient`: a
tensor with the gradient's shape, dtype and device but no data, on which any
operation raises an error that names the way to do what was asked. Zeroing
it (``zero_grad(set_to_none=False)``) is a no-op; it is dropped at the next
forward (so backward accumulates into a fresh gradient) and by the
optimizer's ``zero_grad``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ShardedGradient", "is_guard"]

#: Operations a guard answers without data: zeroing and detaching it (``zero_grad(set_to_none=False)``).
_HARMLESS = {"detach.default", "alias.default", "zero_.default", "detach_.default"}

MESSAGE = (
    "fastcoll.ShardedOptimizer(grads='sharded'): the gradient of this parameter is divided among the ranks "
    "(each rank holds the reduced values of its own range only), so `{op}` cannot be computed on p.grad. "
    "To clip, call opt.clip_grad_norm_(max_norm) (the global norm from every rank's range, one small "
    "all-reduce) or read model.grad_norm() with compute_grad_norm=True; with torch.amp.GradScaler, "
    "scaler.unscale_(opt) and scaler.step(opt) work on the ranges. Pass grads='full' to keep every "
    "rank's full gradients in p.grad."
)


class ShardedGradient(torch.Tensor):
    """A data-less stand-in for a parameter's gradient (shape, dtype, device and strides of ``like``)."""

    @staticmethod
    def __new__(cls, like: torch.Tensor) -> "ShardedGradient":
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, like.shape, strides=like.stride(), dtype=like.dtype, device=like.device, requires_grad=False
        )

    def __init__(self, like: torch.Tensor):
        pass

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"ShardedGradient(shape={tuple(self.shape)}, dtype={self.dtype}: divided among the ranks)"

    def __deepcopy__(self, memo: dict) -> "ShardedGradient":
        return ShardedGradient(self)

    def __reduce_ex__(self, proto: int) -> Any:
        raise RuntimeError(MESSAGE.format(op="pickling"))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        name = func.__name__
        if name in _HARMLESS:
            return args[0]
        raise RuntimeError(MESSAGE.format(op=name.split(".")[0]))


def is_guard(t: Any) -> bool:
    """Whether ``t`` is a :class:`ShardedGradient`."""
    return type(t) is ShardedGradient
