"""``bucket_cap_mb="auto"``: candidate bucket layouts, a measuring schedule and the decision.

Pure policy: no tensors, no collectives, no clock. Given the parameters'
specs and the reduction order (rank 0's, after the ready-order rebuild, so the
same on every rank), :class:`AutoTuner` builds a short list of candidate caps,

* ``default``: the caps the reducer was built with (``bucket_cap_mb=None``:
  25 MiB, first bucket ``first_bucket_mb``), always candidate 0;
* single caps of :data:`SINGLE_CAPS_MB` (1, 5, 25, 100 MiB), each with the
  first bucket ``min(first_bucket_mb, cap)``, as ``bucket_cap_mb=cap`` gives;
* growing cap lists :data:`GROWING_CAPS_MB` ([1, 4, 16, 64] and [2, 8, 32] MiB);
* with a :class:`CostModel` and the backward's compute time: the layout of a
  small grid of single caps and growing lists that the model predicts to
  expose the least communication (:func:`predict_exposed_s`);

keeping only those whose layout differs from every earlier one (a cap larger
than the model, or one that changes nothing, is dropped). When more candidates
remain than the budget can measure, the model's ranking (or else the order
above) keeps the first ones; the default always stays.

Schedule: every candidate is visited twice when the budget allows (rounds
``0, 1, ..., n-1`` then ``n-1, ..., 0``, so a drift of the machine hits all of
them alike), else once, the default last (``1, ..., n-1, 0``): the first
iterations of a job run slower (allocator and caches still warming up), and
a candidate measured then looks worse than it is; the default must not be
the one that pays for it, or a one-round schedule would switch away from it
on that alone (measured: GPT-2 shapes on gloo, the default's first visit at
0.70 s against 0.45 s once warm). A visit that switches layout starts with ``warmup``
iterations that are not measured (new buffers, cold caches); then ``measured``
iterations. The whole schedule spans at most ``budget`` iterations.

Decision (:meth:`AutoTuner.decide`, on rank 0): the candidate with the lowest
median step time (``metric="step"``; or the lowest median exposed sync time,
``metric="exposed"``), unless the default is as good as far as the
measurements can tell: the default wins when its median is within
``tolerance`` (2%) of the best's, or when their samples overlap too much
(the best's sample is the faster in fewer than 70% of the pairs of one
sample of each), since a change that noise could explain is not worth making. Deterministic given the
measurements.

Integration (the reducer, with ``bucket_cap_mb="auto"``)::

    # after the one ready-order rebuild (every rank now has rank 0's order):
    tuner = AutoTuner(specs, order, first_cap_bytes, default_caps,
                      budget=autotune_steps() - iterations_so_far - 1)
    # at the start of every synchronized forward (one whose backward will be
    # reduced: not under no_sync) until tuner.frozen:
    if a tuned iteration just ended:
        tuner.observe(*timeline.last_times())      # (exposed_s, step_s); (None, None) if it did not complete
    if tuner.measured_all:
        k = <broadcast of rank 0's tuner.decide(), e.g. a 1-element int64 tensor>
        tuner.freeze(k)                            # every rank, same forward
        install(tuner.layout(k)) if it differs from the current layout
        log tuner.summary()                        # one line: chosen layout and the alternatives
    else:
        k = tuner.next_candidate()                 # None: keep the current layout
        if k is not None: install(tuner.layout(k))
    model.tuning_report() -> tuner.report()

Everything that shapes the candidate list (specs, order, caps, the cost model
and ``backward_s``) must be equal on every rank, since ranks switch layouts by
candidate index: measure the cost model on rank 0 (or average it) and
broadcast its floats (:meth:`CostModel.to_list` / :meth:`CostModel.from_list`).
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..bucketing import MIB, Caps, ParamSpec, assign_buckets, caps_to_mb

__all__ = [
    "DEFAULT_STEPS",
    "GROWING_CAPS_MB",
    "SINGLE_CAPS_MB",
    "AutoTuner",
    "Candidate",
    "CostModel",
    "autotune_steps",
    "predict_exposed_s",
]

#: Iterations within which tuning finishes unless ``FASTCOLL_AUTOTUNE_STEPS`` says otherwise.
DEFAULT_STEPS = 50
#: Single caps tried (MiB).
SINGLE_CAPS_MB: tuple[float, ...] = (1, 5, 25, 100)
#: Growing per-bucket cap lists tried (MiB, the last repeating).
GROWING_CAPS_MB: tuple[tuple[float, ...], ...] = ((1, 4, 16, 64), (2, 8, 32))
# The grid the cost model searches for its own candidate.
# Nothing below 1 MiB: the model has no per-bucket host cost (pack, launch, a
# communication thread competing with the backward's compute), so it always
# favours finer buckets; measured on 2 CPU ranks, sub-MiB caps lost every time.
_MODEL_SINGLE_MB = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_MODEL_LIST_STARTS_MB = (1, 2, 4)
_MODEL_LIST_RATIOS = (2, 4)
_MODEL_LIST_TOPS_MB = (16, 64, 256)
# decide(): the best candidate replaces the default only if its sample is the faster in this share of all pairs.
_WIN_FRACTION = 0.7
# Grid points predicted within this of the best (relative, absolute seconds) count as equal: the fewest buckets wins.
_MODEL_SLACK = (0.05, 1e-4)


def autotune_steps() -> int:
    """``FASTCOLL_AUTOTUNE_STEPS`` (default 50): iterations within which ``bucket_cap_mb="auto"`` decides."""
    value = os.environ.get("FASTCOLL_AUTOTUNE_STEPS", "").strip()
    if not value:
        return DEFAULT_STEPS
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"fastcoll: FASTCOLL_AUTOTUNE_STEPS={value!r} is not an integer") from None
    if n < 1:
        raise ValueError(f"fastcoll: FASTCOLL_AUTOTUNE_STEPS must be at least 1, got {n}")
    return n


# --------------------------------------------------------------------------- cost model


@dataclass(frozen=True)
class CostModel:
    """All-reduce time as ``latency_s + nbytes * s_per_byte`` (one bucket's collective, issue to completion)."""

    latency_s: float
    s_per_byte: float

    def allreduce_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes * self.s_per_byte

    @classmethod
    def fit(cls, points: Sequence[tuple[float, float]]) -> CostModel:
        """Least-squares line through ``(nbytes, seconds)`` points (two sizes suffice), clamped to non-negative terms.

        Raises:
            ValueError: fewer than two distinct sizes.
        """
        xs = [float(x) for x, _ in points]
        ys = [float(y) for _, y in points]
        if len(set(xs)) < 2:
            raise ValueError("fastcoll.autotune: the cost model needs timings of at least two different sizes")
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx)
        latency = my - slope * mx
        if latency < 0:  # a line through the origin instead
            latency = 0.0
            slope = max(0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs))
        return cls(latency, slope)

    def to_list(self) -> list[float]:
        """The floats to broadcast from rank 0 (with :meth:`from_list` on every rank)."""
        return [self.latency_s, self.s_per_byte]

    @classmethod
    def from_list(cls, values: Sequence[float]) -> CostModel:
        return cls(float(values[0]), float(values[1]))


