"""Tensor collectives: :func:`reduce_mean`, :func:`all_reduce_dict`, :func:`allreduce_grads`.

All three go through one coalesced path, :func:`_reduce_packed`: the tensors
of each (dtype, device) group are packed into one flat buffer by
:func:`fastcoll.ops.flatten_scale` (which applies the ``1 / world_size`` of a
mean on the way), reduced with one asynchronous SUM all-reduce (the next
buffer is packed meanwhile) and unpacked by :func:`fastcoll.ops.unflatten_scale`.
Tensors the fused ops cannot pack (integers, sparse, non-dense) take small
side paths. Tensors on a device the backend cannot use are staged through the
communication device (see :mod:`fastcoll.distributed.backends`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable

import torch

from .. import ops
from ..bucketing import split_by_bytes
from ..ops.dtypes import SUPPORTED_DTYPES, dtype_name, is_dense, is_fusable
from . import backends
from ._agree import agree
from ._mismatch import explain_dict_mismatch, explain_grads_mismatch, spec
from .process import Group, collectives_needed, get_world_size
from .serialize import type_name
from .sparse import all_reduce_sparse

__all__ = ["all_reduce_dict", "allreduce_grads", "reduce_mean"]

#: One coalesced reduction: the tensors packed (one dtype and device), where
#: the reduced values go (may be the same tensors), and the flat buffer.
Pack = tuple[Sequence[torch.Tensor], Sequence[torch.Tensor], torch.Tensor]


def _reduce_packed(
    packs: Iterable[Pack],
    scale: float,
    group: Group,
    world_size: int,
    device: torch.device,
    meanwhile: Callable[[], None] | None = None,
) -> None:
    """Pack, SUM-all-reduce and unpack every pack; the one coalesced path of this module.

    Each pack's sources are flattened into its buffer, times ``scale``, and its
    all-reduce is started before the next pack is taken from ``packs`` (pass a
    generator to overlap packing with communication). Then ``meanwhile`` runs
    while the reductions are in flight, and finally each buffer is waited for
    and unpacked into its destinations.
    """
    pending = []
    for sources, dests, flat in packs:
        ops.flatten_scale(sources, flat, scale)
        work = None
        if collectives_needed(group) and flat.numel() > 0:
            work = backends.all_reduce_flat(flat, group, async_op=True, device=device)
        pending.append((work, flat, dests))
    if meanwhile is not None:
        meanwhile()
    for work, flat, dests in pending:
        if work is not None:
            backends.finish_collective(work, group, "fastcoll.dist", flat.device)
        ops.unflatten_scale(flat, dests, 1.0)


def _sum_exact(tensors: Sequence[torch.Tensor], group: Group, world_size: int, device: torch.device) -> list[torch.Tensor]:
    """The sums of integer/bool tensors over ranks, exactly, as int64 tensors of the same shapes."""
    flat = torch.cat([t.reshape(-1).to(torch.int64) for t in tensors])
    if collectives_needed(group) and flat.numel() > 0:
        backends.all_reduce_flat(flat, group, device=device)
    return [piece.reshape(t.shape) for t, piece in zip(tensors, torch.split(flat, [t.numel() for t in tensors]))]


def reduce_mean(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Mean of a tensor over all ranks, as a new tensor.

    The input is never modified. Floating-point tensors are copied and scaled
    by ``1 / world_size`` in one fused pass, all-reduced, and returned with the
    input's shape and strides (contiguous strides for a non-dense input);
    integer and bool tensors are summed exactly in int64 and return a float32
    mean. The result does not track gradients.

    Args:
        tensor: The local tensor; same shape and dtype on every rank.
        group: Process group; the default group when None.

    Returns:
        A new tensor holding the element-wise mean (a copy of ``tensor`` in a
        single process).

    Raises:
        TypeError: if ``tensor`` is not a tensor.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"fastcoll.dist.reduce_mean: expected a tensor, got {type_name(tensor)}")
    ws = get_world_size(group)
    with torch.no_grad():
        src = tensor.detach()
        device = backends.comm_device(group, [src])
        if src.layout == torch.strided and src.dtype in SUPPORTED_DTYPES:
            src = src if is_dense(src) else src.contiguous()
            out = torch.empty_like(src)  # keeps a dense tensor's strides
            flat = torch.empty(src.numel(), dtype=src.dtype, device=src.device)
            _reduce_packed([([src], [out], flat)], 1.0 / ws, group, ws, device)
            return out
        if src.is_complex() or src.is_floating_point():  # a dtype the fused ops do not pack
            acc = src.clone(memory_format=torch.contiguous_format)
            if collectives_needed(group) and acc.numel() > 0:
                backends.all_reduce_flat(acc.view(-1), group, device=device)
            return acc / ws if src.is_complex() else acc.to(torch.float32) / ws
        return _sum_exact([src], group, ws, device)[0].to(torch.float32) / ws


def _as_tensor(value: Any) -> torch.Tensor | None:
    """A dict value as a tensor (Python numbers become 0-d tensors); None for anything else."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (bool, int, float)):
        return torch.tensor(value)
    return None


