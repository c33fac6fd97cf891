"""fastcoll.DDP: a drop-in replacement for torch.nn.parallel.DistributedDataParallel.

Same constructor arguments, same training loop, same checkpoints (state_dict
keys carry the "module." prefix); gradients are averaged by
:class:`fastcoll.reducer.Reducer`, whose per-byte work runs in the fused ops.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import typing
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from . import _compile_support
from ._reference import SUPPORTED_DTYPES, is_dense
from .bucketing import MIB
from .reducer import Bucket, CoalescedBroadcast, Reducer, _check_comm_dtype, _hook_name, broadcast_coalesced

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


class DDP(nn.Module, Joinable):
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
        comm_dtype: None, ``torch.float16`` or ``torch.bfloat16``: fused
            low-precision communication. Buckets of a wider dtype (float32,
            float64) are cast and scaled into a 16-bit buffer by one fused pack,
            all-reduced in that dtype (half the bytes of float32) and upcast
            into the gradients by one fused unpack. The division by the world
            size happens before the all-reduce (in float32, then one
            rounding to the wire dtype), so the all-reduce sums per-rank shares
            of the mean: the result and every partial sum are bounded by the
            largest per-rank gradient magnitude, so nothing overflows float16
            while every rank's gradients are within its range (sum-then-divide
            would overflow at 65504 / world_size). The price is at most
            log2(world_size) bits of float16's subnormal range for tiny
            gradients. Buckets already 16-bit travel unchanged. Equivalent to
            torch's ``fp16_compress_hook``/``bf16_compress_hook`` with one pass
            per direction instead of a cast, a division and a copy; exclusive
            with comm hooks (``_register_builtin_comm_hook(FP16_COMPRESS)``
            sets ``comm_dtype=torch.float16``).

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
        comm_dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        Joinable.__init__(self)
        self._divide_by_initial_world_size = True
        self._join_count_work: Any = None  # join: the "not joined yet" all-reduce whose sum is the active rank count
        self._join_sync_work: Any = None
        self._comm_hook_desc: Optional[str] = None  # the one registered comm hook (or builtin / comm_dtype)
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
            _check_comm_dtype(comm_dtype)
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
        self._params_to_sync = [p for _, p in named]
        self._buffers_to_sync = [b for n, b in module.named_buffers() if n not in self.parameters_to_ignore]
        self._buffer_broadcast = CoalescedBroadcast(self._buffers_to_sync, self.broadcast_bucket_size)
        if init_sync:
            states = [p.detach() for _, p in named]
            if self.broadcast_buffers:
                states += [b.detach() for b in self._buffers_to_sync]
            broadcast_coalesced(states, self.process_group, 0, self.broadcast_bucket_size)

        # As in torch DDP: the weights of embeddings built with sparse=True get sparse gradients.
        sparse_ids = {
            id(m.weight) for m in module.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
        }
        self.reducer = Reducer(
            [p for _, p in trainable],
            [n for n, _ in trainable],
            self.process_group,
            bucket_cap_bytes=self.bucket_bytes_cap,
            first_bucket_bytes=self.first_bucket_bytes,
            find_unused_parameters=self.find_unused_parameters,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            comm_dtype=comm_dtype,
            sparse_params=[i for i, (_, p) in enumerate(trainable) if id(p) in sparse_ids],
        )
        self.comm_dtype = comm_dtype
        if comm_dtype is not None:
            self._comm_hook_desc = f"comm_dtype={comm_dtype}"
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

        Under torch.compile (``DDP(torch.compile(model))`` or
        ``torch.compile(DDP(model))``) only the wrapped module is compiled, split
        at bucket boundaries as for torch's DDP; see ``fastcoll._compile_support``.
        """
        if _compile_support.is_compiling():
            # torch.compile(DDP(model)): dynamo is tracing this frame. Run the
            # wrapper's steps eagerly and let dynamo compile only the module.
            return self._forward_outside_dynamo(inputs, kwargs, _compile_support.call_eagerly)
        return self._forward(inputs, kwargs, _compile_support.call)

    def _forward(self, inputs: tuple, kwargs: dict, call: Callable[..., Any]) -> Any:
        # ``call`` runs the wrapper's own steps (eagerly when dynamo is active).
        inputs, kwargs = call(self._pre_forward, inputs, kwargs)
        token = call(_compile_support.activate, self)  # dynamo's DDPOptimizer splits graphs compiled in here
        try:
            output = self.module(*inputs, **kwargs)
        finally:
            call(_compile_support.restore, token)
        call(self._post_forward, output)
        return output

    # The same steps in a frame dynamo does not trace (it still compiles the module's frames).
    _forward_outside_dynamo = _compile_support.skip_frame(_forward)

    def _pre_forward(self, inputs: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        # Collective order (a joined rank's _DDPJoinHook.main_hook replays it):
        # [join: "not joined" all-reduce (+ early-termination all-reduce)],
        # [bucket layout broadcast, once], [join: authoritative-rank all-reduce]
        # + buffer broadcast, [join: requires-sync all-reduce].
        join = self._join_config.enable
        if join:
            work = Join.notify_join_context(self)  # None unless this is the Join's first joinable
            self._join_count_work = None if self._divide_by_initial_world_size else work
        if torch.is_grad_enabled():
            self.reducer.prepare_for_forward()
        elif join:
            self.reducer.rebuild_buckets()  # joined ranks replay a pending rebuild whatever the grad mode
        if self.require_forward_param_sync and self.broadcast_buffers and self._buffers_to_sync:
            # Under join, rank 0 may have joined with stale buffers: the highest active rank is the source.
            self._sync_buffers(self._find_common_rank(True) if join else 0)
        if join:
            self._join_sync_work = self._all_reduce_requires_sync(torch.is_grad_enabled() and self.require_backward_grad_sync)
        if self.device_ids:
            device = torch.device(self.device_type, self.device_ids[0])
            inputs, kwargs = _move_to(inputs, device), _move_to(kwargs, device)
        return inputs, kwargs

    def _post_forward(self, output: Any) -> None:
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self.require_forward_param_sync = True
            reducer = self.reducer
            if self._join_config.enable:
                reducer.divisor = self._join_divisor()
            elif reducer.divisor != reducer.world_size:
                reducer.divisor = float(reducer.world_size)
            reducer.prepare_for_backward(output if self.find_unused_parameters and not self.static_graph else None)
        else:
            self.require_forward_param_sync = False

    def _sync_buffers(self, group_src: int = 0) -> None:
        """Broadcast the module's buffers from group rank ``group_src``."""
        with torch.no_grad():
            self._buffer_broadcast(self.process_group, group_src)

    # -------------------------------------------------------------------- join

    def _join_divisor(self) -> float:
        """This iteration's divisor under join: the initial world size, or the number of ranks still training."""
        work = self._join_count_work
        self._join_count_work = None
        if work is None:
            return float(self.reducer.world_size)
        work.wait()
        return float(work.get_future().value()[0].item())

    def _find_common_rank(self, candidate: bool) -> int:
        """The highest group rank among the ranks passing ``candidate=True`` (an all-reduce MAX)."""
        t = torch.tensor([dist.get_rank(self.process_group) if candidate else -1], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
        rank = int(t.item())
        if rank < 0:
            raise RuntimeError("fastcoll.DDP: join protocol error: no rank offered to be the source of the model state")
        return rank

    def _all_reduce_requires_sync(self, requires_sync: bool) -> Any:
        """The join protocol's per-iteration all-reduce telling joined ranks whether a synchronized backward follows."""
        t = (torch.ones if requires_sync else torch.zeros)(1, device=self.device)
        return dist.all_reduce(t, group=self.process_group, async_op=True), t

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        """Broadcast parameters (and buffers, with broadcast_buffers) from the highest last-joining rank."""
        src = self._find_common_rank(is_last_joiner)
        states = [p.detach() for p in self._params_to_sync]
        if self.broadcast_buffers:
            states += [b.detach() for b in self._buffers_to_sync]
        with torch.no_grad():
            broadcast_coalesced(states, self.process_group, src, self.broadcast_bucket_size)

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """Context manager for training with uneven inputs across ranks, as torch DDP's ``join()``.

        Ranks that run out of inputs keep issuing the collectives of a training
        iteration with zero gradients until every rank has run out; then the
        model state of the last rank to finish is broadcast to all. Wrap the
        training loop (forward, backward, optimizer step) in it.

        Args:
            divide_by_initial_world_size: Average over the initial world size
                (True), or over the ranks still training in that iteration (False).
                Comm hooks divide as they do on their own (by the group size).
            enable: False disables uneven-input detection (no extra collectives).
            throw_on_early_termination: Raise on every rank as soon as one runs
                out of inputs, instead of continuing.

        Returns:
            A :class:`torch.distributed.algorithms.join.Join` over this module.
            For several joinables (e.g. a ``ZeroRedundancyOptimizer``), build
            ``Join([ddp, optimizer], divide_by_initial_world_size=...)`` with
            the DDP module first.

        Note:
            Like torch DDP, every rank still training must run one forward per
            iteration; a synchronized backward must follow each forward run
            with gradients enabled outside ``no_sync()`` (forwards under
            ``torch.no_grad()`` are fine: joined ranks learn that no backward
            follows).
        """
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook a :class:`~torch.distributed.algorithms.join.Join` runs on ranks that have run out of inputs.

        Keyword Args:
            divide_by_initial_world_size (bool): see :meth:`join` (default True).
        """
        return _DDPJoinHook(self, divide_by_initial_world_size=kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        """Device of the join protocol's collectives (the parameters' device)."""
        return self.device

    @property
    def join_process_group(self) -> Any:
        """Process group of the join protocol's collectives."""
        return self.process_group

    # -------------------------------------------------------------- comm hooks

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """Register a communication hook, with torch DDP's contract.

        ``hook(state, bucket) -> torch.futures.Future`` is called once per
        bucket per synchronized backward, in bucket index order, with a
        :class:`fastcoll.reducer.Bucket` (the GradBucket interface: ``index()``,
        ``buffer()``, ``gradients()``, ``parameters()``, ``is_last()``,
        ``set_buffer()``). The buffer holds the bucket's gradients *not*
        divided by the world size (the hook divides). The future's value, one
        tensor (or a list holding one) with the bucket's number of elements
        in any floating dtype, is written back into the gradients by one fused
        unpack that casts on the way. torch's hooks (allreduce, fp16/bf16
        compress and wrappers, PowerSGD, post-local SGD, noop) run unchanged.

        Only one hook per module (this, ``_register_builtin_comm_hook`` or
        ``comm_dtype``), registered between iterations.

        Raises:
            TypeError: ``hook`` is not callable or cannot take ``(state, bucket)``.
            ValueError: its annotations are not a GradBucket and a Future of a tensor.
            RuntimeError: a hook (or comm_dtype) is already registered.
        """
        _check_comm_hook(hook)
        self._check_no_hook(_hook_name(hook))
        self.reducer.register_comm_hook(state, hook)
        self._comm_hook_desc = _hook_name(hook)

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
        ``dtype``, ``device``, ``numel``, ``bytes`` (of the gradients), ``comm_dtype`` and
        ``comm_bytes`` (what one all-reduce of it carries). Reflects the rebuilt layout after the
        first iteration."""
        return self.reducer.bucket_info()

    def _remove_hooks(self) -> None:
        """Remove the autograd hooks and release the bucket buffers; the wrapper stops synchronizing."""
        self.reducer.close()

    def close(self) -> None:
        """Alias of :meth:`_remove_hooks`, for frameworks that tear wrappers down between fits."""
        self._remove_hooks()


class _DDPJoinHook(JoinHook):
    """Join hook of :class:`DDP`: on a rank out of inputs, replays one iteration's DDP collectives.

    ``main_hook`` issues, in the order :meth:`DDP._pre_forward` and the
    reducer issue them on the ranks still training (after the Join's own
    "not joined" all-reduce): the pending bucket layout broadcast, the buffer
    sync (authoritative-rank all-reduce + broadcast) when buffers are synced,
    the requires-sync all-reduce, and when it says a synchronized backward
    follows, one zero bucket per bucket (through the comm hook, if any) and
    the used-parameter all-reduce when tracked. ``post_hook`` broadcasts the
    parameters and buffers of the last rank to join.
    """

    def __init__(self, ddp: DDP, divide_by_initial_world_size: bool):
        if not isinstance(ddp, DDP):
            raise TypeError(f"fastcoll.DDP join hook expects a fastcoll.DDP, got {type(ddp).__name__}")
        self.ddp = ddp
        ddp._divide_by_initial_world_size = bool(divide_by_initial_world_size)
        super().__init__()

    def main_hook(self) -> None:
        ddp = self.ddp
        ddp.reducer.rebuild_buckets()
        if ddp.require_forward_param_sync and ddp.broadcast_buffers and ddp._buffers_to_sync:
            ddp._sync_buffers(ddp._find_common_rank(False))
        work, flag = ddp._all_reduce_requires_sync(False)
        work.wait()
        should_sync = flag.item() != 0
        ddp.require_forward_param_sync = should_sync
        if should_sync:
            ddp.reducer.replay_joined_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp._sync_final_model(is_last_joiner)


# ----------------------------------------------------------- hook validation


def _annotation_name(a: Any) -> str:
    return str(a).strip("'\" ").split("[", 1)[0].rsplit(".", 1)[-1]


def _is_bucket_annotation(a: Any) -> bool:
    if a is inspect.Parameter.empty or a is typing.Any or a is object:
        return True
    if isinstance(a, type):
        return issubclass(a, (Bucket, dist.GradBucket))
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


def _check_comm_hook(hook: Any) -> None:
    """Validate a comm hook as torch DDP does, minus its false rejections.

    Accepts functools.partial objects and any name for the second parameter.
    """
    if not callable(hook):
        raise TypeError(f"fastcoll.DDP: the communication hook must be callable, got {type(hook).__name__}")
    try:
        sig = inspect.signature(hook, eval_str=True)
    except (NameError, SyntaxError, TypeError, AttributeError):
        try:
            sig = inspect.signature(hook)
        except (TypeError, ValueError):
            return
    except ValueError:  # builtins without a signature
        return
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
    required = [p for p in positional if p.default is p.empty]
    required_kw = [p for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    if (len(positional) < 2 and not varargs) or len(required) > 2 or required_kw:
        raise TypeError(
            f"fastcoll.DDP: the communication hook {_hook_name(hook)} must be callable as hook(state, bucket); "
            f"its signature is {sig}"
        )
    if len(positional) >= 2 and not _is_bucket_annotation(positional[1].annotation):
        raise ValueError(
            f"fastcoll.DDP: the communication hook {_hook_name(hook)}: its bucket parameter "
            f"'{positional[1].name}' is annotated {positional[1].annotation!r}; it should be dist.GradBucket "
            "(or fastcoll.reducer.Bucket), or not annotated"
        )
    if not _is_future_annotation(sig.return_annotation):
        raise ValueError(
            f"fastcoll.DDP: the communication hook {_hook_name(hook)}: return annotation "
            f"{sig.return_annotation!r} should be torch.futures.Future[torch.Tensor] (or none)"
        )


DistributedDataParallel = DDP
