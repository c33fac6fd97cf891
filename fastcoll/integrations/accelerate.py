"""fastcoll for Hugging Face accelerate: ``FastCollAccelerator``, an ``Accelerator`` whose ``prepare()`` uses fastcoll.DDP.

One line changes::

    from fastcoll.integrations.accelerate import FastCollAccelerator, FastCollKwargs

    accelerator = FastCollAccelerator()  # instead of accelerate.Accelerator()
    # or, with the sharded optimizer and float32 main gradients for a bf16 model:
    accelerator = FastCollAccelerator(
        fastcoll=FastCollKwargs(sharded_optimizer=True, grads="sharded", main_grad_dtype=torch.float32),
    )
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

Everything else is accelerate's: ``FastCollAccelerator`` takes the same
arguments (``DistributedDataParallelKwargs`` in ``kwargs_handlers`` maps onto
fastcoll.DDP's arguments of the same names, its comm hook is registered on the
fastcoll.DDP), and ``backward``, ``accumulate``/``no_sync``,
``clip_grad_norm_``, ``unwrap_model``, ``save_model``/``save_state``/``load_state``
and ``gather_for_metrics`` run accelerate's own code on a model that is a
``torch.nn.parallel.DistributedDataParallel`` (fastcoll.DDP subclasses it).

Why a subclass that overrides ``prepare_model`` (and not a patch or a plugin):
accelerate 1.15 has no registry for model wrappers; ``prepare_model`` builds
``torch.nn.parallel.DistributedDataParallel(...)`` inline, between the steps
that must come before it (autocast of the forward, device placement, FP8
conversion) and after it (``torch.compile``). Replacing the class name inside
accelerate, or ``torch.nn.parallel.DistributedDataParallel`` itself, would be
a global patch that breaks silently when accelerate imports it differently.
Instead the override calls accelerate's own ``prepare_model`` with
``evaluation_mode=True``, whose documented contract is "everything except the
distributed wrapper" (mixed precision and ``torch.compile``), then wraps the
result in fastcoll.DDP (under ``torch.compile`` when accelerate compiled it).
Only public methods and documented arguments are relied on, and a check
raises if a future accelerate returns a torch DDP from that call.

The transformers ``Trainer`` builds its own ``Accelerator``:
:func:`adopt` turns that instance into a ``FastCollAccelerator`` (see
:mod:`fastcoll.integrations.transformers`).

What is not fastcoll's: FSDP, DeepSpeed, Megatron-LM, XLA and tensor/context
parallelism stay accelerate's. A ``FastCollAccelerator`` configured with any
of them raises a ValueError at construction, because accelerate would never
call the DDP path and fastcoll would be bypassed without a word.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType
from torch import nn

from ..ddp import DDP
from ..optim import ShardedOptimizer

__all__ = ["FastCollAccelerator", "FastCollKwargs", "adopt"]

# accelerate modes in which prepare() never wraps in DDP: fastcoll would be bypassed.
_NOT_DDP = {
    DistributedType.FSDP: "FSDP (fsdp_plugin / ACCELERATE_USE_FSDP)",
    DistributedType.DEEPSPEED: "DeepSpeed (deepspeed_plugin / ACCELERATE_USE_DEEPSPEED)",
    DistributedType.MEGATRON_LM: "Megatron-LM (megatron_lm_plugin)",
    DistributedType.XLA: "XLA (TPU)",
}
_PLUGINS = ("fsdp_plugin", "deepspeed_plugin", "megatron_lm_plugin")
_PLUGIN_ENV = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_MEGATRON_LM")
_DDP_PARAMS = frozenset(inspect.signature(DDP.__init__).parameters) - {"self", "module", "device_ids", "output_device"}
_GRADS = ("full", "sharded")


@dataclasses.dataclass
class FastCollKwargs:
    """fastcoll's own options for :class:`FastCollAccelerator` (torch DDP's stay in ``DistributedDataParallelKwargs``).

    Args:
        comm_dtype: The dtype gradients are reduced in (``fastcoll.DDP(comm_dtype=...)``).
        stall_timeout: Seconds before a reduction that does not complete is diagnosed (``fastcoll.DDP``).
        main_grad_dtype: ``torch.float32``: float32 main gradients of 16-bit parameters in the
            buckets (needs ``sharded_optimizer``: a plain optimizer cannot read them).
        sharded_optimizer: Wrap each optimizer passed to ``prepare()`` in
            :class:`fastcoll.ShardedOptimizer` (state divided among the ranks).
        grads: ``"full"`` or ``"sharded"``, :class:`fastcoll.ShardedOptimizer`'s ``grads``.
        master_dtype: ``None`` or ``torch.float32``, :class:`fastcoll.ShardedOptimizer`'s ``master_dtype``.
        overlap_param_gather: :class:`fastcoll.ShardedOptimizer`'s ``overlap_param_gather``.
        grad_buffers: :class:`fastcoll.ShardedOptimizer`'s ``grad_buffers`` (``"pool"`` with
            ``grads="sharded"``: gradient buffers from a pool, ZeRO-2); checked when ``prepare()`` builds it.
        pool_buffers: :class:`fastcoll.ShardedOptimizer`'s ``pool_buffers``.
        accumulate: :class:`fastcoll.ShardedOptimizer`'s ``accumulate``.
        ddp_kwargs: Any other :class:`fastcoll.DDP` keyword argument (``first_bucket_mb``,
            ``compute_grad_norm``, ...). They and the fields above take precedence over
            ``DistributedDataParallelKwargs`` where both name one.

    Raises:
        ValueError: an unknown ``grads``, an unknown fastcoll.DDP argument in ``ddp_kwargs``,
            or ``main_grad_dtype``/``master_dtype``/the pool's arguments without ``sharded_optimizer``.
    """

    comm_dtype: Optional[torch.dtype] = None
    stall_timeout: Optional[float] = None
    main_grad_dtype: Optional[torch.dtype] = None
    sharded_optimizer: bool = False
    grads: str = "full"
    master_dtype: Optional[torch.dtype] = None
    overlap_param_gather: bool = False
    grad_buffers: str = "persistent"
    pool_buffers: Optional[int] = None
    accumulate: Optional[str] = None
    ddp_kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.grads not in _GRADS:
            raise ValueError(f"FastCollKwargs: grads must be one of {_GRADS}, got {self.grads!r}")
        unknown = sorted(set(self.ddp_kwargs) - _DDP_PARAMS)
        if unknown:
            raise ValueError(
                f"FastCollKwargs.ddp_kwargs: fastcoll.DDP has no argument {', '.join(unknown)}; "
                f"it takes {', '.join(sorted(_DDP_PARAMS))}"
            )
        if not self.sharded_optimizer:
            for name in ("main_grad_dtype", "master_dtype", "pool_buffers", "accumulate"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"FastCollKwargs: {name} needs sharded_optimizer=True (the float32 main gradients, master "
                        "weights and gradient pool are the sharded optimizer's; a plain optimizer reads p.grad)"
                    )
            if self.grad_buffers != "persistent":
                raise ValueError(f"FastCollKwargs: grad_buffers={self.grad_buffers!r} needs sharded_optimizer=True")

    def wrapper_kwargs(self) -> Dict[str, Any]:
        """The fastcoll.DDP keyword arguments these options set (only those not left at their default)."""
        own = {"comm_dtype": self.comm_dtype, "stall_timeout": self.stall_timeout, "main_grad_dtype": self.main_grad_dtype}
        return {**{k: v for k, v in own.items() if v is not None}, **self.ddp_kwargs}

    def optimizer_kwargs(self) -> Dict[str, Any]:
        """The :class:`fastcoll.ShardedOptimizer` keyword arguments."""
        names = ("grads", "master_dtype", "overlap_param_gather", "grad_buffers", "pool_buffers", "accumulate")
        return {name: getattr(self, name) for name in names}


class FastCollAccelerator(Accelerator):
    """An ``accelerate.Accelerator`` whose ``prepare()`` wraps models in :class:`fastcoll.DDP`.

    Args:
        *args: ``Accelerator``'s positional arguments.
        fastcoll: fastcoll's options (:class:`FastCollKwargs`); None: the defaults.
        **kwargs: ``Accelerator``'s keyword arguments.

    Raises:
        ValueError: accelerate is configured for FSDP, DeepSpeed, Megatron-LM,
            XLA or tensor/context parallelism (fastcoll would be bypassed).
    """

    _fastcoll: FastCollKwargs

    def __init__(self, *args: Any, fastcoll: Optional[FastCollKwargs] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._fastcoll_setup(fastcoll, [name for name in _PLUGINS if kwargs.get(name) is not None])

    def _fastcoll_setup(self, options: Optional[FastCollKwargs], plugins: Sequence[str] = ()) -> None:
        """Check that accelerate's mode is one whose ``prepare()`` wraps in DDP, and keep the options.

        ``plugins``: the plugin arguments the Accelerator was given (on CPU accelerate ignores an FSDP
        plugin without a word; that is refused here too, as the user asked for something else).
        """
        if options is not None and not isinstance(options, FastCollKwargs):
            raise TypeError(f"FastCollAccelerator: fastcoll must be a FastCollKwargs, got {type(options).__name__}")
        asked = list(plugins) + [v for v in _PLUGIN_ENV if os.environ.get(v, "false").lower() in ("1", "true")]
        mode = _NOT_DDP.get(self.distributed_type) or (", ".join(asked) if asked else None)
        pc = getattr(self, "parallelism_config", None)
        if mode is None and pc is not None:
            on = [n for n in ("tp", "cp", "dp_shard") if getattr(pc, f"{n}_enabled", False)]
            mode = f"parallelism_config with {', '.join(on)}" if on else None
        if mode is not None:
            raise ValueError(
                f"FastCollAccelerator: {mode} is configured. FSDP, DeepSpeed, Megatron-LM, XLA and tensor/context "
                "parallelism are accelerate's own ways to prepare a model, not through DDP: fastcoll.DDP would not be "
                "used (or that configuration would be ignored). Use accelerate.Accelerator (or the plain Trainer) for "
                "them, or remove that configuration to train with fastcoll.DDP"
            )
        self._fastcoll = options if options is not None else FastCollKwargs()
        self._fastcoll_models: List[DDP] = []
        self.register_save_state_pre_hook(_save_own_storage)
        self.register_load_state_pre_hook(_load_through_own_storage)

    # ---------------------------------------------------------------- models

    @property
    def _fastcoll_wraps(self) -> bool:
        """Whether accelerate would wrap models in DDP here (several processes, a DDP-capable mode)."""
        return self.multi_device or self.distributed_type == DistributedType.MULTI_CPU

    def prepare_model(
        self, model: nn.Module, device_placement: Optional[bool] = None, evaluation_mode: bool = False
    ) -> nn.Module:
        """accelerate's ``prepare_model`` with fastcoll.DDP in place of torch DDP.

        Args:
            model: The model (not wrapped yet, or wrapped in fastcoll.DDP by the user).
            device_placement: As accelerate's.
            evaluation_mode: As accelerate's (no wrapper at all then).

        Returns:
            The fastcoll.DDP (under ``torch.compile`` when accelerate is set to compile), or what
            accelerate returns where it would not wrap in DDP (one process, evaluation, frozen model).

        Raises:
            TypeError: ``model`` is already a torch DDP.
        """
        if type(model) is torch.nn.parallel.DistributedDataParallel:
            raise TypeError(
                "FastCollAccelerator.prepare: the model is already wrapped in torch DDP; pass the bare module "
                "(prepare wraps it in fastcoll.DDP)"
            )
        if getattr(model, "_is_accelerate_prepared", False) or evaluation_mode or not self._fastcoll_wraps:
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        if not any(p.requires_grad for p in model.parameters()):
            # Nothing to synchronize: no wrapper (accelerate skips DDP there on GPUs; on CPU torch DDP would raise).
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)
        if isinstance(model, DDP):  # wrapped by the user: accelerate's autocast/placement/compile only
            prepared = super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)
            self._fastcoll_models.append(model)
            return prepared
        # Everything accelerate does except the DDP wrapper: autocast, placement, FP8, torch.compile.
        prepared = super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)
        compiled = isinstance(prepared, torch._dynamo.eval_frame.OptimizedModule)
        inner = prepared._orig_mod if compiled else prepared
        if isinstance(inner, torch.nn.parallel.DistributedDataParallel):
            raise RuntimeError(
                "FastCollAccelerator: accelerate's prepare_model(evaluation_mode=True) returned a torch DDP; this "
                "accelerate version is not supported by fastcoll.integrations.accelerate"
            )
        wrapped = self._fastcoll_wrap(inner)
        if compiled:  # DDP inside the compiled module, as accelerate orders them
            wrapped = torch.compile(wrapped, **self.state.dynamo_plugin.to_kwargs())
        wrapped._is_accelerate_prepared = True
        return wrapped

    def _fastcoll_wrap(self, module: nn.Module) -> DDP:
        """``module`` in fastcoll.DDP with ``DistributedDataParallelKwargs`` and fastcoll's options, plus the comm hook."""
        kwargs = self.ddp_handler.to_kwargs() if self.ddp_handler is not None else {}
        kwargs.update(self._fastcoll.wrapper_kwargs())
        index = self.device.index if self.device.type != "cpu" else None
        ids = [index] if index is not None else None
        ddp = DDP(module, device_ids=ids, output_device=index, **kwargs)
        if self.ddp_handler is not None:
            self.ddp_handler.register_comm_hook(ddp)
        self._fastcoll_models.append(ddp)
        return ddp

    # ------------------------------------------------------------ optimizers

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: Optional[bool] = None) -> Any:
        """accelerate's ``prepare_optimizer``; with ``sharded_optimizer``, the optimizer is first wrapped in
        :class:`fastcoll.ShardedOptimizer` over the prepared fastcoll.DDP that holds its parameters.

        Raises:
            ValueError: ``sharded_optimizer`` is set and no model prepared so far holds the optimizer's
                parameters (pass the model to ``prepare()`` before the optimizer).
        """
        if getattr(optimizer, "_is_accelerate_prepared", False):
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
        if self._fastcoll.sharded_optimizer and self._fastcoll_wraps and not isinstance(optimizer, ShardedOptimizer):
            optimizer = ShardedOptimizer(optimizer, self._fastcoll_model_of(optimizer), **self._fastcoll.optimizer_kwargs())
        if isinstance(optimizer, ShardedOptimizer):
            # Its state lives beside the model's parameters already; placement would round-trip the state
            # dict (a collective gather) for nothing.
            device_placement = False
        return super().prepare_optimizer(optimizer, device_placement=device_placement)

    def _fastcoll_model_of(self, optimizer: torch.optim.Optimizer) -> DDP:
        """The prepared fastcoll.DDP that synchronizes every parameter of ``optimizer``."""
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for ddp in reversed(self._fastcoll_models):  # the newest wrapper of a model prepared again
            if ids <= {id(p) for p in ddp.module.parameters()}:
                return ddp
        raise ValueError(
            "FastCollAccelerator(sharded_optimizer=True): no model prepared so far holds all of the optimizer's "
            f"{len(ids)} parameters; pass the model to prepare() before the optimizer (prepare(model, optimizer)), "
            "and build the optimizer over that model's parameters"
        )

    def free_memory(self, *objects: Any) -> Any:
        """accelerate's ``free_memory``; the fastcoll.DDP wrappers it prepared are forgotten too."""
        self._fastcoll_models = []
        return super().free_memory(*objects)

    def _sharded_optimizers(self) -> List[ShardedOptimizer]:
        out = []
        for opt in self._optimizers:
            while isinstance(opt, AcceleratedOptimizer):
                opt = opt.optimizer
            if isinstance(opt, ShardedOptimizer):
                out.append(opt)
        return out

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2) -> Any:
        """accelerate's ``clip_grad_norm_``; a sharded optimizer's parameters are clipped by
        :meth:`fastcoll.ShardedOptimizer.clip_grad_norm_` (after accelerate's unscaling), which
        reads the gradients where that optimizer keeps them (its ranges, the main gradients).

        Raises:
            ValueError: ``parameters`` holds some but not all of a sharded optimizer's parameters.
        """
        parameters = list(parameters)
        ids = {id(p) for p in parameters}
        for opt in self._sharded_optimizers():
            own = {id(p) for p in opt.model.module.parameters()}
            if not ids & own:
                continue
            if ids != own:
                raise ValueError(
                    "FastCollAccelerator.clip_grad_norm_: the parameters given are not exactly the sharded optimizer's "
                    f"model's ({len(ids & own)} of its {len(own)}, plus {len(ids - own)} others); the sharded optimizer "
                    "clips all of its parameters by their global norm. Pass model.parameters()"
                )
            self.unscale_gradients()
            return opt.clip_grad_norm_(max_norm, norm_type)
        return super().clip_grad_norm_(parameters, max_norm, norm_type)


