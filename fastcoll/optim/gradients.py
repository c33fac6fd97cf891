"""Where a sharded optimizer's pieces find their gradients, and what ``p.grad`` shows meanwhile.

Three sources, per bucket (all reduced over the ranks by backward):

* ``grads="full"``, a bucket of float32 (or any non-main) parameters: the
  views of this rank's pieces of ``p.grad``, as torch DDP leaves it;
* ``grads="full"``, a bucket of 16-bit parameters with float32 main
  gradients (``main_grad_dtype``): the pieces' slots of the bucket itself;
* ``grads="sharded"``: this rank's reduced range of the bucket
  (:class:`~fastcoll.reducer.reduction.ShardGrads`).

When the optimizer's gradients are not ``p.grad`` (the last two), those
parameters' ``.grad`` hold a :class:`~fastcoll.optim.grad_guard.ShardedGradient`
after every synchronized backward, the pieces' gradients are attached then
(``GradScaler.unscale_`` and clipping read them before ``step()``), and a
non-finite value anywhere makes every rank's pieces non-finite too, so that
each rank's GradScaler, which sees its own pieces only, skips the same steps.
A parameter that no rank used since the last ``zero_grad`` gets no gradient
(the optimizer leaves it alone, as it leaves a ``.grad`` of None).
"""

from __future__ import annotations

import math
from typing import Any, Collection, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ..reducer.bucket import MainGradBucket
from ..reducer.shards import Piece, flat_view
from .grad_guard import GradientBook, ShardedGradient, is_guard

__all__ = ["PieceGradients", "memory_order_grad"]


