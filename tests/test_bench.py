"""Smoke tests of the benchmark CLI, so that it does not rot between benchmark runs.

The numbers are never checked (the targets are printed, not asserted): only
that the ops benchmark runs end to end with a tiny configuration and writes
well-formed JSON and a chart, and that the bucket layouts are DDP's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fastcoll.bench import __main__ as cli
from fastcoll.bench import models, report, runner, stats
from fastcoll.bench import ops as bench_ops


def test_ops_smoke_run(tmp_path, capsys):
    path = tmp_path / "ops.json"
    rc = cli.main(["ops", "--smoke", "--threads", "1", "--json", str(path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "fastcoll ops" in out and "fused/floor" in out

    data = json.loads(path.read_text())
    assert data["benchmark"] == "ops"
    assert data["machine"]["torch"] and "fastcoll_build" in data["machine"]
    assert data["config"]["smoke"] and data["config"]["threads"] == [1]
    rows = data["results"]
    assert {r["kind"] for r in rows} == {"model", "synthetic"}
    for r in rows:
        assert set(r["methods"]) == set(bench_ops.METHODS)
        for st in r["methods"].values():
            assert st["median_s"] > 0 and st["q1_s"] <= st["median_s"] <= st["q3_s"] and st["n"] == 3
        assert r["ratios"]["fused/floor"] > 0 and r["ratios"]["per-param/fused"] > 0
    resnet = [r for r in rows if r["model"] == "resnet50"]
    assert resnet and set(resnet[0]["targets"]) == {"fused/floor", "per-param/fused"}
    assert all(t["pass"] in (True, False) for t in resnet[0]["targets"].values())
    assert all(t["verdict"] in (stats.MET, stats.MISSED, stats.UNRESOLVED) for t in resnet[0]["targets"].values())
    # the tables printed are recorded in the JSON; benchmarks/render_results.py renders them and every target
    assert data["version"] == report.JSON_VERSION and any("dtype pairs" in t["title"] for t in data["tables"])
    md = _renderer().render([path])
    assert "## Every target" in md and "| ops (cpu) | resnet50 b" in md and "**fastcoll ops: dtype pairs, CPU, 1 thread**" in md
    old = {k: v for k, v in data.items() if k not in ("version", "tables", "notes")}  # the first JSON layout
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert "predates the recorded tables" in _renderer().render([tmp_path / "old.json"])
    assert path.with_suffix(".png").stat().st_size > 1000

    # dtype pairs: --smoke keeps the (shrunk) model bucket only, so one row per ordered pair of the 4 dtypes
    assert "dtype pairs" in out
    pairs = data["dtype_pairs"]
    names = ("float32", "bfloat16", "float16", "float64")
    assert sorted((r["src"], r["dst"]) for r in pairs) == sorted((s, d) for s in names for d in names)
    for r in pairs:
        assert r["layout"].startswith("resnet50 b2") and r["threads"] == 1
        assert set(r["methods"]) == {"floor", "fused"} and all(st["n"] == 3 for st in r["methods"].values())
        assert r["ratios"]["fused/floor"] > 0 and r["targets"]["fused/floor"]["pass"] in (True, False)
        assert r["checks"]["ok"], r["checks"]
    assert data["config"]["dtype_pairs"]["threads"] == 1


def _renderer():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "render_results.py"
    spec = importlib.util.spec_from_file_location("render_results", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_summary_names_each_row_and_shows_bytes_in_mib(tmp_path):
    """The summary of every target: the row's own label (not "?"), thresholds rounded, byte targets in MiB."""
    targets = {
        "peak pool": stats.target(0.8, 0.75, (0.79, 0.81), "le", "range over ranks"),
        "bytes pool": stats.target(6.91, 2 + 16 / 4 * 1.011331782189828, what="bytes per parameter"),
        "memory sharded": stats.target(-(2**21), 0.0, (-(2**21), -(2**20)), "ge", "range over ranks", unit="bytes"),
    }
    row = {"world_size": 4, "label": "GPT-2 small shapes, N=4", "targets": targets}
    path = tmp_path / "zero_pool_cpu.json"
    path.write_text(json.dumps({"version": report.JSON_VERSION, "benchmark": "zero_pool", "config": {"device": "cpu"},
                                "machine": {}, "results": [row], "tables": []}))  # fmt: skip
    md = _renderer().render([path])
    assert "| zero_pool (cpu) | GPT-2 small shapes, N=4 | peak pool | 0.8 | 0.79 .. 0.81 | le 0.75 | **missed** |" in md
    assert "| bytes pool | 6.91 | exact | le 6.05 | **missed** |" in md
    assert "| memory sharded | -2 MiB | -2 MiB .. -1 MiB | ge 0 MiB | **missed** |" in md
    # bench zero's memory targets written before targets carried a unit are bytes too
    old = {k: v for k, v in targets["memory sharded"].items() if k != "unit"}
    path.write_text(json.dumps({"benchmark": "zero", "results": [{"label": "ResNet-50", "targets": {"memory full": old}}]}))
    assert "| zero (cpu) | ResNet-50 | memory full | -2 MiB | -2 MiB .. -1 MiB | ge 0 MiB | **missed** |" in _renderer().render(
        [path]
    )