def _bucket_bytes(specs: Sequence[ParamSpec], layout: Sequence[Sequence[int]]) -> list[int]:
    return [sum(specs[i].numel * specs[i].element_size for i in b) for b in layout]


def predict_exposed_s(
    specs: Sequence[ParamSpec],
    order: Sequence[int],
    layout: Sequence[Sequence[int]],
    cost: CostModel,
    backward_s: float,
) -> float:
    """Communication time a layout leaves exposed after the backward, by a simple model.

    Gradients become ready in ``order`` at times proportional to the bytes
    before them (the backward computes ``backward_s`` seconds, evenly per
    byte); a bucket is issued when its last gradient is ready and the previous
    bucket's collective is done (one communication channel, buckets in
    reduction order); each takes :meth:`CostModel.allreduce_s`. Returns the
    time from the end of the backward to the end of the last collective
    (>= 0). Sparse buckets count as their dense size.
    """
    total = sum(s.numel * s.element_size for s in specs) or 1
    ready_at: dict[int, float] = {}
    done = 0
    for i in order:
        done += specs[i].numel * specs[i].element_size
        ready_at[i] = backward_s * done / total
    end = 0.0
    for b, nbytes in zip(layout, _bucket_bytes(specs, layout)):
        start = max(ready_at[b[-1]], end)
        end = start + cost.allreduce_s(nbytes)
    return max(0.0, end - backward_s)