def _dict_value_error(canonical: list[Any], values: Mapping[Any, torch.Tensor | None]) -> TypeError | None:
    """The TypeError for values that are not tensors or numbers, or are complex; None when all are fine."""
    bad = [repr(k) for k in canonical if values[k] is None]
    if bad:
        return TypeError(
            "fastcoll.dist.all_reduce_dict: values must be tensors or numbers; not so for key(s) "
            + ", ".join(bad)
            + "; convert them or leave them out"
        )
    complex_keys = [repr(k) for k in canonical if values[k].is_complex()]  # type: ignore[union-attr]
    if complex_keys:
        return TypeError(
            "fastcoll.dist.all_reduce_dict: complex values are not supported (key(s) "
            + ", ".join(complex_keys)
            + "); reduce torch.view_as_real of them instead"
        )
    return None


def _group_dict(canonical: list[Any], values: dict[Any, torch.Tensor], to_float: bool) -> tuple[dict, dict]:
    """Keys per (dtype, device) for the fused path and per device for the exact (integer) path.

    With ``to_float`` every value joins a float32 group (converted first when
    the fused ops cannot read its dtype). Grouping follows ``canonical`` order
    so every rank builds the same buffers.
    """
    fused: dict[tuple[torch.dtype, torch.device], list[Any]] = OrderedDict()
    exact: dict[torch.device, list[Any]] = OrderedDict()
    for k in canonical:
        t = values[k]
        if to_float:
            if t.dtype not in SUPPORTED_DTYPES:
                values[k] = t = t.float()
            fused.setdefault((torch.float32, t.device), []).append(k)
        elif t.dtype in SUPPORTED_DTYPES:
            fused.setdefault((t.dtype, t.device), []).append(k)
        else:
            exact.setdefault(t.device, []).append(k)
    return fused, exact


