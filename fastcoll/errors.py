"""The exceptions fastcoll raises on purpose, beyond the built-in ones (all are RuntimeErrors)."""

from __future__ import annotations

__all__ = ["NonFiniteGradError"]


class NonFiniteGradError(RuntimeError):
    """Synchronized gradients hold NaN or ±Inf; raised on every rank with the same message.

    The message names the iteration and each rank whose local gradients were
    non-finite, with the first parameters affected and their counts, or says
    that the reduction itself overflowed. The gradients are left as reduced.
    """
