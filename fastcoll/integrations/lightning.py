"""fastcoll for PyTorch Lightning and Lightning Fabric.

Importing this module registers the strategy name ``"fastcoll_ddp"`` (and
``"fastcoll_ddp_find_unused_parameters_true"``) with both the Trainer and
Fabric, so switching from torch DDP is one argument::

    import fastcoll.integrations.lightning  # noqa: F401  (registers "fastcoll_ddp")

    trainer = pytorch_lightning.Trainer(accelerator="gpu", devices=8, strategy="fastcoll_ddp")
    fabric = lightning_fabric.Fabric(accelerator="gpu", devices=8, strategy="fastcoll_ddp")

    # the same with the unified package
    import lightning as L
    trainer = L.Trainer(accelerator="gpu", devices=8, strategy="fastcoll_ddp")
    fabric = L.Fabric(accelerator="gpu", devices=8, strategy="fastcoll_ddp")

Lightning ships in two distributions with separate registries and separate
base classes: the standalone packages ``pytorch_lightning`` +
``lightning_fabric``, and the unified package ``lightning`` (``lightning.pytorch``
+ ``lightning.fabric``). The names are registered with each one that is
installed, and each gets its own strategy classes (all four built by one
factory, so they behave the same):

* standalone: :class:`FastCollDDPStrategy` (Trainer) and :class:`FastCollFabricStrategy` (Fabric);
* unified: :class:`UnifiedFastCollDDPStrategy` (``lightning.Trainer``) and
  :class:`UnifiedFastCollFabricStrategy` (``lightning.Fabric``).

A class is defined only when its distribution is installed;
:data:`STRATEGY_CLASSES` maps each installed distribution (``"pytorch_lightning"``
or ``"lightning"``) to its ``(trainer_strategy, fabric_strategy)`` pair.

With arguments, pass an instance of the class that matches the package the
Trainer or Fabric comes from: ``pytorch_lightning.Trainer(strategy=FastCollDDPStrategy(
bucket_cap_mb=50, static_graph=True))``, ``L.Trainer(strategy=UnifiedFastCollDDPStrategy(...))``,
``L.Fabric(strategy=UnifiedFastCollFabricStrategy(...))``. Every keyword
argument the strategy does not know itself goes to :class:`fastcoll.DDP` (its
constructor takes torch DDP's arguments plus ``first_bucket_mb``).

Launching is Lightning's own: the Trainer or Fabric re-runs the script once per
extra local process (or runs under torchrun / SLURM, which it detects).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import types
from contextlib import contextmanager, nullcontext
from types import ModuleType
from typing import Any, Callable, Dict, Generator, List, Optional, Tuple

from torch import Tensor
from torch.nn import Module

from ..ddp import DDP

log = logging.getLogger(__name__)

#: The name under which every strategy is registered.
STRATEGY_NAME = "fastcoll_ddp"

# distribution -> (Trainer package, Fabric package, prefix of the public class names)
_DISTRIBUTIONS: Dict[str, Tuple[str, str, str]] = {
    "pytorch_lightning": ("pytorch_lightning", "lightning_fabric", ""),
    "lightning": ("lightning.pytorch", "lightning.fabric", "Unified"),
}

_DDP_PARAMS = frozenset(
    name for name in inspect.signature(DDP.__init__).parameters if name not in ("self", "module", "device_ids")
)


def _wrap(module: Module, device_ids: Optional[list], ddp_kwargs: Dict[str, Any]) -> DDP:
    """Wrap ``module`` with fastcoll.DDP; unknown keyword arguments raise a TypeError that names them."""
    unknown = sorted(set(ddp_kwargs) - _DDP_PARAMS)
    if unknown:
        raise TypeError(
            f"fastcoll.DDP does not accept {', '.join(unknown)} (passed to the fastcoll_ddp strategy); "
            f"it accepts {', '.join(sorted(_DDP_PARAMS))}"
        )
    return DDP(module, device_ids=device_ids, **ddp_kwargs)


def _unwrap(module: Module) -> Module:
    return module.module if isinstance(module, DDP) else module


def _register(registry: Any, cls: type) -> None:
    """Register ``cls`` under fastcoll's names in one Lightning strategy registry."""
    entries = (
        (STRATEGY_NAME, "DDP with fastcoll's reducer (fastcoll.DDP)", {}),
        (
            f"{STRATEGY_NAME}_find_unused_parameters_true",
            "DDP with fastcoll's reducer (fastcoll.DDP), find_unused_parameters=True",
            {"find_unused_parameters": True},
        ),
    )
    for name, description, params in entries:
        # override=True: importing this module twice (e.g. after a reload) must not fail.
        registry.register(name, cls, description=description, override=True, start_method="popen", **params)


