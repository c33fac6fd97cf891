"""Turning a bucket assignment into buckets, and learning the assignment from the ready order.

:func:`build_buckets` allocates the :class:`GradBucket` objects of a layout
(lists of parameter indices in reduction order, from
:func:`fastcoll.bucketing.assign_buckets`). :class:`ReadyOrder` records the
order in which gradients became ready during the first synchronized backward;
at the next forward the layout is rebuilt once from rank 0's recording, so
that buckets complete in index order.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .._knobs import early_pack_min_numel
from ..bucketing import Caps, ParamSpec, assign_buckets, order_from_ready, reverse_registration_order
from .bucket import GradBucket, MainGradBucket
from .comm import Communicator
from .shards import padded_numel

__all__ = ["BucketSet", "ReadyOrder", "build_buckets", "early_pack_slots", "packs_early", "wire_dtype"]


def wire_dtype(comm_dtype: Optional[torch.dtype], dtype: torch.dtype) -> Optional[torch.dtype]:
    """The collective's dtype for a bucket of ``dtype`` gradients (None: their own).

    ``comm_dtype`` only ever narrows: buckets already 16-bit travel as they are.
    """
    if comm_dtype is None or dtype.itemsize <= comm_dtype.itemsize:
        return None
    return comm_dtype


def build_buckets(
    layout: Sequence[Sequence[int]],
    params: Sequence[torch.Tensor],
    names: Sequence[str],
    sparse: Sequence[bool],
    comm_dtype: Optional[torch.dtype],
    as_view: bool,
    shard_world: int = 0,
    main_dtype: Optional[torch.dtype] = None,
    pooled: bool = False,
    lazy: bool = False,
) -> List[GradBucket]:
    """Allocate the buckets of ``layout``; with ``as_view``, existing gradients move into their views.

    ``shard_world`` > 0: the dense buckets are padded to be divided among that many ranks (:mod:`.shards`).
    ``main_dtype``: buckets of 16-bit parameters accumulate their gradients in it (:class:`MainGradBucket`).
    ``pooled``: the dense buckets get no buffers of their own (a pool lends them, :mod:`.pool`).
    ``lazy``: the dense buckets allocate theirs on first need (:meth:`GradBucket.materialize`), except those with
    ``as_view`` whose parameters hold gradients already (moved into their views now).
    """
    buckets = []
    for pos, idxs in enumerate(layout):
        ps = [params[i] for i in idxs]
        is_sparse = bool(sparse[idxs[0]])
        defer = lazy and not (as_view and any(p.grad is not None for p in ps))
        main = main_dtype is not None and not is_sparse and ps[0].dtype in (torch.float16, torch.bfloat16)
        grad_dtype = main_dtype if main else ps[0].dtype
        padded = padded_numel(sum(p.numel() for p in ps), shard_world, grad_dtype.itemsize) if shard_world else None
        args = (pos, len(layout), list(idxs), ps, [names[i] for i in idxs])
        wire = wire_dtype(comm_dtype, grad_dtype)
        kwargs = dict(wire_dtype=wire, as_view=as_view, sparse=is_sparse, padded=padded, pooled=pooled, lazy=defer)
        buckets.append(MainGradBucket(*args, main_dtype=main_dtype, **kwargs) if main else GradBucket(*args, **kwargs))
    if as_view:
        move_grads_into_views(buckets)
    return buckets


def move_grads_into_views(buckets: Sequence[GradBucket]) -> None:
    """Gradients as bucket views: the parameters' existing gradients are copied into their views and become them."""
    with torch.no_grad():
        for b in buckets:
            for p, v in zip(b.params, b.views):  # none for a sparse bucket (or one without buffers)
                g = p.grad
                if g is not None and g.data_ptr() != v.data_ptr():
                    v.copy_(g)
                    p.grad = v


