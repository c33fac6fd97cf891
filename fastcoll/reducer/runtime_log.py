"""What torch DDP's C++ ``Logger`` records while training, taken from fastcoll's reducer and timeline.

:class:`RuntimeLog` is the training-time half of ``fastcoll.DDP._get_ddp_logging_data()``
(:mod:`fastcoll.ddp.logging_data` adds the construction-time half). It keeps
torch's rules:

* Sampling: the ``k``-th synchronized iteration (``k = 1, 2, ...``: forwards
  that armed the reducer for a synchronized backward, torch's
  ``num_iterations_``) is sampled when ``k <= 10`` or ``k % sample_rate == 0``
  (``sample_rate``: 100 unless set). A sampled iteration that completes is
  published at the next synchronized forward, as torch's ``Logger`` logs the
  previous iteration's statistics at the start of each forward; so after
  iteration ``k`` completes, ``iteration`` is the last sampled ``k' < k``.
* Times, in nanoseconds, from the timeline's iteration-level events:
  ``forward_compute_time`` = forward start to forward end (the reducer armed,
  torch's "backward compute start"); ``backward_compute_time`` = forward end to
  the autograd engine's end-of-backward callback; ``backward_comm_time`` = the
  first bucket's reduction start to the end of the last write-back;
  ``backward_compute_comm_overlap_time`` = how much of those two intervals
  overlap. Each ``avg_*`` is the mean over the published samples that
  measured it. ``*_start``/``*_end`` are the last sample's host times, on the
  wall clock (ns since the epoch, as torch's CPU timer), converted from
  ``time.perf_counter_ns``. A time the iteration did not record (no bucket
  was reduced, say) is left out rather than reported as zero.
* ``has_rebuilt_buckets`` (whether the one rebuild from the gradient-ready
  order had happened by the end of the sampled iteration; never with a
  dynamic graph, as in torch) and, from the first sample that finds it done,
  ``rebuilt_bucket_sizes`` (bytes per bucket) and
  ``rebuilt_per_bucket_param_indices`` (each bucket's parameter indices
  ``" "``-separated, buckets ``", "``-separated); the rebuild happens at the
  second synchronized forward, so the second sample is the first to see it,
  as in torch.
* ``prev_iteration_grad_ready_order_indices``: the parameter indices in the
  order their gradient hooks fired in the sampled iteration (every firing;
  none in a static graph's first, learning, iteration); ``unused_parameter_size``:
  bytes of the parameters treated as unused in it; ``num_buckets_reduced``:
  its buckets that issued a reduction (all but those
  ``skip_all_reduce_unused_params`` skipped).
* The environment torch's ``Logger`` reports, read when the reducer is
  built (at the wrapper's construction, as torch reads it): :attr:`RuntimeLog.env`.
* Errors: :meth:`record_error` keeps the last error raised where torch's
  ``_log_and_throw`` or ``REDUCER_CHECK`` would have logged it (``has_error``,
  ``error``), and sets ``iteration`` to the synchronized forwards begun, as
  torch does. The search that first finds other unused parameters than the
  previous one (``can_set_static_graph`` turns 0) also sets ``iteration``,
  as torch's ``log_if_graph_static`` does.

Cost: a sampled iteration appends each gradient's index to a list and does
a few dozen Python operations at its end; an iteration that is not sampled
costs two attribute tests.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional, Union

__all__ = ["DEFAULT_SAMPLE_RATE", "ENV_KEYS", "RuntimeLog", "bucket_sizes", "should_sample"]

#: torch's ``kDDPRuntimeLoggingSampleRate``.
DEFAULT_SAMPLE_RATE = 100

#: torch Logger's environment keys and the variables they read ("N/A" when unset). The
#: ``gloo_*`` keys are reported for gloo process groups only, the ``nccl_*`` ones for NCCL.
ENV_KEYS: Dict[str, str] = {
    "master_port": "MASTER_PORT",
    "master_addr": "MASTER_ADDR",
    "torch_distributed_debug": "TORCH_DISTRIBUTED_DEBUG",
    "cuda_visible_devices": "CUDA_VISIBLE_DEVICES",
    "nccl_socket_ifname": "NCCL_SOCKET_IFNAME",
    "nccl_blocking_wait": "NCCL_BLOCKING_WAIT",
    "nccl_async_error_handling": "NCCL_ASYNC_ERROR_HANDLING",
    "nccl_debug": "NCCL_DEBUG",
    "nccl_nthreads": "NCCL_NTHREADS",
    "nccl_ib_timeout": "NCCL_IB_TIMEOUT",
    "gloo_socket_ifname": "GLOO_SOCKET_IFNAME",
    "gloo_device_transport": "GLOO_DEVICE_TRANSPORT",
}

#: The durations, each with the timeline events that bound it.
_DURATIONS = (
    ("forward_compute_time", "forward_start", "forward_end"),
    ("backward_compute_time", "forward_end", "backward_end"),
    ("backward_comm_time", "comm_start", "finalize_end"),
)
#: torch's host-time keys and the timeline events they are.
_HOST_TIMES = (
    ("forward_compute_time_start", "forward_start"),
    ("backward_compute_time_start", "forward_end"),
    ("backward_compute_time_end", "backward_end"),
    ("backward_comm_time_start", "comm_start"),
    ("backward_comm_time_end", "finalize_end"),
)
_AVERAGED = (
    "forward_compute_time",
    "backward_compute_time",
    "backward_comm_time",
    "backward_compute_comm_overlap_time",
)


#: Published keys that stay until a later sample replaces them (torch sets them only when it has them).
_STICKY = ("prev_iteration_grad_ready_order_indices", "rebuilt_bucket_sizes", "rebuilt_per_bucket_param_indices")


def bucket_sizes(layout: List[List[int]], params: List[Any]) -> str:
    """torch Logger's format of bucket sizes: each bucket's parameter bytes, ``", "``-separated."""
    return ", ".join(str(sum(params[i].numel() * params[i].element_size() for i in b)) for b in layout)


def should_sample(k: int, sample_rate: int) -> bool:
    """torch's rule: whether the ``k``-th synchronized iteration (1-based) has its runtime statistics collected."""
    return k > 0 and (k <= 10 or k % sample_rate == 0)


