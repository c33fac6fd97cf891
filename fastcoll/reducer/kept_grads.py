"""The synchronized gradients a sharded bucket layout keeps outside ``.grad``, and what ``.grad`` shows for them.

Once the buckets are divided among the ranks (:meth:`Reducer.shard`), the
reduced gradient of a parameter is, per this rank's piece of it:

* with reduce-scattered buckets: this rank's range of the bucket
  (:class:`~fastcoll.reducer.reduction.ShardGrads`);
* in a bucket of 16-bit parameters with float32 main gradients: the
  parameter's slot of the float32 bucket;
* otherwise: ``p.grad``, as torch DDP leaves it.

The first two are "guarded": after every synchronized backward their
parameters' ``.grad`` holds a :class:`~fastcoll.reducer.grad_guard.ShardedGradient`
(GradScaler, clipping and ``zero_()`` act on the kept values through it; with
ranges, GradScaler's non-finite flag is agreed by every rank, since each sees
its own values only and all must skip the same steps), and torch's ways of
resetting a gradient are followed: a guard that left ``.grad``
(``model.zero_grad()``, ``p.grad = None``) resets that parameter's kept
gradient, seen at the next forward, backward or step. The
guards stay in ``.grad`` through the forward (a reset between a forward and
its backward is seen too) and leave it when a backward first reaches a
parameter: a hook that runs before each guarded parameter's gradient is
accumulated, so the backward accumulates into fresh gradients.
A parameter that no rank used since the last reset has no gradient, as a
``.grad`` of None.
"""

from __future__ import annotations

import weakref
from typing import Any, Collection, Dict, List, Optional

import torch

from .._backref import BackRef, weak_method
from .bucket import MainGradBucket
from .grad_guard import GradientBook, ShardedGradient, is_guard
from .shards import Piece, flat_view

__all__ = ["KeptGradients", "memory_order_grad"]


def memory_order_grad(p: torch.Tensor) -> Optional[torch.Tensor]:
    """``p.grad`` as a 1-D tensor in ``p``'s memory order (a view when the gradient has ``p``'s strides)."""
    g = p.grad
    if g is None:
        return None
    if g.stride() != p.stride() and g.numel() > 1:
        g = torch.empty_like(p).copy_(g)
    return flat_view(g)


def _arriving_hook(ref: "weakref.ReferenceType[KeptGradients]") -> Any:
    """A gradient hook: at the first guarded parameter a backward reaches, what the reducer does before accumulating.

    A plain closure over a weak reference (it runs for every guarded parameter of every backward: kept cheap).
    """

    def arriving(_grad: torch.Tensor) -> None:
        kept = ref()
        if kept is not None and kept.placed:
            kept.reducer.before_accumulating()

    return arriving


def _remove_all(handles: List[Any]) -> None:
    for h in handles:
        h.remove()


_CONSUMED = (
    "fastcoll: the float32 main gradients of {names} are gone: the optimizer's step() consumed them (their memory "
    "holds the parameters' all-gather), where torch's .grad would still hold them, so {what} cannot read them. Read, "
    "clip or scale gradients between backward and step(), and reset them (opt.zero_grad()) before another step()"
)

_ORPHANED = (
    "fastcoll: this .grad belongs to a fastcoll.DDP that was deleted, and its synchronized values with it; "
    "reset it with p.grad = None (or module.zero_grad())"
)