def early_pack_slots(
    buckets: Sequence[GradBucket], n: int, enabled: bool = True, main: bool = True
) -> Tuple[List[Optional[torch.Tensor]], List[int]]:
    """Where each large gradient is packed as soon as it is final, and each parameter's slot in its bucket.

    On CPU a gradient just written by backward is still in cache; packing it
    right away (one fused call for that tensor) costs less than re-reading it
    from memory when its bucket completes. Small gradients wait for the
    bucket's single fused pack; other devices' buckets pack in one launch,
    except in two cases where waiting would keep each fresh gradient of a
    bucket alive until the last one arrives (up to a bucket cap of memory), so
    a large one is packed as soon as it is final and released, on any device:
    a 16-bit gradient of a main-gradient bucket, added into its float32 slot
    (:meth:`MainGradBucket.pack_one`), and, with gradients as bucket views, one
    that backward wrote into a tensor of its own (``zero_grad(set_to_none=True)``),
    copied into its view as torch DDP copies it.

    ``enabled`` False (one-rounding reductions, whose pack does not scale):
    every gradient of a bucket without main gradients waits for its bucket's
    pack; ``main`` False (pooled buckets, whose buffer exists only from their
    pack on): every main gradient does.

    Returns:
        Per parameter index: its slice of the bucket's wire buffer (of its
        float32 buffer for a main-gradient bucket), or None when it waits for
        the bucket pack; and its position in its bucket.
    """
    slots: List[Optional[torch.Tensor]] = [None] * n
    slot_pos = [0] * n
    early = packs_early(buckets, n, enabled, main)
    for b in buckets:
        into = b.flat if isinstance(b, MainGradBucket) else b.comm
        for k, i in enumerate(b.param_indices):
            slot_pos[i] = k
            if early[i] and not b.lazy:  # (a lazy bucket gets its slots once it has buffers)
                slots[i] = into[b.offsets[k] : b.offsets[k] + b.params[k].numel()]
    return slots, slot_pos


def packs_early(buckets: Sequence[GradBucket], n: int, enabled: bool = True, main: bool = True) -> List[bool]:
    """Per parameter index: its gradient is packed as soon as it is final (see :func:`early_pack_slots`)."""
    min_numel = early_pack_min_numel()
    out = [False] * n
    for b in buckets:
        if isinstance(b, MainGradBucket):
            eligible = main
        else:
            eligible = enabled and (b.device.type == "cpu" or b.as_view) and not b.sparse
        for k, i in enumerate(b.param_indices):
            out[i] = eligible and b.params[k].numel() >= min_numel
    return out


class ReadyOrder:
    """The gradient-ready order of the first synchronized backward, kept for one layout rebuild.

    Attributes:
        observed: The list the hooks append to during a recorded backward;
            None when nothing is being recorded.
        recorded: A finished recording waiting for the rebuild (None: none).
        rebuilt: The one rebuild has happened (or will never happen).
    """

    def __init__(self, enabled: bool):
        self.observed: Optional[List[int]] = [] if enabled else None
        self.recorded: Optional[List[int]] = None
        self.rebuilt = not enabled

    def enable(self) -> None:
        """Record the next synchronized backward (static_graph switched on before the first one)."""
        self.observed = []
        self.rebuilt = False

    def restart(self) -> None:
        """A new backward begins: drop what an unfinished one observed."""
        if self.observed is not None:
            self.observed = []

    def end_iteration(self, joined: bool) -> None:
        """A synchronized backward completed; a joined rank observed nothing (rank 0's order wins anyway)."""
        if self.observed is not None:
            self.recorded = [] if joined else self.observed
            self.observed = None

    def take(self) -> Optional[List[int]]:
        """The recording to rebuild from, once; None when there is none (yet, or any more)."""
        if self.rebuilt or self.recorded is None:
            return None
        order, self.recorded = self.recorded, None
        self.rebuilt = True
        return order

    def stop(self) -> None:
        """Never rebuild (the reducer is closed)."""
        self.observed = self.recorded = None
        self.rebuilt = True