def all_reduce_dict(
    py_dict: Mapping[Any, Any],
    op: str = "sum",
    group: Group = None,
    to_float: bool = True,
    *,
    reduce_op: str | None = None,
) -> OrderedDict[Any, torch.Tensor]:
    """Sum or average every value of a dict of tensors over all ranks.

    Ranks may build the dict in different key orders. Before reducing, one
    all-gather of a 16-byte digest of every rank's keys, shapes, dtypes and
    device types (and of ``op``/``to_float``) checks that they agree; if not,
    every rank raises a ValueError naming the keys that differ. The values are
    then packed in sorted-key order, per dtype/device group, with one fused
    :func:`fastcoll.ops.flatten_scale` (which also applies the ``1 / world_size``
    of a mean), reduced with one all-reduce and unpacked with one fused
    :func:`fastcoll.ops.unflatten_scale` into new tensors. The input tensors
    are not modified.

    Args:
        py_dict: Mapping of keys to tensors (Python numbers are accepted and
            become 0-d tensors).
        op: 'sum' or 'mean'.
        group: Process group; the default group when None.
        to_float: Convert every value to float32 first. When False, floating
            dtypes are kept; integer and bool values are summed exactly in
            int64 and cast back (bool sums are a logical or), and their mean
            is float32.
        reduce_op: Alias of ``op`` (the keyword vis4d uses); overrides it when given.

    Returns:
        A new ordered dict with the caller's keys in the caller's order.

    Raises:
        ValueError: on every rank, if the dicts or arguments differ across
            ranks, or if ``op`` is not 'sum' or 'mean' on some rank.
        TypeError: on every rank, for values that are not tensors or numbers,
            or are complex, and if ``py_dict`` is not a mapping on some rank.
    """
    what = "fastcoll.dist.all_reduce_dict"
    op = op if reduce_op is None else reduce_op
    ws = get_world_size(group)
    error: Exception | None = None
    if op not in ("sum", "mean"):
        error = ValueError(f"{what}: op must be 'sum' or 'mean', got {op!r}")
    elif not isinstance(py_dict, Mapping):
        error = TypeError(f"{what}: expected a dict, got {type_name(py_dict)}")
    keys = list(py_dict.keys()) if error is None else []
    values = {k: _as_tensor(py_dict[k]) for k in keys}
    canonical = sorted(keys, key=repr)
    desc = None
    if collectives_needed(group) and error is None:
        specs = [(repr(k), spec(py_dict[k] if values[k] is None else values[k])) for k in canonical]
        desc = ((op, bool(to_float)), specs)
    agree(what, group=group, error=error, desc=desc, explain=explain_dict_mismatch)
    value_error = _dict_value_error(canonical, values)
    if value_error is not None:
        raise value_error  # every rank has the same keys and value types here, so every rank raises

    fused, exact = _group_dict(canonical, values, to_float)  # type: ignore[arg-type]
    out: dict[Any, torch.Tensor] = {}
    device = backends.comm_device(group, values.values())  # type: ignore[arg-type]

    def packs() -> Iterable[Pack]:
        for (dtype, dev), group_keys in fused.items():
            srcs = [values[k] if values[k].is_contiguous() else values[k].contiguous() for k in group_keys]  # type: ignore[union-attr]
            dests = [torch.empty(s.shape, dtype=dtype, device=dev) for s in srcs]
            out.update(zip(group_keys, dests))
            yield srcs, dests, torch.empty(ops.total_numel(srcs), dtype=dtype, device=dev)

    def exact_sums() -> None:
        for group_keys in exact.values():
            srcs = [values[k] for k in group_keys]
            for k, s, total in zip(group_keys, srcs, _sum_exact(srcs, group, ws, device)):  # type: ignore[arg-type]
                out[k] = total.to(torch.float32) / ws if op == "mean" else total.to(s.dtype)  # type: ignore[union-attr]

    with torch.no_grad():
        _reduce_packed(packs(), 1.0 / ws if op == "mean" else 1.0, group, ws, device, meanwhile=exact_sums)
    return OrderedDict((k, out[k]) for k in keys)


def _mean_one(t: torch.Tensor, ws: int, group: Group, device: torch.device) -> Any | None:
    """Start averaging one tensor in place; the work handle when the reduce is still running."""
    if t.layout == torch.sparse_coo:  # summed from all-gathers (see fastcoll.distributed.sparse), then written back
        t.copy_(all_reduce_sparse(t, group, ws, "fastcoll.dist sparse gradient") / ws)
        return None
    if t.is_contiguous():
        t.div_(ws)
        return backends.all_reduce_flat(t.view(-1), group, async_op=True, device=device)
    staged = t.contiguous().div_(ws)
    backends.all_reduce_flat(staged.view(-1), group, device=device)
    t.copy_(staged)
    return None


def _mean_each(tensors: Sequence[torch.Tensor], ws: int, group: Group, device: torch.device) -> None:
    """Average tensors in place one by one (their reduces overlap each other)."""
    works = [(w, t) for t, w in ((t, _mean_one(t, ws, group, device)) for t in tensors) if w is not None]
    for work, t in works:
        backends.finish_collective(work, group, "fastcoll.dist", t.device)


