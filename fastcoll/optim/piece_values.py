"""What the wrapped optimizer steps for each piece of this rank's ranges: a view of the parameter, or a master copy.

Each piece (:class:`~fastcoll.reducer.shards.Piece`) of a stepped parameter in
this rank's range of a bucket is one 1-D tensor of the local optimizer:

* a view of that range of the parameter, stepped in place (it follows the
  parameter when ``p.data = ...`` gives it new storage);
* with ``master_dtype=torch.float32`` and a 16-bit parameter: a float32
  master copy, stepped, then rounded into the parameter by the all-gather's
  pack; it follows the parameter when something else wrote it (a checkpoint
  loaded into the model).

Parameters that live in their bucket's flat parameter buffer
(:mod:`.param_buffer`) are stepped there and need no pack.
"""

from __future__ import annotations

from typing import Any, Collection, List, Optional, Sequence, Tuple

import torch

from .. import ops
from ..reducer.shards import Piece, flat_view

__all__ = ["PieceValues", "piece_views"]

_SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def piece_views(params: Sequence[torch.Tensor], pieces: Sequence[Any]) -> List[torch.Tensor]:
    """1-D views of ``pieces`` (:class:`~fastcoll.reducer.shards.Piece`) of the reducer's ``params``, in memory order."""
    return [flat_view(params[pc.param].detach())[pc.lo : pc.hi] for pc in pieces]


class PieceValues:
    """The local optimizer's tensor of every piece, and keeping them in step with the parameters.

    Args:
        params: The reducer's parameters.
        names: Their names, for messages.
        pieces: ``(bucket position, piece)`` of this rank's stepped pieces, in bucket order.
        master_dtype: None, or ``torch.float32``: master copies of the 16-bit parameters' pieces.
        moved: Indices of the parameters that live in a flat parameter buffer.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        pieces: Sequence[Tuple[int, Piece]],
        master_dtype: Optional[torch.dtype],
        moved: Collection[int],
    ):
        self.params = params
        self.names = names
        self.pieces = [pc for _, pc in pieces]
        self.master_dtype = master_dtype
        views = piece_views(params, self.pieces)
        #: One 1-D tensor per piece, in ``pieces`` order: what the local optimizer steps.
        self.tensors: List[torch.Tensor] = views
        if master_dtype is not None:
            self.tensors = [v.to(master_dtype, copy=True) if v.dtype in _SIXTEEN_BIT else v for v in views]
        ks = range(len(self.pieces))
        self.master_ks = [k for k in ks if self.has_master(k)]
        #: (parameter, first element) -> the master copy of that piece.
        self.masters = {(self.pieces[k].param, self.pieces[k].lo): self.tensors[k] for k in self.master_ks}
        self._master_views: Optional[Tuple[Tuple[Any, ...], List[Tuple[torch.Tensor, torch.Tensor]]]] = None
        self._written_hash: Optional[torch.Tensor] = None  # see refresh_masters
        # The pieces stepped as views of their parameter (no master, not in a buffer), and where their
        # parameters kept their values when the views were taken: see follow_storage.
        masters = set(self.master_ks)
        self._view_ks = [k for k in ks if k not in masters and self.pieces[k].param not in moved]
        self._view_key = self._storage_key(self._view_ks)
        self._view_numel = {self.pieces[k].param: params[self.pieces[k].param].numel() for k in self._view_ks}

    def has_master(self, k: int) -> bool:
        """Whether piece ``k`` is stepped as a master copy."""
        return (
            self.master_dtype is not None
            and self.tensors[k].dtype == self.master_dtype
            and self.params[self.pieces[k].param].dtype in _SIXTEEN_BIT
        )

    def gather_source(self, pc: Piece, moved: Collection[int]) -> Optional[torch.Tensor]:
        """What to pack for piece ``pc`` before the all-gather: its master, its values, or None (in a buffer)."""
        value = self.masters.get((pc.param, pc.lo))
        if value is None and pc.param not in moved:
            value = piece_views(self.params, [pc])[0]
        return value

    def _storage_key(self, ks: Sequence[int]) -> Tuple[Any, ...]:
        """Where the parameters of pieces ``ks`` keep their values (address and strides): ``p.data = ...`` changes it."""
        params = self.params
        return tuple((params[self.pieces[k].param].data_ptr(), params[self.pieces[k].param].stride()) for k in ks)

    def master_pieces(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """(master, the parameter's piece it rounds to) for every piece with a float32 master copy.

        The views are built once and kept while every such parameter keeps its storage and strides (a
        ``p.data = ...`` gives it new ones): building them is a few tensor operations per piece, per step.
        """
        key = self._storage_key(self.master_ks)
        if self._master_views is None or self._master_views[0] != key:
            views = [(self.tensors[k], piece_views(self.params, [self.pieces[k]])[0]) for k in self.master_ks]
            self._master_views = (key, views)
        return self._master_views[1]

    def follow_storage(self) -> None:
        """Pieces stepped as views of their parameter follow a parameter given new storage (``p.data = ...``).

        The local optimizer keeps each piece's tensor (its state is keyed by it); only what it views changes,
        to the same range of the parameter's new storage, so the step updates the values the model now holds.

        Raises:
            RuntimeError: the parameter's new values have another number of elements, dtype or device.
        """
        key = self._storage_key(self._view_ks)
        if key == self._view_key:
            return
        for k in self._view_ks:
            pc, t = self.pieces[k], self.tensors[k]
            p = self.params[pc.param]
            numel = self._view_numel[pc.param]
            if p.numel() != numel or p.dtype != t.dtype or p.device != t.device:
                raise RuntimeError(
                    f"fastcoll.ShardedOptimizer: parameter '{self.names[pc.param]}' is now {tuple(p.shape)} {p.dtype} "
                    f"on {p.device} (p.data replaced); its bucket layout holds {numel} {t.dtype} elements on "
                    f"{t.device}. Give a parameter new values of its own shape, dtype and device, or wrap the model again"
                )
            fresh = piece_views(self.params, [pc])[0]
            if t.data_ptr() != fresh.data_ptr():
                t.data = fresh
        self._view_key = key

    def remember_written(self) -> None:
        """After the parameters were written from the masters: a hash of those pieces (one fused pass)."""
        pieces = self.master_pieces() if self.master_dtype is not None else []
        self._written_hash = ops.checksum([v for _, v in pieces]) if pieces else None

    def refresh_masters(self) -> None:
        """A parameter changed outside the optimizer (a checkpoint loaded into the model): its masters follow it.

        After a step each parameter holds its master rounded, and the hash of those pieces is kept: a different
        hash means something was written since (a write through ``p.data`` moves no version counter), and only
        then are the pieces compared value by value.
        """
        if self.master_dtype is None:
            return
        pieces = self.master_pieces()
        if not pieces:
            return
        now = ops.checksum([v for _, v in pieces])
        if self._written_hash is not None and torch.equal(now, self._written_hash):
            return
        for master, value in pieces:
            if not torch.equal(master.to(value.dtype), value):
                master.copy_(value)