def test_render_keeps_what_no_file_here_measured(tmp_path):
    """A (benchmark, device) without a JSON here (a GPU session's stays on the checkout that ran it) keeps its summary
    rows and section from the previous RESULTS.md; a new file of it replaces them."""
    render = _renderer().render

    def write(device: str, value: float) -> Path:
        t = stats.target(value, 1.25, (value, value), "le", "90% bootstrap (rounds)")
        path = tmp_path / f"ops_{device}.json"
        table = {"title": f"T {device} {value}", "columns": ["a"], "rows": [["1"]]}
        path.write_text(json.dumps({"version": report.JSON_VERSION, "benchmark": "ops", "config": {"device": device},
                                    "machine": {}, "results": [{"layout": "b3", "targets": {"fused/floor": t}}],
                                    "tables": [table]}))  # fmt: skip
        return path

    both = render([write("cpu", 0.7), write("cuda", 0.5)])
    assert "| ops (cuda) | b3 | fused/floor | 0.5 |" in both and "**T cuda 0.5**" in both
    cpu_only = render([write("cpu", 0.8)], both)
    assert "| ops (cpu) | b3 | fused/floor | 0.8 |" in cpu_only and "| ops (cpu) | b3 | fused/floor | 0.7 |" not in cpu_only
    assert "| ops (cuda) | b3 | fused/floor | 0.5 |" in cpu_only and "**T cuda 0.5**" in cpu_only  # kept
    assert cpu_only.index("## ops: the fused flatten/unflatten round trip (cpu)") < cpu_only.index("(cuda)\n\nMeasured")
    assert "0.5 |" not in render([write("cpu", 0.8)])  # nothing previous: nothing kept
    assert "**T cuda 0.4**" in render([write("cuda", 0.4)], both) and "**T cuda 0.5**" not in render([write("cuda", 0.4)], both)


