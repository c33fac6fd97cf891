"""fastcoll.DDP: a drop-in replacement for torch.nn.parallel.DistributedDataParallel.

Same constructor arguments, same training loop, same checkpoints (state_dict
keys carry the "module." prefix); gradients are averaged by
:class:`fastcoll.reducer.Reducer`, whose per-byte work runs in the fused ops.
"""

from __future__ import annotations

import dataclasses
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ..bucketing import AUTO
from ..reducer import Reducer
from ..stall import set_group_stall_timeout
from . import compile_support
from .arguments import (
    buffer_sync_flags,
    check_and_agree,
    check_verify_replicas_every,
    group_from_mesh,
    reducer_parameter_names,
    resolve_process_group,
    warn_at_construction,
)
from .broadcast import DEFAULT_CAP_BYTES, broadcast_coalesced
from .buffers import ModuleBuffers
from .comm_hooks import CommHookRegistration
from .compat import TorchMembers
from .health import GradHealthMethods
from .inspection import SyncInspection
from .join import JoinState, JoinSupport
from .logging_data import LoggingData
from .module_changes import ModuleChanges
from .pickling import PicklingSupport

__all__ = ["DDP", "DistributedDataParallel"]


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
        return dataclasses.replace(
            obj, **{f.name: _move_to(getattr(obj, f.name), device) for f in dataclasses.fields(obj) if f.init}
        )
    return obj


