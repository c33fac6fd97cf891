"""fastcoll.reducer.timeline: the per-bucket event ring, exposed sync time, Chrome traces, profiler ranges.

Events are synthetic (a fake clock patched over ``perf_counter_ns``), so every
reported time is known exactly; one test drives the timeline from a real
backward's hooks to check the order of real timestamps.
"""

from __future__ import annotations

import json
import random
import statistics

import pytest
import torch
from multiproc import run_ranks

from fastcoll.reducer import timeline as tlmod
from fastcoll.reducer.timeline import (
    BUCKET_EVENTS,
    NULL_RANGE,
    Timeline,
    profiler_range,
)


class FakeClock:
    """perf_counter_ns stand-in: returns ``now`` (ns) and advances by ``step`` after each read."""

    def __init__(self, start: int = 1_000_000, step: int = 0):
        self.now = start
        self.step = step

    def __call__(self) -> int:
        t = self.now
        self.now += self.step
        return t

    def at(self, us: float) -> FakeClock:
        """Set the clock to ``us`` microseconds after the start (for the next reading)."""
        self.now = 1_000_000 + int(us * 1000)
        return self


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(tlmod, "_ns", c)
    return c


def run_iteration(tl: Timeline, clock: FakeClock, base_us: float, nb: int = 2, exposed_us: float = 30.0) -> None:
    """One iteration of ``nb`` buckets: forward at base, backward at base+100, compute ends at base+500.

    Bucket k: gradients ready at +100+100k and +150+100k, packed over 10 µs, issued,
    completed at end of backward + 5 + 5k, written back over 5 µs; the last write-back
    ends ``exposed_us`` after the end of backward compute.
    """
    b0 = base_us + 100
    clock.at(base_us)
    tl.begin_iteration(nb)
    clock.at(b0)
    tl.backward_start()
    for k in range(nb):
        clock.at(b0 + 100 * k)
        tl.ready(k)
        clock.at(b0 + 20 + 100 * k)
        tl.ready(k)  # a middle gradient: not kept
        clock.at(b0 + 50 + 100 * k)
        tl.ready(k)
        clock.at(b0 + 50 + 100 * k)
        tl.pack_start(k)
        clock.at(b0 + 60 + 100 * k)
        tl.pack_end(k)
        tl.issued(k)
    end = b0 + 400
    clock.at(end)
    tl.backward_end()
    tl.finalize_start()
    for k in range(nb):
        last = k == nb - 1
        clock.at(end + exposed_us - 10 if last else end + 5 + 5 * k)
        tl.completed(k)
        tl.writeback_start(k)
        clock.at(end + exposed_us if last else end + 10 + 5 * k)
        tl.writeback_end(k)
    tl.finalize_end()
    clock.at(end + exposed_us + 1)
    tl.end_iteration()


def test_events_relative_to_backward_start(clock):
    tl = Timeline()
    run_iteration(tl, clock, base_us=0, nb=2, exposed_us=30)
    (it,) = tl.iterations()
    assert it["iteration"] == 0 and it["n_buckets"] == 2
    assert it["forward_start_us"] == -100 and it["backward_start_us"] == 0
    assert it["backward_end_us"] == 400 and it["finalize_start_us"] == 400
    assert it["sync_end_us"] == 430 and it["finalize_end_us"] == 430 and it["end_us"] == 431
    assert it["exposed_sync_us"] == 30
    assert it["step_us"] == 531  # forward start to the end of the iteration
    assert it["t0_ns"] == 1_000_000 + 100_000
    b0, b1 = it["buckets"]
    assert b0 == {
        "bucket": 0,
        "ready_first_us": 0.0,
        "ready_last_us": 50.0,
        "pack_start_us": 50.0,
        "pack_end_us": 60.0,
        "issued_us": 60.0,
        "completed_us": 405.0,
        "writeback_start_us": 405.0,
        "writeback_end_us": 410.0,
    }
    assert b1["ready_first_us"] == 100 and b1["ready_last_us"] == 150 and b1["writeback_end_us"] == 430
    assert tl.last_times() == pytest.approx((30e-6, 531e-6))


