"""Statistics of the benchmarks: medians, bootstrap intervals, A/A controls, target verdicts, when to stop sampling.

Every target a benchmark reports is a dict made by :func:`target`: its value, its 90% interval where it has one, and a
verdict, :data:`MET`, :data:`MISSED` or :data:`UNRESOLVED` (the interval straddles the threshold). Timing samples are
taken in rounds (sample k of every method before sample k+1), so ratios resample whole rounds (``paired=True``) and a
drift of a shared machine cancels in them. :func:`resolved` lets a benchmark stop taking rounds once every target's
interval lies on one side of its threshold.
"""

from __future__ import annotations

import collections
import math
import random
import statistics
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

MET, MISSED, UNRESOLVED = "MET", "MISSED", "not resolved"
Samples = Dict[str, List[float]]
Stat = Callable[[Samples], Optional[float]]


def summarize(samples: Sequence[float]) -> Dict[str, float]:
    """Median, quartiles, interquartile range, minimum and count (seconds) of timing samples."""
    xs = sorted(samples)
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) >= 2 else (xs[0], 0, xs[0])
    return {"median_s": statistics.median(xs), "q1_s": q1, "q3_s": q3, "iqr_s": q3 - q1, "min_s": xs[0], "n": len(xs)}


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """``a / b``, or None when either is missing or ``b`` is zero."""
    return a / b if a is not None and b else None


def rotated(names: Sequence[str], k: int) -> List[str]:
    """Round ``k``'s order: ``names`` rotated by ``k``, so every name takes every position equally often."""
    names = list(names)
    if not names:
        return names
    k %= len(names)
    return names[k:] + names[:k]


def bootstrap_ci(
    statistic: Stat, samples: Dict[str, Sequence[float]], level: float = 0.9, resamples: int = 2000, seed: int = 0,
    paired: bool = False,
) -> Optional[Tuple[float, float]]:  # fmt: skip
    """Percentile bootstrap interval of ``statistic`` over per-method samples (seeded: the same samples, the same interval).

    Args:
        statistic: Maps ``{method: samples}`` to a number; None values are skipped.
        samples: Samples per method (as many for each method when ``paired``).
        level: Coverage of the interval.
        resamples: Number of bootstrap resamples.
        seed: Seed of the resampling.
        paired: The samples are rounds; a resample draws whole rounds.

    Returns:
        ``(low, high)``, or None when ``statistic`` gave no value.
    """
    rng = random.Random(seed)
    rounds = {len(xs) for xs in samples.values()}
    if paired and len(rounds) > 1:
        raise ValueError(f"bootstrap_ci(paired=True): the methods have different sample counts {sorted(rounds)}")
    values = []
    for _ in range(resamples):
        if paired:
            picks = [rng.randrange(n) for n in rounds for _ in range(n)]
            drawn = {m: [xs[k] for k in picks] for m, xs in samples.items()}
        else:
            drawn = {m: [xs[rng.randrange(len(xs))] for _ in xs] for m, xs in samples.items()}
        v = statistic(drawn)
        if v is not None:
            values.append(v)
    if not values:
        return None
    values.sort()
    tail = (1.0 - level) / 2
    return values[int(tail * (len(values) - 1))], values[int(math.ceil((1.0 - tail) * (len(values) - 1)))]


def median_ratio(a: str, b: str) -> Stat:
    """The statistic ``median(samples[a]) / median(samples[b])``."""

    def stat(s: Samples) -> Optional[float]:
        return ratio(statistics.median(s[a]), statistics.median(s[b]))

    return stat


def per_rank_ratios(a: Optional[Sequence[Optional[float]]], b: Optional[Sequence[Optional[float]]]) -> Optional[List[float]]:
    """``a[r] / b[r]`` for every rank ``r``; None when a value is missing or a divisor is zero."""
    if not a or not b or None in a or None in b or not all(b):
        return None
    return [x / y for x, y in zip(a, b)]  # type: ignore[operator]


#: The two peaks a memory phase reads per rank (runner.MemoryProbe), and what each is: the resident set's growth
#: (CUDA: the allocator's peak), and the bytes tensors held at once.
PEAKS = (("peak_bytes", "resident growth"), ("tensor_peak_bytes", "tensor bytes"))


def worst_rank_target(a: Optional[Sequence[Optional[float]]], b: Optional[Sequence[Optional[float]]], threshold: float,
                      what: str) -> Optional[Dict[str, Any]]:  # fmt: skip
    """The target ``a[r] / b[r] <= threshold`` on the worst rank, the range over ranks as its interval; None when a
    value is missing (:func:`per_rank_ratios`)."""
    per_rank = per_rank_ratios(a, b)
    if not per_rank:
        return None
    span = (min(per_rank), max(per_rank))
    return target(span[1], threshold, span, "le", "range over ranks", what)


def paired_cost(with_feature: Sequence[float], without: Sequence[float]) -> Dict[str, float]:
    """Median and quartiles of the per-round differences ``with_feature[k] - without[k]`` (an A/A pair: the noise)."""
    st = summarize([a - b for a, b in zip(with_feature, without)])
    diff = statistics.median(with_feature) - statistics.median(without)
    return {"median_s": st["median_s"], "q1_s": st["q1_s"], "q3_s": st["q3_s"], "diff_of_medians_s": diff}