def test_ddp_bucket_assignment():
    MiB = models.MiB
    params = [("a", (MiB // 4,)), ("b", (3 * MiB // 4,)), ("c", (MiB // 8,)), ("d", (MiB // 8,)), ("e", (2 * MiB,))]
    # reverse order e, d, c, b, a; float32: e is 8 MiB (closes the first, 1 MiB bucket by itself)
    buckets = models.ddp_buckets(params, element_size=4, first_cap=MiB, cap=3 * MiB)
    assert [b["names"] for b in buckets] == [["e"], ["d", "c", "b"], ["a"]]
    assert [b["cap"] for b in buckets] == [MiB, 3 * MiB, 3 * MiB]
    assert buckets[1]["bytes"] == 4 * MiB  # closes once its size reaches the cap, not before exceeding it


def test_model_buckets_cover_every_parameter():
    shapes = models.model_shapes()
    expected = {"resnet50": 25_557_032, "gpt2_small": 124_439_808, "bert_base": 109_482_240}
    for model, numel in expected.items():
        buckets = models.ddp_buckets(shapes[model])
        assert sum(len(b["names"]) for b in buckets) == len(shapes[model])
        assert sum(sum(math.prod(s) for s in b["shapes"]) for b in buckets) == numel
        assert buckets[0]["names"][0] == shapes[model][-1][0]  # reverse parameter order
        for b in buckets[:-1]:
            assert b["bytes"] >= b["cap"]
    layouts, skipped = bench_ops.model_layouts(one_per_model=True)
    assert sorted(lay.model for lay in layouts) == sorted(expected)
    assert all(lay.nbytes >= bench_ops.BUCKET_CAP for lay in layouts)


def test_cli_arguments(capsys):
    args = cli.build_parser().parse_args(["all", "--threads", "all", "--quick", "--device", "cpu"])
    assert args.command == "all" and args.threads == "all" and args.quick and not args.smoke
    assert runner.thread_counts(args) == [report.available_cpus()]
    assert runner.thread_counts(cli.build_parser().parse_args(["ops", "--threads", "3"])) == [3]
    assert runner.thread_counts(cli.build_parser().parse_args(["ops"])) == sorted({1, report.available_cpus()})
    levels = [cli.level(cli.build_parser().parse_args(a)) for a in (["ops"], ["ops", "--full"], ["ops", "--smoke"])]
    assert levels == ["default", "full", "smoke"]
    for bad in (["ops", "--threads", "0"], ["ops", "--threads", "x"], ["nope"], ["ops", "--device", "tpu"]):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(bad)
    assert "--smoke" not in cli.build_parser().format_help()
    sub = cli._args_for(cli.build_parser().parse_args(["all", "--json", "/tmp/r.json"]), "ops")
    assert sub.command == "ops" and sub.json == "/tmp/r_ops.json" and sub.level == "default"


def test_timing_helpers():
    cpu = {}
    samples = runner.measure_interleaved({"f": lambda: sum(range(100))}, warmup=1, reps=5, target_s=1e-4, cpu=cpu)["f"]
    assert len(samples) == len(cpu["f"]) == 5 and all(s > 0 for s in samples)
    st = stats.summarize([3.0, 1.0, 2.0, 4.0])
    assert st["median_s"] == 2.5 and st["q1_s"] <= st["median_s"] <= st["q3_s"] and st["n"] == 4
    assert report.fmt_time(2e-6).endswith("µs") and report.fmt_time(2e-3).endswith("ms")


def test_bootstrap_ci():
    import random
    import statistics

    rng = random.Random(1)
    samples = {"a": [rng.gauss(2.0, 0.2) for _ in range(60)], "b": [rng.gauss(1.0, 0.1) for _ in range(60)]}

    def ratio(s):
        return statistics.median(s["a"]) / statistics.median(s["b"])

    lo, hi = stats.bootstrap_ci(ratio, samples)
    assert lo < ratio(samples) < hi and 1.8 < lo and hi < 2.2 and hi - lo > 0.02
    assert stats.bootstrap_ci(ratio, samples) == (lo, hi)  # seeded
    assert stats.bootstrap_ci(ratio, samples, level=0.5)[1] - stats.bootstrap_ci(ratio, samples, level=0.5)[0] < hi - lo
    assert stats.bootstrap_ci(lambda s: None, samples) is None
    same = {"a": [1.0] * 5, "b": [1.0] * 5}
    assert stats.bootstrap_ci(ratio, same) == (1.0, 1.0)
    # paired: rounds are resampled whole, so a drift shared by both methods cancels in their ratio
    drift = [rng.uniform(1.0, 2.0) for _ in range(60)]
    rounds = {"a": [2.0 * d for d in drift], "b": [1.0 * d for d in drift]}
    lo_p, hi_p = stats.bootstrap_ci(lambda s: statistics.median(x / y for x, y in zip(s["a"], s["b"])), rounds, paired=True)
    assert lo_p == pytest.approx(2.0) and hi_p == pytest.approx(2.0)
    with pytest.raises(ValueError, match="different sample counts"):
        stats.bootstrap_ci(ratio, {"a": [1.0, 2.0], "b": [1.0]}, paired=True)


def test_health_targets_carry_paired_intervals():
    import random

    from fastcoll.bench import health

    rng = random.Random(2)
    drift = [1 + 0.3 * rng.random() for _ in range(40)]  # a round's slowdown, shared by every method
    base = {"torch": 0.100, "torch+clip": 0.130, "fastcoll": 0.100, "fastcoll+torch clip": 0.130}
    base.update({"fastcoll norm": 0.101, "fastcoll norm+clip": 0.110, "fastcoll nonfinite": 0.1005, "fastcoll again": 0.1})
    samples = {m: [base[m] * d * (1 + 0.002 * rng.uniform(-1, 1)) for d in drift] for m in health.METHODS}
    out = health.analyze("resnet50", samples)
    for name in ("norm", "nonfinite", "clip"):
        t = out["targets"][name]
        lo, hi = t["ci90"]
        assert lo <= t["value"] <= hi and t["pass"] and t["resolved"], (name, t)
    # the shared drift (+-15%) cancels in the paired costs: the norm's interval stays within about a point of 1%
    assert 0.0 < out["targets"]["norm"]["ci90"][0] and out["targets"]["norm"]["ci90"][1] < 0.02
    assert "clip" not in health.analyze("mlp96", samples)["targets"]


@pytest.mark.timeout(180)
def test_health_smoke_run(tmp_path, capsys):
    from fastcoll.bench import health as bench_health

    path = tmp_path / "health.json"
    rc = cli.main(["health", "--smoke", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "fastcoll health" in out and "clip fastcoll" in out

    data = json.loads(path.read_text())
    assert data["benchmark"] == "health" and data["machine"]["torch"]
    cfg = data["config"]
    assert cfg["smoke"] and cfg["world_sizes"] == [2] and cfg["threads"] == 1
    rows = data["results"]
    assert {r["model"] for r in rows} == {"mlp", "resnet50", "gpt2_small"}
    for r in rows:
        assert set(r["methods"]) == set(bench_health.METHODS)
        assert all(st["median_s"] > 0 and st["n"] == cfg["reps"] for st in r["methods"].values())
        assert set(r["costs"]) == set(bench_health.COSTS) and set(r["cpu_time"]["costs"]) == set(bench_health.COSTS)
        assert r["checks"]["ok"], r["checks"]  # both clippings scaled by max_norm / norm, fastcoll's grads equal torch's
        assert {"norm", "nonfinite"} <= set(r["targets"]) and ("clip" in r["targets"]) == (r["model"] != "mlp")
    for r in data["ops"]:
        assert all(r["check"].values()) and r["ratio"] > 0
    assert path.with_suffix(".png").stat().st_size > 1000


def test_targets_and_adaptive_rounds():
    import random

    assert stats.verdict(0.7, 0.8, (0.65, 0.75)) == stats.MET
    assert stats.verdict(0.9, 0.8, (0.85, 0.95)) == stats.MISSED
    assert stats.verdict(0.79, 0.8, (0.7, 0.9)) == stats.UNRESOLVED
    assert stats.verdict(5.0, 0.0, (1.0, 9.0), op="ge") == stats.MET and stats.verdict(None, 1.0) == "not measured"
    t = stats.target(1.1, 1.0, (1.05, 1.2))
    assert t["verdict"] == stats.MISSED and t["resolved"] and t["pass"] is False and t["ci90"] == [1.05, 1.2]
    rng = random.Random(4)
    clear = {"a": [2.0 + rng.random() * 0.01 for _ in range(30)], "b": [1.0 + rng.random() * 0.01 for _ in range(30)]}
    goal = [(stats.median_ratio("a", "b"), 1.5, "le")]  # 2.0x: clearly missed, resolved after few rounds
    assert not stats.enough_rounds(clear, 2, 3, 20, goal)  # never before the minimum
    assert stats.enough_rounds(clear, 3, 3, 20, goal)
    assert not stats.enough_rounds(clear, 2, 3, 20) and stats.enough_rounds(clear, 3, 3, 20)  # no target: the minimum
    noisy = {"a": [rng.uniform(0.5, 2.5) for _ in range(10)], "b": [rng.uniform(0.5, 2.5) for _ in range(10)]}
    close = [(stats.median_ratio("a", "b"), 1.0, "le")]  # a ratio near 1 with wide noise: not resolved
    assert not stats.enough_rounds(noisy, 9, 3, 20, close) and stats.enough_rounds(noisy, 20, 3, 20, close)  # the cap
    rounds = []
    out = runner.measure_interleaved({"x": lambda: None, "y": lambda: None}, reps=8, inner=1, warmup=0,
                                     stop=lambda s, k: rounds.append(k) or k == 3)  # fmt: skip
    assert rounds == [1, 2, 3] and len(out["x"]) == len(out["y"]) == 3


def test_progress_estimates_the_time_left(capsys, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(report.time, "perf_counter", lambda: now[0])
    prog = report.Progress("demo", total=10)
    assert prog.left_s() is None  # nothing done yet: no estimate
    now[0] += 4.0
    prog.advance(2)
    assert prog.left_s() == pytest.approx(16.0)  # 2 s per unit, 8 units left
    prog.apply("row", ("first row", 5))
    assert "demo: row 1/5 done (first row); 4 s so far, about 16 s left" in capsys.readouterr().out
    prog.advance(100)
    assert prog.done == 10 and prog.left_s() == 0.0
