"""torch DDP's logging data on :class:`fastcoll.DDP`: ``_get_ddp_logging_data`` and its sample rate.

torch DDP keeps a C++ ``Logger`` whose ``DDPLoggingData`` (a map of strings
and a map of ints) its ``_get_ddp_logging_data()`` returns merged into one
dict; Lightning's DDP strategy, torch's own tests and debugging scripts read
it. fastcoll has no such logger: :class:`LoggingData` builds the same dict
from what fastcoll knows, under torch's keys and in torch's formats, and
leaves out every key fastcoll cannot fill truthfully.

Construction data (read when called; torch records it at construction):
``world_size``, ``rank``, ``module_name``, ``device_ids`` (``"0"``, ``""`` for
none), ``output_device`` (-1 for none), ``broadcast_buffers``,
``bucket_cap_bytes``, ``find_unused_parameters``, ``gradient_as_bucket_view``,
``static_graph``, ``backend_name``, ``is_multi_device_module``,
``has_sync_bn``, ``dtypes`` (torch's names: ``"float"``, ``"double"``,
``"c10::Half"``, ``"c10::BFloat16"``), ``total_parameter_size_bytes``,
``num_parameter_tensors``, ``bucket_sizes`` (bytes of each bucket of the
construction-time layout, ``", "``-separated), ``comm_hook`` (once one is
registered: the hook's qualified name, torch's ``BuiltinCommHookType.X``, or
fastcoll's ``comm_dtype=...``), and the environment torch's Logger reports
(``master_port``, ``master_addr``, ``torch_distributed_debug``,
``cuda_visible_devices``; ``gloo_socket_ifname``, ``gloo_device_transport``,
``gloo_num_threads`` on gloo; ``nccl_*`` on NCCL; "N/A" when unset).

Runtime (sampled as torch samples, times in nanoseconds; see
:mod:`fastcoll.reducer.runtime_log`): ``iteration``, ``forward_compute_time``,
``backward_compute_time``, ``backward_comm_time``,
``backward_compute_comm_overlap_time`` and their ``avg_*``, the host times
``*_start``/``*_end``, ``prev_iteration_grad_ready_order_indices``,
``unused_parameter_size``, ``num_buckets_reduced``, ``has_rebuilt_buckets``,
``rebuilt_bucket_sizes``, ``rebuilt_per_bucket_param_indices``; ``can_set_static_graph``
with ``find_unused_parameters`` and a dynamic graph (1 while every iteration
has found the same unused parameters, 0 once they changed); ``has_error`` and
``error`` once fastcoll.DDP raised an error where torch DDP logs one (its
reducer's checks: a parameter marked ready twice, a reduction left
unfinished, ``_set_static_graph`` after training started; torch's own
``_log_and_throw`` validators, inherited; a bad sample rate).

Not given: ``join_uneven_inputs`` (fastcoll keeps no record of past
``join()`` contexts), torch's per-GPU CUDA event timings (fastcoll times on
the host for every device).
"""

from __future__ import annotations

from typing import Any, Dict, NoReturn, Optional, Union

import torch
from torch import nn

from ..reducer.runtime_log import bucket_sizes

__all__ = ["LoggingData", "TORCH_DTYPE_NAMES", "torch_comm_hook_name"]

#: torch's C++ names of the dtypes fastcoll reduces (caffe2 TypeMeta names, as torch's Logger writes them).
TORCH_DTYPE_NAMES: Dict[torch.dtype, str] = {
    torch.float32: "float",
    torch.float64: "double",
    torch.float16: "c10::Half",
    torch.bfloat16: "c10::BFloat16",
}

_GLOO_ENV = ("gloo_socket_ifname", "gloo_device_transport")
_NCCL_ENV = (
    "nccl_socket_ifname",
    "nccl_blocking_wait",
    "nccl_async_error_handling",
    "nccl_debug",
    "nccl_nthreads",
    "nccl_ib_timeout",
)
_COMMON_ENV = ("master_port", "master_addr", "torch_distributed_debug", "cuda_visible_devices")


def _backend_name(group: Any) -> str:
    """What torch's Logger reports: the process group's ``getBackendName()``."""
    try:
        return str(group.name())
    except (AttributeError, RuntimeError):
        return str(torch.distributed.get_backend(group))