def verdict(value: Optional[float], threshold: float, ci: Optional[Sequence[float]] = None, op: str = "le") -> str:
    """MET / MISSED from the interval ``ci`` (or the exact ``value``); "not resolved" when ``ci`` spans ``threshold``."""
    if value is None:
        return "not measured"
    lo, hi = (value, value) if ci is None else (ci[0], ci[1])
    if op == "le":
        return MET if hi <= threshold else MISSED if lo > threshold else UNRESOLVED
    return MET if lo >= threshold else MISSED if hi < threshold else UNRESOLVED


def target(
    value: Optional[float], threshold: float, ci: Optional[Sequence[float]] = None, op: str = "le", interval: str = "exact",
    what: Optional[str] = None, unit: Optional[str] = None,
) -> Dict[str, Any]:  # fmt: skip
    """A reported target: ``value`` against ``threshold`` (``op`` "le": lower is better, "ge": higher).

    Returns:
        ``op``, ``threshold``, ``value``, ``ci90`` (None for exact values), ``interval`` (what the interval is over),
        ``verdict`` (:func:`verdict`), ``pass`` (the point value alone against the threshold), ``resolved`` (the verdict
        is MET or MISSED) and, when given, ``what`` (the target in words) and ``unit`` (``"bytes"``; none: a ratio).
    """
    v = verdict(value, threshold, ci, op)
    ok = None if value is None else (value <= threshold if op == "le" else value >= threshold)
    out = {"op": op, "threshold": threshold, "value": value, "ci90": list(ci) if ci is not None else None,
           "interval": interval, "verdict": v, "pass": ok, "resolved": v in (MET, MISSED)}  # fmt: skip
    extra = {"what": what, "unit": unit}
    return {**out, **{k: v for k, v in extra.items() if v is not None}}


def ratio_target(
    samples: Samples, a: str, b: str, threshold: float, op: str = "le", what: Optional[str] = None
) -> Dict[str, Any]:
    """The target ``median(a) / median(b)`` against ``threshold``, with its paired 90% bootstrap interval."""
    sub = {a: samples[a], b: samples[b]}
    ci = bootstrap_ci(median_ratio(a, b), sub, paired=True) if len(samples[a]) > 2 else None
    return target(median_ratio(a, b)(sub), threshold, ci, op, "90% bootstrap (rounds)", what)


def group_target(
    groups: Sequence[Dict[str, Any]], a: str, b: str, threshold: float = 1.0, what: Optional[str] = None
) -> Dict[str, Any]:
    """:func:`ratio_target` of ``a`` over ``b`` from the first group (``{"samples": ...}``) timing both."""
    for g in groups:
        if a in g["samples"] and b in g["samples"]:
            return ratio_target(g["samples"], a, b, threshold, what=what)
    return target(None, threshold, what=what)


def method_entry(
    groups: Sequence[Dict[str, Any]], ranks: Sequence[Dict[str, Any]], m: str, keys: Sequence[str]
) -> Dict[str, Any]:
    """``m``'s summary from the first group of rounds timing it (its index: ``group``), each rank's ``keys``, its buckets."""
    g = next((i for i, grp in enumerate(groups) if m in grp["samples"]), None)
    entry: Dict[str, Any] = {"group": g, **(summarize(groups[g]["samples"][m]) if g is not None else {})}
    entry.update({k: [r.get(k) for r in ranks] for k in keys} if ranks else {})
    return {**entry, "buckets": ranks[0].get("buckets") if ranks else None}


def resolved(checks: Iterable[Tuple[Stat, float, str]], samples: Samples) -> bool:
    """Whether every ``(statistic, threshold, op)`` has a paired 90% interval on one side of its threshold.

    A benchmark calls this between rounds to stop sampling early (:func:`enough_rounds`).
    """
    for stat, threshold, op in checks:
        ci = bootstrap_ci(stat, samples, paired=True, resamples=400)
        if ci is None or verdict(ci[0], threshold, ci, op) == UNRESOLVED:
            return False
    return True


def enough_rounds(
    samples: Samples, done: int, lo: int, hi: int, checks: Sequence[Tuple[Stat, float, str]] = (), every: int = 3
) -> bool:
    """Adaptive repetition: stop after ``hi`` rounds, never before ``lo``, and in between once the targets resolve.

    The intervals are looked at every ``every`` rounds (a bootstrap costs tens of milliseconds).
    """
    if done >= hi or (done >= lo and not checks):  # without targets: the minimum
        return True
    if done < lo or (done - lo) % every:
        return False
    return resolved(checks, samples)


def count_verdicts(targets: Iterable[Dict[str, Any]]) -> Dict[str, int]:
    """How many targets are met, missed and not resolved."""
    return {MET: 0, MISSED: 0, UNRESOLVED: 0, **collections.Counter(t["verdict"] for t in targets)}
