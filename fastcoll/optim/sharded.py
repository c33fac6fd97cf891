"""``fastcoll.ShardedOptimizer``: any elementwise torch optimizer with its state divided among the ranks (ZeRO-1).

Built on the model's buckets (:mod:`fastcoll.reducer.shards`): rank ``r``
keeps the optimizer state of range ``r`` of every bucket and steps those
elements only, then the reducer all-gathers the parameters (:mod:`fastcoll.reducer.param_gather`).
The communication is DDP's (a reduce-scatter and an all-gather move what one
all-reduce moves); the state per rank is 1/N of DDP's.

Two ways to get the gradients:

* ``grads="full"`` (default): backward all-reduces as under DDP; every
  ``p.grad`` is torch DDP's, and the optimizer steps the views of this rank's
  pieces of them.
* ``grads="sharded"``: each bucket is reduce-scattered; the reduced values
  live only in this rank's range (:attr:`Reducer.shard_grads`), which the
  pieces' ``.grad`` view. ``p.grad`` is then a guard
  (:mod:`fastcoll.reducer.grad_guard`) through which ``torch.amp.GradScaler``
  unscales and checks this rank's range (the flag agreed across the ranks).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch import nn

from ..ops.dtypes import is_dense
from ..reducer.pool import ACCUMULATE
from ..reducer.sharding import storage_bytes
from ..reducer.shards import Piece
from .checkpoint import CheckpointMethods
from .clip import clip_grad_norm
from .elementwise import check_optimizer_class
from .gradients import PieceGradients
from .param_buffer import ParamBuffers, gather_stages, movable, shares_memory
from .piece_values import PieceValues

__all__ = ["ShardedOptimizer"]

_GRADS = ("full", "sharded")
_GRAD_BUFFERS = ("persistent", "pool")


def _advice(grads: str) -> str:
    """What a refused operation on a guarded ``p.grad`` should do instead."""
    return (
        f"This is fastcoll.ShardedOptimizer(grads={grads!r}). To clip, call opt.clip_grad_norm_(max_norm) (the "
        "global norm, the same on every rank); with torch.amp.GradScaler, scaler.unscale_(opt) and scaler.step(opt) "
        "work as with torch. Pass grads='full' (and no main_grad_dtype) to keep every rank's full gradients in p.grad."
    )


class ShardedOptimizer(CheckpointMethods, torch.optim.Optimizer):
    """Shard the state of ``optimizer`` over the ranks of ``model`` (a :class:`fastcoll.DDP`).

    Args:
        optimizer: A torch optimizer over (a subset of) ``model``'s
            parameters, constructed and not stepped yet; its class,
            hyperparameters and param groups are kept.
        model: The :class:`fastcoll.DDP` whose buckets are divided.
        grads: ``"full"`` or ``"sharded"`` (see the module docstring).
        overlap_param_gather: Issue the parameters' all-gathers at the end of
            :meth:`step` and let each module wait for its own in the next
            forward; False: wait in :meth:`step`.
        elementwise: Assert that ``optimizer``'s class updates elementwise
            (needed for classes fastcoll does not know).
        master_dtype: None or ``torch.float32``: each rank keeps float32
            copies of its pieces of the 16-bit parameters (master weights),
            steps them (with the float32 main gradients of
            ``fastcoll.DDP(main_grad_dtype=torch.float32)``, or the 16-bit
            gradients upcast) and writes them back rounded to the parameters'
            dtype before the all-gather. They are in :meth:`state_dict` as
            ``"fastcoll_master"`` per parameter.
        grad_buffers: ``"persistent"`` (default): every bucket keeps its
            full-size gradient buffers for the whole step. ``"pool"`` (with
            ``grads="sharded"``; ZeRO-2): a bucket's full-size buffers (the flat
            gradient buffer, with main gradients the float32 one) exist only
            from its pack to the end of its reduce-scatter, lent by a pool of
            ``pool_buffers`` buffers of about ``bucket_cap_mb`` each
            (:attr:`grad_pool`; the buckets are re-cut so that the cap counts
            their buffers' bytes, a parameter larger than it alone, reduced
            in chunks); each rank keeps only its range of every bucket's
            reduced gradients until the step.
        pool_buffers: With ``grad_buffers="pool"``: how many buffers the pool
            holds (default 2: one bucket packs while the previous one's
            reduce-scatter is in flight; k lets k - 1 be in flight).
        accumulate: With ``grad_buffers="pool"``: what a backward under
            ``model.no_sync()`` does. ``"reduce_scatter"`` (default, DeepSpeed's
            ZeRO-2): it is reduce-scattered as any other, added into the
            ranges (a collective per micro-batch, no full-size buffer kept;
            with a 16-bit ``comm_dtype`` each micro-batch's sum is rounded on
            the wire).
            ``"full"``: it accumulates locally (float32 main gradients into a
            full-size buffer per bucket, kept until the synchronizing
            backward's reduce-scatter), as with persistent buffers.

    Raises:
        TypeError: ``optimizer`` is not a torch optimizer or ``model`` not a fastcoll.DDP.
        ValueError: a class that does not update elementwise, an optimizer
            that already stepped, a parameter that is not synchronized by
            ``model`` or not dense (a strided slice), ``grads`` not one of "full"/"sharded", ``master_dtype`` not
            float32, ``grad_buffers="pool"`` with ``grads="full"`` or ``gradient_as_bucket_view=True``,
            ``pool_buffers``/``accumulate`` without it.
        RuntimeError: ``model`` has a comm hook, ``bucket_cap_mb="auto"`` or sparse gradients, or another
            ShardedOptimizer divides it already.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        *,
        grads: str = "full",
        overlap_param_gather: bool = False,
        elementwise: bool = False,
        master_dtype: Optional[torch.dtype] = None,
        grad_buffers: str = "persistent",
        pool_buffers: Optional[int] = None,
        accumulate: Optional[str] = None,
    ):
        from ..ddp import DDP

        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, ShardedOptimizer):
            raise TypeError(f"fastcoll.ShardedOptimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not isinstance(model, DDP):
            raise TypeError(f"fastcoll.ShardedOptimizer: model must be a fastcoll.DDP, got {type(model).__name__}")
        if grads not in _GRADS:
            raise ValueError(f"fastcoll.ShardedOptimizer: grads must be one of {_GRADS}, got {grads!r}")
        if master_dtype not in (None, torch.float32):
            raise ValueError(f"fastcoll.ShardedOptimizer: master_dtype must be None or torch.float32, got {master_dtype!r}")
        pool_buffers, accumulate = _check_pool(grads, grad_buffers, pool_buffers, accumulate, model)
        check_optimizer_class(type(optimizer), elementwise)
        if _has_stepped(optimizer):
            raise ValueError(
                "fastcoll.ShardedOptimizer: the optimizer has already stepped (it holds state); wrap it before its first step"
            )
        reducer = model.reducer
        self.model = model
        self.reducer = reducer
        self.grads = grads
        self.master_dtype = master_dtype
        self.grad_buffers = grad_buffers
        self.overlap_param_gather = bool(overlap_param_gather)
        index_of = {id(p): i for i, p in enumerate(reducer.params)}
        self._groups_params = [list(g["params"]) for g in optimizer.param_groups]
        self._order = [p for ps in self._groups_params for p in ps]  # the standard state dict's parameter numbering
        self._order_index = [index_of.get(id(p)) for p in self._order]  # their reducer indices (None: not synchronized)
        self._stepped = _stepped(reducer, self._groups_params, index_of, sharded=grads == "sharded")
        # State some classes create at construction for parameters that are not sharded (frozen ones): kept as is.
        self._outside_state = {k: st for k, p in enumerate(self._order) if index_of.get(id(p)) is None
                               for st in [optimizer.state.get(p)] if st}  # fmt: skip
        # (a collective when a bucket rebuild is due)
        self._layout = reducer.shard(grads == "sharded", _advice(grads), pool_buffers or 0, accumulate)
        shared = shares_memory(reducer.params)
        moving = {bs.pos: movable(reducer.buckets[bs.pos], self._stepped, shared) for bs in self._layout.buckets if bs.padded}
        # Parameters that move into a flat buffer of their bucket's layout: no pack, no write-back for them.
        self._buffers = ParamBuffers(reducer, {pos: m for pos, m in moving.items() if m})
        self._pieces: List[Tuple[int, Piece]] = [  # (bucket position, piece) of the stepped parameters, bucket order
            (bs.pos, pc) for bs, pcs in zip(self._layout.buckets, self._layout.pieces) for pc in pcs if self._stepped[pc.param]
        ]
        self._values = PieceValues(reducer.params, reducer.names, self._pieces, master_dtype, self._buffers.moved)
        self._shard_params = self._values.tensors
        self._grads = PieceGradients(reducer, self._pieces, self._shard_params, sharded=grads == "sharded")
        inner_groups = self._inner_groups(optimizer, index_of)
        #: The torch optimizer that was wrapped: its ``param_groups`` and ``defaults`` are this optimizer's own
        #: (the same objects), so a scheduler or an edit on either reaches both.
        self.wrapped = optimizer
        #: The optimizer of the wrapped class over this rank's pieces (private: its groups follow ``param_groups``).
        self._local = _same_class(optimizer, inner_groups)
        self._bucket_index = {bs.pos: k for k, bs in enumerate(self._layout.buckets)}
        bucket_of_piece = {id(t): pos for (pos, _), t in zip(self._pieces, self._shard_params)}
        #: Per bucket position, per inner param group, the pieces of that group in that bucket (in group order).
        self._bucket_params: Dict[int, List[List[torch.Tensor]]] = {
            bs.pos: [[t for t in ig["params"] if bucket_of_piece[id(t)] == bs.pos] for ig in inner_groups]
            for bs in self._layout.buckets
        }
        self._built = False
        super().__init__([dict(g) for g in optimizer.param_groups], dict(optimizer.defaults))
        self._built = True
        # The wrapped optimizer's own groups (the model's parameters, its hyperparameters) and defaults.
        self.param_groups = optimizer.param_groups
        self.defaults = optimizer.defaults
        self.state = ShardedState(self._local.state, {id(p) for p in self._order})
        _redirect(optimizer, self)
        stages, borrowed = gather_stages(reducer, self._layout, self._buffers, grad_buffers == "pool", grads)
        self._gather = reducer.enable_param_gather(
            self._stepped, stages, self.overlap_param_gather, borrowed, self._buffers.moved, model.module
        )
        gather = self._gather  # the reducer's: the hooks hold no reference to this optimizer
        for m in (model, model.module):
            m.register_state_dict_pre_hook(lambda *args, **kwargs: gather.finish())

    # ------------------------------------------------------------- building

    def _inner_groups(self, optimizer: torch.optim.Optimizer, index_of: Dict[int, int]) -> List[Dict[str, Any]]:
        by_param: Dict[int, List[torch.Tensor]] = {}
        for (_, pc), t in zip(self._pieces, self._shard_params):
            by_param.setdefault(pc.param, []).append(t)
        groups = []
        for g in optimizer.param_groups:
            params = [t for p in g["params"] if id(p) in index_of for t in by_param.get(index_of[id(p)], [])]
            groups.append(dict(g, params=params))
        return groups

    @property
    def grad_pool(self) -> Any:
        """With ``grad_buffers="pool"``: the pool (``bound``, ``slot_bytes``, ``nbytes``, ``live``/``peak``
        buffers lent now / at most, ``held``/``peak_held`` accumulation buffers of ``accumulate="full"``); else None."""
        return self.reducer.pool

    # ----------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        """Step this rank's pieces with the inner optimizer, then all-gather the parameters.

        Every rank must call it (the all-gathers are collectives). Keys that
        the inner optimizer's step writes into its param groups are copied
        into :attr:`param_groups`, as the plain optimizer would have them.

        Raises:
            TypeError: keyword arguments besides ``closure`` (a subclass's own
                ``step(closure, **kwargs)``): the inner step runs once per
                bucket, so they cannot be passed on as one call would.
        """
        if kwargs:
            raise TypeError(
                f"fastcoll.ShardedOptimizer.step() takes only a closure, got {', '.join(map(repr, kwargs))}: it runs "
                f"the wrapped {type(self.wrapped).__name__}'s step() once per bucket over this rank's ranges, so "
                "arguments of that step() cannot be passed on as one call would. Set them on the optimizer (or its "
                "param_groups) before wrapping it"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.reducer.unsynchronized:
            raise RuntimeError(
                "fastcoll.ShardedOptimizer: step() after a backward under no_sync() with no synchronized backward "
                "since: those gradients were never reduced, and each rank steps only its range of them. Run the last "
                "micro-batch's backward outside no_sync() (or call opt.zero_grad() to drop them)"
            )
        gather = self._gather
        gather.begin_step()
        self.reducer.kept.reconcile(at_step=True)
        self._check_grads()
        self._buffers.check()
        self._values.follow_storage()
        self._values.refresh_masters()
        self._push_hyperparameters()
        self._grads.attach()  # as the gradients are now (unscaled, clipped, zeroed since backward)
        # One inner step per bucket, each bucket's all-gather issued as soon as its pieces are stepped: the
        # all-gathers run during the rest of the step. The update is elementwise, so stepping the pieces bucket
        # by bucket is the same arithmetic as one step over all.
        stepped_groups: List[Dict[str, Any]] = []
        for pos in gather.order():
            gather.mark(pos, "step")
            stepped_groups = self._step_bucket(pos)
            gather.start_bucket(pos, self._gather_sources(pos))
        gather.end_step()
        self._pull_group_keys(stepped_groups)
        self._grads.detach_all()
        self._values.remember_written()
        # LR schedulers built on the wrapped optimizer count its steps (torch warns of a scheduler step first).
        self.wrapped._opt_called = True  # type: ignore[attr-defined]
        return loss

    def _check_grads(self) -> None:
        """Every rank alike (all parameters, not only this rank's pieces): gradients the pieces cannot step are refused.

        Raises:
            RuntimeError: a stepped parameter's ``.grad`` is sparse, or not of its parameter's shape.
        """
        r = self.reducer
        for i, p in enumerate(r.params):
            g = p.grad
            if g is None or not self._stepped[i] or type(g) is not torch.Tensor:
                continue
            if g.is_sparse or g.shape != p.shape:
                what = "sparse" if g.is_sparse else f"of shape {tuple(g.shape)}, not {tuple(p.shape)}"
                raise RuntimeError(
                    f"fastcoll.ShardedOptimizer: the gradient of '{r.names[i]}' is {what}; each rank steps a dense "
                    "range of every parameter, so its gradient must be dense and of the parameter's shape"
                )

    def _step_bucket(self, pos: int) -> List[Dict[str, Any]]:
        """The inner optimizer's step over the pieces in bucket ``pos`` only (its groups' other pieces left alone).

        Every group takes part, with no params where none of its pieces is in this bucket on this rank, so
        that ``param_groups[i]`` in the inner step is group ``i`` on every rank.

        Returns:
            The groups that step saw (and may have written keys into): copies of the inner optimizer's own.
        """
        groups = self._local.param_groups
        subset = [dict(g, params=ps) for g, ps in zip(groups, self._bucket_params[pos])]
        self._local.param_groups = subset
        try:
            self._local.step()
        finally:
            self._local.param_groups = groups
        return subset

    def _pull_group_keys(self, stepped: List[Dict[str, Any]]) -> None:
        """Keys an inner step added to or replaced in its groups, into its own groups and ``param_groups``.

        Each bucket's step starts from the same groups (pushed from ``param_groups`` before the first), so a
        key computed from a group's values is the same in every bucket's copy: the last one is taken, once.
        """
        for g, ig, sub in zip(self.param_groups, self._local.param_groups, stepped):
            _copy_changed(sub, ig)
            _copy_changed(sub, g)

    def _push_hyperparameters(self) -> None:
        """The hyperparameters of ``param_groups`` (edited by schedulers, by hand) into the local optimizer's groups."""
        if len(self.param_groups) != len(self._local.param_groups):
            raise RuntimeError(
                "fastcoll.ShardedOptimizer: param groups were added to or removed from the wrapped optimizer after "
                "wrapping; add every group before constructing the ShardedOptimizer"
            )
        for g, ig in zip(self.param_groups, self._local.param_groups):
            for k, v in g.items():
                if k != "params":
                    ig[k] = v

    def _gather_sources(self, pos: int) -> List[Optional[torch.Tensor]]:
        """Per piece of this rank's range of bucket ``pos``, what to pack there before the all-gather.

        The piece's values, or its master copy (rounded to the parameters' dtype by the pack); None for a
        parameter that lives in the bucket's buffer (its values are there already).
        """
        moved = self._buffers.moved
        return [self._values.gather_source(pc, moved) for pc in self._layout.pieces[self._bucket_index[pos]]]

    def staged_parameters(self) -> List[str]:
        """Names of the stepped parameters that do not live in their bucket's flat buffer (:mod:`.param_buffer`).

        Each step packs their pieces before the all-gather and writes the gathered values back into them: odd
        sizes in a bucket without a buffer, a start that is not 128-byte aligned, memory shared with another
        parameter. Empty when every parameter is updated and gathered in place.
        """
        r = self.reducer
        return [r.names[i] for i, s in enumerate(self._stepped) if s and i not in self._buffers.moved]

    def memory_usage(self) -> Dict[str, int]:
        """Bytes this rank's optimizer holds now, by kind; each storage counted once.

        ``masters``: the float32 master weights of this rank's pieces (``master_dtype``); ``state``: the wrapped
        optimizer's state tensors (of this rank's pieces); ``grad_pool``: the pool's buffers allocated so far
        (``grad_buffers="pool"``). The buffers of the model's reducer are :meth:`fastcoll.DDP.memory_usage`'s.
        """
        seen: set = set()
        values = self._values
        masters = storage_bytes(values.masters.values(), seen)
        state = storage_bytes((v for st in self.state.values() for v in st.values()), seen)
        pool = self.reducer.pool
        return {"masters": masters, "state": state, "grad_pool": pool.nbytes if pool is not None else 0}

    def finish_param_sync(self) -> None:
        """Wait for the parameters' all-gathers of the last step and write them into the parameters."""
        self._gather.finish()

    # ------------------------------------------------------------ gradients

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients: the model's ``.grad`` (as ``Optimizer.zero_grad``), the reduced ranges, the main gradients.

        Args:
            set_to_none: As torch's: the gradients are gone (a ``step()`` before the next backward steps
                nothing); with False, every gradient that exists stays, as zeros (a ``step()`` steps them).
        """
        kept = self.reducer.kept
        for i, p in enumerate(self.reducer.params):
            g = p.grad
            if g is None or i in kept.guarded_set:
                continue
            if set_to_none:
                p.grad = None
            else:
                if g.grad_fn is not None:
                    g.detach_()
                else:
                    g.requires_grad_(False)
                g.zero_()
        kept.zero(set_to_none)

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: Optional[bool] = None
    ) -> torch.Tensor:
        """Clip the synchronized gradients by their global norm, with ``torch.nn.utils.clip_grad_norm_``'s contract.

        The norm comes from every rank's range (float64 sums, one small
        all-reduce: each rank reads 1/N of the gradients), so it is the same
        on every rank, bitwise; at one rank it is torch's own, bit for bit
        ``torch.nn.utils.clip_grad_norm_``. The gradients this rank holds
        (``p.grad``, its ranges, the main gradients) are multiplied by
        ``min(1, max_norm / (norm + 1e-6))`` as torch multiplies them.

        Returns:
            The total norm (a 0-dim float32 tensor).
        """
        r = self.reducer
        g = self._grads
        whole = g.whole()
        ranges = g.own_ranges() if whole is None else []
        norm, coef = clip_grad_norm(
            ranges, g.held(), r.comm, r.usage.device, max_norm, norm_type, error_if_nonfinite, whole, foreach
        )
        if g.from_reduction:
            r.health.scaled(r.params, coef)
        return norm

    # ------------------------------------------------------------ misc API

    def _optimizer_step_code(self) -> None:
        """Not torch's: its profiler, tracing Python, inspects the optimizer that runs torch's own of this method,
        looking up ``state[p]`` for every ``p`` of ``param_groups``. Here that is the local optimizer over this
        rank's pieces, whose step runs inside :meth:`step`; a lookup by a model parameter would be refused."""

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Only while the optimizer is being built: groups cannot be added to a sharded optimizer."""
        if getattr(self, "_built", False):
            raise RuntimeError(
                "fastcoll.ShardedOptimizer: param groups cannot be added after construction (the pieces are fixed); "
                "add them to the torch optimizer before wrapping it"
            )
        super().add_param_group(param_group)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "ShardedOptimizer":
        raise RuntimeError(
            "fastcoll.ShardedOptimizer cannot be copied: it is bound to its model's buckets and process group. Build "
            "a new one over the copied model, and load opt.state_dict() into it"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise RuntimeError("fastcoll.ShardedOptimizer cannot be pickled: save opt.state_dict() (or sharded_state_dict()) instead")

    def __repr__(self) -> str:
        return f"ShardedOptimizer({self.wrapped!r}, grads={self.grads!r}, ranks={self._layout.world_size})"


class ShardedState(dict):
    """``opt.state``: this rank's pieces' state, keyed by the pieces; a model parameter as key is refused.

    torch code that walks the state (moving it to a device, counting it) sees this rank's share; a lookup by a
    model parameter would have to answer with the whole state of that parameter, which no rank holds.
    """

    def __init__(self, local: Dict[Any, Any], params: Set[int]):
        super().__init__()
        self._local = local
        self._params = params

    def _refuse(self, key: Any) -> None:
        if id(key) in self._params:
            raise KeyError(
                "fastcoll.ShardedOptimizer: the optimizer state of a model parameter is divided among the ranks "
                "(each holds the state of its own range); opt.state_dict() gathers it whole, in the wrapped "
                "optimizer's standard format (a collective: call it on every rank)"
            )

    def __getitem__(self, key: Any) -> Any:
        self._refuse(key)
        return self._local[key]

    def __contains__(self, key: Any) -> bool:
        self._refuse(key)
        return key in self._local

    def get(self, key: Any, default: Any = None) -> Any:
        self._refuse(key)
        return self._local.get(key, default)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._refuse(key)
        self._local[key] = value

    def __iter__(self) -> Any:
        return iter(self._local)

    def __len__(self) -> int:
        return len(self._local)

    def keys(self) -> Any:
        return self._local.keys()

    def values(self) -> Any:
        return self._local.values()

    def items(self) -> Any:
        return self._local.items()

    def __repr__(self) -> str:
        return f"ShardedState({len(self._local)} pieces of this rank)"


def _redirect(optimizer: torch.optim.Optimizer, sharded: "ShardedOptimizer") -> None:
    """The wrapped optimizer answers for the ShardedOptimizer, or refuses: it no longer steps anything itself.

    Code that kept a reference to it (a training loop, a scheduler helper) zeroes the gradients, saves and
    loads the state through the ShardedOptimizer; stepping it directly is refused. Its class becomes a subclass
    of its own class with those methods (isinstance holds), holding the ShardedOptimizer weakly: no cycle.
    """
    optimizer._fastcoll_sharded = weakref.ref(sharded)  # type: ignore[attr-defined]
    optimizer.__dict__.pop("step", None)  # an LR scheduler's counting wrapper of the old step
    optimizer.__class__ = _answering_class(type(optimizer))


#: Per torch optimizer class, its answering subclass: made once, as a class is always in a reference cycle with
#: its own ``__mro__`` (one class per wrapped optimizer would be garbage for the cyclic collector when it is freed).
_ANSWERING: Dict[type, type] = {}


def _answering_class(cls: type) -> type:
    """The subclass of ``cls`` whose ``step``/``zero_grad``/``state_dict``/``load_state_dict`` are :data:`_ANSWERS`."""
    if cls not in _ANSWERING:
        namespace = {**_ANSWERS, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
        _ANSWERING[cls] = type(cls.__name__, (cls,), namespace)
    return _ANSWERING[cls]


def _owner(optimizer: Any) -> "ShardedOptimizer":
    sharded = optimizer._fastcoll_sharded()
    if sharded is None:
        raise RuntimeError(f"fastcoll.ShardedOptimizer: the ShardedOptimizer wrapping this {type(optimizer).__name__} is gone")
    return sharded


def _refused_step(self: Any, *args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(
        f"fastcoll.ShardedOptimizer: this {type(self).__name__} is wrapped by a ShardedOptimizer, which steps it over "
        "this rank's ranges and all-gathers the parameters; call step() on the ShardedOptimizer"
    )


# LR schedulers mark the step they count (torch warns when it was replaced after them): the ShardedOptimizer's
# step() sets ``_opt_called`` on the wrapped optimizer itself.
_refused_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
_ANSWERS = {
    "step": _refused_step,
    "zero_grad": lambda self, set_to_none=True: _owner(self).zero_grad(set_to_none),
    "state_dict": lambda self: _owner(self).state_dict(),
    "load_state_dict": lambda self, state_dict: _owner(self).load_state_dict(state_dict),
}


def _copy_changed(source: Dict[str, Any], target: Dict[str, Any]) -> None:
    """The entries of param group ``source`` (but its params) that ``target`` lacks or holds another object for."""
    for k, v in source.items():
        if k != "params" and (k not in target or target[k] is not v):
            target[k] = v


def _check_pool(
    grads: str, grad_buffers: str, pool_buffers: Optional[int], accumulate: Optional[str], model: Any
) -> Tuple[Optional[int], Optional[str]]:
    """The pool's size and accumulation choice, defaults filled in (None, None without the pool).

    Raises:
        ValueError: an unknown ``grad_buffers``/``accumulate``, a pool with ``grads="full"`` or gradients as
            bucket views, a ``pool_buffers`` below 1, or pool arguments without the pool.
    """
    if grad_buffers not in _GRAD_BUFFERS:
        raise ValueError(f"fastcoll.ShardedOptimizer: grad_buffers must be one of {_GRAD_BUFFERS}, got {grad_buffers!r}")
    if grad_buffers == "persistent":
        if pool_buffers is not None or accumulate is not None:
            raise ValueError(
                "fastcoll.ShardedOptimizer: pool_buffers and accumulate apply to grad_buffers='pool' only "
                f"(got grad_buffers='persistent', pool_buffers={pool_buffers!r}, accumulate={accumulate!r})"
            )
        return None, None
    if grads != "sharded":
        raise ValueError(
            "fastcoll.ShardedOptimizer: grad_buffers='pool' needs grads='sharded' (with grads='full' every rank "
            "keeps every full gradient, so there is no buffer to release); pass grads='sharded'"
        )
    if model.gradient_as_bucket_view:
        raise ValueError(
            "fastcoll.ShardedOptimizer: grad_buffers='pool' cannot keep gradients as bucket views (the buffers are "
            "lent only while a bucket is reduced); construct fastcoll.DDP with gradient_as_bucket_view=False"
        )
    pool_buffers = 2 if pool_buffers is None else pool_buffers
    if isinstance(pool_buffers, bool) or not isinstance(pool_buffers, int) or pool_buffers < 1:
        raise ValueError(f"fastcoll.ShardedOptimizer: pool_buffers must be an int >= 1, got {pool_buffers!r}")
    accumulate = "reduce_scatter" if accumulate is None else accumulate
    if accumulate not in ACCUMULATE:
        raise ValueError(f"fastcoll.ShardedOptimizer: accumulate must be one of {ACCUMULATE}, got {accumulate!r}")
    return pool_buffers, accumulate


def _has_stepped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` has stepped (state some classes create in ``__init__``, e.g. Adagrad's at step 0, is not)."""
    for st in optimizer.state.values():
        if not st:
            continue
        step = st.get("step")
        if isinstance(step, torch.Tensor) and step.is_meta:
            continue  # no value to read: construction goes on, and the step raises as torch's does
        if step is None or float(step) > 0:
            return True
    return False