def test_event_order_is_checkable(clock):
    tl = Timeline()
    run_iteration(tl, clock, 0, nb=4)
    for b in tl.iterations()[0]["buckets"]:
        times = [b[f"{e}_us"] for e in BUCKET_EVENTS]
        assert times == sorted(times), b


def test_ring_wraps_and_keeps_the_last_iterations(clock):
    tl = Timeline(capacity=3)
    for i in range(7):
        run_iteration(tl, clock, base_us=1000 * i, exposed_us=10 + i)
    its = tl.iterations()
    assert [it["iteration"] for it in its] == [4, 5, 6]
    assert [it["exposed_sync_us"] for it in its] == [14, 15, 16]
    assert tl.committed == 7
    assert tl.last_times()[0] == pytest.approx(16e-6)


def test_open_iteration_is_never_reported(clock):
    tl = Timeline(capacity=2)
    run_iteration(tl, clock, 0)
    clock.at(5000)
    tl.begin_iteration(2)  # a forward without backward
    tl.backward_start()
    assert [it["iteration"] for it in tl.iterations()] == [0]
    run_iteration(tl, clock, 6000, exposed_us=17)  # overwrites the open one
    its = tl.iterations()
    assert [it["iteration"] for it in its] == [0, 1] and its[1]["exposed_sync_us"] == 17


def test_stale_events_of_a_reused_slot_read_as_missing(clock):
    tl = Timeline(capacity=1)
    run_iteration(tl, clock, 0, nb=3)
    # next iteration in the same slot: only bucket 1 gets events
    clock.at(2000)
    tl.begin_iteration(3)
    clock.at(2100)
    tl.backward_start()
    tl.ready(1)
    clock.at(2200)
    tl.backward_end()
    tl.end_iteration()
    (it,) = tl.iterations()
    b0, b1, _ = it["buckets"]
    assert all(v is None for k, v in b0.items() if k != "bucket")
    assert b1["ready_first_us"] == 0 and b1["ready_last_us"] == 0 and b1["pack_start_us"] is None
    assert it["exposed_sync_us"] == 0 and it["sync_end_us"] == 100  # no write-back: the iteration end


def test_more_buckets_than_before(clock):
    tl = Timeline(capacity=1)
    run_iteration(tl, clock, 0, nb=2)
    run_iteration(tl, clock, 2000, nb=5)
    (it,) = tl.iterations()
    assert it["n_buckets"] == 5 and len(it["buckets"]) == 5
    run_iteration(tl, clock, 4000, nb=1)
    assert len(tl.iterations()[0]["buckets"]) == 1


def test_disabled_records_iteration_times_only(clock):
    tl = Timeline(enabled=False)
    run_iteration(tl, clock, 0, exposed_us=30)
    (it,) = tl.iterations()
    assert it["buckets"] == []
    assert it["backward_end_us"] == 400
    assert it["exposed_sync_us"] == 31  # no write-back recorded: to the end of the iteration
    assert tl.last_times() == pytest.approx((31e-6, 532e-6 - 1e-6))
    tl.enabled = True  # takes effect at the next iteration
    run_iteration(tl, clock, 2000)
    assert len(tl.iterations()[-1]["buckets"]) == 2


def test_calls_without_an_open_iteration_are_ignored(clock):
    tl = Timeline()
    for fn in (tl.ready, tl.pack_start, tl.pack_end, tl.issued, tl.completed, tl.writeback_start, tl.writeback_end):
        fn(0)
    tl.backward_start()
    tl.backward_end()
    tl.finalize_start()
    tl.finalize_end()
    tl.end_iteration()
    assert tl.iterations() == [] and tl.last_times() is None and tl.committed == 0
    with pytest.raises(ValueError):
        Timeline(capacity=0)


