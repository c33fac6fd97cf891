"""The reducer's between-iterations side: configuration changes, read-only inspection, errors, teardown.

:class:`ReducerSettings` is the part of :class:`~fastcoll.reducer.Reducer`
that is never called during a backward: switching to a static graph,
installing a comm hook or a wire dtype, the gradient divisor, and what tests
and tools may read (layout, bucket info, the recorded ready order, counters,
collective listeners, the tuning report). The iteration protocol itself is
in :mod:`.core`.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from ..bucketing import assign_buckets
from ..ops.dtypes import check_comm_accum_dtype, check_comm_dtype, check_complex_wire
from .bucket import PackArgs
from .comm import Collective
from .health import check_divisor, inverse_divisor
from .reduction import CommHook, Skipped
from .usage import marked_twice_error, unfinished_error

__all__ = ["ReducerSettings"]


class ReducerSettings:
    """Configuration and inspection methods of :class:`~fastcoll.reducer.Reducer` (see the module docstring)."""

    def set_gradient_divisor(self, divisor: Any) -> None:
        """Divide the next synchronized backwards' summed gradients by ``divisor``.

        ``divisor``: a float, a 1-element tensor, or None (the default).
        """
        self._user_divisor = check_divisor(divisor)

    def _pack_args(self) -> PackArgs:
        """This backward's pack factor: 1/divisor.

        A comm hook divides by the world size itself, so it gets world_size/divisor.
        """
        d = self._user_divisor
        hook = self._hook is not None
        if d is None:
            return PackArgs(1.0 if hook else 1.0 / self.divisor)
        base = float(self.world_size) if hook else 1.0
        if isinstance(d, torch.Tensor):
            return PackArgs(base, inverse_divisor(d, self.usage.device))
        return PackArgs(base / d)

    # -------------------------------------------------------- configuration

    def _check_idle(self, what: str) -> None:
        if self.reducing:
            raise RuntimeError(f"fastcoll.DDP: cannot {what} while a backward pass is being reduced; do it between iterations")

    def _check_unsharded(self, what: str) -> None:
        # A sharded optimizer holds views of the buckets and reduces them its own way.
        if self.shards is not None:
            raise RuntimeError(
                f"fastcoll.DDP: cannot {what}: a fastcoll.ShardedOptimizer divides this model's buckets, and it takes "
                "no comm hook; choose comm_dtype when wrapping the model, before the optimizer is built"
            )

    def set_static_graph(self) -> None:
        """Switch to static-graph mode; only before the first synchronized iteration.

        Raises:
            RuntimeError: a synchronized iteration has completed (recorded in :attr:`runtime_log`).
        """
        try:
            self.usage.enable_static_graph()
        except RuntimeError as exc:
            self.runtime_log.record_error(str(exc))
            raise
        self._set.order.enable()

    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        """Install ``hook`` (already validated by :class:`fastcoll.DDP`); between iterations only."""
        self._check_idle("register a comm hook")
        self._check_unsharded("register a comm hook")
        if self.comm_dtype is not None:
            raise RuntimeError("fastcoll.DDP: a comm hook cannot be combined with comm_dtype")
        if self._tuning is not None:
            raise RuntimeError(
                "fastcoll.DDP: a comm hook cannot be combined with bucket_cap_mb='auto': tuning switches bucket layouts, "
                "and stateful hooks (PowerSGD, post-local SGD) key their state by bucket index; pass a fixed bucket_cap_mb"
            )
        sparse = [self.names[i] for i, s in enumerate(self._sparse) if s]
        if sparse:
            raise RuntimeError(
                f"fastcoll.DDP: comm hooks are not supported with sparse gradients (parameter '{sparse[0]}' belongs "
                "to an nn.Embedding/EmbeddingBag with sparse=True); use sparse=False or no comm hook"
            )
        self._hook = CommHook(self.comm, hook, state, self.timeline)
        self._index_reductions()

    def set_comm_dtype(self, comm_dtype: Optional[torch.dtype]) -> None:
        """Change the wire dtype (reallocates the bucket buffers, keeping the layout); between iterations only."""
        check_comm_dtype(comm_dtype)
        check_complex_wire(zip(self.names, self.params), comm_dtype)
        self._check_idle("change comm_dtype")
        if comm_dtype != self.comm_dtype:
            self._check_unsharded("change comm_dtype")
        if comm_dtype is not None and self._hook is not None:
            raise RuntimeError("fastcoll.DDP: comm_dtype cannot be combined with a comm hook")
        if self.comm_accum_dtype is not None:
            check_comm_accum_dtype(self.comm_accum_dtype, comm_dtype)
        if comm_dtype == self.comm_dtype:
            return
        self.comm_dtype = comm_dtype
        if not self.closed:
            self._install_layout(self.layout(), lazy=self._set.deferred)  # (still no buffers before their first need)

    # ------------------------------------------------------------ inspection

    def layout(self) -> List[List[int]]:
        """The current buckets as lists of parameter indices, in reduction order."""
        return self._set.layout()

    def initial_layout(self) -> List[List[int]]:
        """The layout built at construction (reverse registration order), whatever the layout is now."""
        return self._set.initial_layout()

    def rebuilt_layout(self) -> Optional[List[List[int]]]:
        """The layout the one rebuild from the gradient-ready order installed; None when no rebuild has happened."""
        s = self._set
        if s.rebuild_order is None:
            return None
        return assign_buckets(s.specs, s.rebuild_order, s.first_bucket_bytes, s.bucket_cap_bytes)

    def bucket_info(self) -> List[Dict[str, Any]]:
        """Each bucket's index, parameter names, dtype, device, numel, bytes and wire dtype, in reduction order."""
        return self._set.info()

    @property
    def recorded_order(self) -> Optional[List[int]]:
        """The gradient-ready order recorded in the first synchronized backward, until the rebuild takes it."""
        rec = self._set.order.recorded
        return None if rec is None else list(rec)

    @property
    def rebuilt(self) -> bool:
        """Whether the one layout rebuild from the ready order has happened (or never will)."""
        return self._set.order.rebuilt

    # ------------------------------------------- torch's C++ Reducer's names

    def _rebuild_buckets(self) -> bool:
        """torch Reducer's name of :meth:`rebuild_buckets` (Lightning's manual optimization calls it)."""
        return self.rebuild_buckets()

    def _delay_all_reduce(self) -> None:
        """torch's delayed reduction of a static graph's first iteration: fastcoll's happens at the end of that backward.

        Raises:
            RuntimeError: the backward left buckets unreduced (parameters without gradients).
        """
        if self.reducing:
            self._raise_unfinished()

    def _ddp_graph_static(self) -> bool:
        """torch's: whether the graph looks static so far (static_graph, or the same unused parameters every iteration)."""
        return self.usage.static_graph or self.usage.graph_static

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """torch's: sample every ``sample_rate``-th iteration's runtime statistics after the first 10."""
        self.runtime_log.set_sample_rate(sample_rate)

    def _get_local_used_map(self) -> torch.Tensor:
        """The last used-parameter map reduced over ranks (int32 counts per parameter), as torch's reducer keeps it."""
        last = self.usage._last_reduced
        return last if last is not None else torch.zeros(len(self.params), dtype=torch.int32, device=self.usage.device)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the reducer does not have: torch's C++ Reducer methods get a message naming fastcoll.
        if name in _TORCH_REDUCER_ONLY:
            raise AttributeError(
                f"fastcoll's Reducer has no torch Reducer method {name!r}: fastcoll.DDP's reducer is its own "
                "(fastcoll.reducer); see fastcoll.DDP's members and bucket_info()"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ------------------------------------------------------- inspection seams

    def add_collective_listener(self, fn: Callable[[Collective], None]) -> Callable[[], None]:
        """Call ``fn`` with a :class:`~fastcoll.reducer.comm.Collective` for every collective issued; returns its remover."""
        return self.comm.add_listener(fn)

    def stats(self) -> Dict[str, int]:
        """Counters: completed synchronized ``iterations``, ``unused_searches`` run, ``collectives`` issued,
        ``host_reads`` of the used-parameter map (each a host synchronization; none without find_unused_parameters)."""
        u = self.usage
        return {
            "iterations": u.iterations,
            "unused_searches": u.searches,
            "collectives": self.comm.seq,
            "host_reads": u.host_reads,
        }

    def buckets_reduced(self) -> int:
        """Buckets of the iteration under way (or just completed) that issued a reduction (not skipped as unused)."""
        return sum(1 for f in self._inflight if f is not None and not isinstance(f, Skipped))

    def tuning_report(self) -> Optional[List[Dict[str, Any]]]:
        """``bucket_cap_mb="auto"``: each candidate layout with its measured medians and which was chosen (empty
        before the tuning starts); None without autotuning."""
        return None if self._tuning is None else self._tuning.report()

    # ----------------------------------------------------------------- errors

    def _raise_marked_twice(self, idx: int) -> None:
        raise self._logged(marked_twice_error(self.names[idx], idx in self.usage.unused))

    def unfinished_names(self) -> List[str]:
        """Names of parameters whose gradients are still missing in the current iteration."""
        return [self.names[i] for i in self.usage.unfinished()]

    def _raise_unfinished(self) -> None:
        raise self._logged(unfinished_error(self.unfinished_names()))

    def _logged(self, exc: BaseException) -> BaseException:
        """``exc``, recorded as the last error (torch's reducer logs its checks' failures the same way)."""
        self.runtime_log.record_error(str(exc))
        return exc

    # ---------------------------------------------------------------- teardown

    def close(self) -> None:
        """Remove the autograd hooks and release the bucket buffers.

        Gradients that are views of a bucket keep that storage alive; they stay valid.
        """
        self._finalizer()
        self._phase = type(self._phase).IDLE  # Phase.IDLE (core.py defines the enum)
        self._set.clear()
        self._reductions = []
        self._count_expected()
        self._reset_progress()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return not self._finalizer.alive


#: Methods of torch's C++ ``dist.Reducer`` that fastcoll's reducer does not offer.
_TORCH_REDUCER_ONLY = frozenset(
    {
        "_autograd_hook", "_check_reducer_finalized", "_get_zeros_like_grad_buckets",
        "_install_post_backward_futures", "_push_all_rebuilt_params", "_remove_autograd_hooks", "_reset_state",
        "_run_allreduce_hook", "_run_comm_hook", "_set_forward_pass_work_handle",
        "_set_mixed_precision_param_dtype", "_set_optimizer_in_backward", "_set_sparse_metadata", "_set_static_graph",
        "_update_process_group", "get_backward_stats", "set_logger",
    }
)  # fmt: skip
