"""Which parameters take part in an iteration: expected gradient counts, unused parameters, static graphs.

Three modes, fixed per iteration by :meth:`ParameterUsage.begin_iteration`:

* default: every parameter gets exactly one gradient per synchronized backward;
* ``find_unused_parameters``: before backward, the autograd graph is searched
  from the forward's outputs; parameters not reached are marked ready at the
  first hook; parameters reachable from the outputs that the backward did
  not reach (an output the loss ignores) are ready at its end. Each rank's
  "got a gradient" map, which also counts the ``no_sync`` backwards since the
  last synchronized one, is summed over ranks (the used-parameter all-reduce,
  issued after the last bucket): a parameter used on any rank is averaged,
  one unused on every rank keeps its ``.grad`` (torch's reducer rules);
* ``static_graph``: the first iteration is a learning one (no bucket launches
  during backward: the hooks only count), its counts become the expected
  counts and its global use map is kept for every later iteration, without
  any graph search or used-parameter all-reduce.

:meth:`ParameterUsage.end_iteration` closes every synchronized iteration,
on ranks that trained and on ranks that replay a joined backward alike.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

from .comm import Communicator

__all__ = ["ParameterUsage", "find_tensors", "marked_twice_error", "unfinished_error", "unreachable_parameters"]


def find_tensors(obj: Any) -> List[torch.Tensor]:
    """All tensors inside ``obj``: nested lists, tuples (incl. namedtuples), dicts, sets and dataclasses."""
    out: List[torch.Tensor] = []
    stack = [obj]
    seen = set()
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif hasattr(o, "__dataclass_fields__") and not isinstance(o, type):
            if id(o) in seen:
                continue
            seen.add(id(o))
            stack.extend(getattr(o, f) for f in o.__dataclass_fields__)
    return out


def unreachable_parameters(outputs: Any, index_of_id: dict, n: int) -> List[int]:
    """Indices of the parameters not reachable from ``outputs`` through the autograd graph.

    ``n`` parameters; ``index_of_id`` maps ``id(param)`` to its index.
    """
    used = bytearray(n)
    found = 0
    stack = []
    for t in find_tensors(outputs):
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad:
            i = index_of_id.get(id(t))
            if i is not None and not used[i]:
                used[i] = 1
                found += 1
    seen = set()
    while stack and found < n:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)
        if var is not None:
            i = index_of_id.get(id(var))
            if i is not None and not used[i]:
                used[i] = 1
                found += 1
            continue
        for nxt, _ in fn.next_functions:
            if nxt is not None and nxt not in seen:
                stack.append(nxt)
    return [i for i in range(n) if not used[i]]


class ParameterUsage:
    """Per-parameter gradient accounting for one reducer.

    Args:
        params: The reducer's parameters.
        comm: The reducer's communicator (for the used-parameter all-reduce).
        device: Device of the used-parameter map.
        find_unused: Search for unused parameters every iteration (unless static).
        static_graph: Learn counts and use in the first iteration, then keep them.
    """

    def __init__(
        self, params: Sequence[torch.Tensor], comm: Communicator, device: torch.device, find_unused: bool, static_graph: bool
    ):
        n = len(params)
        self.n = n
        self.comm = comm
        self.device = device
        self.find_unused = find_unused
        self.static_graph = static_graph
        self.index_of_id = {id(p): i for i, p in enumerate(params)}
        #: Gradient accumulations per parameter that complete it in one iteration.
        self.expected: List[int] = [1] * n
        #: The first (learning) iteration of a static graph is still to come or under way.
        self.learning_static_graph = static_graph
        #: Completed synchronized iterations.
        self.iterations = 0
        #: Unused-parameter searches run (one per iteration when the graph is dynamic).
        self.searches = 0
        #: Every search so far found the same unused parameters (torch's ``ddp_graph_static_``).
        self.graph_static = True
        self._static_used: Optional[List[bool]] = None
        # Per iteration:
        self.remaining: List[int] = [1] * n
        self.unused: List[int] = []
        self._unused_set: frozenset = frozenset()
        self.track_used = False
        self.local_used = bytearray(n)
        self.hook_counts: List[int] = [0] * n
        self.global_used: Optional[List[bool]] = None
        self._used_tensor: Optional[torch.Tensor] = None
        self._used_work: Any = None
        self._last_reduced: Optional[torch.Tensor] = None  # the last used map reduced over ranks (counts)
        # CUDA: the local map goes up from pinned memory without blocking the host.
        self._pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True) if device.type == "cuda" and n else None
        #: Device-to-host reads (host synchronizations) of the used-parameter map so far.
        self.host_reads = 0

    def enable_static_graph(self) -> None:
        """Switch to static-graph mode (before the first iteration only)."""
        if self.iterations > 0:
            raise RuntimeError(
                "fastcoll.DDP: _set_static_graph() should be called before training loop starts (static_graph can "
                "only be enabled before the first synchronized iteration; pass static_graph=True to the constructor)"
            )
        self.static_graph = True
        self.learning_static_graph = True

    @property
    def searching(self) -> bool:
        """Whether each iteration searches the graph for unused parameters."""
        return self.find_unused and not self.static_graph

    @property
    def tracking_use(self) -> bool:
        """Whether gradients mark their parameters used (:attr:`local_used`), also between synchronized backwards."""
        return self.searching or self.learning_static_graph

    def begin_iteration(self, outputs: Any) -> None:
        """Reset the per-iteration state; search ``outputs`` for unused parameters when the graph is dynamic."""
        n = self.n
        self.remaining = self.expected[:]
        self.track_used = self.tracking_use
        self._used_work = None
        self._used_tensor = None
        self.global_used = self._static_used
        if self.learning_static_graph:
            self.hook_counts = [0] * n
        if self.searching:
            self.searches += 1
            unused = unreachable_parameters(outputs, self.index_of_id, n)
            if self.searches > 1 and unused != self.unused:
                self.graph_static = False
            self.unused = unused
        else:
            self.unused = []
        self._unused_set = frozenset(self.unused)

    def all_unused(self, indices: Sequence[int]) -> bool:
        """Whether every parameter of ``indices`` is unused in this iteration (unreachable, or learned unused)."""
        if self.searching:
            unused = self._unused_set
            return all(i in unused for i in indices)
        used = self._static_used
        return used is not None and not self.learning_static_graph and not any(used[i] for i in indices)

    def unfinished(self) -> List[int]:
        """Parameters whose gradients are still missing in the current iteration."""
        if self.learning_static_graph:
            return []
        return [i for i, r in enumerate(self.remaining) if r > 0]

    # -------------------------------------------------------- used-parameter map

    def start_used_map(self, joined: bool = False) -> None:
        """Issue the used-parameter all-reduce of this rank's map.

        A rank that has joined (run out of inputs) sends what torch's joined
        ranks send: the last map it saw reduced (torch all-reduces its
        reducer's device copy of the map, which holds the previous reduced
        counts), zeros if it saw none. So a parameter used in the last
        iteration a joined rank took part in counts as used while it is
        joined: unused on every training rank, its gradient is still written
        (zeros) rather than left alone, as under torch DDP.
        """
        if joined or not self.n:
            last = self._last_reduced
            self._used_tensor = last.clone() if last is not None else torch.zeros(self.n, dtype=torch.int32, device=self.device)
        else:
            local = torch.frombuffer(self.local_used, dtype=torch.uint8)
            if self._pinned is not None:
                local = self._pinned.copy_(local).to(self.device, non_blocking=True)
            self._used_tensor = local.to(dtype=torch.int32)
        self._used_work = self.comm.all_reduce(self._used_tensor, "used parameters")

    @property
    def used_map_started(self) -> bool:
        return self._used_work is not None

    def finish_used_map(self) -> None:
        """Wait for the used-parameter all-reduce (if one was issued) and set :attr:`global_used`.

        Reading the map is a host synchronization (it waits for the
        collective, and on CUDA for the stream): whether a parameter unused
        everywhere keeps its ``.grad`` is decided on the host.
        """
        if self._used_work is None:
            return
        self.comm.wait(self._used_work, "used parameters")
        self._used_work = None
        self.host_reads += 1
        self._last_reduced = self._used_tensor
        self.global_used = [c > 0 for c in self._used_tensor.tolist()]

    def used_here(self, indices: Sequence[int]) -> bool:
        """Whether every parameter of ``indices`` got a gradient on this rank (then it is used globally too)."""
        local = self.local_used
        return all(local[i] for i in indices)

    # ------------------------------------------------------------ end of iteration

    def learn_from_hooks(self) -> None:
        """End of a static graph's learning backward on a training rank: what the hooks counted was used."""
        for i, c in enumerate(self.hook_counts):
            if c:
                self.local_used[i] = 1

    def end_iteration(self) -> None:
        """Close a synchronized iteration (after :meth:`finish_used_map`), training or joined.

        Ends a static graph's learning: the expected counts become what this
        rank's hooks counted (a joined rank, whose hooks never fired, expects
        one gradient per parameter used anywhere) and the global use map is
        kept for every later iteration.
        """
        if self.learning_static_graph:
            self.learning_static_graph = False
            used = self.global_used if self.global_used is not None else [True] * self.n
            self._static_used = None if all(used) else list(used)
            trained = any(self.hook_counts)
            self.expected = list(self.hook_counts) if trained else [1 if u else 0 for u in used]
        self.local_used = bytearray(self.n)  # use counts from here to the next synchronized backward's end
        self.iterations += 1