# ------------------------------------------------------------------ checkpoints
# With a ShardedOptimizer, parameters can live in one flat buffer per bucket (views of it). accelerate's
# save_state keeps one name per storage (clean_state_dict_for_safetensors: the other parameters of the
# bucket would be left out of the file without an error) and safetensors' load_model refuses views that do
# not cover their storage. The two hooks below give both a state dict in which each such tensor has its own
# storage (tied weights, one tensor under two names, keep sharing theirs).


def _is_view_into_larger(t: Any) -> bool:
    """Whether ``t`` is a tensor that covers only part of its storage (a view into a flat buffer)."""
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return False
    storage = t.untyped_storage()
    return t.data_ptr() != storage.data_ptr() or t.numel() * t.element_size() != storage.nbytes()


def _own_storage(state: Dict[str, Any]) -> Dict[str, Any]:
    """``state`` with each view into a larger storage copied into its own (one copy per tensor, so ties stay)."""
    copies: Dict[tuple, torch.Tensor] = {}
    out = type(state)()
    for name, t in state.items():
        if _is_view_into_larger(t):
            key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
            if key not in copies:
                copies[key] = t.detach().clone()
            t = copies[key]
        out[name] = t
    return out


def _save_own_storage(models: List[nn.Module], weights: List[Dict[str, Any]], output_dir: str) -> None:
    """accelerate's save-state pre-hook: the state dicts about to be written, with views copied out."""
    for i, state in enumerate(weights):
        if any(_is_view_into_larger(t) for t in state.values()):
            weights[i] = _own_storage(state)


