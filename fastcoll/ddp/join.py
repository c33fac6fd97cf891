"""Uneven inputs for :class:`fastcoll.DDP`: the join protocol's collectives, on training and joined ranks.

Under ``DDP.join()``, a rank that runs out of inputs keeps issuing, every
iteration, the collectives the ranks still training issue, until all have
run out. Per iteration, in this order on every rank (after the Join's own
"not joined yet" all-reduce, whose sum is the number of ranks still training):

1. the pending one-time bucket layout broadcast (:meth:`Reducer.rebuild_buckets`);
2. with buffer sync: an all-reduce MAX electing the highest rank still
   training as the source, then the buffer broadcast from it;
3. the "requires sync" all-reduce: > 0 when a synchronized backward follows;
4. if it does: the backward's collectives (:meth:`Reducer.replay_joined_backward`
   on joined ranks).

When every rank has joined, the model state of the highest last joiner is
broadcast to all. :class:`JoinState` holds a wrapper's side of this;
:class:`DDPJoinHook` is what a :class:`~torch.distributed.algorithms.join.Join`
runs on the joined ranks.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from .._backref import BackRef
from ..stall import protected_wait, run_collective
from .broadcast import broadcast_coalesced

__all__ = ["DDPJoinHook", "JoinState", "JoinSupport"]


class JoinState:
    """A wrapper's join bookkeeping: the active-rank count and the requires-sync flag in flight."""

    ddp = BackRef()  # the wrapper holds this state: no cycle back to it

    def __init__(self, ddp: Any):
        self.ddp = ddp
        #: join(divide_by_initial_world_size=...): average over the initial world size (True) or the active ranks.
        self.divide_by_initial_world_size = True
        self._count_work: Any = None  # the Join's "not joined yet" all-reduce: its sum is the active rank count
        self._sync_flag: Optional[Tuple[Any, torch.Tensor]] = None

    def notify(self) -> None:
        """At the start of a forward under an enabled join: take part in the Join's per-iteration all-reduce."""
        work = Join.notify_join_context(self.ddp)  # None unless the DDP module is the Join's first joinable
        self._count_work = None if self.divide_by_initial_world_size else work

    def divisor(self, world_size: int) -> float:
        """This iteration's divisor: the initial world size, or the number of ranks still training."""
        work, self._count_work = self._count_work, None
        if work is None:
            return float(world_size)
        protected_wait(work, self.ddp.process_group, "join: ranks still training", self.ddp.stall_timeout, self.ddp.device)
        return float(work.get_future().value()[0].item())

    def common_rank(self, candidate: bool) -> int:
        """The highest group rank among the ranks passing ``candidate=True`` (an all-reduce MAX)."""
        ddp = self.ddp
        t = torch.tensor([dist.get_rank(ddp.process_group) if candidate else -1], device=ddp.device)
        run_collective(
            lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ddp.process_group, async_op=True),
            "all_reduce", "join: source rank", t, ddp.process_group, ddp.stall_timeout,
        )  # fmt: skip
        rank = int(t.item())
        if rank < 0:
            raise RuntimeError("fastcoll.DDP.join: join protocol error: no rank offered to be the source of the model state")
        return rank

    def send_requires_sync(self, requires_sync: bool) -> None:
        """Start the all-reduce telling joined ranks whether a synchronized backward follows."""
        self._sync_flag = self._requires_sync_all_reduce(requires_sync)

    def _requires_sync_all_reduce(self, requires_sync: bool) -> Tuple[Any, torch.Tensor]:
        t = (torch.ones if requires_sync else torch.zeros)(1, device=self.ddp.device)
        return dist.all_reduce(t, group=self.ddp.process_group, async_op=True), t

    def receive_requires_sync(self) -> int:
        """On a joined rank: how many ranks still training run a synchronized backward this iteration (0: none)."""
        work, flag = self._requires_sync_all_reduce(False)
        protected_wait(work, self.ddp.process_group, "join: requires sync", self.ddp.stall_timeout, self.ddp.device)
        return int(flag.item())

    def sync_final_model(self, is_last_joiner: bool) -> None:
        """Broadcast parameters (and buffers, with broadcast_buffers) from the highest last-joining rank."""
        ddp = self.ddp
        src = self.common_rank(is_last_joiner)
        with torch.no_grad():
            ddp._authoritative_rank = src  # torch DDP's name for the source of the final model
            states = ddp._sync_states(ddp.forward_sync_buffers)
            broadcast_coalesced(states, ddp.process_group, src, ddp.broadcast_bucket_size, ddp.stall_timeout)