# --------------------------------------------------------------------------- #
# The strategies' methods, written once. _make_strategies composes each mixin
# with one distribution's Lightning base class; what differs per distribution
# (the helper classes and Lightning functions it uses) lands in class
# attributes named _fastcoll_*.
# --------------------------------------------------------------------------- #


class _ForwardRedirectionMethods:
    """Manual optimization: the backward runs inside ``training_step`` (that is,
    inside the wrapper's forward), so the wrapper must not arm its reducer
    after that forward; ``pre_backward`` arms it for each
    ``manual_backward`` instead (as Lightning does for torch DDP)."""

    def on_after_inner_forward(self, wrapper_module: Module, original_module: Module) -> None:
        if isinstance(wrapper_module, DDP) and not original_module.automatic_optimization:
            wrapper_module.require_backward_grad_sync = False

    def on_after_outer_forward(self, wrapper_module: Module, original_module: Module) -> None:
        if isinstance(wrapper_module, DDP) and not original_module.automatic_optimization:
            wrapper_module.require_backward_grad_sync = True


class _TrainerStrategyMethods:
    """The Trainer strategy's methods, on top of a distribution's ``strategies.DDPStrategy``."""

    # set per distribution by _make_strategies
    _fastcoll_forward_redirection_cls: type
    _fastcoll_register_ddp_comm_hook: Callable[..., None]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._forward_redirection = self._fastcoll_forward_redirection_cls()

    def _setup_model(self, model: Module) -> DDP:
        """Wrap the LightningModule with fastcoll.DDP (with the keyword arguments Lightning collected)."""
        device_ids = self.determine_ddp_device_ids()
        log.debug(f"{type(self).__name__}: wrapping with fastcoll.DDP, device ids {device_ids}, kwargs {self._ddp_kwargs}")
        return _wrap(model, device_ids, self._ddp_kwargs)

    def _register_ddp_hooks(self) -> None:
        """Register the communication hook, if one was given, on whatever device the model is."""
        if self._ddp_comm_hook is None:
            return
        if not hasattr(self.model, "register_comm_hook"):
            raise RuntimeError("fastcoll_ddp: a ddp_comm_hook was given but this fastcoll.DDP has no register_comm_hook")
        self._fastcoll_register_ddp_comm_hook(
            model=self.model,
            ddp_comm_state=self._ddp_comm_state,
            ddp_comm_hook=self._ddp_comm_hook,
            ddp_comm_wrapper=self._ddp_comm_wrapper,
        )

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: backwards inside only accumulate locally (fastcoll.DDP.no_sync)."""
        if isinstance(self.model, DDP):
            with self.model.no_sync():
                yield None
        else:
            with super().block_backward_sync():
                yield None

    def pre_backward(self, closure_loss: Tensor) -> None:
        """Manual optimization: arm the reducer for the backward of ``manual_backward``."""
        if not isinstance(self.model, DDP):
            return super().pre_backward(closure_loss)
        assert self.lightning_module is not None
        if not self.lightning_module.automatic_optimization:
            self.model._post_forward(closure_loss)
        return None

    def post_backward(self, closure_loss: Tensor) -> None:
        if not isinstance(self.model, DDP):
            return super().post_backward(closure_loss)
        return None

    def setup(self, trainer: Any) -> None:
        """Lightning's setup, then gradient clipping by norm routed to a ShardedOptimizer's own (see :func:`_route_clipping`)."""
        super().setup(trainer)  # type: ignore[misc]
        _route_clipping(self.precision_plugin)  # type: ignore[attr-defined]

    def teardown(self) -> None:
        """Remove fastcoll's autograd hooks and put the bare LightningModule back, so a later fit starts clean."""
        if isinstance(self.model, DDP):
            self.model._remove_hooks()
            self.model = self.lightning_module
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register fastcoll's names only (the inherited method would re-register "ddp" and fail)."""
        _register(strategy_registry, cls)


_TRAINER_STRATEGY_DOC = """Lightning Trainer strategy ({tp}): Lightning's DDP with the model wrapped
    in :class:`fastcoll.DDP`.

    Takes the arguments of ``{tp}.strategies.DDPStrategy``; extra keyword
    arguments (``find_unused_parameters``, ``static_graph``, ``bucket_cap_mb``,
    ``gradient_as_bucket_view``, ``broadcast_buffers``, ``first_bucket_mb``,
    ...) go to :class:`fastcoll.DDP`. ``ddp_comm_hook`` (with
    ``ddp_comm_state`` / ``ddp_comm_wrapper``) is registered on any device,
    through ``fastcoll.DDP.register_comm_hook``.

    Registered with ``{tp}``'s Trainer as ``"fastcoll_ddp"`` and
    ``"fastcoll_ddp_find_unused_parameters_true"``.
    """