def _durations(times: Dict[str, int]) -> Dict[str, int]:
    out = {name: times[b] - times[a] for name, a, b in _DURATIONS if a in times and b in times and times[b] >= times[a]}
    if all(k in times for k in ("forward_end", "backward_end", "comm_start", "finalize_end")):
        start = max(times["forward_end"], times["comm_start"])
        end = min(times["backward_end"], times["finalize_end"])
        out["backward_compute_comm_overlap_time"] = max(0, end - start)
    return out


class RuntimeLog:
    """Sampled runtime statistics and the last error of one reducer, in torch ``DDPLoggingData``'s keys.

    The reducer calls :meth:`forward_end` when a forward arms it for a
    synchronized backward and :meth:`end_iteration` when a synchronized
    iteration completes on this rank; :meth:`data` is what has been published.

    Attributes:
        sample_rate: After the first 10 iterations, every ``sample_rate``-th is sampled.
        begun: Synchronized forwards so far (torch's ``num_iterations_``).
        iteration: torch's ``iteration``: the last published sample's ``k``,
            or ``begun`` when an error was recorded later; 0 before either.
        samples: Samples published so far.
        env: :data:`ENV_KEYS` with their values when this log was created.
    """

    def __init__(self) -> None:
        self.env = {key: os.environ.get(var, "N/A") for key, var in ENV_KEYS.items()}
        self.sample_rate = DEFAULT_SAMPLE_RATE
        self.begun = 0
        self.iteration = 0
        self.samples = 0
        self.error: Optional[str] = None
        self._sampling = False
        self._graph_static = True
        self._staged: Optional[Dict[str, Union[int, str]]] = None
        self._published: Dict[str, Union[int, str]] = {}
        self._sums: Dict[str, List[int]] = {}  # name -> [total ns, samples that measured it]

    def set_sample_rate(self, rate: int) -> None:
        """Sample every ``rate``-th iteration after the first 10 (torch's ``_set_ddp_runtime_logging_sample_rate``).

        Raises:
            ValueError: ``rate`` is less than 1.
        """
        if rate < 1:
            raise ValueError("DDP runtime logging sample rate should be equal or greater than 1")
        self.sample_rate = int(rate)

    # ------------------------------------------------------------ the reducer's calls

    def forward_end(self, timeline: Any, graph_static: bool = True) -> None:
        """A forward armed the reducer: publish the last staged sample, then start iteration ``begun + 1``.

        ``graph_static``: every unused-parameter search so far found the same
        parameters; when that stops being true, ``iteration`` becomes this
        iteration's number (torch logs the event with it).
        """
        if self._staged is not None:
            self._publish(self._staged)
            self._staged = None
        self.begun += 1
        if not graph_static and self._graph_static:
            self._graph_static = False
            self.iteration = self.begun
        self._sampling = should_sample(self.begun, self.sample_rate)
        timeline.ready_order = [] if self._sampling else None

    def end_iteration(self, reducer: Any) -> None:
        """The synchronized iteration begun last completed on this rank: stage its sample if it is sampled."""
        if not self._sampling:
            return
        self._sampling = False
        timeline = reducer.timeline
        order, timeline.ready_order = timeline.ready_order, None
        sample: Dict[str, Union[int, str]] = {"iteration": self.begun}
        last = timeline.last_iteration_ns()
        if last is not None and last[0] == timeline.committed - 1 and "forward_end" in last[1]:
            times = last[1]  # this iteration's (its forward ended, so the timeline had it open)
            sample.update(_durations(times))
            offset = time.time_ns() - time.perf_counter_ns()
            for key, event in _HOST_TIMES:
                if event in times:
                    sample[key] = times[event] + offset
        if order:
            sample["prev_iteration_grad_ready_order_indices"] = ", ".join(map(str, order))
        sample["unused_parameter_size"] = _unused_bytes(reducer)
        sample["num_buckets_reduced"] = reducer.buckets_reduced()
        rebuilt = reducer.rebuilt_layout()
        sample["has_rebuilt_buckets"] = int(rebuilt is not None)
        if rebuilt is not None and "rebuilt_bucket_sizes" not in self._published:
            sample["rebuilt_bucket_sizes"] = bucket_sizes(rebuilt, reducer.params)
            sample["rebuilt_per_bucket_param_indices"] = ", ".join(" ".join(map(str, b)) for b in rebuilt)
        self._staged = sample

    def record_error(self, message: str) -> None:
        """Keep ``message`` as the last error (``has_error``/``error``); ``iteration`` becomes the forwards begun."""
        self.error = message
        self.iteration = self.begun

    # ---------------------------------------------------------------- reading

    def _publish(self, sample: Dict[str, Union[int, str]]) -> None:
        self.samples += 1
        self.iteration = int(sample["iteration"])
        for name in _AVERAGED:
            if name in sample:
                acc = self._sums.setdefault(name, [0, 0])
                acc[0] += int(sample[name])
                acc[1] += 1
        kept = {k: v for k, v in self._published.items() if k in _STICKY}
        self._published = {**kept, **{k: v for k, v in sample.items() if k != "iteration"}}

    def data(self) -> Dict[str, Union[int, str]]:
        """The published runtime keys, ``iteration``, and ``has_error``/``error`` once an error was recorded."""
        out: Dict[str, Union[int, str]] = dict(self._published)
        for name, (total, n) in self._sums.items():
            out[f"avg_{name}"] = total // n
        out["iteration"] = self.iteration
        if self.error is not None:
            out["has_error"] = 1
            out["error"] = self.error
        return out


def _unused_bytes(reducer: Any) -> int:
    """Bytes of the parameters the reducer treated as unused in the iteration just completed."""
    usage = reducer.usage
    if usage.searching:
        unused = usage.unused
    else:
        used = usage._static_used
        unused = [] if used is None else [i for i, u in enumerate(used) if not u]
    params = reducer.params
    return sum(params[i].numel() * params[i].element_size() for i in unused)