class KeptGradients:
    """The kept gradients of a sharded reducer (see the module docstring).

    Args:
        reducer: The reducer, sharded already.
        advice: What a refused operation on a guard should do instead (the layer that divided the buckets knows).
    """

    reducer = BackRef()  # the reducer holds this object: no cycle back to it

    def __init__(self, reducer: Any, advice: str):
        self.reducer = reducer
        self.sharded = reducer.shard_grads is not None
        self.main = {b.pos for b in reducer.buckets if isinstance(b, MainGradBucket)}
        #: Parameters whose ``.grad`` is not their synchronized gradient (guarded after each synchronized backward).
        self.guarded: List[int] = [i for b in reducer.buckets for i in b.param_indices if self.sharded or b.pos in self.main]
        self.guarded_set = set(self.guarded)
        self.used = [False] * len(reducer.params)  # since the last reset, on any rank
        self.layout = reducer.shards
        #: Per parameter, this rank's pieces of it, ``(bucket position, piece)``.
        self.pieces_of: Dict[int, List[tuple]] = {}
        for bs, pcs in zip(reducer.shards.buckets, reducer.shards.pieces):
            for pc in pcs:
                self.pieces_of.setdefault(pc.param, []).append((bs.pos, pc))
        where = "the ranks each hold a range of it" if self.sharded else "it is a float32 main gradient, in its bucket"
        # The guards in .grad hold the book: its callbacks hold this object weakly (no cycle through the guards).
        held, reset = weak_method(self.held_of, _ORPHANED), weak_method(self.reset_param, _ORPHANED)
        main_dtypes = {i: b.main_dtype for b in reducer.buckets if b.pos in self.main for i in b.param_indices}
        agree = weak_method(self.agree_found_inf, _ORPHANED) if self.sharded else None
        whole = None if self.sharded else weak_method(self.whole_of, _ORPHANED)
        self.book = GradientBook(held, not self.sharded, reset, reducer.names, where, advice, main_dtypes, agree, whole)
        #: The guard put into each parameter's ``.grad`` after the last synchronized backward.
        self.placed: Dict[int, ShardedGradient] = {}
        #: Per main-gradient bucket the step consumed, the parameters whose gradients were reset since (zeros).
        self.reset_since_step: Dict[int, set] = {}
        # Before a guarded parameter's gradient is accumulated (the guard must not be accumulated into).
        arriving = _arriving_hook(weakref.ref(self))
        handles = [reducer.params[i].register_hook(arriving) for i in self.guarded if reducer.params[i].requires_grad]
        weakref.finalize(self, _remove_all, handles)

    # ------------------------------------------------------------- the values

    def source(self, pos: int, pc: Piece) -> Optional[torch.Tensor]:
        """This rank's reduced gradient of piece ``pc`` of bucket ``pos`` (1-D, a view), or None: it has none."""
        r = self.reducer
        if pc.param in self.guarded_set and not self.used[pc.param]:
            return None
        if self.sharded:
            shards = r.shard_grads
            return shards.grads[pos][pc.at : pc.at + pc.numel] if shards.readable() else None
        if pos in self.main:
            b = r.buckets[pos]
            off = b.offsets[r._set.slot_pos[pc.param]]
            return b.flat[off + pc.lo : off + pc.hi]
        g = memory_order_grad(r.params[pc.param])
        return None if g is None else g[pc.lo : pc.hi]

    def own_ranges(self) -> List[torch.Tensor]:
        """The reduced gradients of this rank's range of every bucket (every parameter's, stepped or not)."""
        r = self.reducer
        self.refuse_gone("the gradients' norm")
        if self.sharded:
            shards = r.shard_grads
            return [g for g in shards.ranges() if g is not None and g.numel()] if shards.readable() else []
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

    def held_of(self, i: int) -> List[torch.Tensor]:
        """The tensors holding this rank's values of guarded parameter ``i``'s gradient (empty: it has none)."""
        if i not in self.guarded_set or not self.used[i]:
            return []
        r = self.reducer
        b = r.buckets[r._set.bucket_of[i]]
        self._refuse_consumed(b, [i], "p.grad")  # on every rank, whether or not it holds a piece of the parameter
        if not self.sharded:  # float32 main gradients: the parameter's whole slot of its bucket
            off = b.offsets[r._set.slot_pos[i]]
            return [b.flat[off : off + r.params[i].numel()]]
        return [g for pos, pc in self.pieces_of.get(i, ()) for g in [self.source(pos, pc)] if g is not None]

    def whole_of(self, i: int) -> Optional[torch.Tensor]:
        """Unsharded main gradients: parameter ``i``'s, shaped like it (a new view of its bucket), or None: it has none."""
        if not self.held_of(i):  # (raises where the step consumed it)
            return None
        r = self.reducer
        v = r.buckets[r._set.bucket_of[i]].views[r._set.slot_pos[i]]
        return v.as_strided(v.size(), v.stride())

    def reset_param(self, i: int) -> None:
        """Parameter ``i``'s gradient was zeroed in place: the values behind it are zeros from now on."""
        r = self.reducer
        b = r.buckets[r._set.bucket_of[i]] if i in self.guarded_set else None
        if b is not None and self._gone(b):
            self._reset_consumed(b, i)
            return
        for g in self.held_of(i):
            g.zero_()

    def _gone(self, b: Any) -> bool:
        """The step consumed main-gradient bucket ``b``, whose memory held the kept gradients (its own, or with
        reduce-scattered buckets this rank's range, reduced in place)."""
        if not (isinstance(b, MainGradBucket) and b.consumed):
            return False
        return not self.sharded or b.pos in self.reducer.shard_grads.in_place

    def refuse_gone(self, what: str) -> None:
        """Raise, on every rank alike, when ``what`` (reading every kept gradient: a step, a norm) would meet main
        gradients the step consumed and no reset followed."""
        for pos in self.main:
            b = self.reducer.buckets[pos]
            self._refuse_consumed(b, b.param_indices, what)

    def _refuse_consumed(self, b: Any, params: List[int], what: str) -> None:
        """Raise when the step consumed main-gradient bucket ``b`` and a used one of ``params`` was not reset since."""
        if not self._gone(b):
            return
        done = self.reset_since_step.get(b.pos, ())
        lost = [i for i in params if self.used[i] and i not in done]
        if lost:
            names = ", ".join(repr(self.reducer.names[i]) for i in lost[:4]) + (" ..." if len(lost) > 4 else "")
            raise RuntimeError(_CONSUMED.format(names=names, what=what))

    def _reset_consumed(self, b: Any, i: int) -> None:
        """Reset parameter ``i`` of a bucket the step consumed: its memory is zeros once the bucket's all-gather is
        written (done now); when every used parameter of the bucket was reset, it accumulates again."""
        gather = self.reducer.param_gather
        if gather is not None:
            gather.wait([b.pos])
        done = self.reset_since_step.setdefault(b.pos, set())
        done.add(i)
        if all(j in done or not self.used[j] for j in b.param_indices):
            b.consumed = False
            del self.reset_since_step[b.pos]

    def _forget(self, i: int) -> None:
        """Parameter ``i``'s gradient was set to None: it has none until a backward gives it one again."""
        self.reset_param(i)
        self.used[i] = False
        self.placed.pop(i, None)

    # ------------------------------------------------- end of synchronized backward

    def after_backward(self) -> None:
        """Guards in ``.grad``."""
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

    def agree_found_inf(self, found_inf: torch.Tensor) -> None:
        """GradScaler's non-finite flag of this rank's ranges (``found_inf``, in place): 1 on every rank if it is on any.

        Called by ``GradScaler.unscale_`` through the guards, on every rank alike (one small all-reduce).
        """
        comm = self.reducer.comm
        comm.wait(comm.all_reduce(found_inf, "GradScaler's non-finite check"), "GradScaler's non-finite check")
        found_inf.clamp_(max=1.0)

    def after_local_backward(self, arrived: List[int]) -> None:
        """After a ``no_sync`` backward added the 16-bit gradients of ``arrived`` into the float32 buckets.

        Unsharded, each parameter's slot holds its local sum, which is what ``.grad`` holds under torch DDP:
        guards in ``.grad`` present it (norms, scaling, resets). With reduce-scattered buckets the ranges hold
        the last reduced values beside the local sums, which no ``.grad`` can present: it stays None.
        """
        if self.sharded:
            return
        params = self.reducer.params
        for i in arrived:
            self.used[i] = True
        for i in self.guarded:
            if self.used[i]:
                guard = ShardedGradient(params[i], self.book, i)
                params[i].grad = guard
                self.placed[i] = guard

    # ----------------------------------------------------------------- resets

    def reconcile(self, at_step: bool) -> None:
        """Make the kept gradients follow what was done to ``p.grad`` since the last synchronized backward.

        A guard that is gone means its parameter's gradient was reset; when every guarded parameter's was,
        the kept ranges and main gradients are reset whole (as :meth:`zero`).

        Raises:
            RuntimeError: at a step, a guarded parameter's ``.grad`` holds a tensor written by hand.
        """
        r = self.reducer
        if at_step:
            for i in self.guarded:
                g = r.params[i].grad
                if g is not None and not is_guard(g):
                    raise RuntimeError(
                        f"fastcoll: the gradient of '{r.names[i]}' was written by hand (p.grad = ...); its synchronized "
                        f"gradient is not p.grad ({self.book.where}), so what was written there cannot be stepped. "
                        f"Modify gradients in place (p.grad.mul_) instead. {self.book.advice}"
                    )
        forgot = False
        for i, guard in list(self.placed.items()):
            if r.params[i].grad is not guard:
                self._forget(i)
                forgot = True
        if forgot and not any(self.used[i] for i in self.guarded):
            self.zero_kept(release=True)

    def before_accumulating(self) -> None:
        """Before a backward accumulates: resets seen; the guards leave ``.grad`` (it accumulates into fresh gradients).

        Called by the reducer once a backward has begun, and by the hook of the first guarded parameter a
        backward reaches (:func:`_arriving_hook`), whichever comes first.
        """
        self.reconcile(at_step=False)
        for p in self.reducer.params:
            if is_guard(p.grad):
                p.grad = None
        self.placed = {}

    def zero(self, set_to_none: bool) -> None:
        """``zero_grad`` of the guarded parameters, as torch's of ``.grad``.

        ``set_to_none``: their ``.grad`` and everything kept for them are gone (a step skips them). Else the
        gradients that exist stay, as zeros (a step steps them, as torch's steps a zeroed ``.grad``); the
        ones that do not exist stay absent.
        """
        r = self.reducer
        keep: List[int] = []
        if not set_to_none:
            self.reconcile(at_step=False)  # a .grad set to None by hand has no gradient to keep as zeros
            keep = [i for i in self.guarded if self.used[i]]
        if keep and r.param_gather is not None:
            r.param_gather.finish()  # the gradient memory some all-gathers borrow is zeros once they are written
        for i in self.guarded:
            g = r.params[i].grad
            if g is None:
                continue
            if set_to_none or is_guard(g):
                r.params[i].grad = None
            else:
                g.detach_().zero_()
        self.zero_kept(release=set_to_none)
        if keep:
            self._zeros_kept(keep)

    def _zeros_kept(self, params: List[int]) -> None:
        """``params`` have a gradient of zeros (the main gradients are zeroed already, the ranges on first read);
        guards in ``.grad``."""
        r = self.reducer
        if r.shard_grads is not None:
            r.shard_grads.zero_lazily()
        for i in params:
            self.used[i] = True
            self.placed[i] = r.params[i].grad = ShardedGradient(r.params[i], self.book, i)

    def zero_kept(self, release: bool = False) -> None:
        """Forget the kept gradients (the ranges, the main gradients) and the use record; ``release``: free the
        ranges that are not views of a bucket, as torch frees ``.grad`` (``set_to_none``)."""
        r = self.reducer
        gather = r.param_gather
        busy: Collection[int] = gather.borrowing() if gather is not None else ()
        self.placed = {}
        if r.shard_grads is not None:
            r.shard_grads.zero()  # (the in-place ranges with their buckets, next)
            if release:
                r.shard_grads.release()
        r.zero_main_grads(busy)
        for b in r.main_buckets:  # a busy one is zeroed once its all-gather is written: accumulating then is right
            b.consumed = False
        self.reset_since_step = {}
        self.used = [False] * len(self.used)
        r.unsynchronized = False
