"""Where a sharded optimizer's pieces find their gradients: the reducer's kept gradients, attached at each step.

The reducer says where this rank's reduced gradient of each piece is
(:meth:`~fastcoll.reducer.kept_grads.KeptGradients.source`): a view of
``p.grad`` (``grads="full"``), of the float32 main-gradient bucket, or of this
rank's reduce-scattered range (``grads="sharded"``). Each step attaches them
as the pieces' ``.grad`` (a view, or a copy cast to a master's dtype) as they
are at that moment: unscaled, clipped or zeroed since backward.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch

from ..reducer.shards import Piece

__all__ = ["PieceGradients"]


class PieceGradients:
    """The gradients of one sharded optimizer's pieces.

    Args:
        reducer: The model's reducer (sharded already).
        pieces: ``(bucket position, piece)`` of every stepped piece, in order.
        tensors: The tensor the inner optimizer steps for each piece.
        sharded: ``grads="sharded"``.
    """

    def __init__(self, reducer: Any, pieces: Sequence[Tuple[int, Piece]], tensors: Sequence[torch.Tensor], sharded: bool):
        self.reducer = reducer
        self.kept = reducer.kept
        self.pieces = list(pieces)
        self.tensors = list(tensors)
        self.sharded = sharded
        #: The pieces' gradients come from the reduction, not from ``p.grad``.
        self.from_reduction = bool(self.kept.guarded)

    def attach(self) -> None:
        """Set each piece's ``.grad`` (a view of its source, or a cast copy when the dtypes differ).

        Raises:
            RuntimeError: on every rank, before any is set, when the last step consumed main gradients not reset since.
        """
        self.kept.refuse_gone("step()")
        for (pos, pc), t in zip(self.pieces, self.tensors):
            g = self.kept.source(pos, pc)
            t.grad = None if g is None else (g if g.dtype == t.dtype else g.to(t.dtype))

    def detach_all(self) -> None:
        for t in self.tensors:
            t.grad = None

    # --------------------------------------------------------------- norms

    def own_ranges(self) -> List[torch.Tensor]:
        """The reduced gradients of this rank's range of every bucket (every parameter's, stepped or not)."""
        return self.kept.own_ranges()

    def whole(self) -> Optional[List[torch.Tensor]]:
        """At one rank, every parameter's reduced gradient (1-D where it is a range's), in parameter order; else None.

        One rank's range is the whole bucket, so each parameter is one piece of it.
        """
        r = self.reducer
        if r.world_size != 1:
            return None
        layout = self.kept.layout
        found = [(pc.param, self.kept.source(bs.pos, pc)) for bs, pcs in zip(layout.buckets, layout.pieces) for pc in pcs]
        return [g for _, g in sorted(found, key=lambda item: item[0]) if g is not None]

    def held(self) -> List[torch.Tensor]:
        """Every reduced gradient this rank holds and the optimizer reads (what clipping scales)."""
        r = self.reducer
        if self.sharded:
            return self.own_ranges()
        guarded = self.kept.guarded_set
        out = [r.buckets[pos].flat for pos in sorted(self.kept.main)]
        return out + [p.grad for i, p in enumerate(r.params) if i not in guarded and p.grad is not None]
