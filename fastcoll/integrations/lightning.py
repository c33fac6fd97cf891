"""fastcoll for PyTorch Lightning and Lightning Fabric.

Importing this module registers the strategy name ``"fastcoll_ddp"`` (and
``"fastcoll_ddp_find_unused_parameters_true"``) with both the Trainer and
Fabric, so switching from torch DDP is one argument::

    import fastcoll.integrations.lightning  # noqa: F401  (registers "fastcoll_ddp")

    trainer = pytorch_lightning.Trainer(accelerator="gpu", devices=8, strategy="fastcoll_ddp")
    fabric = lightning_fabric.Fabric(accelerator="gpu", devices=8, strategy="fastcoll_ddp")

or, with arguments, ``strategy=FastCollDDPStrategy(bucket_cap_mb=50,
static_graph=True)`` / ``strategy=FastCollFabricStrategy(...)``. Every
keyword argument the strategy does not know itself goes to
:class:`fastcoll.DDP` (its constructor takes torch DDP's arguments plus
``first_bucket_mb``).

Launching is Lightning's own: the Trainer or Fabric re-runs the script once per
extra local process (or runs under torchrun / SLURM, which it detects).
"""

from __future__ import annotations

import inspect
import logging
from contextlib import contextmanager, nullcontext
from typing import Any, Dict, Generator, Optional

from torch import Tensor
from torch.nn import Module

try:
    import lightning_fabric  # noqa: F401
    import pytorch_lightning as pl
except ImportError as exc:  # pragma: no cover - exercised only without Lightning
    raise ImportError(
        "fastcoll.integrations.lightning needs PyTorch Lightning: pip install 'fastcoll[lightning]'"
    ) from exc

from lightning_fabric.strategies import STRATEGY_REGISTRY as _FABRIC_REGISTRY
from lightning_fabric.strategies import DDPStrategy as _FabricDDPStrategy
from lightning_fabric.strategies.registry import _StrategyRegistry
from lightning_fabric.strategies.strategy import _BackwardSyncControl
from pytorch_lightning.overrides.distributed import _register_ddp_comm_hook
from pytorch_lightning.strategies import DDPStrategy as _TrainerDDPStrategy
from pytorch_lightning.strategies import StrategyRegistry as _TRAINER_REGISTRY
from pytorch_lightning.strategies.strategy import _ForwardRedirection

from ..ddp import DDP

__all__ = ["FastCollDDPStrategy", "FastCollFabricStrategy", "STRATEGY_NAME"]

log = logging.getLogger(__name__)

#: The name under which both strategies are registered.
STRATEGY_NAME = "fastcoll_ddp"

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


# --------------------------------------------------------------------------- #
# Trainer
# --------------------------------------------------------------------------- #


class _FastCollForwardRedirection(_ForwardRedirection):
    """Manual optimization: the backward runs inside ``training_step`` (that is,
    inside the wrapper's forward), so the wrapper must not arm its reducer
    after that forward; :meth:`FastCollDDPStrategy.pre_backward` arms it for
    each ``manual_backward`` instead (as Lightning does for torch DDP)."""

    def on_after_inner_forward(self, wrapper_module: Module, original_module: "pl.LightningModule") -> None:
        if isinstance(wrapper_module, DDP) and not original_module.automatic_optimization:
            wrapper_module.require_backward_grad_sync = False

    def on_after_outer_forward(self, wrapper_module: Module, original_module: "pl.LightningModule") -> None:
        if isinstance(wrapper_module, DDP) and not original_module.automatic_optimization:
            wrapper_module.require_backward_grad_sync = True


class FastCollDDPStrategy(_TrainerDDPStrategy):
    """Lightning Trainer strategy: Lightning's DDP with the model wrapped in :class:`fastcoll.DDP`.

    Takes the arguments of ``pytorch_lightning.strategies.DDPStrategy``;
    extra keyword arguments (``find_unused_parameters``, ``static_graph``,
    ``bucket_cap_mb``, ``gradient_as_bucket_view``, ``broadcast_buffers``,
    ``first_bucket_mb``, ...) go to :class:`fastcoll.DDP`. ``ddp_comm_hook``
    (with ``ddp_comm_state`` / ``ddp_comm_wrapper``) is registered on any
    device, through ``fastcoll.DDP.register_comm_hook``.

    Registered as ``"fastcoll_ddp"`` and ``"fastcoll_ddp_find_unused_parameters_true"``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._forward_redirection = _FastCollForwardRedirection()

    def _setup_model(self, model: Module) -> DDP:  # type: ignore[override]
        """Wrap the LightningModule with fastcoll.DDP (with the keyword arguments Lightning collected)."""
        device_ids = self.determine_ddp_device_ids()
        log.debug(f"{type(self).__name__}: wrapping with fastcoll.DDP, device ids {device_ids}, kwargs {self._ddp_kwargs}")
        return _wrap(model, device_ids, self._ddp_kwargs)

    def _register_ddp_hooks(self) -> None:
        """Register the communication hook, if one was given, on whatever device the model is."""
        if self._ddp_comm_hook is None:
            return
        if not hasattr(self.model, "register_comm_hook"):
            raise RuntimeError(
                "fastcoll_ddp: a ddp_comm_hook was given but this fastcoll.DDP has no register_comm_hook"
            )
        _register_ddp_comm_hook(
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

    def teardown(self) -> None:
        """Remove fastcoll's autograd hooks and put the bare LightningModule back, so a later fit starts clean."""
        if isinstance(self.model, DDP):
            self.model._remove_hooks()
            self.model = self.lightning_module
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register fastcoll's names only (the inherited method would re-register "ddp" and fail)."""
        _register(strategy_registry, cls)


# --------------------------------------------------------------------------- #
# Fabric
# --------------------------------------------------------------------------- #


class _FastCollBackwardSyncControl(_BackwardSyncControl):
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


class FastCollFabricStrategy(_FabricDDPStrategy):
    """Lightning Fabric strategy: Fabric's DDP with the module wrapped in :class:`fastcoll.DDP`.

    Takes the arguments of ``lightning_fabric.strategies.DDPStrategy``; extra
    keyword arguments go to :class:`fastcoll.DDP`. ``fabric.no_backward_sync``
    works, and saved/loaded module state carries the bare module's keys (no
    "module." prefix), as with Fabric's own DDP strategy.

    Registered as ``"fastcoll_ddp"`` and ``"fastcoll_ddp_find_unused_parameters_true"``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._backward_sync_control = _FastCollBackwardSyncControl()

    def setup_module(self, module: Module) -> DDP:  # type: ignore[override]
        return _wrap(module, self._determine_ddp_device_ids(), self._ddp_kwargs)

    def get_module_state_dict(self, module: Module) -> Dict[str, Any]:
        return super().get_module_state_dict(_unwrap(module))

    def load_module_state_dict(self, module: Module, state_dict: Dict[str, Any], strict: bool = True) -> None:
        super().load_module_state_dict(module=_unwrap(module), state_dict=state_dict, strict=strict)

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register fastcoll's names only (the inherited method would re-register "ddp" and fail)."""
        _register(strategy_registry, cls)


def _register(registry: _StrategyRegistry, cls: type) -> None:
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


FastCollDDPStrategy.register_strategies(_TRAINER_REGISTRY)
FastCollFabricStrategy.register_strategies(_FABRIC_REGISTRY)