class _LoadThrough(nn.Module):
    """Stands in for a model while accelerate's ``load_state`` loads it: ``state_dict()`` shows tensors with
    their own storage (what safetensors' ``load_model`` accepts), ``load_state_dict`` loads into the model."""

    def __init__(self, target: nn.Module):
        super().__init__()
        object.__setattr__(self, "_target", target)  # not a submodule: its state dict is ours to shape

    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:  # type: ignore[override]
        return _own_storage(self._target.state_dict(*args, **kwargs))

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        return self._target.load_state_dict(state_dict, strict=strict, assign=assign)


def _load_through_own_storage(models: List[nn.Module], input_dir: str) -> None:
    """accelerate's load-state pre-hook: models whose parameters are views are loaded through a stand-in."""
    for i, model in enumerate(models):
        if any(_is_view_into_larger(t) for t in model.state_dict().values()):
            models[i] = _LoadThrough(model)


def adopt(
    accelerator: Accelerator, fastcoll: Optional[FastCollKwargs] = None, plugins: Sequence[str] = ()
) -> FastCollAccelerator:
    """Turn an ``Accelerator`` that has prepared nothing yet into a :class:`FastCollAccelerator`, in place.

    For code that builds its ``Accelerator`` itself from many settings (the
    transformers ``Trainer``): its configuration is kept as it is; only the
    class changes (``FastCollAccelerator`` adds methods and the options).

    Args:
        accelerator: A plain ``accelerate.Accelerator`` (or a FastCollAccelerator: options replaced).
        fastcoll: fastcoll's options.
        plugins: Names of the FSDP/DeepSpeed/Megatron-LM settings its builder was given (refused).

    Returns:
        The same object, now a FastCollAccelerator.

    Raises:
        ValueError: it has prepared a model already, or its mode is not DDP's (see FastCollAccelerator).
        TypeError: it is an Accelerator subclass other than FastCollAccelerator.
    """
    if type(accelerator) not in (Accelerator, FastCollAccelerator):
        raise TypeError(
            f"fastcoll adopt: expected an accelerate.Accelerator, got the subclass {type(accelerator).__name__} "
            "(its own overrides would be dropped)"
        )
    if accelerator._models:
        raise ValueError("fastcoll adopt: the Accelerator has prepared models already (they are in torch DDP)")
    FastCollAccelerator._fastcoll_setup(accelerator, fastcoll, plugins)  # raises before the class changes
    accelerator.__class__ = FastCollAccelerator
    return accelerator