def memory_order_grad(p: torch.Tensor) -> Optional[torch.Tensor]:
    """``p.grad`` as a 1-D tensor in ``p``'s memory order (a view when the gradient has ``p``'s strides)."""
    g = p.grad
    if g is None:
        return None
    if g.stride() != p.stride() and g.numel() > 1:
        g = torch.empty_like(p).copy_(g)
    return flat_view(g)


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
        self.pieces = list(pieces)
        self.tensors = list(tensors)
        self.sharded = sharded
        buckets = reducer.buckets
        self.main: Set[int] = {b.pos for b in buckets if isinstance(b, MainGradBucket)}
        #: Parameters whose ``.grad`` is not what the optimizer steps (guarded after each synchronized backward).
        self.guarded: List[int] = [i for b in buckets for i in b.param_indices if sharded or b.pos in self.main]
        self.guarded_set = set(self.guarded)
        #: The pieces' gradients come from the reduction, not from ``p.grad`` (they are attached at backward's end).
        self.from_reduction = bool(self.guarded)
        self.used = [False] * len(reducer.params)  # since the last zero_grad, on any rank
        #: Per parameter, the pieces (indices into ``pieces``) this rank holds.
        self.pieces_of: Dict[int, List[int]] = {}
        for k, (_, pc) in enumerate(self.pieces):
            self.pieces_of.setdefault(pc.param, []).append(k)
        where = (
            "the ranks each hold a range of it (grads='sharded')" if sharded else "it is a float32 main gradient, in its bucket"
        )
        self.book = GradientBook(self.held_of, not sharded, self.reset_param, reducer.names, where)
        #: The guard this object put into each parameter's ``.grad`` after the last synchronized backward.
        self.placed: Dict[int, ShardedGradient] = {}
        self._epoch = getattr(reducer, "grads_epoch", 0)

    # ---------------------------------------------------------------- attach

    def _source(self, pos: int, pc: Piece) -> Optional[torch.Tensor]:
        r = self.reducer
        if pc.param in self.guarded_set and not self.used[pc.param]:
            return None
        if self.sharded:
            shards = r.shard_grads
            return shards.grads[pos][pc.at : pc.at + pc.numel] if shards.filled else None
        if pos in self.main:
            b = r.buckets[pos]
            off = b.offsets[r._set.slot_pos[pc.param]]
            return b.flat[off + pc.lo : off + pc.hi]
        g = memory_order_grad(r.params[pc.param])
        return None if g is None else g[pc.lo : pc.hi]

    def attach(self) -> None:
        """Set each piece's ``.grad`` (a view of its source, or a cast copy when the dtypes differ)."""
        for (pos, pc), t in zip(self.pieces, self.tensors):
            g = self._source(pos, pc)
            t.grad = None if g is None else (g if g.dtype == t.dtype else g.to(t.dtype))

    def detach_all(self) -> None:
        for t in self.tensors:
            t.grad = None

    # ------------------------------------------------- what a guard stands for

    def held_of(self, i: int) -> List[torch.Tensor]:
        """The tensors holding this rank's values of parameter ``i``'s synchronized gradient (empty: it has none)."""
        if i not in self.guarded_set or not self.used[i]:
            return []
        r = self.reducer
        if not self.sharded:  # float32 main gradients: the parameter's whole slot of its bucket
            b = r.buckets[r._set.bucket_of[i]]
            off = b.offsets[r._set.slot_pos[i]]
            return [b.flat[off : off + r.params[i].numel()]]
        out = []
        for k in self.pieces_of.get(i, ()):
            g = self._source(*self.pieces[k])
            if g is not None:
                out.append(g)
        return out

    def reset_param(self, i: int) -> None:
        """Parameter ``i``'s gradient was zeroed in place: the values behind it are zeros from now on."""
        for g in self.held_of(i):
            g.zero_()

    def _forget(self, i: int) -> None:
        """Parameter ``i``'s gradient was set to None: it has none until a backward gives it one again."""
        self.reset_param(i)
        self.used[i] = False
        self.placed.pop(i, None)
        for k in self.pieces_of.get(i, ()):
            self.tensors[k].grad = None

    # ------------------------------------------------- end of synchronized backward

    def after_backward(self) -> None:
        """Guards in ``.grad``, the pieces' gradients attached, non-finite values agreed."""
        r = self.reducer
        used = r.usage.global_used
        params = r.params
        self.placed = {}
        for i in self.guarded:
            if used is None or used[i]:
                self.used[i] = True
            if self.used[i]:
                guard = ShardedGradient(params[i], self.book, i)
                params[i].grad = guard
                self.placed[i] = guard
        self.attach()
        total = r.health.total
        if total is None:
            return
        bad = ~torch.isfinite(total)
        for i in self.guarded:
            for g in self.held_of(i):
                if g.numel():
                    first = g[:1]  # one element per rank is enough for its GradScaler to see it
                    first.copy_(torch.where(bad, torch.full_like(first, math.inf), first))
                    return

    def reconcile(self, at_step: bool) -> bool:
        """Make the kept gradients follow what was done to ``p.grad`` since the last synchronized backward.

        torch code resets gradients through the parameters (``model.zero_grad()``, the wrapped optimizer's
        ``zero_grad``, ``p.grad = None``): a guard that is gone means that parameter's gradient was reset. At a
        forward the guards then leave ``.grad`` (backward accumulates into fresh local gradients); at ``step()``
        a gradient written into ``.grad`` by hand is refused (the optimizer steps the reduced values).

        Returns:
            Whether this call found every guarded parameter's gradient reset (a full ``zero_grad``).

        Raises:
            RuntimeError: at ``step()``, a guarded parameter's ``.grad`` holds a tensor that is not its guard.
        """
        r = self.reducer
        epoch = getattr(r, "grads_epoch", 0)
        forgot = False
        if epoch != self._epoch:  # the model's zero_grad() reset the reducer's kept gradients
            self._epoch = epoch
            for i in list(self.placed):
                self._forget(i)
            self.used = [False] * len(self.used)
            forgot = True
        params = r.params
        for i, guard in list(self.placed.items()):
            g = params[i].grad
            if g is guard:
                continue
            if at_step and g is not None and not is_guard(g):
                raise RuntimeError(
                    f"fastcoll.ShardedOptimizer: the gradient of '{r.names[i]}' was replaced by hand after backward; "
                    f"its synchronized gradient is not p.grad ({self.book.where}), so the optimizer cannot step what "
                    "was written there. Modify gradients with in-place multiplications (p.grad.mul_), or pass "
                    "grads='full' without main_grad_dtype"
                )
            self._forget(i)
            forgot = True
        return forgot and not any(self.used[i] for i in self.guarded)

    def drop_guards(self) -> None:
        """Before a forward: backward must accumulate into fresh gradients, not into a guard."""
        self.reconcile(at_step=False)
        for p in self.reducer.params:
            if is_guard(p.grad):
                p.grad = None
        self.placed = {}

    def zero(self, set_to_none: bool, busy: Collection[int] = ()) -> None:
        """The reduction's side of ``zero_grad``: guards, the kept ranges, the main gradients, the use record.

        ``busy``: buckets whose gradient memory holds a pending all-gather of the parameters (zeroed once written).
        """
        r = self.reducer
        for p in r.params:
            if is_guard(p.grad):
                p.grad = None
        for i in self.guarded:
            g = r.params[i].grad
            if g is not None:
                if set_to_none:
                    r.params[i].grad = None
                else:
                    g.detach_().zero_()
        self.zero_kept(busy)

    def zero_kept(self, busy: Collection[int] = ()) -> None:
        """Forget the gradients kept outside ``.grad`` (the ranges, the main gradients) and the use record."""
        r = self.reducer
        self.placed = {}
        if r.shard_grads is not None:
            r.shard_grads.zero(busy)
        r.zero_main_grads(busy)
        self.used = [False] * len(self.used)
        self.detach_all()

    # --------------------------------------------------------------- norms

    def own_ranges(self) -> List[torch.Tensor]:
        """The reduced gradients of this rank's range of every bucket (every parameter's, stepped or not)."""
        r = self.reducer
        if self.sharded:
            shards = r.shard_grads
            return [g for g in shards.grads.values() if g.numel()] if shards.filled else []
        out = []
        layout = r.shards
        for bs, pcs in zip(layout.buckets, layout.pieces):
            if bs.pos in self.main:
                b = r.buckets[bs.pos]
                out.append(b.flat_padded[bs.start : bs.start + bs.shard])
                continue
            for pc in pcs:
                g = memory_order_grad(r.params[pc.param])
                if g is not None:
                    out.append(g[pc.lo : pc.hi])
        return out

    def whole(self) -> Optional[List[torch.Tensor]]:
        """At one rank, every parameter's reduced gradient (1-D where it is a range's), in parameter order; else None.

        One rank's range is the whole bucket, so each parameter is one piece of it.
        """
        r = self.reducer
        if r.world_size != 1:
            return None
        layout = r.shards
        found = [(pc.param, self._source(bs.pos, pc)) for bs, pcs in zip(layout.buckets, layout.pieces) for pc in pcs]
        return [g for _, g in sorted(found, key=lambda item: item[0]) if g is not None]

    def held(self) -> List[torch.Tensor]:
        """Every reduced gradient this rank holds and the optimizer reads (what clipping scales)."""
        r = self.reducer
        if self.sharded:
            out = self.own_ranges()
        else:
            guarded = set(self.guarded)
            out = [r.buckets[pos].flat for pos in sorted(self.main)]
            out += [p.grad for i, p in enumerate(r.params) if i not in guarded and p.grad is not None]
        seen = {t.untyped_storage().data_ptr() for t in out}
        # Pieces whose gradient is a copy (another dtype, another layout) are scaled too.
        return out + [t.grad for t in self.tensors if t.grad is not None and t.grad.untyped_storage().data_ptr() not in seen]
