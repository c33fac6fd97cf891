"""Smoke tests of the ZeRO benchmark (``python -m fastcoll.bench zero``), so that it does not rot.

The numbers are never checked (the targets are printed, not asserted): only
that a tiny configuration runs end to end on 2 gloo ranks (a fresh process
pair per method for the memory phase, one for the timing), writes
well-formed JSON and a chart, and finds every method's parameters equal to
torch DDP + AdamW's; plus the analysis, which needs no ranks.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from fastcoll.bench import __main__ as cli
from fastcoll.bench import common, zero


@pytest.mark.timeout(120)
def test_zero_smoke_run(tmp_path, capsys):
    path = tmp_path / "zero.json"
    rc = cli.main(["zero", "--smoke", "--json", str(path)])
    out = capsys.readouterr().out
    if not zero.supported():
        assert rc == 0 and "skipping" in out
        return
    assert rc == 0, out
    assert "fastcoll zero: step time" in out and "all-gather" in out and "targets" in out

    data = json.loads(path.read_text())
    assert data["benchmark"] == "zero" and data["machine"]["torch"]
    cfg = data["config"]
    assert cfg["smoke"] and cfg["world_size"] == 2 and cfg["backend"] == "gloo" and cfg["threads"] == 1
    (row,) = data["results"]
    assert row["model"] == "resnet50" and len(row["groups"]) == 1
    for m in zero.METHODS:
        st = row["methods"][m]
        assert st["median_s"] > 0 and st["n"] == cfg["reps"]
        assert len(st["state_bytes"]) == 2 and all(b > 0 for b in st["state_bytes"])
        assert all(p is not None and p >= 0 for p in st["peak_bytes"]) and all(s > 0 for s in st["sent_bytes"])
        assert row["checks"][m]["ok"], row["checks"]
    torch_state = max(row["methods"]["torch"]["state_bytes"])
    for m in zero.SHARDED:  # each rank holds about half of DDP's state
        assert max(row["methods"][m]["state_bytes"]) < 0.6 * torch_state
        g = row["gather"][m]
        assert g["gather_s"] > 0 and g["exposed_s"] >= 0 and g["steps"] >= 1 and g["buckets"] >= 1
    names = set(row["targets"])
    assert {"state full", "state sharded", "step full/zero", "step sharded/zero", "step sharded/torch"} <= names
    for t in row["targets"].values():
        assert t["verdict"] in (zero.MET, zero.MISSED, zero.UNRESOLVED)
    assert path.with_suffix(".png").stat().st_size > 1000


def test_verdicts_and_labels():
    assert zero.verdict(0.7, 0.8, (0.65, 0.75)) == zero.MET
    assert zero.verdict(0.9, 0.8, (0.85, 0.95)) == zero.MISSED
    assert zero.verdict(0.79, 0.8, (0.7, 0.9)) == zero.UNRESOLVED
    assert zero.verdict(1.004, 1.01) == zero.MET and zero.verdict(1.02, 1.01) == zero.MISSED  # exact values
    assert zero.verdict(5.0, 0.0, (1.0, 9.0), op="ge") == zero.MET
    assert zero.verdict(-1.0, 0.0, (-2.0, 3.0), op="ge") == zero.UNRESOLVED
    assert zero.verdict(None, 1.0) == "not measured"
    assert zero.target_label("step sharded/zero") == "step, grads=sharded / torch ZeRO's"
    assert "grads=full" in zero.target_label("state full") and "grads=sharded" in zero.target_label("memory sharded")


def test_plans():
    MiB = common.MiB
    assert zero.timing_groups(100 * MiB, zero.GROUP_LIMIT_BYTES) == [zero.METHODS]  # ResNet-50's 97.5 MiB
    groups = zero.timing_groups(475 * MiB, zero.GROUP_LIMIT_BYTES)  # GPT-2's
    assert groups == [tuple(g) for g in zero.SPLIT_GROUPS]
    # every target's pair of methods is timed together, and every method somewhere
    for a, b in (("full", "zero"), ("sharded", "zero"), ("sharded", "torch")):
        assert any(a in g and b in g for g in groups)
    assert set().union(*groups) == set(zero.METHODS)
    cfg = zero._config(cli.build_parser().parse_args(["zero", "--quick"]), "cpu")
    assert zero.sample_count(cfg, False, 1e-3) == cfg["max_reps"] and zero.sample_count(cfg, False, 1e3) == cfg["reps"]
    assert zero.sample_count(cfg, True, 1e3) == cfg["reps_large"]
    assert [s.name for s in zero.model_specs(cfg)] == ["mlp96", "resnet50"]
    full = zero._config(cli.build_parser().parse_args(["zero"]), "cpu")
    assert [s.name for s in zero.model_specs(full)] == ["mlp96", "resnet50", "gpt2_small"]


def test_layered_shape_model_calls_a_module_per_parameter():
    spec = zero.model_specs(zero._config(cli.build_parser().parse_args(["zero", "--smoke"]), "cpu"))[0]
    storage = zero.bench_ddp.build_storage(spec, "cpu")
    model = zero.build_model(spec, "cpu", storage)
    params = list(model.parameters())
    assert len(params) == 24 and all(p.data_ptr() == t.data_ptr() for p, t in zip(params, storage))
    called = []
    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(lambda _m, _inp, i=i: called.append(i))
    x = zero.bench_ddp.make_input(spec, rank=1, device="cpu")
    model(x).backward()
    assert called == list(range(24))  # registration order, one pre-hook per parameter
    for i, p in enumerate(params):
        assert torch.equal(p.grad, torch.full_like(p, float(x[i])))


def test_gather_metrics():
    times = {
        0: {"pack": 0, "issued": 10, "completed": 50, "wait": 60, "waited": 60, "written": 65},
        1: {"pack": 12, "issued": 20, "completed": 90, "wait": 70, "waited": 95, "written": 100},
    }
    g = zero.gather_metrics({k: {e: v * 1000 for e, v in d.items()} for k, d in times.items()})
    assert g == pytest.approx(
        {"issue_s": 20e-6, "gather_s": 80e-6, "exposed_s": 25e-6, "hidden_s": 55e-6, "write_s": 10e-6, "buckets": 2}
    )
    assert zero.gather_metrics({0: {"pack": 0, "issued": 1}}) is None  # never waited for: not counted
    assert zero.gather_metrics({}) is None


def _fake_row(model: str, ratios: dict, rounds: int = 30) -> dict:
    rng = random.Random(3)
    drift = [1 + 0.3 * rng.random() for _ in range(rounds)]  # a round's slowdown, shared by every method
    samples = {m: [0.1 * ratios[m] * d * (1 + 0.005 * rng.uniform(-1, 1)) for d in drift] for m in zero.METHODS}
    state = {"torch": 800, "zero": 400, "fastcoll": 800, "full": 401, "sharded": 401}
    peak = {"torch": 5000, "zero": 4700, "fastcoll": 5000, "full": 4590, "sharded": 4400}

    def rank(m: str, r: int) -> dict:
        return {"state_bytes": state[m], "peak_bytes": peak[m] + r, "sent_bytes": 1, "digest": [1.0, 2.0]}

    mem = {m: {"ranks": [rank(m, r) for r in (0, 1)]} for m in zero.METHODS}
    gather = {"gather_s": 0.02, "exposed_s": 0.015, "hidden_s": 0.005, "issue_s": 0.001, "write_s": 0.002, "buckets": 3.0}
    group = {
        "samples": samples,
        "inner": 1,
        "reps": rounds,
        "gather_per_rank": [{"full": gather, "sharded": gather}] * 2,
        "forward_per_rank": [{"fastcoll": 0.01, "full": 0.02, "sharded": 0.025}] * 2,
    }
    return {"model": model, "world_size": 2, "memory": mem, "groups": [group]}


def test_analyze_targets():
    ratios = {"torch": 1.0, "zero": 1.25, "fastcoll": 0.98, "full": 0.9, "sharded": 1.2}
    row = zero.analyze(_fake_row("resnet50", ratios))
    t = row["targets"]
    assert t["state full"]["value"] == pytest.approx(401 / 400) and t["state full"]["verdict"] == zero.MET
    assert t["step full/zero"]["value"] == pytest.approx(0.72, rel=0.02) and t["step full/zero"]["verdict"] == zero.MET
    lo, hi = t["step full/zero"]["ci90"]
    assert lo <= t["step full/zero"]["value"] <= hi and hi - lo < 0.02  # the shared drift cancels: paired rounds
    assert t["step sharded/zero"]["verdict"] == zero.MISSED  # 0.96x
    assert t["step sharded/torch"]["verdict"] == zero.MISSED  # 1.2x
    # memory: torch's peak - full's = 410, state saved 399 -> margin 11 (both ranks); sharded: 600 - 399
    assert t["memory full"]["value"] == 11 and t["memory full"]["verdict"] == zero.MET
    assert t["memory sharded"]["value"] == 201
    assert row["gather"]["sharded"]["hidden_share"] == pytest.approx(0.25)
    assert row["gather"]["full"]["forward_fastcoll_s"] == 0.01
    assert all(c["ok"] for c in row["checks"].values())
    assert "step sharded/torch" not in zero.analyze(_fake_row("mlp96", ratios))["targets"]  # ResNet-50 and GPT-2 only
