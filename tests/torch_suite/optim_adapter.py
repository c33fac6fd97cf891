"""The adapter that runs PyTorch's optimizer tests with every optimizer wrapped in ``fastcoll.ShardedOptimizer``.

PyTorch's tests (``test/test_optim.py`` of pytorch/pytorch, run unmodified)
construct optimizers from ``torch.testing._internal.common_optimizers.optim_db``
(``optim_info.optim_cls(params, **kwargs)``) or by name (``SGD(...)``,
``torch.optim.Adam(...)``). :func:`install` replaces those classes with
subclasses of the real ones whose constructor
returns, instead of the torch optimizer, a ``fastcoll.ShardedOptimizer``
around it, built over a ``fastcoll.DDP`` of a module that holds the very
tensors the test passed (the same objects: the tests keep references to them,
set ``p.grad`` by hand and compare them afterwards).

The tests compute their losses from those tensors directly, not through a
module's forward, while a DDP reduces only the backward that follows one of
its forwards. The adapter runs the DDP's (empty) forward where a training
loop's forward would be: when the optimizer is built and in every
``zero_grad()`` (each test's closure starts with it). It never runs one after
``step()``: a read of the parameters between ``step()`` and the next
``zero_grad()`` sees what ``step()`` left, as in a real loop.

Configuration (:class:`Config`): the world size is the process group's; the
gradient mode ``grads`` is ``"full"`` or ``"sharded"``; a 16-bit parameter
gets float32 masters (``master_dtype=torch.float32``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Type

import torch
from torch import nn

import fastcoll

_SIXTEEN_BIT = (torch.float16, torch.bfloat16)

#: How many ShardedOptimizers this process has built (the worker records it per test: proof of the substitution).
built = 0


@dataclass(frozen=True)
class Config:
    """How the optimizers are wrapped: the ShardedOptimizer's gradient mode and parameter all-gather overlap."""

    grads: str = "full"
    overlap_param_gather: bool = False  # ShardedOptimizer's default


class _Holder(nn.Module):
    """A module whose parameters are the test's own tensors (registered as they are, Parameter or not)."""

    def __init__(self, tensors: List[torch.Tensor]):
        super().__init__()
        for i, t in enumerate(tensors):
            self._parameters[f"p{i}"] = t  # the object itself: identity is what the tests compare

    def forward(self) -> None:
        """Nothing: the tests compute their losses from the tensors directly."""
        return None


class AdaptedShardedOptimizer(fastcoll.ShardedOptimizer):
    """A ShardedOptimizer whose ``zero_grad`` also runs the model's forward (the start of the test's iteration)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``ShardedOptimizer.zero_grad``, then the DDP forward that arms the next backward's reduction."""
        super().zero_grad(set_to_none)
        arm(self.model)


def arm(model: nn.Module) -> None:
    """Run ``model``'s forward with gradients enabled: its reducer reduces the backward that follows."""
    with torch.enable_grad():
        model()


def _params_of(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    seen: Dict[int, torch.Tensor] = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            seen.setdefault(id(p), p)
    return list(seen.values())


def wrap(
    optimizer: torch.optim.Optimizer,
    config: Config,
    process_group: Optional[Any] = None,
    elementwise: bool = False,
) -> torch.optim.Optimizer:
    """A ShardedOptimizer around ``optimizer``, over a fastcoll.DDP of a module holding ``optimizer``'s tensors.

    Args:
        optimizer: The torch optimizer the test built.
        config: How to wrap it.
        process_group: The DDP's process group (None: the default group).
        elementwise: Passed on to the ShardedOptimizer (the caller asserts the class updates elementwise).

    Returns:
        The ShardedOptimizer (an :class:`AdaptedShardedOptimizer`), its model's next backward armed.
    """
    params = _params_of(optimizer)
    model = fastcoll.DDP(_Holder(params), process_group=process_group)
    master = torch.float32 if any(p.dtype in _SIXTEEN_BIT for p in params) else None
    opt = AdaptedShardedOptimizer(
        optimizer,
        model,
        grads=config.grads,
        master_dtype=master,
        overlap_param_gather=config.overlap_param_gather,
        elementwise=elementwise,
    )
    arm(model)
    global built
    built += 1
    return opt


def wrapped_class(cls: Type[torch.optim.Optimizer], config: Config) -> Type[torch.optim.Optimizer]:
    """A subclass of ``cls`` (same name and module) whose construction returns ``wrap(cls(...))``."""

    def __new__(klass: type, params: Any, *args: Any, **kwargs: Any) -> torch.optim.Optimizer:
        return wrap(cls(params, *args, **kwargs), config)

    namespace = {"__new__": __new__, "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
    return type(cls.__name__, (cls,), namespace)


_ORIGINAL: Dict[str, Type[torch.optim.Optimizer]] = {}


def install(config: Optional[Config], module: Any = None) -> int:
    """Replace the torch optimizer classes the tests construct with their wrapped versions (None: leave them).

    The classes of ``optim_db`` (what ``test_optim.py`` constructs), the same
    names in ``torch.optim`` (``torch.optim.SGD(...)``) and the test module's
    own globals bound to one of them (``from torch.optim import SGD``).

    Returns:
        How many classes were replaced.
    """
    from torch.testing._internal.common_optimizers import optim_db

    if config is None:
        return 0
    for info in optim_db:
        _ORIGINAL.setdefault(info.optim_cls.__name__, info.optim_cls)
    wrapped = {name: wrapped_class(cls, config) for name, cls in _ORIGINAL.items()}
    for info in optim_db:
        info.optim_cls = wrapped[info.optim_cls.__name__]
    for name, cls in wrapped.items():
        if getattr(torch.optim, name, None) is _ORIGINAL[name]:
            setattr(torch.optim, name, cls)
    if module is not None:
        for key, value in list(vars(module).items()):
            if isinstance(value, type) and _ORIGINAL.get(value.__name__) is value:
                setattr(module, key, wrapped[value.__name__])
    return len(wrapped)
