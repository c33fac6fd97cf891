"""``fastcoll.ShardedOptimizer``: any elementwise torch optimizer with its state divided among the ranks (ZeRO-1).

Built on the model's buckets (:mod:`fastcoll.reducer.shards`): rank ``r``
keeps the optimizer state of range ``r`` of every bucket and steps those
elements only, then the parameters are all-gathered (:mod:`.param_sync`).
The communication is DDP's (a reduce-scatter and an all-gather move what one
all-reduce moves); the state per rank is 1/N of DDP's.

Two ways to get the gradients:

* ``grads="full"`` (default): backward all-reduces as under DDP; every
  ``p.grad`` is torch DDP's, and the optimizer steps the views of this rank's
  pieces of them.
* ``grads="sharded"``: each bucket is reduce-scattered; the reduced values
  live only in this rank's range (:attr:`Reducer.shard_grads`), which the
  pieces' ``.grad`` view. ``p.grad`` then refuses to be read
  (:mod:`.grad_guard`); ``param_groups`` hold the pieces, so
  ``torch.amp.GradScaler`` unscales and checks exactly this rank's range.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .. import ops
from ..reducer.shards import Piece, flat_view
from .elementwise import check_optimizer_class
from .grad_guard import ShardedGradient, is_guard
from .param_sync import ParamSync, piece_views

__all__ = ["ShardedOptimizer"]

_GRADS = ("full", "sharded")


class ShardedOptimizer(torch.optim.Optimizer):
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

    Raises:
        TypeError: ``optimizer`` is not a torch optimizer or ``model`` not a fastcoll.DDP.
        ValueError: a class that does not update elementwise, an optimizer
            that already stepped, a parameter that is not synchronized by
            ``model``, ``grads`` not one of "full"/"sharded".
        RuntimeError: ``model`` has a comm hook, ``bucket_cap_mb="auto"`` or sparse gradients.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        *,
        grads: str = "full",
        overlap_param_gather: bool = True,
        elementwise: bool = False,
    ):
        from ..ddp import DDP

        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, ShardedOptimizer):
            raise TypeError(f"fastcoll.ShardedOptimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not isinstance(model, DDP):
            raise TypeError(f"fastcoll.ShardedOptimizer: model must be a fastcoll.DDP, got {type(model).__name__}")
        if grads not in _GRADS:
            raise ValueError(f"fastcoll.ShardedOptimizer: grads must be one of {_GRADS}, got {grads!r}")
        check_optimizer_class(type(optimizer), elementwise)
        if _has_stepped(optimizer):
            raise ValueError(
                "fastcoll.ShardedOptimizer: the optimizer has already stepped (it holds state); wrap it before its first step"
            )
        reducer = model.reducer
        self.model = model
        self.reducer = reducer
        self.grads = grads
        self.overlap_param_gather = bool(overlap_param_gather)
        index_of = {id(p): i for i, p in enumerate(reducer.params)}
        self._groups_params = [list(g["params"]) for g in optimizer.param_groups]
        self._order = [p for ps in self._groups_params for p in ps]  # the standard state dict's parameter numbering
        self._order_index = [index_of.get(id(p)) for p in self._order]  # their reducer indices (None: not synchronized)
        stepped = [False] * len(reducer.params)
        for gi, ps in enumerate(self._groups_params):
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
        if grads == "sharded":
            missing = [reducer.names[i] for i, s in enumerate(stepped) if not s]
            if missing:
                raise ValueError(
                    "fastcoll.ShardedOptimizer(grads='sharded'): every synchronized parameter must be in the optimizer "
                    f"(their full gradients exist nowhere); not in it: {', '.join(missing[:10])}"
                )
        self._stepped = stepped
        # State some classes create at construction for parameters that are not sharded (frozen ones): kept as is.
        self._outside_state = {k: st for k, p in enumerate(self._order) if index_of.get(id(p)) is None
                               for st in [optimizer.state.get(p)] if st}  # fmt: skip
        self._layout = reducer.shard(grads == "sharded")  # collective when a bucket rebuild is due
        self._pieces: List[Tuple[int, Piece]] = [  # (bucket position, piece) of the stepped parameters, bucket order
            (bs.pos, pc) for bs, pcs in zip(self._layout.buckets, self._layout.pieces) for pc in pcs if stepped[pc.param]
        ]
        self._shard_params = self._make_shard_params()
        self._piece_of_shard = {id(t): k for k, t in enumerate(self._shard_params)}
        inner_groups = self._inner_groups(optimizer, index_of)
        self.inner = _same_class(optimizer, inner_groups)
        outer = [dict(g, params=list(ig["params"]) if grads == "sharded" else list(g["params"])) for g, ig in
                 zip(optimizer.param_groups, inner_groups)]  # fmt: skip
        self._built = False
        super().__init__(outer, dict(optimizer.defaults))
        self._built = True
        self.state = self.inner.state  # this rank's pieces' state
        self._sync = ParamSync(reducer, stepped, self._stages(), self.overlap_param_gather)
        if self.overlap_param_gather:
            self._sync.install_hooks(model.module)
        model._param_sync = self._sync
        reducer.on_backward.append(self._sync.finish)
        for m in (model, model.module):
            m.register_state_dict_pre_hook(lambda *args, **kwargs: self._sync.finish())
        if grads == "sharded":
            reducer.health.watched = [reducer.shard_grads.grads[bs.pos] for bs in self._layout.buckets]
            reducer.on_synchronized.append(self._after_sharded_backward)
            reducer.on_forward.append(self._drop_guards)
        self._used = [False] * len(reducer.params)  # since the last zero_grad (grads="sharded")

    # ------------------------------------------------------------- building

    def _make_shard_params(self) -> List[torch.Tensor]:
        """One 1-D tensor per piece: a view of this rank's part of the parameter (stepped in place)."""
        return piece_views(self.reducer.params, [pc for _, pc in self._pieces])

    def _inner_groups(self, optimizer: torch.optim.Optimizer, index_of: Dict[int, int]) -> List[Dict[str, Any]]:
        by_param: Dict[int, List[torch.Tensor]] = {}
        for (_, pc), t in zip(self._pieces, self._shard_params):
            by_param.setdefault(pc.param, []).append(t)
        groups = []
        for g in optimizer.param_groups:
            params = [t for p in g["params"] if id(p) in index_of for t in by_param.get(index_of[id(p)], [])]
            groups.append(dict(g, params=params))
        return groups

    def _stages(self) -> Dict[int, torch.Tensor]:
        """Per sharded bucket, where its parameters are all-gathered: the bucket's own buffer when it is free then."""
        r = self.reducer
        stages = {}
        for bs in self._layout.buckets:
            b = r.buckets[bs.pos]
            free = b.flat.dtype == b.dtype and (self.grads == "sharded" or not b.as_view)
            stages[bs.pos] = b.flat_padded if free else torch.empty(b.padded, dtype=b.dtype, device=b.device)
        return stages

    # ----------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Step this rank's pieces with the inner optimizer, then all-gather the parameters.

        Every rank must call it (the all-gathers are collectives).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync.finish()
        self._push_hyperparameters()
        self._attach_grads()
        self.inner.step()
        self._sync.start(self._gather_sources)
        return loss

    def _push_hyperparameters(self) -> None:
        for g, ig in zip(self.param_groups, self.inner.param_groups):
            for k, v in g.items():
                if k != "params":
                    ig[k] = v

    def _attach_grads(self) -> None:
        """Give each piece its gradient: a view of ``p.grad`` (full) or of this rank's reduced range (sharded)."""
        params = self.reducer.params
        if self.grads == "sharded":
            ranges = self.reducer.shard_grads.grads
            filled = self.reducer.shard_grads.filled
            for (pos, pc), t in zip(self._pieces, self._shard_params):
                t.grad = ranges[pos][pc.at : pc.at + pc.numel] if filled and self._used[pc.param] else None
            return
        full: Dict[int, Optional[torch.Tensor]] = {}
        for (_, pc), t in zip(self._pieces, self._shard_params):
            if pc.param not in full:
                full[pc.param] = _memory_order_grad(params[pc.param])
            g = full[pc.param]
            t.grad = None if g is None else g[pc.lo : pc.hi]

    def _gather_sources(self, pos: int) -> List[torch.Tensor]:
        """The values this rank contributes to bucket ``pos``'s all-gather: every parameter's piece in its range."""
        bs_index = next(k for k, bs in enumerate(self._layout.buckets) if bs.pos == pos)
        return piece_views(self.reducer.params, self._layout.pieces[bs_index])

    def finish_param_sync(self) -> None:
        """Wait for the parameters' all-gathers of the last step and write them into the parameters."""
        self._sync.finish()

    # ------------------------------------------------------------ gradients

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients: the model's ``.grad`` (as ``Optimizer.zero_grad``) and this rank's reduced ranges."""
        if self.grads == "full":
            super().zero_grad(set_to_none)
        else:
            self._drop_guards()
            for p in self.reducer.params:
                if p.grad is not None and set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.detach_().zero_()
            self.reducer.shard_grads.zero()
            self._used = [False] * len(self._used)
        for t in self._shard_params:
            t.grad = None

    def _after_sharded_backward(self) -> None:
        """End of a synchronized backward with reduce-scattered gradients: guards in ``.grad``; agree on non-finite."""
        r = self.reducer
        used = r.usage.global_used
        for i, p in enumerate(r.params):
            if used is None or used[i]:
                self._used[i] = True
            if self._used[i]:
                p.grad = ShardedGradient(p)
        self._attach_grads()  # GradScaler.unscale_ and clipping read the pieces' gradients before step()
        total = r.health.total
        if total is not None and self._pieces:
            # A non-finite value anywhere makes every rank's own range non-finite too, so that a GradScaler
            # on each rank (which sees its range only) finds it and every rank skips the same steps.
            bad = ~torch.isfinite(total)
            ranges = r.shard_grads.grads
            seen = set()
            for pos, pc in self._pieces:
                if pos not in seen:
                    seen.add(pos)
                    first = ranges[pos][pc.at : pc.at + 1]
                    first.copy_(torch.where(bad, torch.full_like(first, math.inf), first))

    def _drop_guards(self) -> None:
        """Before a forward (or zero_grad): backward must accumulate into fresh gradients, not into a guard."""
        for p in self.reducer.params:
            if is_guard(p.grad):
                p.grad = None

    # ------------------------------------------------------------- clipping

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: Optional[bool] = None
    ) -> torch.Tensor:
        """Clip the synchronized gradients by their global norm, with ``torch.nn.utils.clip_grad_norm_``'s contract.

        The norm comes from every rank's range (one small all-reduce), so it
        is the same on every rank, bitwise; the gradients this rank holds
        (``p.grad`` with ``grads="full"``, its ranges with ``"sharded"``) are
        multiplied by ``min(1, max_norm / (norm + 1e-6))``.

        Returns:
            The total norm (a 0-dim float32 tensor).
        """
        norm_type = float(norm_type)
        ranges = self._own_ranges()
        device = self.reducer.usage.device
        if norm_type == math.inf:
            local = torch.stack([g.abs().max().to(torch.float64) for g in ranges]).max() if ranges else None
            total = (local if local is not None else torch.zeros((), dtype=torch.float64, device=device)).reshape(1)
            self._all_reduce(total, torch.distributed.ReduceOp.MAX)
        else:
            if norm_type == 2.0:
                total = torch.zeros(1, dtype=torch.float64, device=device)
                if ranges:
                    ops.sum_of_squares(ranges, out=total)
            else:
                total = sum((g.to(torch.float64).abs().pow(norm_type).sum() for g in ranges),
                            torch.zeros((), dtype=torch.float64, device=device)).reshape(1)  # fmt: skip
            self._all_reduce(total, torch.distributed.ReduceOp.SUM)
            total = total.pow(1.0 / norm_type)
        norm = total.reshape(()).to(torch.float32)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
                "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`"
            )
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        grads = self._held_grads()
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        if self.grads == "sharded":
            self.reducer.health.scaled(self.reducer.params, coef)
        return norm

    def _own_ranges(self) -> List[torch.Tensor]:
        """The reduced gradient values of this rank's range of every bucket (every parameter's, stepped or not)."""
        if self.grads == "sharded":
            return [g for g in self.reducer.shard_grads.grads.values() if g.numel()] if self.reducer.shard_grads.filled else []
        out = []
        params = self.reducer.params
        for pcs in self._layout.pieces:
            for pc in pcs:
                g = _memory_order_grad(params[pc.param])
                if g is not None:
                    out.append(g[pc.lo : pc.hi])
        return out

    def _held_grads(self) -> List[torch.Tensor]:
        if self.grads == "sharded":
            return self._own_ranges()
        return [p.grad for p in self.reducer.params if p.grad is not None]

    def _all_reduce(self, t: torch.Tensor, op: Any) -> None:
        comm = self.reducer.comm
        if comm.active:
            work = torch.distributed.all_reduce(t, op=op, group=comm.group, async_op=True)
            comm.wait(work, "gradient norm")

    # ------------------------------------------------------------ misc API

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Only while the optimizer is being built: groups cannot be added to a sharded optimizer."""
        if getattr(self, "_built", False):
            raise RuntimeError(
                "fastcoll.ShardedOptimizer: param groups cannot be added after construction (the pieces are fixed); "
                "add them to the torch optimizer before wrapping it"
            )
        super().add_param_group(param_group)

    def __repr__(self) -> str:
        return f"ShardedOptimizer({self.inner!r}, grads={self.grads!r}, ranks={self._layout.world_size})"

    # Checkpoints: fastcoll.optim.checkpoint
    def state_dict(self) -> Dict[str, Any]:
        """The inner optimizer class's standard state dict, as if it had never been sharded (a collective).

        Per-parameter state keyed by parameter index (the wrapped optimizer's
        numbering), full tensors, identical on every rank: loadable by the
        plain torch optimizer in a single process, or by :meth:`load_state_dict`
        at any world size.
        """
        from .checkpoint import full_state_dict

        return full_state_dict(self)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a standard (unsharded) state dict of the inner optimizer's class; each rank keeps its pieces."""
        from .checkpoint import load_full_state_dict

        load_full_state_dict(self, state_dict)

    def sharded_state_dict(self) -> Dict[str, Any]:
        """This rank's pieces of the state and the layout needed to reshard them (see :mod:`fastcoll.optim.checkpoint`)."""
        from .checkpoint import sharded_state_dict

        return sharded_state_dict(self)

    def load_sharded_state_dict(self, state_dicts: Sequence[Dict[str, Any]]) -> None:
        """Load the :meth:`sharded_state_dict` of every rank of a run at any world size (this rank takes its pieces)."""
        from .checkpoint import load_sharded_state_dicts

        load_sharded_state_dicts(self, state_dicts)


def _has_stepped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` has stepped (state some classes create in ``__init__``, e.g. Adagrad's at step 0, is not)."""
    for st in optimizer.state.values():
        if not st:
            continue
        step = st.get("step")
        if step is None or float(step) > 0:
            return True
    return False


def _memory_order_grad(p: torch.Tensor) -> Optional[torch.Tensor]:
    """``p.grad`` as a 1-D tensor in ``p``'s memory order (a view when the gradient has ``p``'s strides)."""
    g = p.grad
    if g is None:
        return None
    if g.stride() != p.stride() and g.numel() > 1:
        g = torch.empty_like(p).copy_(g)
    return flat_view(g)


def _same_class(optimizer: torch.optim.Optimizer, groups: List[Dict[str, Any]]) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class over ``groups`` (each carrying its own hyperparameters)."""
    cls = type(optimizer)
    try:
        return cls(groups, **optimizer.defaults)
    except TypeError:
        return cls(groups)
