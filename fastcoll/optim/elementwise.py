"""Which torch optimizers can step pieces of parameters: those whose update is elementwise.

A sharded optimizer steps 1-D pieces of parameters (a parameter that
straddles two ranks' ranges is stepped half here, half there). That gives
the unsharded result only when every element's update depends on that
element's gradient and state alone (and on per-parameter scalars every
piece shares, such as the step count). A per-tensor norm (LAMB, LARS),
a shape (Adafactor's factored moments, Muon's orthogonalization) or a
closure that re-evaluates the loss (LBFGS) would be computed on pieces.
"""

from __future__ import annotations

from typing import Type

import torch

__all__ = ["ELEMENTWISE", "REFUSED", "check_optimizer_class"]

#: torch optimizers whose update is elementwise (each has foreach/fused variants selected by flags).
ELEMENTWISE = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop", "Adadelta", "Rprop", "ASGD")
    if hasattr(torch.optim, name)
)

#: Never shardable, even with ``elementwise=True``.
REFUSED = {
    "LBFGS": "it re-evaluates the loss in step() and keeps a history of whole flattened gradients",
    "SparseAdam": "it needs sparse gradients, which a sharded optimizer does not produce",
}


def check_optimizer_class(cls: Type[torch.optim.Optimizer], elementwise: bool) -> None:
    """Raise unless ``cls`` can step pieces of parameters.

    Args:
        cls: The optimizer's class.
        elementwise: The caller asserts that ``cls``'s update is elementwise.

    Raises:
        ValueError: naming the class and why.
    """
    name = cls.__name__
    if name in REFUSED and cls.__module__.startswith("torch.optim"):
        raise ValueError(f"fastcoll.ShardedOptimizer: {name} cannot be sharded: {REFUSED[name]}")
    if cls in ELEMENTWISE or elementwise:
        return
    known = ", ".join(c.__name__ for c in ELEMENTWISE)
    raise ValueError(
        f"fastcoll.ShardedOptimizer: {cls.__module__}.{name} is not known to update parameters elementwise. Each "
        "rank steps 1-D pieces of the parameters, so a per-tensor norm or a shape in its update would be computed on "
        f"pieces and give another result. Known elementwise: {known}. If {name}'s update is elementwise, pass "
        "elementwise=True."
    )