class BucketSet:
    """The buckets of a reducer and how parameters map onto them; rebuilt once from the ready order.

    Args:
        params, names: The reducer's parameters and their qualified names.
        sparse: Per parameter, whether its gradients are sparse (a bucket of its own).
        first_bucket_bytes, bucket_cap_bytes: The caps given to :func:`fastcoll.bucketing.assign_buckets`.
        as_view: Gradients live in the bucket buffers (gradient_as_bucket_view).
        record_order: Record the first synchronized backward's ready order for the rebuild.

    Attributes:
        buckets: The :class:`GradBucket` objects, in reduction order.
        bucket_of: Per parameter index, the position of its bucket.
        eager_slots, slot_pos: See :func:`early_pack_slots`.
        order: The :class:`ReadyOrder` the layout is rebuilt from.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        sparse: Sequence[bool],
        first_bucket_bytes: int,
        bucket_cap_bytes: Caps,
        as_view: bool,
        record_order: bool,
    ):
        self.params = params
        self.names = names
        self.sparse = sparse
        self.first_bucket_bytes = first_bucket_bytes
        self.bucket_cap_bytes = bucket_cap_bytes
        self.as_view = as_view
        self.specs = [ParamSpec.of(p, bool(sparse[i])) for i, p in enumerate(params)]
        self.order = ReadyOrder(enabled=record_order)
        #: The reduction order of the rebuild (rank 0's), once it happened.
        self.rebuild_order: Optional[List[int]] = None
        self.buckets: List[GradBucket] = []
        self.bucket_of: List[int] = []
        self.eager_slots: List[Optional[torch.Tensor]] = []
        self.slot_pos: List[int] = []
        #: Some buckets were installed ``lazy`` and have no buffers yet (:meth:`materialize`).
        self.deferred = False
        self._early_packs = True
        self._main_early = True

    def initial_layout(self) -> List[List[int]]:
        """Buckets in reverse registration order (before any gradient-ready order was seen)."""
        return assign_buckets(
            self.specs, reverse_registration_order(len(self.params)), self.first_bucket_bytes, self.bucket_cap_bytes
        )

    def install(
        self,
        layout: List[List[int]],
        comm_dtype: Optional[torch.dtype],
        shard_world: int = 0,
        main_dtype: Optional[torch.dtype] = None,
        early_packs: bool = True,
        pooled: bool = False,
        lazy: bool = False,
    ) -> None:
        """Allocate the buckets of ``layout`` (lists of parameter indices, in reduction order) and index them.

        ``shard_world`` > 0 pads the dense buckets to be divided among that many ranks; ``main_dtype``: see
        :func:`build_buckets`; ``early_packs``: see :func:`early_pack_slots`
        (never into pooled buckets, whose buffer exists only from their pack on); ``pooled``, ``lazy``: see
        :func:`build_buckets` (lazy buckets get their early-pack slots when :meth:`materialize` allocates them).
        """
        self.buckets, self.eager_slots = [], []  # release the old buffers (the slots view them) before allocating the new
        self.buckets = build_buckets(
            layout, self.params, self.names, self.sparse, comm_dtype, self.as_view, shard_world, main_dtype, pooled,
            lazy,
        )  # fmt: skip
        self.bucket_of = [0] * len(self.params)
        for b in self.buckets:
            for i in b.param_indices:
                self.bucket_of[i] = b.pos
        self._early_packs = early_packs and not pooled
        self._main_early = not pooled
        self.deferred = any(b.lazy for b in self.buckets)
        self._index_slots()

    def _index_slots(self) -> None:
        self.eager_slots, self.slot_pos = early_pack_slots(self.buckets, len(self.params), self._early_packs, self._main_early)

    def materialize(self) -> bool:
        """Allocate the buffers of the buckets installed ``lazy`` and index their early-pack slots; True if any."""
        if not self.deferred:
            return False
        self.deferred = False
        made = [b for b in self.buckets if b.materialize()]
        if self.as_view:
            move_grads_into_views(made)
        self._index_slots()
        return True

    def clear(self) -> None:
        """Drop the buckets (and the slot views that keep their storage alive)."""
        self.buckets = []
        self.eager_slots = [None] * len(self.params)
        self.order.stop()

    def layout(self) -> List[List[int]]:
        """The current buckets as lists of parameter indices, in reduction order."""
        return [list(b.param_indices) for b in self.buckets]

    def next_layout(self, comm: Communicator, device: torch.device) -> Optional[List[List[int]]]:
        """The layout from the recorded ready order, rank 0's (a broadcast), once; None when no rebuild is due."""
        observed = self.order.take()
        if observed is None:
            return None
        order = order_from_ready(observed, len(self.params))
        if comm.active:
            t = torch.tensor(order, dtype=torch.int64, device=device)
            comm.broadcast(t, "layout", group_src=0)
            order = t.tolist()
        self.rebuild_order = order
        return assign_buckets(self.specs, order, self.first_bucket_bytes, self.bucket_cap_bytes)

    def info(self) -> List[Dict[str, Any]]:
        """Each bucket's index, parameter names, dtype, device, numel, bytes, wire dtype and early-packed names."""
        early = packs_early(self.buckets, len(self.params), self._early_packs, self._main_early)
        return [
            {
                "index": b.pos,
                "names": list(b.names),
                "dtype": b.dtype,
                "device": b.device,
                "numel": b.numel,
                "bytes": b.nbytes,
                "comm_dtype": b.comm.dtype,
                "comm_bytes": b.nbytes
                if b.sparse
                else b.comm_nbytes,  # sparse: the values when every row is sent (each rank also sends 8 bytes of index per row)
                "sparse": b.sparse,
                "packed_early": [self.names[i] for i in b.param_indices if early[i]],
            }
            for b in self.buckets
        ]
