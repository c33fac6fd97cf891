"""Parameters the user changed after the model was wrapped: cast, moved, or replaced.

The buckets are laid out for the parameters' dtype and device at construction,
and the gradient hooks sit on the parameter objects of that moment. torch DDP
documents that parameters must not change after wrapping; when they do, it
stops averaging them without a word (after ``ddp.double()``, or
``module.weight = nn.Parameter(...)`` with ``find_unused_parameters=True``, each
rank keeps its own gradients). fastcoll refuses instead, naming the parameters:

* cast or moved (``ddp.double()``, ``model.half()``, ``ddp.to(device)``): at the
  next forward that can be followed by a synchronized backward; a forward
  without gradients (inference) still runs. A conversion of the wrapper is seen
  whole; one of the inner module (which the wrapper does not see) when it
  reaches the first parameter of a bucket, as a cast of the whole model does;
* replaced by another tensor: a replaced parameter gets no gradient, so it is
  looked for among those that got none: at the end of the forward with
  ``find_unused_parameters=True`` (before the backward), else at the next
  forward, which would otherwise report the reduction unfinished;
* frozen (``requires_grad_(False)``) without ``find_unused_parameters``: named
  at the next forward, where the reduction would be reported unfinished;
* unfrozen: a parameter that did not require gradients at construction has no
  hook and no bucket, so its gradients stay each rank's own (torch DDP's rule,
  applied silently): refused at the next forward that can be followed by a
  synchronized backward (a check of those parameters' ``requires_grad``).

Buffers follow any change (:mod:`fastcoll.ddp.buffers`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

import torch
from torch import nn

from ..ops.dtypes import dtype_name

__all__ = ["ModuleChanges", "tensor_slots"]


class ModuleChanges:
    """Mixin of :class:`fastcoll.DDP` (expects its ``module`` and ``reducer``): the checks above."""

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        out = super()._apply(fn, *args, **kwargs)  # type: ignore[misc]
        self.__dict__["_applied"] = True
        return out

    def _refuse_changed_parameters(self) -> None:
        """Before a forward that can be followed by a synchronized backward: raise for cast, moved or replaced ones.

        Raises:
            RuntimeError: naming the parameters.
        """
        reducer = self.reducer  # type: ignore[attr-defined]
        buckets = reducer.buckets
        # After a conversion through the wrapper, every parameter; else each bucket's first.
        if self.__dict__.get("_applied") or any(b.params[0].dtype != b.dtype for b in buckets if b.params):
            changed = [
                f"'{name}' ({dtype_name(p.dtype)} on {p.device}, was {dtype_name(b.dtype)} on {b.device})"
                for b in buckets
                for name, p in zip(b.names, b.params)
                if p.dtype != b.dtype or p.device != b.device
            ]
            if changed:
                raise RuntimeError(
                    f"fastcoll.DDP: parameters were cast or moved after the model was wrapped: {_few(changed)}. Their "
                    "gradients would be reduced in buckets of the old dtype and device. Cast or move the model before "
                    "wrapping it (torch DDP requires the same); a forward without gradients (inference) still runs"
                )
            self.__dict__["_applied"] = False  # (converted to the same dtype and device)
        outside, _ = self._parameter_slots()
        thawed = [repr(n) for n, p in outside if p.requires_grad]
        if thawed:
            raise RuntimeError(
                f"fastcoll.DDP: parameters require gradients now that did not when the model was wrapped: {_few(thawed)}. "
                "Only parameters that required gradients at construction are averaged (torch DDP's rule too, applied "
                "without a word), so theirs would differ across ranks. Wrap the model again after unfreezing them "
                "(ddp.close(); ddp = fastcoll.DDP(ddp.module, ...)), or wrap it with them trainable and pass "
                "find_unused_parameters=True (a parameter frozen after wrapping then counts as unused)"
            )
        if reducer.reducing:  # a gradient missing: replaced, or frozen, since wrapping?
            missing = reducer.usage.unfinished()
            self._refuse_replaced(missing)
            frozen = [repr(reducer.names[i]) for i in missing if not reducer.params[i].requires_grad]
            if frozen:
                raise RuntimeError(
                    f"fastcoll.DDP: parameters stopped requiring gradients after the model was wrapped: {_few(frozen)}. "
                    "Each synchronized backward waits for a gradient of every parameter the model was wrapped with: "
                    "freeze them before wrapping, or pass find_unused_parameters=True (a frozen parameter then counts "
                    "as unused)"
                )

    def _refuse_replaced(self, indices: Sequence[int]) -> None:
        """Raise when a parameter of ``indices`` (reducer indices) is no longer where the module keeps it.

        Raises:
            RuntimeError: naming the parameters.
        """
        if not indices:
            return
        params, slots = self.reducer.params, self._parameter_slots()[1]  # type: ignore[attr-defined]
        gone = [i for i in indices if not slots.get(i) or any(o._parameters.get(n) is not params[i] for o, n in slots[i])]
        if gone:
            names = _few([repr(self.reducer.names[i]) for i in gone])  # type: ignore[attr-defined]
            raise RuntimeError(
                f"fastcoll.DDP: parameters replaced by other tensors after the model was wrapped: {names}. The gradient "
                "hooks and buckets belong to the old parameters, so the new ones would not be averaged across ranks "
                "(torch DDP would not average them either, without a word). Copy new values into a parameter in place "
                "(with torch.no_grad(): p.copy_(value)), or wrap the module after changing it"
            )

    def _parameter_slots(self) -> Tuple[List[Tuple[str, torch.Tensor]], Dict[int, List[Tuple[nn.Module, str]]]]:
        """Read once per reducer: the module's parameters it does not average (neither ignored nor trainable at
        construction), by name; and per reducer index, the (module, attribute) pairs holding that parameter."""
        kept = self.__dict__.get("_slots")
        reducer = self.reducer  # type: ignore[attr-defined]
        if kept is None or kept[0] is not reducer:
            index = {id(p): i for i, p in enumerate(reducer.params)}
            ignored = self.parameters_to_ignore  # type: ignore[attr-defined]
            table: Dict[int, List[Tuple[nn.Module, str]]] = {}
            outside, seen = [], set()
            for full, owner, name, p in tensor_slots(self.module, "_parameters"):  # type: ignore[attr-defined]
                if id(p) in index:
                    table.setdefault(index[id(p)], []).append((owner, name))
                elif id(p) not in seen and full not in ignored:  # named_parameters()' first name
                    outside.append((full, p))
                seen.add(id(p))
            kept = self.__dict__["_slots"] = (reducer, outside, table)
        return kept[1], kept[2]


def tensor_slots(module: nn.Module, kind: str) -> Iterator[Tuple[str, nn.Module, str, torch.Tensor]]:
    """Every place ``module`` keeps a tensor of ``kind`` (``"_parameters"`` or ``"_buffers"``), None entries left out:
    ``(qualified name, owning module, attribute, tensor)``, in ``named_parameters()`` / ``named_buffers()`` order,
    a tensor held in several places once per place."""
    for prefix, owner in module.named_modules():
        for name, t in getattr(owner, kind).items():
            if t is not None:
                yield (f"{prefix}.{name}" if prefix else name), owner, name, t


def _few(items: List[str]) -> str:
    """The first four of ``items``, and how many more."""
    return ", ".join(items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "")