def _sharded(optimizer: Any) -> Any:
    """``optimizer`` (or the optimizer a Lightning wrapper holds) if it is a fastcoll.ShardedOptimizer, else None."""
    from ..optim import ShardedOptimizer

    inner = getattr(optimizer, "_optimizer", optimizer)
    return inner if isinstance(inner, ShardedOptimizer) else None


def _route_clipping(plugin: Any) -> None:
    """Make ``plugin.clip_grad_by_norm`` clip a ShardedOptimizer's gradients with its global norm.

    Lightning clips with ``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters; with
    ``grads="sharded"`` no rank holds those gradients whole, so the norm must come from every rank's range
    (:meth:`fastcoll.ShardedOptimizer.clip_grad_norm_`). Other optimizers keep Lightning's own clipping.
    """
    cls = type(plugin)
    if getattr(cls, "_fastcoll_routed", False):
        return

    def clip_grad_by_norm(self: Any, optimizer: Any, clip_val: Any) -> None:
        sharded = _sharded(optimizer)
        if sharded is None:
            return cls.clip_grad_by_norm(self, optimizer, clip_val)
        sharded.clip_grad_norm_(clip_val)
        return None

    plugin.__class__ = type(cls.__name__, (cls,), {"clip_grad_by_norm": clip_grad_by_norm, "_fastcoll_routed": True})


class _BackwardSyncControlMethods:
    def no_backward_sync(self, module: Module, enabled: bool) -> Any:
        """``fabric.no_backward_sync(model)``: enter fastcoll.DDP's no_sync."""
        if not enabled:
            return nullcontext()
        if not isinstance(module, DDP):
            raise TypeError(
                "Blocking backward sync needs the module to be wrapped in fastcoll.DDP by the fastcoll_ddp "
                f"strategy (set it up with fabric.setup); got {type(module).__name__}"
            )
        return module.no_sync()


class _FabricStrategyMethods:
    """The Fabric strategy's methods, on top of a distribution's ``fabric.strategies.DDPStrategy``."""

    # set per distribution by _make_strategies
    _fastcoll_backward_sync_control_cls: type

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._backward_sync_control = self._fastcoll_backward_sync_control_cls()

    def setup_module(self, module: Module) -> DDP:
        return _wrap(module, self._determine_ddp_device_ids(), self._ddp_kwargs)

    def clip_gradients_norm(self, module: Module, optimizer: Any, max_norm: Any, norm_type: Any = 2.0,
                            error_if_nonfinite: bool = True) -> Tensor:  # fmt: skip
        """Fabric's clipping; a ShardedOptimizer's gradients by its own global norm (every rank's range)."""
        sharded = _sharded(optimizer)
        if sharded is None:
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)  # type: ignore[misc]
        self.precision.unscale_gradients(optimizer)  # type: ignore[attr-defined]
        return sharded.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)

    def get_module_state_dict(self, module: Module) -> Dict[str, Any]:
        return super().get_module_state_dict(_unwrap(module))

    def load_module_state_dict(self, module: Module, state_dict: Dict[str, Any], strict: bool = True) -> None:
        super().load_module_state_dict(module=_unwrap(module), state_dict=state_dict, strict=strict)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register fastcoll's names only (the inherited method would re-register "ddp" and fail)."""
        _register(strategy_registry, cls)


_FABRIC_STRATEGY_DOC = """Lightning Fabric strategy ({fp}): Fabric's DDP with the module wrapped
    in :class:`fastcoll.DDP`.

    Takes the arguments of ``{fp}.strategies.DDPStrategy``; extra keyword
    arguments go to :class:`fastcoll.DDP`. ``fabric.no_backward_sync`` works,
    and saved/loaded module state carries the bare module's keys (no
    "module." prefix), as with Fabric's own DDP strategy.

    Registered with ``{fp}``'s Fabric as ``"fastcoll_ddp"`` and
    ``"fastcoll_ddp_find_unused_parameters_true"``.
    """


def _compose(name: str, methods: type, base: type, doc: Optional[str], **attrs: Any) -> type:
    """Class ``name`` of this module: ``methods`` (a mixin above) on ``base`` (a Lightning class), plus ``attrs``."""
    namespace = {"__module__": __name__, "__qualname__": name, "__doc__": doc, **attrs}
    return types.new_class(name, (methods, base), exec_body=lambda ns: ns.update(namespace))