# ---------------------------------------------------------------------------- candidates


@dataclass
class Candidate:
    """One layout to try.

    Attributes:
        label: How logs and reports name it (``"default (25 MiB)"``, ``"5 MiB"``, ``"[1, 4, 16, 64] MiB"``).
        caps: Byte caps for :func:`fastcoll.bucketing.assign_buckets`: an int or a list.
        first_cap_bytes: The first bucket's cap for an int ``caps`` (ignored for a list).
        layout: The buckets it gives (parameter indices, reduction order).
        predicted_exposed_s: The cost model's prediction (None without a model).
    """

    label: str
    caps: Caps
    first_cap_bytes: int
    layout: list[list[int]] = field(default_factory=list, repr=False)
    predicted_exposed_s: float | None = None
    steps: list[float] = field(default_factory=list, repr=False)
    exposed: list[float] = field(default_factory=list, repr=False)

    @property
    def caps_mb(self) -> float | list[float]:
        """The caps in MiB: what to pass as ``bucket_cap_mb`` for this layout (with ``first_mb`` for a number)."""
        return caps_to_mb(self.caps)

    @property
    def first_mb(self) -> float | None:
        return None if isinstance(self.caps, list) else caps_to_mb(self.first_cap_bytes)


def _quartiles(xs: Sequence[float]) -> tuple[float, float]:
    """First and third quartile (inclusive method: within the samples' range)."""
    q1, _, q3 = statistics.quantiles(sorted(xs), n=4, method="inclusive")
    return q1, q3


def _mb_label(mb: float) -> str:
    return f"{mb:g}"


def _caps_label(caps: Caps) -> str:
    mb = caps_to_mb(caps)
    if isinstance(mb, list):
        return "[" + ", ".join(_mb_label(m) for m in mb) + "] MiB"
    return f"{_mb_label(mb)} MiB"


def _single(cap_mb: float, first_cap_bytes: int) -> tuple[int, int]:
    cap = max(1, int(cap_mb * MIB))
    return cap, min(first_cap_bytes, cap)


def _growing(start_mb: float, ratio: float, top_mb: float) -> list[int]:
    caps, c = [], start_mb
    while c < top_mb:
        caps.append(max(1, int(c * MIB)))
        c *= ratio
    caps.append(max(1, int(top_mb * MIB)))
    return caps


# ---------------------------------------------------------------------------------- tuner


@dataclass(frozen=True)
class _Slot:
    candidate: int
    measured: bool


