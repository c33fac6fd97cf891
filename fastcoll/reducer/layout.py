"""Turning a bucket assignment into buckets, and learning the assignment from the ready order.

:func:`build_buckets` allocates the :class:`GradBucket` objects of a layout
(lists of parameter indices in reduction order, from
:func:`fastcoll.bucketing.assign_buckets`). :class:`ReadyOrder` records the
order in which gradients became ready during the first synchronized backward;
at the next forward the layout is rebuilt once from rank 0's recording, so
that buckets complete in index order.
"""

from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple

import torch

from .bucket import GradBucket

__all__ = ["EARLY_PACK_MIN_NUMEL", "ReadyOrder", "build_buckets", "early_pack_slots", "wire_dtype"]

#: CPU gradients with at least this many elements are packed as soon as they
#: are final, while still in cache (measured: ~25% less pack time on ResNet-50
#: shapes); smaller ones wait for their bucket's single fused pack. The
#: environment variable FASTCOLL_EARLY_PACK_MIN_NUMEL overrides it (read when
#: buckets are built; a huge value turns early packing off).
EARLY_PACK_MIN_NUMEL = 1 << 16


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
) -> List[GradBucket]:
    """Allocate the buckets of ``layout``; with ``as_view``, existing gradients move into their views."""
    buckets = []
    for pos, idxs in enumerate(layout):
        ps = [params[i] for i in idxs]
        buckets.append(
            GradBucket(
                pos, len(layout), list(idxs), ps, [names[i] for i in idxs],
                wire_dtype=wire_dtype(comm_dtype, ps[0].dtype), as_view=as_view, sparse=bool(sparse[idxs[0]]),
            )
        )  # fmt: skip
    if as_view:
        with torch.no_grad():
            for b in buckets:
                for p, v in zip(b.params, b.views):  # none for a sparse bucket
                    g = p.grad
                    if g is not None and g.data_ptr() != v.data_ptr():
                        v.copy_(g)
                        p.grad = v
    return buckets


def early_pack_slots(buckets: Sequence[GradBucket], n: int) -> Tuple[List[Optional[torch.Tensor]], List[int]]:
    """Where each large CPU gradient is packed as soon as it is final, and each parameter's slot in its bucket.

    On CPU a gradient just written by backward is still in cache; packing it
    right away (one fused call for that tensor) costs less than re-reading it
    from memory when its bucket completes. Small gradients wait for the
    bucket's single fused pack; CUDA buckets always pack in one launch.

    Returns:
        Per parameter index: its slice of the bucket's wire buffer, or None
        when it waits for the bucket pack; and its position in its bucket.
    """
    min_numel = int(os.environ.get("FASTCOLL_EARLY_PACK_MIN_NUMEL", EARLY_PACK_MIN_NUMEL))
    slots: List[Optional[torch.Tensor]] = [None] * n
    slot_pos = [0] * n
    for b in buckets:
        eligible = b.device.type == "cpu" and not b.sparse
        for k, i in enumerate(b.param_indices):
            slot_pos[i] = k
            numel = b.params[k].numel()
            if eligible and numel >= min_numel:
                slots[i] = b.comm[b.offsets[k] : b.offsets[k] + numel]
    return slots, slot_pos


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