def _unique_grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The ``.grad`` of every parameter that has one, each parameter and gradient once."""
    seen = set()
    grads: list[torch.Tensor] = []
    for p in params:
        g = p.grad
        if g is None or id(p) in seen or id(g) in seen:
            continue
        seen.update((id(p), id(g)))
        grads.append(g)
    return grads


def _layout_error(grads: Sequence[torch.Tensor]) -> TypeError | None:
    """The TypeError for the first gradient that is neither strided nor sparse COO, else None."""
    for i, g in enumerate(grads):
        if g.layout not in (torch.strided, torch.sparse_coo):
            return TypeError(
                f"fastcoll.dist.allreduce_grads: gradient {i} ({dtype_name(g.dtype)}{list(g.shape)}) has layout "
                f"{g.layout}; only dense (strided) and sparse COO gradients can be reduced"
            )
    return None


def _mean_coalesced(grads: Sequence[torch.Tensor], bucket_size_mb: float, ws: int, group: Group, device: torch.device) -> None:
    """Average gradients in place in flat buckets per dtype and device; those the fused ops cannot pack one by one."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = OrderedDict()
    singles: list[torch.Tensor] = []
    for g in grads:
        if not is_fusable(g):
            singles.append(g)
        elif g.numel() > 0:
            groups.setdefault((g.dtype, g.device), []).append(g)
    cap = float(bucket_size_mb) * 1024 * 1024

    def packs() -> Iterable[Pack]:
        for (dtype, dev), members in groups.items():
            storage = backends.flat_buffer(ops.total_numel(members), dtype, dev)
            offset = 0
            for run in split_by_bytes([m.numel() * m.element_size() for m in members], cap):
                bucket = [members[i] for i in run]
                n = ops.total_numel(bucket)
                yield bucket, bucket, storage[offset : offset + n]
                offset += n

    _reduce_packed(packs(), 1.0 / ws, group, ws, device, meanwhile=lambda: _mean_each(singles, ws, group, device))


def allreduce_grads(
    params: Iterable[torch.Tensor],
    coalesce: bool = True,
    bucket_size_mb: float = -1,
    group: Group = None,
    *,
    check: bool = True,
) -> None:
    """Average, in place, the ``.grad`` of every parameter that has one over all ranks.

    With ``coalesce`` the gradients are grouped by dtype and device (in
    parameter order) and split into buckets; each bucket is packed and scaled
    by ``1 / world_size`` with one fused :func:`fastcoll.ops.flatten_scale`,
    all-reduced asynchronously while the next one is packed, and written back
    with one fused :func:`fastcoll.ops.unflatten_scale`. Gradients the fused
    ops cannot pack (sparse, non-dense, other dtypes), and all of them with
    ``coalesce=False``, are reduced one by one. Gradients are packed in memory
    order, so a gradient must have the same memory layout on every rank (as
    with DDP). On CPU the flat buffer is kept between calls (per thread); free
    it with :func:`fastcoll.dist.release_buffers`.

    Args:
        params: Parameters (or any tensors with ``.grad``); those whose
            ``.grad`` is None are skipped.
        coalesce: Reduce in flat buckets instead of tensor by tensor.
        bucket_size_mb: Bucket size in MiB (a larger gradient gets a bucket of
            its own); one bucket per dtype/device group when <= 0.
        group: Process group; the default group when None.
        check: First verify, with one all-gather of a 16-byte digest (and one
            host read of its result, which waits for the device), that every
            rank reduces the same number of gradients with the same shapes and
            dtypes; a mismatch raises ValueError on every rank instead of
            corrupting the gradients or hanging. It cannot be cached safely (a
            rank whose gradients changed would skip a collective the others
            issue); pass ``check=False`` where the gradients are known to agree.

    Raises:
        ValueError: on every rank, if ``check`` finds the gradients differ.
        TypeError: if a gradient is neither strided nor sparse COO (on every
            rank when ``check``).
    """
    grads = _unique_grads(params)
    error = _layout_error(grads)
    ws = get_world_size(group)
    if check and collectives_needed(group):
        desc = None
        if error is None:
            specs = [f"{dtype_name(g.dtype)}{list(g.shape)} {g.layout} on {g.device.type}" for g in grads]
            desc = ((bool(coalesce), float(bucket_size_mb)), specs)
        agree("fastcoll.dist.allreduce_grads", group=group, error=error, desc=desc, explain=explain_grads_mismatch)
    elif error is not None:
        raise error
    if not collectives_needed(group) or not grads:
        return
    device = backends.comm_device(group, grads)
    with torch.no_grad():
        if coalesce:
            _mean_coalesced(grads, bucket_size_mb, ws, group, device)
        else:
            _mean_each(grads, ws, group, device)