class DDPJoinHook(JoinHook):
    """Join hook of :class:`fastcoll.DDP`: on a rank out of inputs, replays one iteration's collectives.

    ``main_hook`` issues what :meth:`fastcoll.DDP.forward` and the reducer
    issue on the ranks still training (see the module docstring);
    ``post_hook`` broadcasts the model state of the last rank to join.
    """

    def __init__(self, ddp: Any, divide_by_initial_world_size: bool):
        from .wrapper import DDP

        if not isinstance(ddp, DDP):
            raise TypeError(f"fastcoll.DDP.join_hook: expects a fastcoll.DDP, got {type(ddp).__name__}")
        self.ddp = ddp
        ddp._join.divide_by_initial_world_size = bool(divide_by_initial_world_size)
        super().__init__()

    def main_hook(self) -> None:
        ddp = self.ddp
        ddp.reducer.prepare_layout()
        if ddp.require_forward_param_sync and ddp.forward_sync_buffers and ddp._buffer_sync:
            ddp._sync_buffers(ddp._join.common_rank(False))
        training = ddp._join.receive_requires_sync()
        should_sync = training > 0
        ddp.require_forward_param_sync = should_sync
        if should_sync:
            # The training ranks' divisor: with comm_accum_dtype this rank sums (and scales) its range of the result.
            initial = ddp._join.divide_by_initial_world_size
            ddp.reducer.divisor = float(ddp.reducer.world_size if initial else training)
            ddp.reducer.replay_joined_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp._join.sync_final_model(is_last_joiner)


class JoinSupport(Joinable):
    """The :class:`~torch.distributed.algorithms.join.Joinable` interface of :class:`fastcoll.DDP`.

    Expects the wrapper's ``_join`` (a :class:`JoinState`), ``device`` and ``process_group``.
    """

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """Context manager for training with uneven inputs across ranks, as torch DDP's ``join()``.

        Ranks that run out of inputs keep issuing the collectives of a training
        iteration with zero gradients until every rank has run out; then the
        model state of the last rank to finish is broadcast to all. Wrap the
        training loop (forward, backward, optimizer step) in it.

        Args:
            divide_by_initial_world_size: Average over the initial world size
                (True), or over the ranks still training in that iteration (False).
                Comm hooks divide as they do on their own (by the group size).
            enable: False disables uneven-input detection (no extra collectives).
            throw_on_early_termination: Raise on every rank as soon as one runs
                out of inputs, instead of continuing.

        Returns:
            A :class:`torch.distributed.algorithms.join.Join` over this module.
            For several joinables (e.g. a ``ZeroRedundancyOptimizer``), build
            ``Join([ddp, optimizer], divide_by_initial_world_size=...)`` with
            the DDP module first.

        Note:
            Like torch DDP, every rank still training must run one forward per
            iteration; a synchronized backward must follow each forward run
            with gradients enabled outside ``no_sync()`` (forwards under
            ``torch.no_grad()`` are fine: joined ranks learn that no backward
            follows).
        """
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook a :class:`~torch.distributed.algorithms.join.Join` runs on ranks that have run out of inputs.

        Keyword Args:
            divide_by_initial_world_size (bool): see :meth:`join` (default True).
        """
        if self.reducer.shards is not None:
            raise ValueError(
                "fastcoll.DDP: join() cannot be combined with buckets divided among the ranks (fastcoll.ShardedOptimizer): "
                "a rank that has run out of inputs would not update its range. Give every rank the same number of batches "
                "(e.g. DistributedSampler(drop_last=True))"
            )
        if self.skip_all_reduce_unused_params and self.reducer.usage.searching:
            raise ValueError(
                "fastcoll.DDP: join() cannot be combined with skip_all_reduce_unused_params and a dynamic graph: a rank "
                "that has run out of inputs cannot know which buckets the others skip. Use static_graph=True (the "
                "unused parameters are then learned once) or drop skip_all_reduce_unused_params"
            )
        return DDPJoinHook(self, divide_by_initial_world_size=kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        """Device of the join protocol's collectives (the parameters' device)."""
        return self.device

    @property
    def join_process_group(self) -> Any:
        """Process group of the join protocol's collectives."""
        return self.process_group

    @property
    def _divide_by_initial_world_size(self) -> bool:
        """torch DDP's name for the join divisor choice (set by :meth:`join_hook`)."""
        return self._join.divide_by_initial_world_size
