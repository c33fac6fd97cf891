"""Replica verification (issue #12): are the model copies bitwise equal on every rank?

:func:`verify_replicas` backs ``fastcoll.DDP.verify_replicas()`` (and its
``verify_replicas_every=N``). Every rank hashes the tensors DDP keeps in step
(the parameters, and the buffers when DDP broadcasts them, less the names in
``module._ddp_params_and_buffers_to_ignore``) with :func:`fastcoll.ops.checksum`,
one fused pass per device, and the ranks exchange the int64 vectors in one
all-gather. Replicas that agree cost nothing more. On any difference, every
rank raises :class:`~fastcoll.errors.ReplicaMismatchError` with the same
message, computed from the gathered vectors only: the first differing
parameters and buffers, and for each which ranks hold the majority version and
which ranks hold others.

The majority of a tensor is the largest group of ranks with equal checksums;
between groups of equal size, the one holding the lowest rank (with two ranks
that disagree, rank 0 is the majority and rank 1 the outlier).

Buffers that the forward pass updates from the local batch (BatchNorm's
running statistics) differ between ranks after a forward until DDP broadcasts
them at the start of the next one; verify such a model right after that
broadcast, or pass ``buffers=False``.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import ops
from ..distributed.backends import comm_device
from ..distributed.process import collectives_needed
from ..errors import ReplicaMismatchError
from ..ops.dtypes import dtype_name, is_dense
from ..stall import run_collective

__all__ = ["MAX_NAMED", "synchronized_tensors", "local_checksums", "verify_replicas"]

#: Differing tensors named in the message (all of them are in ``mismatches``).
MAX_NAMED = 10

_WHO = "fastcoll.DDP.verify_replicas"


def synchronized_tensors(ddp: Any, buffers: Optional[bool] = None) -> List[Tuple[str, str, torch.Tensor]]:
    """``(qualified name, "parameter" or "buffer", tensor)`` of what DDP keeps equal across ranks, in module order.

    Args:
        ddp: A ``fastcoll.DDP`` (anything with ``module``; ``parameters_to_ignore``
            and ``broadcast_buffers`` are read when present).
        buffers: Include the buffers; None: when DDP broadcasts them (``broadcast_buffers``).
    """
    module = ddp.module
    ignore = set(getattr(ddp, "parameters_to_ignore", ()) or ())
    ignore |= set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()) or ())
    named = [(n, "parameter", p) for n, p in module.named_parameters() if n not in ignore]
    if buffers is None:
        buffers = bool(getattr(ddp, "broadcast_buffers", True))
    if buffers:
        named += [(n, "buffer", b) for n, b in module.named_buffers() if n not in ignore]
    return named


def _hashable(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a dense strided tensor (the checksum hashes memory; replicas share their strides)."""
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    return t if is_dense(t) else t.contiguous()


