"""Comm hook registration on :class:`fastcoll.DDP`: torch DDP's ``register_comm_hook`` and built-in hooks.

The reducer checks, calls and reads hooks (:mod:`fastcoll.reducer.hooks`);
this mixin is the wrapper's side: one hook per module, registered between iterations.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from ..reducer.hooks import check_comm_hook, hook_name

__all__ = ["CommHookRegistration"]


class CommHookRegistration:
    """Comm hook registration of :class:`fastcoll.DDP` (torch DDP's ``register_comm_hook`` and built-in hooks).

    Expects the wrapper's ``reducer``, ``comm_dtype`` and ``_comm_hook_desc``
    (the one registered hook, built-in hook or comm_dtype, or None).
    """

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """Register a communication hook, with torch DDP's contract.

        ``hook(state, bucket) -> torch.futures.Future`` is called once per
        bucket per synchronized backward, in bucket index order, with a
        :class:`fastcoll.GradBucket` (torch's GradBucket interface: ``index()``,
        ``buffer()``, ``gradients()``, ``parameters()``, ``is_last()``,
        ``set_buffer()``). The buffer holds the bucket's gradients *not*
        divided by the world size (the hook divides). The future's value, one
        tensor (or a list holding one) with the bucket's number of elements
        in any floating dtype, is written back into the gradients by one fused
        unpack that casts on the way. A bucket of complex parameters shows
        its buffer as torch DDP does, as the floats it holds (twice as many),
        and takes them back. torch's hooks (allreduce, fp16/bf16
        compress and wrappers, PowerSGD, post-local SGD, noop) run unchanged.

        Only one hook per module (this, ``_register_builtin_comm_hook`` or
        ``comm_dtype``), registered between iterations.

        Raises:
            TypeError: ``hook`` is not callable or cannot take ``(state, bucket)``.
            ValueError: its annotations are not a GradBucket and a Future of a tensor.
            RuntimeError: a hook (or comm_dtype) is already registered.
        """
        check_comm_hook(hook)
        self._check_no_hook(hook_name(hook))
        self.reducer.register_comm_hook(state, hook)
        self._comm_hook_desc = hook_name(hook)

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        """torch DDP's built-in hooks, on fastcoll's fused paths.

        ``ALLREDUCE`` is the default reduction; ``FP16_COMPRESS`` is
        ``comm_dtype=torch.float16`` (one fused cast+scale pack, a float16
        all-reduce, one fused upcast unpack).
        """
        if not isinstance(comm_hook_type, dist.BuiltinCommHookType):
            raise TypeError(
                f"fastcoll.DDP: expected a torch.distributed.BuiltinCommHookType, got {type(comm_hook_type).__name__}"
            )
        desc = f"builtin {comm_hook_type.name}"
        self._check_no_hook(desc)
        if comm_hook_type == dist.BuiltinCommHookType.FP16_COMPRESS:
            self.reducer.set_comm_dtype(torch.float16)
            self.comm_dtype = torch.float16
        elif comm_hook_type != dist.BuiltinCommHookType.ALLREDUCE:
            raise ValueError(f"fastcoll.DDP: unsupported builtin comm hook {comm_hook_type}")
        self._comm_hook_desc = desc

    def _check_no_hook(self, new: str) -> None:
        if self._comm_hook_desc is not None:
            raise RuntimeError(
                f"fastcoll.DDP: a communication hook ({self._comm_hook_desc}) is already registered; "
                f"cannot also register {new} (register_comm_hook, _register_builtin_comm_hook and "
                "comm_dtype allow one per module, as in torch DDP)"
            )
