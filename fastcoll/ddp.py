"""fastcoll.DDP: a drop-in replacement for torch.nn.parallel.DistributedDataParallel.

Same constructor arguments, same training loop, same checkpoints (state_dict
keys carry the "module." prefix); gradients are averaged by
:class:`fastcoll.reducer.Reducer`, whose per-byte work runs in the fused ops.
"""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ._reference import SUPPORTED_DTYPES, is_dense
from .bucketing import MIB
from .reducer import Reducer, broadcast_coalesced

__all__ = ["DDP", "DistributedDataParallel"]

_BROADCAST_BUCKET_BYTES = 250 * MIB


def _check_device_ids(
    device_ids: Optional[Sequence[Any]], output_device: Any, device_type: str, multi_device: bool, devices: set
) -> Tuple[Optional[List[int]], Optional[int]]:
    """Validate device_ids/output_device like torch DDP; returns the normalized pair.

    device_ids name the one accelerator a single-device module lives on. For a
    CPU module or a module spread over several devices they must be None (or
    empty), as in torch DDP. Kept in one place so the rule can be relaxed.

    Raises:
        ValueError: more than one device id, or device ids for a CPU / multi-device module.
    """
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError(f"fastcoll.DDP: device_ids can only be None or contain a single element, got {list(device_ids)}")
    if not device_ids or device_type == "cpu" or multi_device:
        if device_ids or output_device is not None:
            raise ValueError(
                "fastcoll.DDP: device_ids and output_device only work with a module whose parameters are all on "
                f"one accelerator; got device_ids {device_ids}, output_device {output_device} and parameters "
                f"on {sorted(str(d) for d in devices)}. Leave them unset for CPU or multi-device modules."
            )
        return None, None
    ids = [torch.device(device_type, d).index if isinstance(d, int) else torch.device(d).index for d in device_ids]
    out = output_device if output_device is not None else ids[0]
    if not isinstance(out, int):
        out = torch.device(out).index
    return ids, out


def _move_to(obj: Any, device: torch.device) -> Any:
    """Copy every tensor in ``obj`` (nested lists/tuples/dicts/namedtuples/dataclasses) to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_move_to(o, device) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_move_to(o, device) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _move_to(v, device)) for k, v in obj.items())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _move_to(getattr(obj, f.name), device) for f in dataclasses.fields(obj) if f.init})
    return obj


def _describe(entry: Optional[tuple]) -> str:
    if entry is None:
        return "no such parameter"
    name, shape, dtype, stride, requires_grad = entry
    return f"'{name}' shape {shape} dtype {dtype} stride {stride} requires_grad={requires_grad}"


def _mismatch_message(sigs: List[List[tuple]]) -> str:
    """Describe the first parameter at which the ranks' signatures differ."""
    n_max = max(len(s) for s in sigs)
    first = next(i for i in range(n_max + 1) if len({(s[i] if i < len(s) else None) for s in sigs}) > 1)
    groups: Dict[str, List[int]] = {}
    for r, s in enumerate(sigs):
        desc = _describe(s[first] if first < len(s) else None) + f" ({len(s)} parameters in all)"
        groups.setdefault(desc, []).append(r)
    per_rank = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {d}" for d, rs in groups.items())
    return (
        "fastcoll.DDP: the wrapped module differs across ranks (every rank must build the same model, with "
        f"parameters registered in the same order). First difference at parameter #{first}: {per_rank}"
    )