def local_checksums(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`fastcoll.ops.checksum` of ``tensors`` on several devices: one call per device, values on the CPU, in order."""
    by_device: "OrderedDict[torch.device, List[int]]" = OrderedDict()
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out = torch.empty(len(tensors), dtype=torch.int64)
    with torch.no_grad():
        for indices in by_device.values():
            values = ops.checksum([_hashable(tensors[i]) for i in indices])
            out[torch.tensor(indices, dtype=torch.long)] = values.cpu()
    return out


def _layout_digest(named: Sequence[Tuple[str, str, torch.Tensor]]) -> int:
    """64 bits of a hash of the names, kinds, dtypes and shapes (equal on ranks that hold the same model)."""
    text = "\n".join(f"{n}\t{k}\t{dtype_name(t.dtype)}\t{tuple(t.shape)}" for n, k, t in named)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _groups(values: Sequence[int], ranks: Sequence[int]) -> List[List[int]]:
    """Ranks grouped by equal value: the majority first (largest, ties to the lowest rank), then the others likewise."""
    by_value: dict = {}
    for value, rank in zip(values, ranks):
        by_value.setdefault(value, []).append(rank)
    return sorted(by_value.values(), key=lambda g: (-len(g), min(g)))


def _ranks_str(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _versions_str(groups: List[List[int]]) -> str:
    """'majority: ranks 0, 2; outliers: rank 1' (outlier versions separated by ' | ')."""
    others = " | ".join(_ranks_str(g) for g in groups[1:])
    extra = f" ({len(groups) - 1} different versions)" if len(groups) > 2 else ""
    return f"majority: {_ranks_str(groups[0])}; outliers: {others}{extra}"


def _error(message: str, mismatches: List[Tuple[str, str, List[List[int]]]], outliers: List[int]) -> ReplicaMismatchError:
    err = ReplicaMismatchError(message)
    err.mismatches = mismatches
    err.outlier_ranks = outliers
    return err


def _explain(
    rows: List[List[int]], ranks: List[int], named: Sequence[Tuple[str, str, torch.Tensor]]
) -> Optional[ReplicaMismatchError]:
    """The error every rank raises for the gathered ``rows`` (``[digest, checksum, ...]`` by group rank), or None."""
    digests = _groups([row[0] for row in rows], ranks)
    if len(digests) > 1:
        outliers = sorted(r for g in digests[1:] for r in g)
        sides = "; ".join(f"{_ranks_str(g)}: list {i + 1}" for i, g in enumerate(digests))
        return _error(
            f"{_WHO}: the ranks do not hold the same parameters and buffers (their names, kinds, dtypes or shapes "
            f"differ): {sides}; outlier ranks: {', '.join(map(str, outliers))}. Build the same model on every rank.",
            [("<module structure>", "structure", digests)],
            outliers,
        )
    mismatches = []
    for j, (name, kind, _) in enumerate(named):
        column = [row[j + 1] for row in rows]
        if any(v != column[0] for v in column[1:]):
            mismatches.append((name, kind, _groups(column, ranks)))
    if not mismatches:
        return None
    outliers = sorted({r for _, _, groups in mismatches for g in groups[1:] for r in g})
    lines = [f"  {kind} '{name}': {_versions_str(groups)}" for name, kind, groups in mismatches[:MAX_NAMED]]
    if len(mismatches) > MAX_NAMED:
        lines.append(f"  ... and {len(mismatches) - MAX_NAMED} more")
    message = (
        f"{_WHO}: the model replicas differ across the {len(ranks)} ranks: {len(mismatches)} of {len(named)} "
        "synchronized parameters and buffers are not bitwise equal on every rank (the first "
        f"{min(len(mismatches), MAX_NAMED)} in module order):\n" + "\n".join(lines) + "\n"
        f"Outlier ranks: {', '.join(map(str, outliers))}. Something changed their copies outside DDP's "
        "synchronized path: an update that depends on the rank (an optimizer step on some ranks only, "
        "rank-dependent random numbers, a write to the weights or buffers on one rank), or faulty hardware."
    )
    return _error(message, mismatches, outliers)


def verify_replicas(ddp: Any, *, buffers: Optional[bool] = None) -> None:
    """Check that every rank holds bitwise the same parameters and buffers; raise on every rank otherwise.

    One fused checksum pass per device and one all-gather of one int64 per
    tensor (plus one for the list's layout) over ``ddp.process_group``; nothing
    else when the replicas agree, and nothing at all in a world of one rank
    (unless ``FASTCOLL_FORCE_COLLECTIVES=1``). A collective: every rank of the
    group must call it at the same point.

    Args:
        ddp: The ``fastcoll.DDP`` wrapper (``module``, ``process_group``,
            ``parameters_to_ignore``, ``broadcast_buffers`` are read).
        buffers: Verify the buffers too; None (default): when DDP broadcasts
            them (``broadcast_buffers=True``).

    Raises:
        ReplicaMismatchError: on every rank, with the same message, when some
            parameter or buffer differs (naming the first ones, up to
            :data:`MAX_NAMED`, with the majority and outlier ranks of each), or
            when the ranks hold different lists of them.
    """
    group = getattr(ddp, "process_group", None)
    if not collectives_needed(group):
        return
    named = synchronized_tensors(ddp, buffers)
    tensors = [t for _, _, t in named]
    values = local_checksums(tensors)
    device = comm_device(group, tensors)
    mine = torch.cat([torch.tensor([_layout_digest(named)], dtype=torch.int64), values]).to(device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    run_collective(lambda: dist.all_gather(parts, mine, group=group, async_op=True), "all_gather", "verify_replicas", mine, group)
    rows = torch.stack(parts).cpu().tolist()
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    err = _explain(rows, ranks, named)
    if err is not None:
        raise err