class DDP(
    PicklingSupport,
    CommHookRegistration,
    JoinSupport,
    GradHealthMethods,
    SyncInspection,
    LoggingData,
    TorchMembers,
    ModuleChanges,
    TorchDDP,
):
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
        bucket_cap_mb: Bucket size in MiB (None: 25); or a list of caps in
            MiB, one per bucket in reduction order (the last repeating), so the
            first buckets can be small and later ones large; or ``"auto"``:
            the layout is tuned while the job trains (after the first
            iteration's ready-order rebuild, a few candidate layouts run a few
            iterations each, the one with the lowest median step time is kept;
            within ``FASTCOLL_AUTOTUNE_STEPS`` (50) iterations, rank 0 decides,
            every rank switches at the same forward; see :meth:`tuning_report`).
            ``"auto"`` refuses comm hooks (stateful hooks key their state by
            bucket index).
        bucket_cap_mb_list: torch 2.13's per-bucket caps in MiB: as a list
            given to ``bucket_cap_mb`` (which is then ignored, as in torch,
            when it is a number); None or ``[]``: ``bucket_cap_mb`` applies.
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
        comm_accum_dtype: None (the default: the all-reduce above), or
            ``torch.float32`` with a 16-bit ``comm_dtype``: 16-bit values on
            the wire, a float32 result. Each bucket (padded to a multiple of
            the world size, as a sharded optimizer's) is exchanged by an
            all-to-all of its N ranges (the bytes of a reduce-scatter); each
            rank sums the N 16-bit contributions to its range in float64 (in
            rank order: exact while an element's N values span at most
            45 - log2(N) binades), times 1/divisor, rounds once to float32
            and from there to the wire dtype (:func:`fastcoll.ops.sum_chunks`),
            and an all-gather completes the bucket: two roundings to 16 bits
            whatever the world size, where a 16-bit ring rounds N-1 times. With
            ``ShardedOptimizer(grads="sharded")`` the all-gather is not needed
            and float32 main gradients receive the sum rounded once to float32.
            The pack does not divide (16-bit gradients travel exactly; float16
            wire values are the undivided gradients, which must be within
            float16's range).
        compute_grad_norm: Fuse the sum of squares of the synchronized
            gradients into each bucket's write-back, for :meth:`grad_norm` and
            :meth:`clip_grad_norm_` without a read pass.
        check_nonfinite: Flag NaN/Inf in the fused pack; when the synchronized
            gradients are not finite, raise :class:`fastcoll.NonFiniteGradError`
            out of ``backward()`` on every rank, naming the ranks and parameters
            at fault (one small device-to-host read per backward; no extra
            collective unless it fails). Also computes the norm's partial sums.
        record_timeline: Record per-bucket event times of the last iterations
            (:meth:`sync_timeline`, :meth:`export_chrome_trace`); about 0.2 µs
            per gradient and per bucket event. Iteration-level times are kept
            either way.
        stall_timeout: Seconds a rank may wait inside fastcoll's gradient
            synchronization (bucket reductions, the used-parameter all-reduce,
            buffer broadcasts, join's collectives) before every live rank
            gathers every rank's state through the process group's store and
            raises :class:`fastcoll.StallError` with one report naming the
            culprit (docs/hangs.md); it becomes the process group's (the
            ``fastcoll.dist`` helpers use it). None: the group's, else
            ``FASTCOLL_STALL_TIMEOUT``, else half the group's timeout up to
            300 s; 0 disables. Only waiting inside synchronization counts,
            never the rank's own compute.
        verify_replicas_every: Run :meth:`verify_replicas` (checksums of all
            parameters and buffers, one all-gather) at the start of every N-th
            synchronized iteration; 0 (default): never. Not under ``join()``.

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
        broadcast_buffers: Optional[bool] = None,
        init_sync: bool = True,
        process_group: Optional[dist.ProcessGroup] = None,
        bucket_cap_mb: Any = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: Optional[List[float]] = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: Optional[bool] = None,
        *,
        first_bucket_mb: float = 1.0,
        comm_dtype: Optional[torch.dtype] = None,
        compute_grad_norm: bool = False,
        check_nonfinite: bool = False,
        record_timeline: bool = True,
        stall_timeout: Optional[float] = None,
        verify_replicas_every: int = 0,
        main_grad_dtype: Optional[torch.dtype] = None,
        comm_accum_dtype: Optional[torch.dtype] = None,
    ):
        nn.Module.__init__(self)  # not torch DDP's __init__: no torch reducer, hooks or broadcasts
        JoinSupport.__init__(self)
        self._join = JoinState(self)
        self._comm_hook_desc: Optional[str] = None  # the one registered comm hook (or builtin / comm_dtype)
        self.process_group = resolve_process_group(group_from_mesh(process_group, device_mesh))
        if device_mesh is not None:
            self.device_mesh = device_mesh
        warn_at_construction(module, broadcast_buffers, forward_sync_buffers, check_reduction)
        self.module = module
        self.dim = dim
        self.forward_sync_buffers, init_sync_buffers = buffer_sync_flags(broadcast_buffers, forward_sync_buffers)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.skip_all_reduce_unused_params = bool(skip_all_reduce_unused_params)
        self.batched_grad_copy = bool(batched_grad_copy)  # fastcoll's pack is always one fused call per bucket
        self.mixed_precision = None
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.static_graph = False
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self.broadcast_bucket_size = DEFAULT_CAP_BYTES
        self.bucket_bytes_cap_default = bucket_cap_mb is None and not bucket_cap_mb_list
        self.comm_dtype = comm_dtype
        self.comm_accum_dtype = comm_accum_dtype
        self.compute_grad_norm = bool(compute_grad_norm)
        self.check_nonfinite = bool(check_nonfinite)
        self.record_timeline = bool(record_timeline)
        self.stall_timeout = stall_timeout
        self.verify_replicas_every = check_verify_replicas_every(verify_replicas_every)
        self.main_grad_dtype = main_grad_dtype
        self._verified_at = 0
        torch_only = (delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision)
        cfg = check_and_agree(
            self, (bucket_cap_mb, bucket_cap_mb_list), first_bucket_mb, device_ids, output_device, torch_only
        )  # a collective
        self.bucket_caps, self._reducer_caps, self.first_bucket_bytes, self.device_type, self.device_ids, self.output_device = cfg
        #: torch DDP's attribute (dynamo's graph splitting reads it): the largest bucket cap in bytes.
        self.bucket_bytes_cap = cfg[1] if isinstance(cfg[1], int) else max(cfg[1])
        if stall_timeout is not None:  # the group's helpers (fastcoll.dist) then report as soon as this DDP's waits
            set_group_stall_timeout(self.process_group, stall_timeout)

        self._build()
        if init_sync:
            states = self._sync_states(init_sync_buffers)
            broadcast_coalesced(states, self.process_group, 0, self.broadcast_bucket_size, self.stall_timeout)
        if comm_dtype is not None:
            self._comm_hook_desc = f"comm_dtype={comm_dtype}"
        if static_graph:
            self._set_static_graph()

    def _named_parameters(self) -> List[Tuple[str, torch.Tensor]]:
        return [(n, p) for n, p in self.module.named_parameters() if n not in self.parameters_to_ignore]

    def _build(self) -> None:
        """Build what synchronizes (the reducer and its hooks, the buffer broadcast): at construction and after unpickling."""
        named = self._named_parameters()
        averaged = set(reducer_parameter_names([n for n, _ in self.module.named_parameters()], self.parameters_to_ignore))
        trainable = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad and n in averaged]
        self.device = trainable[0][1].device
        self._module_parameters = [p for _, p in named]  # torch DDP's name for them
        self.is_multi_device_module = len({p.device for p in self._module_parameters}) > 1
        self._params_to_sync = self._module_parameters
        self._buffer_sync = ModuleBuffers(self.module, self.parameters_to_ignore, self.broadcast_bucket_size)
        # As in torch DDP: the weights of embeddings built with sparse=True get sparse gradients.
        sparse_ids = {id(m.weight) for m in self.module.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}
        self.reducer = Reducer(
            [p for _, p in trainable],
            [n for n, _ in trainable],
            self.process_group,
            bucket_cap_bytes=self._reducer_caps,
            first_bucket_bytes=self.first_bucket_bytes,
            find_unused_parameters=self.find_unused_parameters,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            comm_dtype=self.comm_dtype,
            sparse_params=[i for i, (_, p) in enumerate(trainable) if id(p) in sparse_ids],
            compute_grad_norm=self.compute_grad_norm,
            check_nonfinite=self.check_nonfinite,
            record_timeline=self.record_timeline,
            autotune=self.bucket_caps == AUTO,
            stall_timeout=self.stall_timeout,
            skip_unused_buckets=self.skip_all_reduce_unused_params,
            main_grad_dtype=self.main_grad_dtype,
            comm_accum_dtype=getattr(self, "comm_accum_dtype", None),  # (a pickle from before the argument: None)
        )

    def _sync_states(self, buffers: bool) -> List[torch.Tensor]:
        """What init_sync and the end of join() broadcast: the parameters, and the buffers if ``buffers``."""
        states = [p.detach() for p in self._params_to_sync]
        if buffers:
            states += [b.detach() for b in self._buffer_sync.current()]
        return states

    # ------------------------------------------------------------ construction

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
        at bucket boundaries as for torch's DDP; see ``fastcoll.ddp.compile_support``.
        """
        if compile_support.is_compiling():
            # torch.compile(DDP(model)): dynamo is tracing this frame. Run the
            # wrapper's steps eagerly and let dynamo compile only the module.
            return self._forward_outside_dynamo(inputs, kwargs, compile_support.call_eagerly)
        return self._forward(inputs, kwargs, compile_support.call)

    def _forward(self, inputs: tuple, kwargs: dict, call: Callable[..., Any]) -> Any:
        # ``call`` runs the wrapper's own steps (eagerly when dynamo is active).
        inputs, kwargs = call(self._pre_forward, *inputs, **kwargs)
        gather = self.reducer.param_gather
        if gather is not None and (call is not compile_support.call or compile_support.is_compiled(self.module)):
            # A compiled module's graph cannot wait in module hooks: the parameters' all-gathers finish first.
            call(gather.finish)
        token = call(compile_support.activate, self)  # dynamo's DDPOptimizer splits graphs compiled in here
        try:
            output = self.module(*inputs, **kwargs)
        finally:
            call(compile_support.restore, token)
        return call(self._post_forward, output)

    # The same steps in a frame dynamo does not trace (it still compiles the module's frames).
    _forward_outside_dynamo = compile_support.skip_frame(_forward)

    def _pre_forward(self, *inputs: Any, **kwargs: Any) -> Tuple[tuple, dict]:
        """Before the module runs (torch DDP's signature): returns the inputs, moved to ``device_ids[0]`` if given."""
        # Collective order (a joined rank's DDPJoinHook.main_hook replays it, see fastcoll.ddp.join):
        # [join: "not joined" all-reduce (+ early-termination all-reduce)],
        # [bucket layout broadcast, once], [join: authoritative-rank all-reduce]
        # + buffer broadcast, [join: requires-sync all-reduce].
        if self.reducer.param_gather is not None:
            self.reducer.param_gather.before_forward()
        elif self.reducer.main_buckets:
            raise RuntimeError(
                "fastcoll.DDP(main_grad_dtype=torch.float32): wrap the optimizer in fastcoll.ShardedOptimizer(opt, model) "
                "before the first forward. The float32 main gradients live in the buckets, not in p.grad (a 16-bit "
                "tensor cannot hold them), so a plain torch optimizer would read 16-bit or no gradients"
            )
        join = self._join_config.enable
        if join:
            self._join.notify()
        if torch.is_grad_enabled():
            self._refuse_changed_parameters()
            self.reducer.prepare_for_forward()
        elif join:
            self.reducer.prepare_layout()  # joined ranks replay layout changes whatever the grad mode
        if self.require_forward_param_sync and self.forward_sync_buffers and self._buffer_sync:
            # Under join, rank 0 may have joined with stale buffers: the highest active rank is the source.
            self._sync_buffers(self._join.common_rank(True) if join else 0)
        if self.verify_replicas_every and not join and torch.is_grad_enabled():
            done = self.reducer.usage.iterations
            if done and done % self.verify_replicas_every == 0 and done != self._verified_at:
                self._verified_at = done  # every rank has completed the same number of synchronized iterations
                self.verify_replicas()
        if join:
            self._join.send_requires_sync(torch.is_grad_enabled() and self._syncs_backward)
        if self.device_ids:
            device = torch.device(self.device_type, self.device_ids[0])
            inputs, kwargs = _move_to(inputs, device), _move_to(kwargs, device)
        return inputs, kwargs

    def _post_forward(self, output: Any) -> Any:
        """After the module ran (torch DDP's signature): arms the reducer for a synchronized backward; returns ``output``."""
        if self.reducer.param_gather is not None and torch.is_grad_enabled():
            self.reducer.param_gather.check_after_forward(output)
        if torch.is_grad_enabled() and self._syncs_backward:
            self.require_forward_param_sync = True
            reducer = self.reducer
            if self._join_config.enable:
                reducer.divisor = self._join.divisor(reducer.world_size)
            elif reducer.divisor != reducer.world_size:
                reducer.divisor = float(reducer.world_size)
            reducer.prepare_for_backward(output if self.find_unused_parameters and not self.static_graph else None)
            self._refuse_replaced(reducer.usage.unused)  # (found with find_unused_parameters: before the backward)
        else:
            self.require_forward_param_sync = False
        return output

    def _sync_buffers(self, group_src: int = 0) -> None:
        """Broadcast the module's buffers from group rank ``group_src``."""
        with torch.no_grad():
            self._buffer_sync(self.process_group, group_src, self.stall_timeout)

    # ------------------------------------------------------------------ public

    @property
    def _syncs_backward(self) -> bool:
        """The next backward is reduced: outside ``no_sync``, or always when the reducer reduces every backward."""
        return self.require_backward_grad_sync or self.reducer.reduces_every_backward

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Context manager: forwards inside it are followed by backwards that only accumulate locally.

        The first forward+backward outside the context averages the accumulated gradients. When the reducer
        reduces every backward (pooled gradient buffers accumulating by reduce-scatter: no full-size buffer to
        accumulate into locally), backwards inside it are reduced all the same.
        """
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``, and the gradients kept outside ``.grad`` too (main gradients, reduced ranges).

        Args:
            set_to_none: As ``nn.Module.zero_grad``.
        """
        super().zero_grad(set_to_none)
        self.reducer.zero_kept_grads(set_to_none)

    def main_grad(self, param: torch.Tensor) -> torch.Tensor:
        """The float32 main gradient of a 16-bit parameter (``main_grad_dtype``): a view of its bucket.

        After a synchronized backward it holds the reduced gradient (sum over
        ranks of every micro-batch's gradients, divided once by the divisor).

        Raises:
            KeyError: ``param`` is not one of the synchronized parameters.
            RuntimeError: ``param`` has no main gradient, or the main gradients are reduce-scattered.
        """
        for i, p in enumerate(self.reducer.params):
            if p is param:
                return self.reducer.main_grad(i)
        raise KeyError("fastcoll.DDP.main_grad: not a parameter this wrapper synchronizes")

    def _remove_hooks(self) -> None:
        """Remove the autograd hooks and release the bucket buffers; the wrapper stops synchronizing."""
        self.reducer.close()

    def close(self) -> None:
        """Alias of :meth:`_remove_hooks`, for frameworks that tear wrappers down between fits."""
        self._remove_hooks()


DistributedDataParallel = DDP