def test_clear(clock):
    tl = Timeline()
    run_iteration(tl, clock, 0)
    tl.clear()
    assert tl.iterations() == [] and tl.committed == 0
    run_iteration(tl, clock, 1000)
    assert [it["iteration"] for it in tl.iterations()] == [0]


# ------------------------------------------------------------------ chrome trace


def test_chrome_trace(clock, tmp_path):
    tl = Timeline()
    for i in range(2):
        run_iteration(tl, clock, 1000 * i, nb=4)
    path = tl.export_chrome_trace(tmp_path / "trace.json", rank=1)
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    names = {e["name"] for e in spans}
    for k in range(4):
        assert {f"bucket {k} ready", f"bucket {k} pack", f"bucket {k} all-reduce", f"bucket {k} write-back"} <= names
    assert {"forward", "backward", "exposed sync"} <= names
    assert all(e["pid"] == 1 and e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert len([e for e in spans if e["name"] == "bucket 3 all-reduce"]) == 2  # one per iteration
    meta = {(e["name"], e["tid"]): e["args"] for e in events if e["ph"] == "M"}
    assert meta[("process_name", 0)] == {"name": "rank 1"}
    assert [meta[("thread_name", t)]["name"] for t in range(5)] == list(tlmod.LANES)
    # origin: the oldest forward start; the second iteration's backward starts at 1100 µs
    back = [e for e in spans if e["name"] == "backward"]
    assert [e["ts"] for e in back] == [100, 1100] and [e["dur"] for e in back] == [400, 400]
    exposed = [e for e in spans if e["name"] == "exposed sync"]
    assert exposed[0]["dur"] == 30 and exposed[0]["args"]["exposed_us"] == 30
    # a common origin for several ranks; comm names per bucket
    tl.comm_names = ["comm hook"] * 4
    shifted = tl.to_chrome_trace(rank=0, origin_ns=0)
    assert {e["name"] for e in shifted["traceEvents"]} >= {"bucket 2 comm hook"}
    assert min(e["ts"] for e in shifted["traceEvents"] if e["ph"] == "X") == 1000  # 1_000_000 ns


def test_chrome_trace_empty():
    data = Timeline().to_chrome_trace()
    assert [e for e in data["traceEvents"] if e["ph"] == "X"] == []
    json.dumps(data)


# --------------------------------------------------------------- profiler ranges


def test_profiler_ranges_only_when_profiling():
    assert profiler_range("x") is NULL_RANGE
    with profiler_range("x"):
        pass
    from torch.profiler import ProfilerActivity, profile

    tl = Timeline()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert tlmod.profiler_active()
        tl.begin_iteration(2)
        tl.backward_start()
        for k in range(2):
            tl.pack_start(k)
            torch.ones(8).sum()
            tl.pack_end(k)
        tl.backward_end()
        tl.finalize_start()
        for k in range(2):
            tl.writeback_start(k)
            tl.writeback_end(k)
        tl.finalize_end()
        tl.end_iteration()
        with profiler_range("fastcoll.custom"):
            pass
    names = [e.name for e in prof.events()]
    for name in ("fastcoll.bucket[0].pack", "fastcoll.bucket[1].pack", "fastcoll.bucket[0].unpack", "fastcoll.bucket[1].unpack"):
        assert names.count(name) == 1, names
    assert names.count("fastcoll.finalize") == 1 and "fastcoll.custom" in names
    assert not tl._ranges


def test_ranges_left_open_are_closed_at_the_end_of_the_iteration():
    from torch.profiler import profile

    tl = Timeline(enabled=False)  # ranges do not depend on recording
    with profile() as prof:
        tl.begin_iteration(1)
        tl.pack_start(0)  # e.g. the pack raised
        tl.end_iteration()
    assert not tl._ranges
    assert [e.name for e in prof.events()].count("fastcoll.bucket[0].pack") == 1


# ------------------------------------------------------------ a real backward


def test_real_hooks_give_ordered_times():
    layers = [torch.nn.Linear(8, 8) for _ in range(4)]
    params = [p for layer in layers for p in layer.parameters()]
    bucket_of = {id(p): i // 4 for i, p in enumerate(reversed(params))}  # 2 buckets of 4 params
    tl = Timeline()

    def hook(p):
        tl.ready(bucket_of[id(p)])

    for p in params:
        p.register_post_accumulate_grad_hook(hook)
    for _ in range(3):
        tl.begin_iteration(2)
        x = torch.randn(2, 8)
        for layer in layers:
            x = torch.tanh(layer(x))
        tl.backward_start()
        x.sum().backward()
        tl.backward_end()
        for b in range(2):
            tl.pack_start(b)
            tl.pack_end(b)
            tl.issued(b)
        for b in range(2):
            tl.completed(b)
            tl.writeback_start(b)
            tl.writeback_end(b)
        tl.end_iteration()
    its = tl.iterations()
    assert len(its) == 3
    for it in its:
        assert it["forward_start_us"] < 0 <= it["backward_end_us"] <= it["sync_end_us"] <= it["end_us"]
        assert it["exposed_sync_us"] >= 0 and it["step_us"] > 0
        b0, b1 = it["buckets"]
        assert 0 <= b0["ready_first_us"] <= b0["ready_last_us"] <= b1["ready_first_us"] <= b1["ready_last_us"]
        for b in (b0, b1):
            times = [b[f"{e}_us"] for e in BUCKET_EVENTS]
            assert None not in times and times == sorted(times)


# ------------------------------------------------- the timeline benchmark's pieces


def fake_ranks(clock: FakeClock, ranks: int = 2, iters: int = 4, nb: int = 3) -> list[list[dict]]:
    """Per rank, the iterations() of a Timeline fed synthetic events (rank r exposes 10 + 5 r + i µs in iteration i)."""
    out = []
    for r in range(ranks):
        tl = Timeline()
        for i in range(iters):
            run_iteration(tl, clock, base_us=1000 * i, nb=nb, exposed_us=20 + 5 * r + i)
        out.append(tl.iterations())
    return out


def test_gantt_chart_from_synthetic_iterations(clock, tmp_path):
    pytest.importorskip("matplotlib")
    from fastcoll.bench import timeline as bench

    per_rank = fake_ranks(clock)
    num, recs = bench.representative(per_rank)
    # slowest-rank exposed per iteration: 25, 26, 27, 28 µs; the median (lower) is iteration 1
    assert num == 1 and [r["iteration"] for r in recs] == [1, 1]
    assert bench.exposed_median_s(per_rank) == pytest.approx(26.5e-6)
    spans = bench._spans(recs[0])
    assert {kind for _, kind, _, _, _ in spans} == {"forward", "backward", "exposed", "ready", "pack", "comm", "write-back"}
    assert all(a <= b for _, _, _, a, b in spans)
    path = bench.gantt_chart(
        tmp_path / "gantt.png",
        "synthetic",
        {"default (25 MiB): 3 buckets": recs, "auto: 2 buckets": [per_rank[0][-1], None]},  # a rank without data
    )
    assert path is not None and path.stat().st_size > 5000
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_model_gantt_and_merged_traces(clock, tmp_path):
    pytest.importorskip("matplotlib")
    from fastcoll.bench import timeline as bench

    traces = []
    for r in range(2):
        tl = Timeline()
        for i in range(3):
            run_iteration(tl, clock, base_us=1000 * i, nb=2, exposed_us=20 + r)
        traces.append(tl.to_chrome_trace(rank=r)["traceEvents"])
    row = {
        "model": "m",
        "label": "model m",
        "auto_choice": "5 MiB",
        "layouts": {
            "25 MiB": {"timeline": fake_ranks(clock, nb=2), "buckets": 2, "trace_events": traces},
            "auto": {"timeline": fake_ranks(clock, nb=3), "buckets": 3, "trace_events": traces},
        },
    }
    assert bench.model_gantt(tmp_path / "m.png", row, "cpu").stat().st_size > 5000
    written = bench.write_traces(lambda model: tmp_path / f"{model}.trace.json", {"results": [row]})
    assert written == [tmp_path / "m.trace.json"] and "trace_events" not in row["layouts"]["auto"]
    data = json.loads(written[0].read_text())
    names = {e["name"] for e in data["traceEvents"] if e["ph"] == "X"}
    assert {"bucket 1 all-reduce", "bucket 0 pack", "bucket 1 write-back", "exposed sync"} <= names
    procs = {e["pid"]: e["args"]["name"] for e in data["traceEvents"] if e["name"] == "process_name"}
    assert procs == {
        0: "default (25 MiB), rank 0",
        1: "default (25 MiB), rank 1",
        100: "auto (5 MiB), rank 0",
        101: "auto (5 MiB), rank 1",
    }


def test_summarize_row_targets():
    from fastcoll.bench import timeline as bench

    def st(x):
        return {"median_s": x}

    row = {
        "methods": {
            "torch": st(0.10),
            "1 MiB": st(0.12),
            "5 MiB": st(0.08),
            "25 MiB": st(0.09),
            "100 MiB": st(0.11),
            "auto": st(0.083),
        },
        "tuning_report": [{"label": "default (25 MiB)", "chosen": False}, {"label": "5 MiB", "chosen": True}],
        "layouts": {"25 MiB": {"timeline": [[]]}, "auto": {"timeline": [[]]}},
    }
    bench.summarize_row(row)
    assert row["best_fixed"] == "5 MiB" and row["auto_choice"] == "5 MiB"
    assert row["ratios"]["auto/best fixed"] == pytest.approx(0.083 / 0.08)
    assert row["targets"]["auto vs best fixed"]["pass"] and row["targets"]["auto vs torch"]["pass"]
    row["methods"]["auto"] = st(0.101)
    bench.summarize_row(row)
    assert not row["targets"]["auto vs best fixed"]["pass"] and not row["targets"]["auto vs torch"]["pass"]
    assert row["exposed_sync_s"] == {"25 MiB": None, "auto": None}
    assert row["targets"]["auto vs torch"]["ci90"] is None  # no samples: no interval


def test_summarize_row_intervals():
    """With the samples, each target carries a 90% bootstrap interval; resolved only when it excludes the threshold."""
    from fastcoll.bench import timeline as bench

    rng = random.Random(0)

    def noisy(center, spread):
        return [center * (1 + spread * rng.uniform(-1, 1)) for _ in range(40)]

    def row_of(samples):
        return {
            "methods": {m: {"median_s": statistics.median(xs)} for m, xs in samples.items()},
            "samples_s": samples,
            "layouts": {},
        }

    tight = {m: noisy(0.1, 0.01) for m in bench.METHODS}
    tight["auto"] = noisy(0.08, 0.01)  # clearly faster than everything: both targets pass, resolved
    row = bench.summarize_row(row_of(tight))
    for t in row["targets"].values():
        lo, hi = t["ci90"]
        assert lo <= t["value"] <= hi and hi < t["threshold"] and t["pass"] and t["resolved"]
    wide = {m: noisy(0.1, 0.5) for m in bench.METHODS}  # +-50% noise: the interval straddles 1.0
    row = bench.summarize_row(row_of(wide))
    t = row["targets"]["auto vs torch"]
    assert t["ci90"][0] < 1.0 < t["ci90"][1] and not t["resolved"]


def test_bench_cli_registration(capsys):
    from fastcoll.bench import __main__ as cli
    from fastcoll.bench import timeline as bench

    assert "timeline" in cli.SUBCOMMANDS
    args = cli._args_for(cli.build_parser().parse_args(["timeline", "--quick"]), "timeline")
    assert args.command == "timeline"
    cfg = bench._config(args, "cpu")
    assert cfg["world_size"] == 2 and cfg["backend"] == "gloo" and cfg["threads"] == 1 and cfg["quick"]
    assert [s.name for s in bench.model_specs(cfg)] == ["mlp96", "encoder", "resnet50"]
    assert bench.METHODS == ("torch", "1 MiB", "5 MiB", "25 MiB", "100 MiB", "auto")


@pytest.mark.timeout(300)
def test_bench_smoke_run(tmp_path, capsys):
    from fastcoll.bench import __main__ as cli
    from fastcoll.bench import timeline as bench

    path = tmp_path / "timeline.json"
    assert cli.main(["timeline", "--smoke", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "bucket caps sweep" in out and "exposed synchronization" in out
    data = json.loads(path.read_text())
    assert data["benchmark"] == "timeline" and data["config"]["smoke"]
    for r in data["results"]:
        assert set(r["methods"]) == set(bench.METHODS)
        assert all(st["median_s"] > 0 for st in r["methods"].values())
        assert any(x["chosen"] for x in r["tuning_report"])
        for lay in r["layouts"].values():
            assert len(lay["timeline"]) == 2 and all(lay["timeline"])  # both ranks recorded iterations
        assert (tmp_path / f"timeline_{r['model']}.png").stat().st_size > 1000
        assert (tmp_path / f"timeline_{r['model']}.trace.json").exists()
    assert path.with_suffix(".png").stat().st_size > 1000


def test_completed_keeps_the_first_time_and_watch_uses_the_future(clock):
    tl = Timeline()
    clock.at(0)
    tl.begin_iteration(2)
    clock.at(100)
    tl.backward_start()
    fut = torch.futures.Future()
    tl.watch(fut, 0)

    class Work:  # a c10d Work: the future comes from get_future()
        def __init__(self):
            self.fut = torch.futures.Future()

        def get_future(self):
            return self.fut

    work = Work()
    tl.watch(work, 1)
    tl.watch(object(), 1)  # no future (world size 1): ignored
    clock.at(150)
    fut.set_result(None)  # bucket 0 completes at 150 (50 µs after backward start)
    clock.at(170)
    work.fut.set_result(None)
    clock.at(300)
    tl.backward_end()
    for b in range(2):
        tl.completed(b)  # after wait(): later, not kept
    tl.end_iteration()
    b0, b1 = tl.iterations()[0]["buckets"]
    assert b0["completed_us"] == 50 and b1["completed_us"] == 70
    tl.enabled = False
    tl.begin_iteration(2)
    tl.watch(torch.futures.Future(), 0)  # not recording: no callback
    tl.end_iteration()


@pytest.mark.timeout(120)
def test_watch_gloo_all_reduce():
    assert run_ranks(_watch_worker, 2, timeout=90) == [True, True]


def _watch_worker(rank: int, world_size: int) -> bool:
    import time

    import torch.distributed as dist

    tl = Timeline()
    tl.begin_iteration(2)
    tl.backward_start()
    ts = [torch.ones(1 << 16), torch.ones(1 << 16)]
    handles = []
    for b, t in enumerate(ts):
        h = dist.all_reduce(t, async_op=True)
        tl.issued(b)
        tl.watch(h, b)
        handles.append(h)
    time.sleep(0.3)  # the collectives finish long before finalize waits
    tl.backward_end()
    for b, h in enumerate(handles):
        h.wait()
        tl.completed(b)
    tl.end_iteration()
    it = tl.iterations()[0]
    for b in it["buckets"]:
        assert b["issued_us"] <= b["completed_us"] < it["backward_end_us"], it
    return True