def marked_twice_error(name: str, unused: bool) -> RuntimeError:
    """The error for a parameter whose gradient arrived again in the same iteration (``unused``: it was marked unused)."""
    if unused:
        why = (
            "find_unused_parameters found it unreachable from the forward's outputs through the autograd graph "
            "(so it was marked unused), yet this backward computed a gradient for it. The usual cause is "
            "activation checkpointing with use_reentrant=True: the checkpointed region's parameters are hidden "
            "from the graph until its backward recomputes the forward. Use torch.utils.checkpoint with "
            "use_reentrant=False, or static_graph=True if the same parameters are used every iteration. "
            "Otherwise the parameter was used outside the wrapped module's forward (e.g. a loss term on "
            "model.module's weights), or in a tensor the forward did not return"
        )
    else:
        why = (
            "its gradient was accumulated more than once in one backward (a parameter used in several "
            "reentrant backward passes, e.g. activation checkpointing with use_reentrant=True, or "
            "several backward calls per iteration); use static_graph=True if the pattern is the same "
            "every iteration, or no_sync() for all but the last backward"
        )
    return RuntimeError(f"fastcoll.DDP: parameter '{name}' was marked ready twice in one iteration: {why}.")


def unfinished_error(names: Sequence[str]) -> RuntimeError:
    """The error for a backward that left the parameters ``names`` without gradients."""
    shown = ", ".join(names[:50]) + (f", ... ({len(names)} in all)" if len(names) > 50 else "")
    return RuntimeError(
        "fastcoll.DDP: the previous iteration's gradient reduction did not finish, because these "
        f"parameters received no gradient in its backward: {shown}. Either pass "
        "find_unused_parameters=True to DDP (parameters that take no part in some forward passes are "
        "then handled, at the cost of a graph traversal per iteration), or make sure every parameter "
        "contributes to the loss in every iteration (all forward outputs used in the loss)."
    )
