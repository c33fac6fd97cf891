"""Construction checks of :class:`fastcoll.DDP`: arguments, devices, the process group, the module.

Everything here runs on one rank before anything is built; the wrapper then
shares a local failure with the other ranks (``fastcoll.distributed._agree``) so that
every rank raises the same error and none hangs.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as _TorchDDP  # bound now: a test harness may rebind the name

from ..bucketing import AUTO, MIB, bucket_caps_from_mb
from ..distributed._agree import agree
from ..distributed.backends import backend_name, bound_device, pick_comm_device
from ..ops.dtypes import (
    COMPLEX_DTYPES,
    SUPPORTED_DTYPES,
    SUPPORTED_NAMES,
    check_comm_accum_dtype,
    check_comm_dtype,
    check_complex_wire,
    dtype_name,
)
from ..stall import resolve_stall_timeout
from .compat import check_torch_features


def check_device_ids(
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


def _describe(entry: Optional[tuple]) -> str:
    if entry is None:
        return "no such parameter"
    name, shape, dtype, stride, requires_grad = entry
    return f"'{name}' shape {shape} dtype {dtype} stride {stride} requires_grad={requires_grad}"


def mismatch_message(sigs: List[List[tuple]]) -> str:
    """Describe the first parameter at which the ranks' signatures differ."""
    n_max = max(len(s) for s in sigs)
    first = next(i for i in range(n_max + 1) if len({(s[i] if i < len(s) else None) for s in sigs}) > 1)
    groups: Dict[str, List[int]] = {}
    for r, s in enumerate(sigs):
        desc = _describe(s[first] if first < len(s) else None) + f" ({len(s)} parameters in all)"
        groups.setdefault(desc, []).append(r)
    per_rank = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {d}" for d, rs in groups.items())
    return (
        "the wrapped module differs across ranks (every rank must build the same model, with "
        f"parameters registered in the same order). First difference at parameter #{first}: {per_rank}"
    )


def sync_device(
    backend: str,
    device_ids: Optional[Sequence[Any]],
    param_devices: Sequence[torch.device],
    bound: Optional[torch.device],
    current: Optional[int],
) -> torch.device:
    """The device of fastcoll.DDP's construction-time agreement collective (a pure function).

    The rule: with a backend that needs CUDA tensors (NCCL), the device named
    by ``device_ids``, else the module's first CUDA parameter's device, else the
    group's bound device, else ``cuda:current``; CPU for backends that take CPU
    tensors (gloo). ``torch.cuda.set_device`` is therefore not needed when the
    model is on its GPU: ``model.to(local_rank); DDP(model, device_ids=[local_rank])``
    never puts two ranks of a node on cuda:0.
    """
    named = [torch.device("cuda", d) if isinstance(d, int) else torch.device(d) for d in (device_ids or [])]
    return pick_comm_device(backend, [*named, *param_devices], bound, current)