def _gloo_threads(group: Any) -> Optional[int]:
    """The gloo backend's worker threads (its options' ``threads``); None when it cannot be read."""
    try:
        return int(group._get_backend(torch.device("cpu")).options._threads)
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None


def torch_comm_hook_name(desc: Optional[str]) -> Optional[str]:
    """torch Logger's ``comm_hook`` for fastcoll's description of the registered hook (None: none registered)."""
    if desc is None:
        return None
    if desc.startswith("builtin "):
        return f"BuiltinCommHookType.{desc[len('builtin ') :]}"
    if len(desc) >= 2 and desc[0] == desc[-1] and desc[0] in "'\"":
        return desc[1:-1]  # fastcoll.reducer.hooks.hook_name quotes the qualified name
    return desc


class LoggingData:
    """torch DDP's ``_get_ddp_logging_data`` and ``_set_ddp_runtime_logging_sample_rate`` (see the module docstring).

    Expects the wrapper's ``reducer``, ``module``, ``process_group`` and settings.
    """

    def _get_ddp_logging_data(self) -> Dict[str, Union[str, int]]:
        """torch DDP's logging data (its string and int maps merged), from what fastcoll knows.

        Returns:
            A new dict with torch's keys and formats; keys fastcoll cannot
            fill truthfully are absent (see :mod:`fastcoll.ddp.logging_data`).
        """
        reducer = self.reducer
        log = reducer.runtime_log
        group = self.process_group
        params = reducer.params
        backend = _backend_name(group)
        data: Dict[str, Union[str, int]] = {
            "world_size": reducer.world_size,
            "rank": reducer.rank,
            "module_name": type(self.module).__name__,
            "device_ids": ", ".join(str(int(i)) for i in (self.device_ids or [])),
            "output_device": -1 if self.output_device is None else int(self.output_device),
            "broadcast_buffers": int(bool(self.forward_sync_buffers)),
            "bucket_cap_bytes": int(self.bucket_bytes_cap),
            "find_unused_parameters": int(self.find_unused_parameters),
            "gradient_as_bucket_view": int(self.gradient_as_bucket_view),
            "static_graph": int(bool(self.static_graph)),
            "backend_name": backend,
            "is_multi_device_module": int(bool(self.is_multi_device_module)),
            "has_sync_bn": int(any(isinstance(m, nn.SyncBatchNorm) for m in self.module.modules())),
            "dtypes": ", ".join(sorted({TORCH_DTYPE_NAMES.get(p.dtype, str(p.dtype)) for p in params})),
            "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params),
            "num_parameter_tensors": len(params),
            "bucket_sizes": bucket_sizes(reducer.initial_layout(), params),
        }
        hook = torch_comm_hook_name(self._comm_hook_desc)
        if hook is not None:
            data["comm_hook"] = hook
        env = log.env
        names = _COMMON_ENV + (_GLOO_ENV if backend == "gloo" else _NCCL_ENV if backend == "nccl" else ())
        data.update((k, env[k]) for k in names)
        if backend == "gloo":
            threads = _gloo_threads(group)
            if threads is not None:
                data["gloo_num_threads"] = threads
        usage = reducer.usage
        if usage.searching and usage.searches:
            data["can_set_static_graph"] = int(usage.graph_static)
        data.update(log.data())
        return data

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """Collect runtime statistics every ``sample_rate``-th iteration after the first 10 (torch: 100).

        Raises:
            ValueError: ``sample_rate`` is less than 1 (recorded as the last error, as torch does).
        """
        if sample_rate < 1:
            self._log_and_throw(ValueError, "DDP runtime logging sample rate should be equal or greater than 1")
        self.reducer.runtime_log.set_sample_rate(sample_rate)

    def _log_and_throw(self, err_type: type, err_msg: str) -> NoReturn:
        """Record ``err_type: err_msg`` as the logging data's last error (torch's format), then raise it.

        torch DDP's validators that fastcoll inherits (``_check_comm_hook``,
        ``_check_default_group``, ...) raise through this.
        """
        self.reducer.runtime_log.record_error(f"{err_type}: {err_msg}")
        raise err_type(err_msg)
