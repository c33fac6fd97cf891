"""A model cast or moved after it was wrapped: ``ddp.double()``, ``ddp.half()``, ``ddp.to(device)``.

The buckets are laid out for the parameters' dtype and device at construction.
torch DDP documents that parameters must not change after wrapping, and when
they do it reduces nothing for them, silently (after ``ddp.double()`` each rank
keeps its own gradients). fastcoll lets the conversion happen, so a model can
still be cast for inference, and refuses the next forward that could be
followed by a synchronized backward, naming the parameters. A conversion of the
wrapper is seen whole; one of the inner module (which the wrapper does not
see) is caught when it reaches the first parameter of a bucket: a cast of the
whole model always does. Buffers follow any conversion
(:mod:`fastcoll.ddp.buffers`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..ops.dtypes import dtype_name

__all__ = ["ConversionGuard"]


class ConversionGuard:
    """Mixin of :class:`fastcoll.DDP`: after ``nn.Module._apply``, :meth:`_refuse_converted` compares the parameters
    with their buckets at the next forward that can be followed by a synchronized backward."""

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        out = super()._apply(fn, *args, **kwargs)  # type: ignore[misc]
        self.__dict__["_applied"] = True
        return out

    def _refuse_converted(self) -> None:
        """Raise when a conversion since construction changed a synchronized parameter's dtype or device.

        Raises:
            RuntimeError: naming the parameters (the first few).
        """
        buckets = self.reducer.buckets  # type: ignore[attr-defined]
        # After a conversion through the wrapper, every parameter; else each bucket's first (a cast of the inner
        # module, which the wrapper does not see, reaches them; its head's parameters come first in bucket 0).
        if not self.__dict__.get("_applied") and all(b.params[0].dtype == b.dtype for b in buckets if b.params):
            return
        changed = [
            f"'{name}' ({dtype_name(p.dtype)} on {p.device}, was {dtype_name(b.dtype)} on {b.device})"
            for b in buckets
            for name, p in zip(b.names, b.params)
            if p.dtype != b.dtype or p.device != b.device
        ]
        if changed:
            more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
            raise RuntimeError(
                f"fastcoll.DDP: parameters were cast or moved after the model was wrapped: {', '.join(changed[:4])}{more}. "
                "Their gradients would be reduced in buckets of the old dtype and device. Cast or move the model before "
                "wrapping it (torch DDP requires the same); a forward without gradients (inference) still runs"
            )
        self.__dict__["_applied"] = False  # (a conversion to the same dtype and device: nothing to refuse)