def _stepped(reducer: Any, groups: List[List[torch.Tensor]], index_of: Dict[int, int], sharded: bool) -> List[bool]:
    """Per reducer parameter, whether the optimizer steps it.

    Raises:
        ValueError: an optimizer parameter with a gradient that the model does not synchronize, a stepped one that
            is not dense (no block of memory to divide into ranges), or (sharded
            gradients) a synchronized parameter the optimizer does not step (its full gradient exists nowhere).
    """
    stepped = [False] * len(reducer.params)
    for gi, ps in enumerate(groups):
        for p in ps:
            i = index_of.get(id(p))
            if i is not None:
                stepped[i] = True
            elif p.requires_grad:
                raise ValueError(
                    f"fastcoll.ShardedOptimizer: a parameter of param group {gi} (shape {tuple(p.shape)}) is not "
                    "synchronized by the model (not one of its parameters, or excluded with "
                    "_set_params_and_buffers_to_ignore_for_model); only synchronized parameters can be sharded"
                )
    for i, p in enumerate(reducer.params):
        if stepped[i] and not is_dense(p):
            raise ValueError(
                f"fastcoll.ShardedOptimizer: parameter '{reducer.names[i]}' (shape {tuple(p.shape)}, strides "
                f"{tuple(p.stride())}) is not dense (a strided slice of a larger tensor?): each rank updates a range "
                "of every parameter's memory, so its elements must fill one block. Make it dense before wrapping the "
                "model: p.data = p.data.contiguous()"
            )
    if sharded:
        missing = [reducer.names[i] for i, s in enumerate(stepped) if not s]
        if missing:
            raise ValueError(
                "fastcoll.ShardedOptimizer(grads='sharded'): every synchronized parameter must be in the optimizer "
                f"(their full gradients exist nowhere); not in it: {', '.join(missing[:10])}"
            )
    return stepped


def _same_class(optimizer: torch.optim.Optimizer, groups: List[Dict[str, Any]]) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class over ``groups`` (each carrying its own hyperparameters)."""
    cls = type(optimizer)
    try:
        return cls(groups, **optimizer.defaults)
    except TypeError:
        return cls(groups)