class AutoTuner:
    """Candidates, schedule and decision of ``bucket_cap_mb="auto"``; see the module docstring.

    Args:
        specs: Per parameter index, its :class:`~fastcoll.bucketing.ParamSpec`.
        order: The reduction order (a permutation of the parameter indices;
            after the rebuild: rank 0's observed ready order).
        first_cap_bytes: ``first_bucket_mb`` in bytes.
        default_caps: The caps the reducer runs without tuning (candidate 0).
        budget: Iterations the schedule may span (default
            :func:`autotune_steps` - 2: the iteration recording the ready order
            and the one of the decision).
        cost: All-reduce cost model; with ``backward_s``, it adds its own
            candidate and ranks the others for pruning.
        backward_s: Backward compute time of one iteration (e.g. a Timeline's
            ``backward_end_us``) for the model.
        warmup: Unmeasured iterations after each layout switch.
        min_measured: Fewest measured iterations per candidate; candidates
            that do not fit the budget with this many are pruned.
        tolerance: Relative margin within which the default is kept.
        metric: ``"step"`` (median step time) or ``"exposed"`` (median exposed sync time).
        single_caps_mb, growing_caps_mb: The fixed candidates.
    """

    def __init__(
        self,
        specs: Sequence[ParamSpec],
        order: Sequence[int],
        first_cap_bytes: int,
        default_caps: Caps,
        *,
        budget: int | None = None,
        cost: CostModel | None = None,
        backward_s: float | None = None,
        warmup: int = 1,
        min_measured: int = 3,
        tolerance: float = 0.02,
        metric: str = "step",
        single_caps_mb: Sequence[float] = SINGLE_CAPS_MB,
        growing_caps_mb: Sequence[Sequence[float]] = GROWING_CAPS_MB,
    ):
        if metric not in ("step", "exposed"):
            raise ValueError(f"fastcoll.autotune: metric must be 'step' or 'exposed', got {metric!r}")
        if warmup < 0 or min_measured < 1:
            raise ValueError("fastcoll.autotune: warmup must be >= 0 and min_measured >= 1")
        self.specs = list(specs)
        self.order = list(order)
        self.first_cap_bytes = int(first_cap_bytes)
        self.budget = max(1, autotune_steps() - 2 if budget is None else int(budget))
        self.cost = cost
        self.backward_s = backward_s
        self.warmup = int(warmup)
        self.min_measured = int(min_measured)
        self.tolerance = float(tolerance)
        self.metric = metric
        self.candidates: list[Candidate] = self._candidates(default_caps, single_caps_mb, growing_caps_mb)
        self.pruned: list[Candidate] = []
        self.schedule: list[_Slot] = self._plan()
        self._started = 0  # iterations handed out by next_candidate()
        self._observed = 0  # iterations observe() accounted for
        self._installed = 0  # the candidate whose layout is installed (the default at the start)
        self.chosen: int | None = None

    # ------------------------------------------------------------ candidates

    def _model(self) -> bool:
        return self.cost is not None and self.backward_s is not None

    def _make(self, label: str, caps: Caps, first: int) -> Candidate:
        layout = assign_buckets(self.specs, self.order, first, caps)
        c = Candidate(label, caps, first, layout)
        if self._model():
            c.predicted_exposed_s = predict_exposed_s(self.specs, self.order, layout, self.cost, self.backward_s)  # type: ignore[arg-type]
        return c

    def _candidates(self, default_caps: Caps, singles: Sequence[float], growing: Sequence[Sequence[float]]) -> list[Candidate]:
        default_caps = default_caps if isinstance(default_caps, int) else [int(c) for c in default_caps]
        first = min(self.first_cap_bytes, default_caps) if isinstance(default_caps, int) else self.first_cap_bytes
        out = [self._make(f"default ({_caps_label(default_caps)})", default_caps, first)]
        proposals: list[tuple[str, Caps, int]] = []
        for mb in singles:
            cap, f = _single(mb, self.first_cap_bytes)
            proposals.append((_caps_label(cap), cap, f))
        for mbs in growing:
            caps = [max(1, int(m * MIB)) for m in mbs]
            proposals.append((_caps_label(caps), caps, self.first_cap_bytes))
        if self._model():
            proposals.append(self._model_choice())
        seen = [out[0].layout]
        for label, caps, f in proposals:
            c = self._make(label, caps, f)
            if c.layout not in seen:
                seen.append(c.layout)
                out.append(c)
        return out

    def _model_choice(self) -> tuple[str, Caps, int]:
        """The grid point the cost model predicts best.

        Predictions within :data:`_MODEL_SLACK` of the best are treated as
        equal (the model is optimistic about many small buckets): among them
        the fewest buckets, then the earlier grid point.
        """
        grid: list[tuple[Caps, int]] = [_single(mb, self.first_cap_bytes) for mb in _MODEL_SINGLE_MB]
        for start in _MODEL_LIST_STARTS_MB:
            for ratio in _MODEL_LIST_RATIOS:
                for top in _MODEL_LIST_TOPS_MB:
                    if start < top:
                        grid.append((_growing(start, ratio, top), self.first_cap_bytes))
        scored = []
        for j, (caps, f) in enumerate(grid):
            layout = assign_buckets(self.specs, self.order, f, caps)
            pred = predict_exposed_s(self.specs, self.order, layout, self.cost, self.backward_s)  # type: ignore[arg-type]
            scored.append((pred, len(layout), j))
        best_pred = min(p for p, _, _ in scored)
        rel, absolute = _MODEL_SLACK
        near = [(n, j) for p, n, j in scored if p <= best_pred * (1 + rel) + absolute]
        caps, f = grid[min(near)[1]]
        return f"model: {_caps_label(caps)}", caps, f

    # --------------------------------------------------------------- schedule

    def _plan(self) -> list[_Slot]:
        w, budget = self.warmup, self.budget
        fit = max(1, budget // (w + self.min_measured))
        if len(self.candidates) > fit:
            rest = list(range(1, len(self.candidates)))
            if self._model():
                rest.sort(key=lambda i: (self.candidates[i].predicted_exposed_s, i))
            keep = sorted([0, *rest[: fit - 1]])
            self.pruned = [c for i, c in enumerate(self.candidates) if i not in keep]
            self.candidates = [self.candidates[i] for i in keep]
        n = len(self.candidates)
        if n == 1:
            return []
        per = budget // n
        if per >= 2 * (w + self.min_measured):
            rounds, measured = 2, per // 2 - w
        else:
            rounds, measured = 1, per - w
        visits = list(range(n)) + list(range(n - 1, -1, -1)) if rounds == 2 else [*range(1, n), 0]
        slots: list[_Slot] = []
        current = 0  # the default is installed when tuning starts (just rebuilt: it warms up too)
        for v, k in enumerate(visits):
            switched = k != current or v == 0
            if switched:
                slots += [_Slot(k, False)] * w
            slots += [_Slot(k, True)] * measured
            current = k
        return slots

    @property
    def iterations(self) -> int:
        """Length of the schedule: tuned iterations before the decision."""
        return len(self.schedule)

    @property
    def frozen(self) -> bool:
        """The decision has been applied (:meth:`freeze`)."""
        return self.chosen is not None

    @property
    def measured_all(self) -> bool:
        """Every scheduled iteration has been observed: time to decide (at the start of the next forward)."""
        return self._observed >= len(self.schedule)

    def layout(self, k: int) -> list[list[int]]:
        """Candidate ``k``'s buckets (parameter indices in reduction order)."""
        return [list(b) for b in self.candidates[k].layout]

    def next_candidate(self) -> int | None:
        """At the start of a tuned iteration's forward: the candidate to install now, or None to keep the current layout."""
        if self.frozen or self._started >= len(self.schedule):
            return None
        k = self.schedule[self._started].candidate
        self._started += 1
        if k == self._installed:
            return None
        self._installed = k
        return k

    def observe(self, exposed_s: float | None, step_s: float | None) -> None:
        """Measurements of the tuned iteration that just ended, in order.

        None (it did not complete): its slot of the schedule passes without a
        measurement. Ignored when no handed-out iteration awaits one.
        """
        if self._observed >= min(self._started, len(self.schedule)):
            return  # nothing is waiting for a measurement
        slot = self.schedule[self._observed]
        self._observed += 1
        if slot.measured and step_s is not None and exposed_s is not None and math.isfinite(step_s) and math.isfinite(exposed_s):
            c = self.candidates[slot.candidate]
            c.steps.append(float(step_s))
            c.exposed.append(float(exposed_s))

    # --------------------------------------------------------------- decision

    def _score(self, c: Candidate) -> float | None:
        xs = self._samples(c)
        return statistics.median(xs) if xs else None

    def decide(self) -> int:
        """The index to keep (rank 0's decision; broadcast it). 0 (the default) when nothing was measured."""
        scores = [self._score(c) for c in self.candidates]
        known = [(s, i) for i, s in enumerate(scores) if s is not None]
        if not known:
            return 0
        best_score, best = min(known)
        default = scores[0]
        if default is not None and default <= best_score * (1 + self.tolerance):
            return 0
        if default is not None and not self._separated(self.candidates[best], self.candidates[0]):
            return 0
        return best

    def _samples(self, c: Candidate) -> list[float]:
        return c.steps if self.metric == "step" else c.exposed

    def _separated(self, faster: Candidate, slower: Candidate) -> bool:
        """Whether ``faster``'s samples are below ``slower``'s in at least :data:`_WIN_FRACTION` of all pairs (ties: half)."""
        a, b = self._samples(faster), self._samples(slower)
        if not a or not b:
            return True
        wins = sum(1.0 if x < y else 0.5 if x == y else 0.0 for x in a for y in b)
        return wins >= _WIN_FRACTION * len(a) * len(b)

    def freeze(self, k: int) -> Candidate:
        """Apply the (broadcast) decision: candidate ``k`` is kept from now on; returns it."""
        if not 0 <= k < len(self.candidates):
            raise ValueError(f"fastcoll.autotune: candidate index {k} out of range(0, {len(self.candidates)})")
        self.chosen = k
        self._installed = k
        return self.candidates[k]

    # ----------------------------------------------------------------- reports

    def report(self) -> list[dict[str, Any]]:
        """One dict per candidate (measured ones first, then pruned): what ``model.tuning_report()`` returns.

        Keys: ``index`` (None for pruned), ``label``, ``caps_mb`` (a number
        or a list), ``first_mb`` (None for a list), ``buckets``,
        ``measured_iterations``, ``step_median_s``, ``step_quartiles_s``
        (first and third quartile; None below 2 samples), ``exposed_median_s``,
        ``predicted_exposed_s``, ``default``, ``chosen``, ``pruned``.
        """
        rows = []
        for i, c in enumerate(self.candidates):
            rows.append(self._row(c, i))
        rows += [self._row(c, None) for c in self.pruned]
        return rows

    def _row(self, c: Candidate, i: int | None) -> dict[str, Any]:
        return {
            "index": i,
            "label": c.label,
            "caps_mb": c.caps_mb,
            "first_mb": c.first_mb,
            "buckets": len(c.layout),
            "measured_iterations": len(c.steps),
            "step_median_s": statistics.median(c.steps) if c.steps else None,
            "step_quartiles_s": _quartiles(c.steps) if len(c.steps) >= 2 else None,
            "exposed_median_s": statistics.median(c.exposed) if c.exposed else None,
            "predicted_exposed_s": c.predicted_exposed_s,
            "default": i == 0,
            "chosen": i is not None and i == self.chosen,
            "pruned": i is None,
        }

    def summary(self) -> str:
        """The one log line: the chosen layout and the alternatives with their medians."""

        def ms(x: float | None) -> str:
            return "-" if x is None else f"{x * 1e3:.2f} ms"

        def describe(r: dict[str, Any]) -> str:
            return (
                f"{r['label']} ({r['buckets']} buckets): step {ms(r['step_median_s'])}, exposed sync {ms(r['exposed_median_s'])}"
            )

        rows = [r for r in self.report() if not r["pruned"]]
        chosen = next((r for r in rows if r["chosen"]), None)
        head = "fastcoll.DDP: bucket_cap_mb='auto' " + ("chose " + describe(chosen) if chosen else "has not decided yet")
        others = [describe(r) for r in rows if r is not chosen]
        line = head + (f"; alternatives: {'; '.join(others)}" if others else "")
        return line + f" (medians of {self.metric} time over {len(self.schedule)} tuning iterations)"