def resolve_process_group(process_group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    """The group fastcoll.DDP averages over: ``process_group``, or the default group when None.

    Raises:
        RuntimeError: the default process group is not initialized.
        TypeError: ``process_group`` is not a ProcessGroup.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "fastcoll.DDP: the default process group has not been initialized; call "
            "torch.distributed.init_process_group(...) before wrapping the model"
        )
    if process_group is None:
        return dist.distributed_c10d._get_default_group()
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"fastcoll.DDP: process_group must be a torch.distributed ProcessGroup, got {type(process_group).__name__}"
        )
    return process_group


def check_verify_replicas_every(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"fastcoll.DDP: verify_replicas_every must be an int >= 0 (0: never), got {value!r}")
    return value


def check_positive_mib(name: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"fastcoll.DDP: {name} must be a positive number of MiB, got {value!r}")
    return float(value)


def bucket_cap_mb_in_force(bucket_cap_mb: Any, bucket_cap_mb_list: Any) -> Any:
    """The ``bucket_cap_mb`` that torch 2.13's pair ``(bucket_cap_mb, bucket_cap_mb_list)`` amounts to.

    torch's rule: a non-empty ``bucket_cap_mb_list`` gives one cap per bucket in
    MiB (in reduction order once the buckets are rebuilt; the last repeats),
    and ``bucket_cap_mb`` is then ignored; ``None`` or an empty list leaves
    ``bucket_cap_mb`` in force. fastcoll's ``bucket_cap_mb`` takes such a list
    itself, so the list is returned as ``bucket_cap_mb``.

    Raises:
        TypeError: ``bucket_cap_mb_list`` is not a list or tuple (torch fails on it too).
        ValueError: an entry is not a positive finite number of MiB (named by its index; torch would
            take 0 or a negative cap as one parameter per bucket, or fail on NaN), or ``bucket_cap_mb``
            is fastcoll's own list or "auto" as well (two layouts asked for).
    """
    if bucket_cap_mb_list is None:
        return bucket_cap_mb
    if not isinstance(bucket_cap_mb_list, (list, tuple)):
        raise TypeError(
            "fastcoll.DDP: bucket_cap_mb_list must be a list of per-bucket caps in MiB (or None), got "
            f"{type(bucket_cap_mb_list).__name__} {bucket_cap_mb_list!r}"
        )
    if not bucket_cap_mb_list:
        return bucket_cap_mb  # torch: an empty list is no list
    for i, cap in enumerate(bucket_cap_mb_list):
        if not isinstance(cap, (int, float)) or isinstance(cap, bool) or not (0 < cap < float("inf")):
            raise ValueError(
                f"fastcoll.DDP: bucket_cap_mb_list[{i}] is {cap!r}; every per-bucket cap must be a positive "
                f"finite number of MiB (got bucket_cap_mb_list={list(bucket_cap_mb_list)!r})"
            )
    if isinstance(bucket_cap_mb, (list, tuple, str)):
        raise ValueError(
            f"fastcoll.DDP: bucket_cap_mb={bucket_cap_mb!r} and bucket_cap_mb_list={list(bucket_cap_mb_list)!r} both "
            "ask for a bucket layout; give one of them (bucket_cap_mb also takes a list of per-bucket caps)"
        )
    return list(bucket_cap_mb_list)


def check_arguments(
    named: List[Tuple[str, torch.Tensor]],
    bucket_cap_mb: Any,
    first_bucket_mb: Any,
    comm_dtype: Any,
    device_ids: Optional[Sequence[Any]],
    output_device: Any,
    bucket_cap_mb_list: Any = None,
) -> Tuple[Any, Any, int, str, Optional[List[int]], Optional[int]]:
    """This rank's checks of the module and the arguments, before anything is built.

    ``bucket_cap_mb_list`` (torch 2.13's per-bucket caps), when given, replaces ``bucket_cap_mb``
    (:func:`bucket_cap_mb_in_force`).

    Returns:
        (parsed bucket_cap_mb: bytes, a list of bytes or "auto"; the caps the reducer starts
        with; first bucket cap bytes; device type; device_ids; output_device).

    Raises:
        ValueError, RuntimeError, TypeError: naming the argument or parameter at fault.
    """
    caps = bucket_caps_from_mb(bucket_cap_mb_in_force(bucket_cap_mb, bucket_cap_mb_list))
    first = check_positive_mib("first_bucket_mb", first_bucket_mb)
    # "auto" starts from the default caps; a list of caps sets the first bucket's too.
    cap_bytes = bucket_caps_from_mb(None) if caps == AUTO else caps
    # The first bucket is never larger than the others (as in torch, where a
    # user-set bucket_cap_mb also caps the first bucket).
    first_bytes = min(int(first * MIB), cap_bytes if isinstance(cap_bytes, int) else cap_bytes[0])
    check_comm_dtype(comm_dtype)
    for n, p in named:
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise RuntimeError(f"fastcoll.DDP: parameter '{n}' is uninitialized (lazy module); run a dummy forward pass first")
    trainable = [(n, p) for n, p in named if p.requires_grad]
    if not trainable:
        raise RuntimeError("fastcoll.DDP: the module has no parameter that requires a gradient; DDP is not needed")
    devices = {p.device for _, p in named}
    types = {d.type for d in devices}
    if len(types) != 1:
        raise ValueError(f"fastcoll.DDP: all parameters must be on one device type, but they are on {sorted(types)}")
    device_type = next(iter(types))
    ids, out = check_device_ids(device_ids, output_device, device_type, len(devices) > 1, devices)
    for n, p in trainable:
        if p.dtype not in SUPPORTED_DTYPES and p.dtype not in COMPLEX_DTYPES:
            raise TypeError(
                f"fastcoll.DDP: parameter '{n}' has dtype {p.dtype}; trainable parameters must be one of {SUPPORTED_NAMES} "
                "(or complex64 / complex128)"
            )
        if p.layout != torch.strided:  # any strides are fine (a non-dense one's gradient is contiguous)
            raise ValueError(f"fastcoll.DDP: parameter '{n}' has layout {p.layout}; parameters must be strided tensors")
    check_complex_wire(trainable, comm_dtype)
    return caps, cap_bytes, first_bytes, device_type, ids, out


def group_from_mesh(process_group: Optional[dist.ProcessGroup], device_mesh: Any) -> Optional[dist.ProcessGroup]:
    """The group that ``device_mesh`` selects, as torch DDP reads it (a 1-D mesh: its only dimension's group).

    Raises:
        RuntimeError: both ``process_group`` and ``device_mesh`` given, or a mesh that is not 1-D (torch's errors).
        ValueError: a mesh sliced out of a larger one (torch's DDP + tensor parallel path, which
            rewrites the module's DTensor parameters; fastcoll reduces plain tensors only).
    """
    if device_mesh is None:
        return process_group
    if process_group is not None:
        raise RuntimeError("fastcoll.DDP: cannot specify both process_group and device_mesh arguments")
    if device_mesh.ndim != 1:
        raise RuntimeError(f"fastcoll.DDP: only a 1-D device mesh is supported, got {device_mesh}")
    root = device_mesh._get_root_mesh() if hasattr(device_mesh, "_get_root_mesh") else device_mesh
    if root != device_mesh:
        raise ValueError(
            "fastcoll.DDP: device_mesh is a slice of a larger mesh (data parallel over tensor-parallel DTensor "
            "parameters); fastcoll reduces plain tensors only: use torch DDP or FSDP2 for DDP + tensor parallel"
        )
    return device_mesh.get_group(mesh_dim=0)


def buffer_sync_flags(broadcast_buffers: Optional[bool], forward_sync_buffers: Optional[bool]) -> Tuple[bool, bool]:
    """``(forward_sync_buffers, init_sync_buffers)`` from torch 2.13's pair of arguments, with its rules.

    ``forward_sync_buffers`` (the new name) sets the per-forward buffer broadcast
    and leaves the construction-time one on; the deprecated ``broadcast_buffers``
    sets both; neither given: both on.
    """
    if forward_sync_buffers is not None:
        return bool(forward_sync_buffers), True
    on = True if broadcast_buffers is None else bool(broadcast_buffers)
    return on, on


def refuse_torch_only(delay_all_reduce_named_params: Any, param_to_hook_all_reduce: Any, mixed_precision: Any) -> None:
    """Refuse, with what fastcoll does instead, torch DDP arguments whose mechanism fastcoll does not have.

    Raises:
        ValueError: naming the argument.
    """
    if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
        raise ValueError("fastcoll.DDP: delay_all_reduce_named_params and param_to_hook_all_reduce need to be set together")
    if delay_all_reduce_named_params is not None:
        raise ValueError(
            "fastcoll.DDP: delay_all_reduce_named_params/param_to_hook_all_reduce are not supported. fastcoll "
            "starts every bucket's reduction as soon as its gradients are ready; to send some parameters "
            "first or last, size the buckets with bucket_cap_mb=[caps in reduction order] and first_bucket_mb"
        )
    if mixed_precision is not None:
        raise ValueError(
            "fastcoll.DDP: mixed_precision (torch DDP's experimental _MixedPrecision) is not supported; use "
            "torch.autocast for low-precision compute and comm_dtype=torch.bfloat16/float16 for fused "
            "low-precision communication (the gradients stay in the parameters' dtype)"
        )


def reducer_parameter_names(names: Sequence[str], ignored: set) -> List[str]:
    """The names of ``names`` that the reducer averages, as torch DDP's reducer chooses them.

    torch builds the reducer's list from ``named_modules()`` and tests
    ``f"{module_name}.{param_name}"`` against the ignore list: a parameter of the
    root module is tested as ``".name"`` and so is never ignored by the
    reducer, although the construction-time broadcast (which uses the real
    names) skips it. fastcoll averages the same parameters.
    """
    return [n for n in names if not ("." in n and n in ignored)]


def _torch_has_forward_sync_buffers() -> bool:
    try:
        return "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


#: The running torch's DDP deprecates ``broadcast_buffers`` (2.13 and newer): fastcoll warns when torch would.
BROADCAST_BUFFERS_DEPRECATED = _torch_has_forward_sync_buffers()


def warn_at_construction(
    module: nn.Module, broadcast_buffers: Optional[bool], forward_sync_buffers: Optional[bool], check_reduction: bool
) -> None:
    """The construction's warnings (pointing at the caller's line): a module that is a DDP already (torch's or
    fastcoll's: every gradient would be averaged twice, the results the same, the communication doubled), and the
    FutureWarnings torch DDP gives for its deprecated arguments."""
    if isinstance(module, _TorchDDP):
        warnings.warn(
            f"fastcoll.DDP: the module is already a {type(module).__module__}.{type(module).__qualname__}; wrapping "
            "it again averages every gradient twice (the same result, twice the communication): wrap the model "
            "itself (its .module)",
            UserWarning,
            stacklevel=3,
        )
    if broadcast_buffers is not None and BROADCAST_BUFFERS_DEPRECATED:
        if forward_sync_buffers is not None:
            msg = "both broadcast_buffers (deprecated) and forward_sync_buffers were given; broadcast_buffers is ignored"
        else:
            msg = (
                "broadcast_buffers is deprecated, use forward_sync_buffers; note that broadcast_buffers=False also "
                "skips the buffers' broadcast at construction, forward_sync_buffers=False does not"
            )
        warnings.warn(f"fastcoll.DDP: {msg}", FutureWarning, stacklevel=3)
    if check_reduction:
        warnings.warn("fastcoll.DDP: check_reduction is deprecated and ignored", FutureWarning, stacklevel=3)


def check_main_grad_dtype(main_grad_dtype: Any, gradient_as_bucket_view: bool) -> None:
    """Validate ``main_grad_dtype`` (None or torch.float32).

    Raises:
        ValueError: another dtype, or combined with ``gradient_as_bucket_view`` (the float32 buckets cannot be
            the 16-bit parameters' ``.grad``).
    """
    if main_grad_dtype is None:
        return
    if main_grad_dtype is not torch.float32:
        raise ValueError(f"fastcoll.DDP: main_grad_dtype must be None or torch.float32, got {main_grad_dtype!r}")
    if gradient_as_bucket_view:
        raise ValueError(
            "fastcoll.DDP: gradient_as_bucket_view cannot be combined with main_grad_dtype: the 16-bit gradients are "
            "added into float32 buckets, which a 16-bit .grad cannot view (the buckets already spare the copies)"
        )


def check_and_agree(
    ddp: Any, caps: Tuple[Any, Any], first_bucket_mb: Any, device_ids: Any, output_device: Any, torch_only: tuple
) -> Tuple[Any, Any, int, str, Optional[List[int]], Optional[int]]:
    """Every rank's checks of the module and the arguments, then one agreement across ranks (a collective).

    ``ddp``: the wrapper being built (its settings and ``process_group`` are set); ``caps``:
    ``(bucket_cap_mb, bucket_cap_mb_list)`` as given. One small all-gather (``fastcoll.distributed``'s
    agreement protocol) shares a local failure, so that every rank raises it and none hangs, and
    compares the parameter signatures: differing modules make every rank raise a RuntimeError naming
    the first differing parameter.

    Returns:
        :func:`check_arguments`'s tuple.
    """
    named = ddp._named_parameters()
    error: Optional[BaseException] = None
    try:
        refuse_torch_only(*torch_only)
        check_torch_features([p for _, p in named])
        check_main_grad_dtype(ddp.main_grad_dtype, ddp.gradient_as_bucket_view)
        check_comm_accum_dtype(ddp.comm_accum_dtype, ddp.comm_dtype)
        cfg = check_arguments(named, caps[0], first_bucket_mb, ddp.comm_dtype, device_ids, output_device, caps[1])
        resolve_stall_timeout(ddp.stall_timeout, ddp.process_group)  # a bad value raises here, on every rank
    except (ValueError, RuntimeError, TypeError) as exc:
        error = exc
    try:
        sig = [(n, tuple(p.shape), dtype_name(p.dtype), tuple(p.stride()), bool(p.requires_grad)) for n, p in named]
    except Exception:  # uninitialized parameters have no shape
        sig = []
    group = ddp.process_group
    cuda_now = torch.cuda.current_device() if torch.cuda.is_available() else None
    device = sync_device(backend_name(group), device_ids, [p.device for _, p in named], bound_device(group), cuda_now)
    agree("fastcoll.DDP", group=group, error=error, desc=sig, explain=mismatch_message, mismatch=RuntimeError, device=device)
    if error is not None:
        raise error
    return cfg
