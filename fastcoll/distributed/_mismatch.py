"""Messages for tensor collectives whose inputs differ across ranks.

Each ``explain_*`` function receives every rank's description (in group-rank
order, as :func:`fastcoll.distributed._agree.agree` gathers them on a mismatch) and
names what differs: the arguments, the keys, the first differing gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from ..ops.dtypes import dtype_name
from .serialize import type_name

__all__ = ["explain_dict_mismatch", "explain_grads_mismatch", "spec"]


def spec(t: Any) -> str:
    """How a value is described when comparing ranks: ``float32[2, 3] on cpu``, or ``a str``."""
    if isinstance(t, torch.Tensor):
        return f"{dtype_name(t.dtype)}{list(t.shape)} on {t.device.type}"
    return f"a {type_name(t)}"


def explain_dict_mismatch(descs: list[Any]) -> str:
    """Explain ``all_reduce_dict`` descriptions ``((op, to_float), [(repr(key), spec), ...])`` that differ."""
    problems = []
    settings = [d[0] for d in descs]
    if any(s != settings[0] for s in settings):
        problems.append(
            "the arguments differ: " + ", ".join(f"rank {r} op={s[0]!r} to_float={s[1]}" for r, s in enumerate(settings))
        )
    per_rank = [dict(d[1]) for d in descs]
    for key in sorted(set().union(*per_rank)):
        missing = [r for r, d in enumerate(per_rank) if key not in d]
        present = [(r, d[key]) for r, d in enumerate(per_rank) if key in d]
        if missing:
            problems.append(f"key {key} is missing on rank(s) {missing}")
        elif any(s != present[0][1] for _, s in present):
            problems.append(f"key {key} differs: " + ", ".join(f"rank {r} {s}" for r, s in present))
    return (
        "the dicts differ across ranks; "
        + "; ".join(problems)
        + "; every rank must pass the same keys with the same shapes and dtypes, and the same op and to_float"
    )


def explain_grads_mismatch(descs: list[Any]) -> str:
    """Explain ``allreduce_grads`` descriptions ``((coalesce, bucket_size_mb), [gradient spec, ...])`` that differ."""
    parts = []
    settings = [d[0] for d in descs]
    if any(s != settings[0] for s in settings):
        parts.append(
            "the arguments differ: "
            + ", ".join(f"rank {r} coalesce={s[0]} bucket_size_mb={s[1]}" for r, s in enumerate(settings))
        )
    specs = [d[1] for d in descs]
    counts = [len(s) for s in specs]
    if any(c != counts[0] for c in counts):
        parts.append("the number of gradients differs: " + ", ".join(f"rank {r} has {c}" for r, c in enumerate(counts)))
    for i in range(max(counts)):
        column = [s[i] if i < len(s) else None for s in specs]
        if any(c != column[0] for c in column):
            parts.append(
                f"gradient {i} is the first to differ: "
                + ", ".join(f"rank {r} {c if c is not None else '(none)'}" for r, c in enumerate(column))
            )
            break
    return (
        "the gradients differ across ranks (parameters without .grad differ?); "
        + "; ".join(parts)
        + "; every rank must pass the same parameters with the same gradients (give unused ones zero gradients, not None)"
    )