def _make_strategies(trainer_pkg: ModuleType, fabric_pkg: ModuleType, prefix: str = "") -> Dict[str, type]:
    """Build the fastcoll strategy classes on one Lightning distribution's base classes.

    Args:
        trainer_pkg: The Trainer package, ``pytorch_lightning`` or ``lightning.pytorch``.
        fabric_pkg: The Fabric package that goes with it, ``lightning_fabric`` or
            ``lightning.fabric``.
        prefix: Put in front of the class names (``"Unified"`` gives
            ``UnifiedFastCollDDPStrategy``).

    Returns:
        The classes by name: ``f"{prefix}FastCollDDPStrategy"``,
        ``f"{prefix}FastCollFabricStrategy"`` and their helpers
        ``f"_{prefix}FastCollForwardRedirection"``, ``f"_{prefix}FastCollBackwardSyncControl"``,
        each named as a global of this module (so that instances pickle once
        the caller puts them there). They are not registered yet.
    """
    tp, fp = trainer_pkg.__name__, fabric_pkg.__name__
    register_ddp_comm_hook = importlib.import_module(f"{tp}.overrides.distributed")._register_ddp_comm_hook
    trainer_base = importlib.import_module(f"{tp}.strategies").DDPStrategy
    forward_redirection_base = importlib.import_module(f"{tp}.strategies.strategy")._ForwardRedirection
    fabric_base = importlib.import_module(f"{fp}.strategies").DDPStrategy
    backward_sync_control_base = importlib.import_module(f"{fp}.strategies.strategy")._BackwardSyncControl

    forward_redirection = _compose(
        f"_{prefix}FastCollForwardRedirection",
        _ForwardRedirectionMethods,
        forward_redirection_base,
        _ForwardRedirectionMethods.__doc__,
    )
    trainer_strategy = _compose(
        f"{prefix}FastCollDDPStrategy",
        _TrainerStrategyMethods,
        trainer_base,
        _TRAINER_STRATEGY_DOC.format(tp=tp),
        _fastcoll_forward_redirection_cls=forward_redirection,
        _fastcoll_register_ddp_comm_hook=staticmethod(register_ddp_comm_hook),
    )
    backward_sync_control = _compose(
        f"_{prefix}FastCollBackwardSyncControl", _BackwardSyncControlMethods, backward_sync_control_base, None
    )
    fabric_strategy = _compose(
        f"{prefix}FastCollFabricStrategy",
        _FabricStrategyMethods,
        fabric_base,
        _FABRIC_STRATEGY_DOC.format(fp=fp),
        _fastcoll_backward_sync_control_cls=backward_sync_control,
    )
    return {cls.__name__: cls for cls in (forward_redirection, trainer_strategy, backward_sync_control, fabric_strategy)}


#: Installed distribution (``"pytorch_lightning"`` or ``"lightning"``) -> its
#: ``(Trainer strategy class, Fabric strategy class)``, both registered as "fastcoll_ddp".
STRATEGY_CLASSES: Dict[str, Tuple[type, type]] = {}
__all__: List[str] = ["STRATEGY_NAME", "STRATEGY_CLASSES"]


def _install() -> None:
    """Build, publish and register the strategies of every installed distribution."""
    not_found: Optional[ModuleNotFoundError] = None
    for dist, (trainer_name, fabric_name, prefix) in _DISTRIBUTIONS.items():
        try:
            trainer_pkg, fabric_pkg = importlib.import_module(trainer_name), importlib.import_module(fabric_name)
        except ModuleNotFoundError as exc:
            # Not installed; anything else (a broken installation, a missing dependency) propagates.
            if exc.name not in {trainer_name, fabric_name, trainer_name.split(".")[0], fabric_name.split(".")[0]}:
                raise
            not_found = exc
            continue
        classes = _make_strategies(trainer_pkg, fabric_pkg, prefix)
        for name, cls in classes.items():
            globals()[name] = cls
            if not name.startswith("_"):
                __all__.append(name)
        trainer_cls, fabric_cls = classes[f"{prefix}FastCollDDPStrategy"], classes[f"{prefix}FastCollFabricStrategy"]
        trainer_cls.register_strategies(importlib.import_module(f"{trainer_name}.strategies").StrategyRegistry)
        fabric_cls.register_strategies(importlib.import_module(f"{fabric_name}.strategies").STRATEGY_REGISTRY)
        STRATEGY_CLASSES[dist] = (trainer_cls, fabric_cls)
    if not STRATEGY_CLASSES:
        raise ImportError(
            "fastcoll.integrations.lightning needs PyTorch Lightning (the `lightning` or the `pytorch_lightning` "
            "package): pip install 'fastcoll[lightning]'"
        ) from not_found


_install()


def __getattr__(name: str) -> Any:
    """Say which package a strategy class needs when its distribution is not installed."""
    for dist, (trainer_name, fabric_name, prefix) in _DISTRIBUTIONS.items():
        if name in (f"{prefix}FastCollDDPStrategy", f"{prefix}FastCollFabricStrategy"):
            raise AttributeError(
                f"{__name__}.{name} is for the `{dist}` package ({trainer_name} / {fabric_name}), which is not "
                f"installed; installed: {', '.join(STRATEGY_CLASSES)} (see {__name__}.STRATEGY_CLASSES)"
            )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
