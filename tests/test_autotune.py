"""fastcoll.reducer.autotune: candidate layouts, the measuring schedule, the decision, the cost model.

No processes: the tuner is driven as the reducer would drive it, with
synthetic measurements (each candidate's step time a function of its index).
"""

from __future__ import annotations

import pytest
import torch

from fastcoll.bucketing import (
    MIB,
    ParamSpec,
    assign_buckets,
    reverse_registration_order,
)
from fastcoll.reducer import autotune
from fastcoll.reducer.autotune import (
    AutoTuner,
    CostModel,
    autotune_steps,
    predict_exposed_s,
)


def model_specs(n: int = 50, numel: int = MIB // 4, dtype=torch.float32) -> list[ParamSpec]:
    """``n`` parameters of ``numel`` elements (1 MiB each in float32)."""
    return [ParamSpec(numel, torch.empty((), dtype=dtype).element_size(), ("cpu", dtype)) for _ in range(n)]


def tuner(specs=None, budget=48, **kw) -> AutoTuner:
    specs = specs if specs is not None else model_specs()
    return AutoTuner(specs, reverse_registration_order(len(specs)), MIB, 25 * MIB, budget=budget, **kw)


def drive(t: AutoTuner, step_of, exposed_of=None, max_iters=200) -> int:
    """Run the integration loop; ``step_of(candidate, i)`` gives the step time of tuned iteration i. Returns the choice."""
    installed = 0
    pending = False
    for i in range(max_iters):
        if pending:  # iteration i - 1 ended
            t.observe(exposed_of(installed, i - 1) if exposed_of else 0.001, step_of(installed, i - 1))
            pending = False
        if t.measured_all:
            t.freeze(t.decide())
            return t.chosen
        k = t.next_candidate()
        if k is not None:
            installed = k
        pending = True
    raise AssertionError("the tuner never decided")


# ----------------------------------------------------------------------------- candidates


def test_candidates_fixed_caps_and_growing_lists_deduplicated():
    t = tuner()
    labels = [c.label for c in t.candidates]
    # 25 MiB gives the default's layout: dropped
    assert labels == ["default (25 MiB)", "1 MiB", "5 MiB", "100 MiB", "[1, 4, 16, 64] MiB", "[2, 8, 32] MiB"]
    layouts = [c.layout for c in t.candidates]
    assert all(layouts.count(lay) == 1 for lay in layouts)
    specs, order = t.specs, t.order
    # a fixed-cap candidate is exactly the layout bucket_cap_mb=cap gives (first bucket min(first_bucket_mb, cap))
    assert t.candidates[2].layout == assign_buckets(specs, order, MIB, 5 * MIB)
    assert t.candidates[4].layout == assign_buckets(specs, order, 1, [MIB, 4 * MIB, 16 * MIB, 64 * MIB])
    assert [len(c.layout) for c in t.candidates] == [3, 50, 11, 2, 4, 4]
    assert t.candidates[4].caps_mb == [1.0, 4.0, 16.0, 64.0] and t.candidates[4].first_mb is None
    assert t.candidates[2].caps_mb == 5.0 and t.candidates[2].first_mb == 1.0
    assert t.layout(3) == t.candidates[3].layout and t.layout(3) is not t.candidates[3].layout


def test_small_model_has_nothing_to_tune():
    t = tuner(model_specs(10, 1000))  # 40 KB: every cap gives one bucket
    assert [c.label for c in t.candidates] == ["default (25 MiB)"]
    assert t.iterations == 0 and t.measured_all and t.next_candidate() is None
    assert t.decide() == 0
    t.freeze(0)
    assert t.frozen and t.report()[0]["chosen"]


def test_default_given_as_list():
    specs = model_specs()
    t = AutoTuner(specs, reverse_registration_order(50), MIB, [2 * MIB, 8 * MIB, 32 * MIB], budget=48)
    assert t.candidates[0].label == "default ([2, 8, 32] MiB)"
    assert "[2, 8, 32] MiB" not in [c.label for c in t.candidates[1:]]  # same layout as the default


def test_deterministic():
    a, b = tuner(cost=CostModel(1e-4, 1e-9), backward_s=0.05), tuner(cost=CostModel(1e-4, 1e-9), backward_s=0.05)
    assert [c.label for c in a.candidates] == [c.label for c in b.candidates]
    assert a.schedule == b.schedule


# ------------------------------------------------------------------------------- schedule


@pytest.mark.parametrize("budget", [4, 8, 12, 20, 30, 48, 100])
def test_schedule_fits_the_budget(budget):
    t = tuner(budget=budget)
    assert t.iterations <= budget
    n = len(t.candidates)
    if n > 1:
        for k in range(n):
            measured = [s for s in t.schedule if s.candidate == k and s.measured]
            assert len(measured) >= t.min_measured
    # every switch is followed by a warm-up iteration that is not measured
    prev = None
    for j, s in enumerate(t.schedule):
        if s.candidate != prev:
            assert not s.measured, (j, s)
        prev = s.candidate


def test_two_rounds_in_mirrored_order_when_they_fit_else_the_default_last():
    t = tuner(model_specs(50), budget=48)  # 6 candidates: 8 iterations each
    visits = []
    for s in t.schedule:
        if not visits or visits[-1] != s.candidate:
            visits.append(s.candidate)
    assert visits == [0, 1, 2, 3, 4, 5, 4, 3, 2, 1, 0]
    assert t.schedule[0] == autotune._Slot(0, False)  # the default warms up too (it was just rebuilt)
    one = tuner(model_specs(50), budget=30)
    visits = [s.candidate for j, s in enumerate(one.schedule) if j == 0 or one.schedule[j - 1].candidate != s.candidate]
    assert visits == [1, 2, 3, 4, 5, 0]  # one round: the default last, once the job has warmed up
    assert one.schedule[0] == autotune._Slot(1, False)


def test_pruning_keeps_the_default_then_the_list_order():
    t = tuner(budget=8)  # room for 2 candidates of 1 warm-up + 3 measured
    assert [c.label for c in t.candidates] == ["default (25 MiB)", "1 MiB"]
    assert [r["label"] for r in t.report() if r["pruned"]] == ["5 MiB", "100 MiB", "[1, 4, 16, 64] MiB", "[2, 8, 32] MiB"]


def test_budget_from_environment(monkeypatch):
    monkeypatch.delenv("FASTCOLL_AUTOTUNE_STEPS", raising=False)
    assert autotune_steps() == 50
    assert tuner(budget=None).budget == 48
    monkeypatch.setenv("FASTCOLL_AUTOTUNE_STEPS", "20")
    assert autotune_steps() == 20 and tuner(budget=None).iterations <= 18
    for bad in ("x", "0", "-3"):
        monkeypatch.setenv("FASTCOLL_AUTOTUNE_STEPS", bad)
        with pytest.raises(ValueError, match="FASTCOLL_AUTOTUNE_STEPS"):
            autotune_steps()


# ------------------------------------------------------------------------------- decision


def test_picks_the_fastest():
    t = tuner()
    labels = [c.label for c in t.candidates]
    fast = labels.index("5 MiB")
    chosen = drive(t, lambda k, i: 0.090 if k == fast else 0.100 + 0.001 * k)
    assert chosen == fast
    rep = t.report()
    assert [r["chosen"] for r in rep].count(True) == 1 and rep[fast]["chosen"]
    assert rep[fast]["step_median_s"] == pytest.approx(0.090)
    assert all(r["measured_iterations"] >= t.min_measured for r in rep)
    assert rep[0]["default"] and not rep[1]["default"]


def test_keeps_the_default_within_tolerance():
    t = tuner()
    chosen = drive(t, lambda k, i: 0.100 if k == 0 else 0.0985)  # 1.5% better: within 2% of noise
    assert chosen == 0
    t = tuner()
    chosen = drive(t, lambda k, i: 0.100 if k == 0 else 0.097)  # 3% better: switch, to the first of the tied best
    assert chosen == 1


def test_keeps_the_default_when_the_samples_overlap():
    # Medians 4% apart (beyond the tolerance), but each candidate's sample is the faster in only
    # half of the pairs with the default's: noise could explain it.
    t = tuner()
    chosen = drive(t, lambda k, i: (0.090 + 0.020 * (i % 2)) if k == 0 else (0.080 + 0.032 * (i % 2)))
    assert chosen == 0
    rep = t.report()
    assert rep[1]["step_median_s"] < 0.97 * rep[0]["step_median_s"]
    assert rep[1]["step_quartiles_s"][1] > rep[0]["step_quartiles_s"][1]
    # A gap like that with the samples apart: switch.
    t = tuner()
    chosen = drive(t, lambda k, i: (0.090 + 0.020 * (i % 2)) if k == 0 else (0.085 + 0.004 * (i % 2)))
    assert chosen == 1


def test_median_ignores_outliers_and_warmup():
    t = tuner()

    def step(k, i):
        if i % 7 == 3:
            return 5.0  # a hiccup (GC, another process) now and then
        return 0.100 - 0.005 * (k == 2)

    slow_warmup = {j for j, s in enumerate(t.schedule) if not s.measured}
    chosen = drive(t, lambda k, i: 100.0 if i in slow_warmup else step(k, i))
    assert chosen == 2


def test_exposed_metric():
    t = tuner(metric="exposed")
    chosen = drive(t, step_of=lambda k, i: 0.1, exposed_of=lambda k, i: 0.01 if k == 3 else 0.02)
    assert chosen == 3
    with pytest.raises(ValueError, match="metric"):
        tuner(metric="fastest")


def test_unfinished_iterations_and_nothing_measured():
    t = tuner()
    for _ in range(t.iterations):
        t.next_candidate()
        t.observe(None, None)
    assert t.measured_all and t.decide() == 0
    assert all(r["step_median_s"] is None for r in t.report())
    t.observe(0.1, 0.1)  # nothing waits for a measurement: ignored
    with pytest.raises(ValueError, match="out of range"):
        t.freeze(99)


def test_next_candidate_switches_only_on_change():
    t = tuner()
    handed = [t.next_candidate() for _ in range(t.iterations)]
    switches = [k for k in handed if k is not None]
    assert switches == [1, 2, 3, 4, 5, 4, 3, 2, 1, 0]  # the default is installed at the start
    assert t.next_candidate() is None  # past the schedule


def test_summary_line():
    t = tuner()
    assert "has not decided" in t.summary()
    drive(t, lambda k, i: 0.05 if k == 1 else 0.1)
    line = t.summary()
    assert line.startswith("fastcoll.DDP: bucket_cap_mb='auto' chose 1 MiB (50 buckets): step 50.00 ms")
    assert "alternatives: default (25 MiB) (3 buckets): step 100.00 ms" in line and "\n" not in line


# ----------------------------------------------------------------------------- cost model


def test_cost_model_fit():
    m = CostModel.fit([(1 * MIB, 0.001 + 1 * MIB * 2e-9), (16 * MIB, 0.001 + 16 * MIB * 2e-9)])
    assert m.latency_s == pytest.approx(0.001) and m.s_per_byte == pytest.approx(2e-9)
    assert m.allreduce_s(0) == pytest.approx(0.001)
    assert CostModel.from_list(m.to_list()) == m
    # a negative intercept becomes a line through the origin
    m = CostModel.fit([(100, 0.0), (200, 1.0)])
    assert m.latency_s == 0 and m.s_per_byte > 0
    with pytest.raises(ValueError, match="two different sizes"):
        CostModel.fit([(100, 1.0), (100, 2.0)])


def test_predict_exposed():
    specs = model_specs(4)  # 1 MiB each, ready at 1/4, 2/4, 3/4, 4/4 of the backward
    order = [3, 2, 1, 0]
    cost = CostModel(0.01, 0.0)  # 10 ms per collective, whatever its size
    one = assign_buckets(specs, order, 1 << 40, 1 << 40)
    per = assign_buckets(specs, order, 1, 1)
    assert predict_exposed_s(specs, order, one, cost, backward_s=0.1) == pytest.approx(0.01)
    # 4 buckets ready at 25, 50, 75, 100 ms: each 10 ms, the last one ends at 110 ms
    assert predict_exposed_s(specs, order, per, cost, backward_s=0.1) == pytest.approx(0.01)
    # a slow channel: 40 ms each, a queue builds: 25+40=65, 105, 145, 185 -> 85 ms exposed
    assert predict_exposed_s(specs, order, per, CostModel(0.04, 0.0), 0.1) == pytest.approx(0.085)
    assert predict_exposed_s(specs, order, one, CostModel(0.04, 0.0), 0.1) == pytest.approx(0.04)


def test_model_candidate_and_pruning_by_prediction():
    cost, back = CostModel(1e-4, 1e-9), 0.05
    t = tuner(cost=cost, backward_s=back)
    model = [c for c in t.candidates if c.label.startswith("model: ")]
    assert len(model) == 1 and model[0].predicted_exposed_s is not None
    assert model[0].predicted_exposed_s <= min(c.predicted_exposed_s for c in t.candidates)
    small = tuner(budget=8, cost=cost, backward_s=back)
    assert len(small.candidates) == 2 and small.candidates[0].label.startswith("default")
    best_other = min(t.candidates[1:], key=lambda c: c.predicted_exposed_s)
    assert small.candidates[1].label == best_other.label
    assert all(r["predicted_exposed_s"] is not None for r in small.report())


def test_mixed_dtypes_group_separately():
    specs = model_specs(20) + model_specs(20, dtype=torch.float16)
    t = AutoTuner(specs, reverse_registration_order(40), MIB, 25 * MIB, budget=48)
    for c in t.candidates:
        for b in c.layout:
            assert len({specs[i].key for i in b}) == 1


def test_model_prefers_fewer_buckets_among_near_equal_predictions():
    # 1 ms per collective, almost free bytes: every layout exposes about one collective (~1 ms),
    # so the model's pick is the fewest buckets: 64 MiB is the first grid cap giving 2 buckets (1 MiB + 49 MiB).
    t = tuner(cost=CostModel(1e-3, 1e-13), backward_s=0.05)
    label, caps, first = t._model_choice()
    assert label == "model: 64 MiB" and caps == 64 * MIB and first == MIB
    assert all(mb >= 1 for mb in autotune._MODEL_SINGLE_MB + autotune._MODEL_LIST_STARTS_MB)