class DDP(nn.Module):
    """Data-parallel wrapper with torch DistributedDataParallel's interface.

    Wraps ``module`` so that every synchronized backward averages the
    gradients of its trainable parameters over ``process_group``. Arguments
    mean what they mean for ``torch.nn.parallel.DistributedDataParallel``.

    Args:
        module: The model; all trainable parameters on one device type.
        device_ids: ``[i]`` for a module on accelerator ``i`` (inputs are
            moved there); None for CPU and multi-device modules.
        output_device: Kept for compatibility (outputs stay where the module puts them).
        dim: Kept for compatibility (no scatter across local devices).
        broadcast_buffers: Broadcast buffers from rank 0 at construction and
            before each forward that follows a synchronized one.
        process_group: Group to average over (None: the default group).
        bucket_cap_mb: Bucket size in MiB (None: 25).
        find_unused_parameters: Traverse the autograd graph from the outputs
            each iteration; parameters not reached are reduced as zeros and
            keep their ``.grad`` when unused on every rank.
        check_reduction: Deprecated, ignored (with a warning).
        gradient_as_bucket_view: Gradients become views into the bucket buffers.
        static_graph: The graph (used parameters, accumulation counts) is the
            same every iteration; learned in the first one.
        init_sync: Broadcast parameters (and buffers, with broadcast_buffers)
            from rank 0 at construction.
        first_bucket_mb: Cap of the first bucket (per device and dtype), in
            MiB; ``min(first_bucket_mb, bucket_cap_mb)`` is used.

    Raises:
        RuntimeError: the process group is not initialized, no parameter
            requires grad, or the module differs across ranks (on every rank).
        ValueError: bad ``bucket_cap_mb``/``first_bucket_mb``, parameters on
            several device types, or device_ids for a CPU/multi-device module.
        TypeError: a trainable parameter of a dtype the reducer cannot handle.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Optional[Sequence[Any]] = None,
        output_device: Any = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        process_group: Optional[dist.ProcessGroup] = None,
        bucket_cap_mb: Optional[float] = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        init_sync: bool = True,
        *,
        first_bucket_mb: float = 1.0,
    ):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "fastcoll.DDP: the default process group has not been initialized; call "
                "torch.distributed.init_process_group(...) before wrapping the model"
            )
        if process_group is None:
            process_group = dist.distributed_c10d._get_default_group()
        elif not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"fastcoll.DDP: process_group must be a torch.distributed ProcessGroup, got {type(process_group).__name__}")
        self.process_group = process_group
        if check_reduction:
            warnings.warn("fastcoll.DDP: check_reduction is deprecated and ignored", FutureWarning, stacklevel=2)

        self.module = module
        self.dim = dim
        self.broadcast_buffers = bool(broadcast_buffers)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.static_graph = False
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self.broadcast_bucket_size = _BROADCAST_BUCKET_BYTES

        # Local checks; a failure is shared with the other ranks by the
        # signature exchange below, so that every rank raises and none hangs.
        error: Optional[BaseException] = None
        named = [(n, p) for n, p in module.named_parameters() if n not in self.parameters_to_ignore]
        trainable = [(n, p) for n, p in named if p.requires_grad]
        self.device_ids: Optional[List[int]] = None
        self.output_device: Optional[int] = None
        self.device_type = "cpu"
        try:
            cap = 25.0 if bucket_cap_mb is None else bucket_cap_mb
            if not isinstance(cap, (int, float)) or isinstance(cap, bool) or not cap > 0:
                raise ValueError(f"fastcoll.DDP: bucket_cap_mb must be a positive number of MiB, got {bucket_cap_mb!r}")
            if not isinstance(first_bucket_mb, (int, float)) or isinstance(first_bucket_mb, bool) or not first_bucket_mb > 0:
                raise ValueError(f"fastcoll.DDP: first_bucket_mb must be a positive number of MiB, got {first_bucket_mb!r}")
            self.bucket_bytes_cap = int(cap * MIB)
            # The first bucket is never larger than the others (as in torch, where a
            # user-set bucket_cap_mb also caps the first bucket).
            self.first_bucket_bytes = min(int(first_bucket_mb * MIB), self.bucket_bytes_cap)
            self.bucket_bytes_cap_default = bucket_cap_mb is None
            for n, p in named:
                if isinstance(p, nn.parameter.UninitializedParameter):
                    raise RuntimeError(
                        f"fastcoll.DDP: parameter '{n}' is uninitialized (lazy module); run a dummy forward pass first"
                    )
            if not trainable:
                raise RuntimeError("fastcoll.DDP: the module has no parameter that requires a gradient; DDP is not needed")
            devices = {p.device for _, p in named}
            types = {d.type for d in devices}
            if len(types) != 1:
                raise ValueError(
                    f"fastcoll.DDP: all parameters must be on one device type, but they are on {sorted(types)}"
                )
            self.device_type = next(iter(types))
            self.device_ids, self.output_device = _check_device_ids(
                device_ids, output_device, self.device_type, len(devices) > 1, devices
            )
            for n, p in trainable:
                if p.dtype not in SUPPORTED_DTYPES:
                    raise TypeError(
                        f"fastcoll.DDP: parameter '{n}' has dtype {p.dtype}; trainable parameters must be "
                        "float32, float16, bfloat16 or float64"
                    )
                if p.layout != torch.strided or not is_dense(p):
                    raise ValueError(
                        f"fastcoll.DDP: parameter '{n}' (shape {tuple(p.shape)}, strides {tuple(p.stride())}) is "
                        "not a dense tensor; parameters must be dense and non-overlapping"
                    )
        except (ValueError, RuntimeError, TypeError) as exc:
            error = exc
        self._verify_across_ranks(named, error)
        if error is not None:
            raise error

        self.device = trainable[0][1].device
        self._buffers_to_sync = [b for n, b in module.named_buffers() if n not in self.parameters_to_ignore]
        if init_sync:
            states = [p.detach() for _, p in named]
            if self.broadcast_buffers:
                states += [b.detach() for b in self._buffers_to_sync]
            broadcast_coalesced(states, self.process_group, 0, self.broadcast_bucket_size)

        self.reducer = Reducer(
            [p for _, p in trainable],
            [n for n, _ in trainable],
            self.process_group,
            bucket_cap_bytes=self.bucket_bytes_cap,
            first_bucket_bytes=self.first_bucket_bytes,
            find_unused_parameters=self.find_unused_parameters,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
        )
        if static_graph:
            self._set_static_graph()

    # ------------------------------------------------------------ construction

    def _verify_across_ranks(self, named: List[Tuple[str, torch.Tensor]], error: Optional[BaseException]) -> None:
        """Compare parameter signatures (and local check failures) across ranks; raise on every rank on mismatch."""
        try:
            sig = [
                (n, tuple(p.shape), str(p.dtype).replace("torch.", ""), tuple(p.stride()), bool(p.requires_grad))
                for n, p in named
            ]
        except Exception:  # uninitialized parameters have no shape
            sig = []
        digest = hashlib.sha256(repr(sig).encode()).hexdigest()
        local_err = None if error is None else f"{type(error).__name__}: {error}"
        world = dist.get_world_size(self.process_group)
        if world == 1:
            return
        gathered: List[Any] = [None] * world
        dist.all_gather_object(gathered, (digest, local_err), group=self.process_group)
        failed = [(r, e) for r, (_, e) in enumerate(gathered) if e is not None]
        if failed:
            if error is not None:
                return  # the caller raises the local error
            detail = "; ".join(f"rank {r}: {e}" for r, e in failed)
            raise RuntimeError(f"fastcoll.DDP: construction failed on other ranks: {detail}")
        if len({d for d, _ in gathered}) == 1:
            return
        sigs: List[Any] = [None] * world
        dist.all_gather_object(sigs, sig, group=self.process_group)
        raise RuntimeError(_mismatch_message(sigs))

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, params_and_buffers_to_ignore: Sequence[str]) -> None:
        """Exclude parameters and buffers (by qualified name) from synchronization, as torch DDP does."""
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore

    def _set_static_graph(self) -> None:
        """Enable static-graph mode (torch DDP's private switch, used by some frameworks)."""
        if self.static_graph:
            warnings.warn("fastcoll.DDP: static_graph is already enabled", stacklevel=2)
            return
        self.reducer.set_static_graph()
        self.static_graph = True

    # ----------------------------------------------------------------- forward

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; returns its output unchanged.

        Before the module runs: check that the previous reduction finished,
        rebuild the buckets once, broadcast buffers from rank 0. After: arm the
        reducer for the backward (when gradients are enabled and synchronized).
        """
        inputs, kwargs = self._pre_forward(inputs, kwargs)
        output = self.module(*inputs, **kwargs)
        self._post_forward(output)
        return output

    def _pre_forward(self, inputs: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        # Collective order: [bucket layout broadcast, once], buffer broadcast.
        if torch.is_grad_enabled():
            self.reducer.prepare_for_forward()
        if self.require_forward_param_sync and self.broadcast_buffers and self._buffers_to_sync:
            self._sync_buffers()
        if self.device_ids:
            device = torch.device(self.device_type, self.device_ids[0])
            inputs, kwargs = _move_to(inputs, device), _move_to(kwargs, device)
        return inputs, kwargs

    def _post_forward(self, output: Any) -> None:
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self.require_forward_param_sync = True
            self.reducer.prepare_for_backward(output if self.find_unused_parameters and not self.static_graph else None)
        else:
            self.require_forward_param_sync = False

    def _sync_buffers(self, group_src: int = 0) -> None:
        """Broadcast the module's buffers from group rank ``group_src``."""
        with torch.no_grad():
            broadcast_coalesced(self._buffers_to_sync, self.process_group, group_src, self.broadcast_bucket_size)

    # ------------------------------------------------------------------ public

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Context manager: forwards inside it are followed by backwards that only accumulate locally.

        The first forward+backward outside the context averages the accumulated gradients.
        """
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def bucket_info(self) -> List[Dict[str, Any]]:
        """Each bucket, in reduction order: ``index``, parameter ``names`` (relative to ``.module``),
        ``dtype``, ``device``, ``numel`` and ``bytes``. Reflects the rebuilt layout after the first iteration."""
        return self.reducer.bucket_info()

    def _remove_hooks(self) -> None:
        """Remove the autograd hooks and release the bucket buffers; the wrapper stops synchronizing."""
        self.reducer.close()

    def close(self) -> None:
        """Alias of :meth:`_remove_hooks`, for frameworks that tear wrappers down between fits."""
        self._remove_hooks()


DistributedDataParallel = DDP
