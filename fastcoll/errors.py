"""The exceptions fastcoll raises on purpose, beyond the built-in ones (all are RuntimeErrors)."""

from __future__ import annotations

__all__ = ["NonFiniteGradError", "ReplicaMismatchError"]


class NonFiniteGradError(RuntimeError):
    """Synchronized gradients hold NaN or ±Inf; raised on every rank with the same message.

    The message names the iteration and each rank whose local gradients were
    non-finite, with the first parameters affected and their counts, or says
    that the reduction itself overflowed. The gradients are left as reduced.
    """


class ReplicaMismatchError(RuntimeError):
    """The model replicas are not bitwise equal across ranks; raised on every rank with the same message.

    Raised by ``fastcoll.DDP.verify_replicas()`` (``fastcoll.ddp.replicas``). The
    message names the first differing parameters and buffers (qualified names,
    up to 10) and, for each, the ranks holding the majority version and the
    outlier ranks grouped by the version they hold. Attributes (the same on
    every rank): ``mismatches``, a list of ``(name, kind, groups)`` for every
    differing tensor, ``kind`` being "parameter" or "buffer" and ``groups`` the
    lists of ranks holding each version, the majority first; ``outlier_ranks``,
    the sorted ranks outside the majority of some differing tensor.
    """
