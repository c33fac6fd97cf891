"""What :class:`fastcoll.DDP` answers for torch DDP's own members (it is a ``DistributedDataParallel``).

``fastcoll.DDP`` subclasses ``torch.nn.parallel.DistributedDataParallel`` so
that code which recognizes DDP with ``isinstance`` (DCP's state dicts,
accelerate, transformers, Lightning, mmengine) treats it as one; torch's
constructor never runs, so none of torch's reducer, logger, hooks or
broadcasts exist. Every torch member is therefore one of:

* fastcoll's own, with torch's meaning (the wrapper and its mixins, such as
  :class:`fastcoll.ddp.logging_data.LoggingData` (``_get_ddp_logging_data``,
  ``_set_ddp_runtime_logging_sample_rate``, ``_log_and_throw``), and
  :class:`TorchMembers` below: ``will_sync_module_buffers``,
  ``_remove_autograd_hooks``, ``_check_reducer_finalized``,
  ``_has_rebuilt_buckets``, ...);
* torch's, inherited, where it only reads attributes fastcoll sets
  (``train``, ``scatter``/``gather``, ``_get_data_parallel_params``,
  ``_set_params_and_buffers_to_ignore_for_model``, ``_register_fused_optim``
  through :meth:`register_comm_hook`, ...);
* one of :data:`UNSUPPORTED`: torch's machinery that fastcoll does not have;
  calling it raises ``NotImplementedError`` naming fastcoll, the member and
  what to use instead, and reading a torch-only attribute raises an
  ``AttributeError`` that says the same (``hasattr`` stays False).

``tests/test_ddp_members.py`` holds the member-by-member table.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, List

import torch

__all__ = ["TORCH_ONLY_ATTRIBUTES", "UNSUPPORTED", "TorchMembers", "check_torch_features"]

#: torch DDP methods that drive machinery fastcoll does not have, with what to do instead.
UNSUPPORTED: Dict[str, str] = {
    "_ddp_init_helper": "fastcoll builds its own reducer at construction",
    "_register_accum_grad_hook": "torch's compiled-autograd (python_reducer) path is not used; fastcoll's reducer owns the hooks",
    "_should_disable_cpp_reducer": "torch's compiled-autograd (python_reducer) path is not used; fastcoll's reducer owns hooks",
    "_delayed_all_reduce_hook": "delay_all_reduce_named_params is not supported (see the constructor's error)",
    "_register_delay_all_reduce_hook": "delay_all_reduce_named_params is not supported (see the constructor's error)",
    "_clear_grad_buffer": "delay_all_reduce_named_params is not supported",
    "_setup_in_backward_optimizers": "optimizers applied in backward are refused at construction",
    "_lazy_init": "fastcoll has nothing to initialize lazily",
    "_fire_reducer_autograd_hook": "mixed_precision is not supported: use torch.autocast and comm_dtype",
    "_root_copy_hook": "mixed_precision is not supported: use torch.autocast and comm_dtype",
    "_module_wait_for_copy_hook": "mixed_precision is not supported: use torch.autocast and comm_dtype",
    "_run_ddp_forward": "call the wrapper itself (its forward runs the module)",
    "_check_global_requires_backward_grad_sync": "join() is fastcoll's own (fastcoll.ddp.join)",
    "_check_and_sync_module_buffers": "join() is fastcoll's own (fastcoll.ddp.join)",
    "_sync_final_model": "join() is fastcoll's own (fastcoll.ddp.join)",
    "_match_all_reduce_for_bwd_pass": "join() is fastcoll's own (fastcoll.ddp.join)",
    "_match_unused_params_allreduce": "join() is fastcoll's own (fastcoll.ddp.join)",
    "_register_buffer_comm_hook": "fastcoll broadcasts buffers from rank 0 itself; buffer comm hooks are not supported",
    "_check_sync_bufs_pre_fwd": "use will_sync_module_buffers()",
    "_check_sync_bufs_post_fwd": "use will_sync_module_buffers()",
    "_sync_module_buffers": "use _sync_buffers()",
    "_set_sparse_metadata": "sparse gradients are summed from all-gathers of the rows each rank touched (no metadata needed)",
    "_update_process_group": "build a new fastcoll.DDP on the new process group",
    "_inside_ddp_forward": "fastcoll activates dynamo's graph splitting itself (fastcoll.ddp.compile_support)",
    "_build_params_for_reducer": "fastcoll's reducer takes the parameters at construction (see bucket_info())",
    "_assign_modules_buffers": "see modules_buffers and named_module_buffers",
}

#: Attributes torch DDP's constructor sets that fastcoll has no counterpart for.
TORCH_ONLY_ATTRIBUTES: Dict[str, str] = {
    "_use_python_reducer": "fastcoll always uses its own reducer",
    "_bucket_config": "see bucket_bytes_cap, bucket_bytes_cap_list and bucket_info()",
    "_delay_all_reduce_params": "delay_all_reduce_named_params is not supported",
    "_delay_grad_buffer": "delay_all_reduce_named_params is not supported",
    "_delay_grad_views": "delay_all_reduce_named_params is not supported",
    "_delay_all_reduce_all_params": "delay_all_reduce_named_params is not supported",
    "_comm_hooks": "see register_comm_hook (one hook per module)",
    "_mp_stream": "mixed_precision is not supported",
    "_submodule_to_event": "mixed_precision is not supported",
    "_lazy_init_ran": "fastcoll has nothing to initialize lazily",
    "_accum_grad_hooks": "fastcoll's reducer owns the parameter hooks",
    "_static_graph_delay_allreduce_enqueued": "fastcoll has no output sink; static graphs are learned in the first iteration",
    "buffer_hook": "buffer comm hooks are not supported",
}


def _unsupported(name: str, instead: str) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"fastcoll.DDP does not implement torch DDP's {name}(): {instead}")

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"Not available in fastcoll.DDP: {instead}."
    return method


def check_torch_features(params: List[torch.Tensor]) -> None:
    """Refuse torch features that would act on fastcoll's parameters behind its back.

    Raises:
        ValueError: a parameter has an optimizer applied in backward
            (``_apply_optimizer_in_backward``: it would step on unreduced
            gradients), or dynamo's ``optimize_ddp`` is ``"python_reducer"``
            (torch DDP's compiled-autograd reduction, which fastcoll does not use).
    """
    if any(hasattr(p, "_in_backward_optimizers") for p in params):
        raise ValueError(
            "fastcoll.DDP: some parameters have optimizers applied in backward (_apply_optimizer_in_backward); "
            "they would step on gradients before fastcoll averages them. Step a regular optimizer after backward"
        )
    dynamo = sys.modules.get("torch._dynamo")
    get_mode = getattr(getattr(dynamo, "utils", None), "get_optimize_ddp_mode", None)
    if get_mode is not None and get_mode() == "python_reducer":
        raise ValueError(
            "fastcoll.DDP: torch._dynamo.config.optimize_ddp='python_reducer' selects torch DDP's compiled-autograd "
            "reduction, which fastcoll does not have; use the default ('ddp_optimizer'): fastcoll splits compiled "
            "graphs at its bucket boundaries"
        )


class TorchMembers:
    """torch DDP's members with fastcoll's meaning (expects the wrapper's ``reducer``, ``module`` and settings)."""

    #: torch DDP's logger (a ``dist.Logger`` over its C++ reducer); fastcoll has none.
    logger = None
    #: fastcoll moves inputs with plain ``.to(device, non_blocking=True)``.
    use_side_stream_for_tensor_copies = False
    is_multi_device_module = False

    @property
    def broadcast_buffers(self) -> bool:
        """Whether buffers are broadcast from rank 0 before each forward (torch 2.13's alias of ``forward_sync_buffers``)."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = bool(value)

    def __getattr__(self, name: str) -> Any:
        instead = TORCH_ONLY_ATTRIBUTES.get(name)
        if instead is not None:
            raise AttributeError(f"fastcoll.DDP has no torch DDP attribute {name!r}: {instead}")
        return torch.nn.Module.__getattr__(self, name)

    @property
    def _has_rebuilt_buckets(self) -> bool:
        """Whether the one bucket rebuild from the gradients' ready order has happened (read by torch's ZeRO hook)."""
        return self.reducer.rebuilt

    @property
    def bucket_bytes_cap_list(self) -> List[int]:
        """Per-bucket caps in bytes when the layout was given as a list (``[]`` for one cap), as torch 2.13 has it."""
        caps = self.bucket_caps
        return list(caps) if isinstance(caps, list) else []

    @property
    def modules_buffers(self) -> List[torch.Tensor]:
        """The buffers broadcast before each forward (torch DDP's name)."""
        return list(self._buffer_sync.current())

    @property
    def named_module_buffers(self) -> Dict[str, torch.Tensor]:
        """The broadcast buffers by qualified name (torch DDP's name)."""
        ignored = self.parameters_to_ignore
        return {n: b for n, b in self.module.named_buffers() if n not in ignored}

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts the buffers from rank 0."""
        return bool(self.require_forward_param_sync and self.forward_sync_buffers and self._buffer_sync)

    def _remove_autograd_hooks(self) -> None:
        """Remove the reducer's autograd hooks (torch DDP's name for :meth:`fastcoll.DDP.close`)."""
        self._remove_hooks()

    def _check_reducer_finalized(self) -> None:
        """Raise if the last synchronized backward left buckets unreduced (parameters without gradients)."""
        if self.reducer.reducing:
            self.reducer._raise_unfinished()

    def _set_ddp_sink_clone(self, val: bool) -> None:
        """Accepted for torch's API: fastcoll has no output sink and never clones the forward's outputs."""
        self._ddp_sink_clone = bool(val)


for _name, _instead in UNSUPPORTED.items():
    setattr(TorchMembers, _name, _unsupported(_name, _instead))
del _name, _instead
