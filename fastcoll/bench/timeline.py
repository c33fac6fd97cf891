"""Where the gradient synchronization goes, bucket by bucket, and what autotuned buckets gain (docs/benchmarks.md).

Per model, a step (zero_grad + forward + backward) of each of :data:`METHODS` (torch DDP, fixed bucket caps,
``bucket_cap_mb="auto"`` after its tuning) in rounds on shared weights. Then, for the 25 MiB and the tuned layout, the
exposed synchronization (``model.sync_timeline()``), a Gantt chart per model and a merged Chrome trace
(``timeline_<device>_<model>.trace.json``, for ui.perfetto.dev).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

from ..reducer.autotune import autotune_steps
from ..reducer.timeline import LANES
from . import models, report, runner, stats

CPU_WORLD_SIZE = 2
CUDA_WORLD_SIZE = 1
FIXED_CAPS_MB = (1, 5, 25, 100)
FIXED_METHODS = tuple(f"{c} MiB" for c in FIXED_CAPS_MB)
METHODS = ("torch", *FIXED_METHODS, "auto")
BUCKET_CAPS = {**{m: float(c) for m, c in zip(FIXED_METHODS, FIXED_CAPS_MB)}, "auto": "auto"}  # fastcoll.DDP's bucket_cap_mb
METHOD_DESCRIPTIONS = {
    "torch": "torch.nn.parallel.DistributedDataParallel(module) (bucket_cap_mb=25)",
    **{f"{c} MiB": f"fastcoll.DDP(module, bucket_cap_mb={c})" for c in FIXED_CAPS_MB},
    "auto": 'fastcoll.DDP(module, bucket_cap_mb="auto"), timed after its tuning',
}
AUTO_VS_BEST_FIXED = 1.05  # auto's step <= 1.05x the best fixed cap's
AUTO_VS_TORCH = 1.0  # auto's step <= 1.0x torch DDP's default
TIMELINE_LAYOUTS = ("25 MiB", "auto")  # the layouts whose timelines are charted: the default cap and the tuned one
SMOKE_AUTOTUNE_STEPS = "12"

#: Gantt chart colours per lane kind (fastcoll.reducer.timeline.LANES): two shades alternating per bucket, the legend.
LANE_COLOURS = {
    "forward": ("#d9d9d9", "#d9d9d9", "forward"), "backward": ("#8c8c8c", "#8c8c8c", "backward compute"),
    "exposed": ("#e34a33", "#e34a33", "exposed sync"), "ready": ("#a1d99b", "#41ab5d", "gradients ready (first-last)"),
    "pack": ("#fdae6b", "#e6550d", "pack"), "comm": ("#9ecae1", "#3182bd", "communication"),
    "write-back": ("#bcbddc", "#756bb1", "write-back"),
}  # fmt: skip
#: The bucket lanes of the Gantt chart: colour kind, and the record's start and end fields.
BUCKET_LANES = (("ready", "ready_first_us", "ready_last_us"), ("pack", "pack_start_us", "pack_end_us"),
                ("comm", "issued_us", "completed_us"), ("write-back", "writeback_start_us", "writeback_end_us"))  # fmt: skip

CONFIGS = {  # rounds: reps..max_reps, until both targets resolve
    "smoke": {"reps": 2, "max_reps": 2, "setup_steps": 3, "target_s": 0.0, "max_inner": 1},
    "default": {"reps": 6, "max_reps": 20, "setup_steps": 3, "target_s": 0.03, "max_inner": 50},
    "full": {"reps": 30, "max_reps": 100, "setup_steps": 3, "target_s": 0.1, "max_inner": 200},
}


def _config(args: Any, device: str = "cpu") -> dict[str, Any]:
    return runner.level_config(args, CONFIGS, CUDA_WORLD_SIZE if device == "cuda" else CPU_WORLD_SIZE)


def model_specs(cfg: dict[str, Any]) -> list[Any]:
    """The ddp benchmark's models (default run: the MLP, the encoder and the ResNet-50 shapes; smoke: tiny ones)."""
    if cfg["smoke"]:
        return [models.SMOKE_MLP, models.SMOKE_CONVBN, models.SMOKE_ENCODER, models.SMOKE_RESNET50]
    if cfg["quick"]:
        return [models.MLP96, models.ENCODER, models.RESNET50]
    return [models.MLP96, models.CONVBN, models.ENCODER, models.RESNET50, models.GPT2]


def best_fixed_ratio(samples: stats.Samples) -> float | None:
    """auto's median step over the best fixed cap's."""
    return stats.ratio(statistics.median(samples["auto"]), min(statistics.median(samples[m]) for m in FIXED_METHODS))


#: The targets: name -> (the ratio it reports, its threshold, the statistic of its interval and of when to stop sampling).
GOALS = {"auto vs best fixed": ("auto/best fixed", AUTO_VS_BEST_FIXED, best_fixed_ratio),
         "auto vs torch": ("auto/torch", AUTO_VS_TORCH, stats.median_ratio("auto", "torch"))}  # fmt: skip


def bench_model(spec: Any, me: runner.Rank) -> dict[str, Any]:
    """One model on this rank: the sweep, then the timelines and tuning report (gathered from every rank)."""
    device = me.device
    storage = models.build_storage(spec, device)
    x = models.make_input(spec, me.rank, device)
    wrappers, steps, setup_s = {}, {}, {}  # per method: the wrapper, its step, the seconds of its last setup step
    tune_steps = autotune_steps() + 5
    for method in METHODS:
        fastcoll = {"bucket_cap_mb": BUCKET_CAPS[method], "record_timeline": True} if method != "torch" else {}
        wrapper = runner.wrap("fastcoll" if fastcoll else "torch", models.build_model(spec, device, storage), device, **fastcoll)
        step = models.backward_step(spec, wrapper, x)
        runner.run_steps(step, (tune_steps if method == "auto" else me.cfg["setup_steps"]) - 1)  # the rebuild, auto's tuning
        setup_s[method] = runner.time_calls(step, 1, device)
        wrappers[method], steps[method] = wrapper, step
        me.tick()
    inner = me.inner(max(setup_s.values()))
    goals = [(stat, thr, "le") for _, thr, stat in GOALS.values()]
    samples, _ = runner.timed_rounds(steps, inner, me.cfg["reps"], me.cfg["max_reps"], goals, device, me.tick)

    layouts: dict[str, Any] = {}
    for method in TIMELINE_LAYOUTS:
        w = wrappers[method]
        with tempfile.TemporaryDirectory(prefix="fastcoll_bench_timeline_") as tmp:
            events = json.loads(w.export_chrome_trace(os.path.join(tmp, "trace.json")).read_text())["traceEvents"]
        layouts[method] = {"timeline": runner.gather(w.sync_timeline()), "buckets": len(w.bucket_info()),  # per rank
                           "bucket_bytes": [b["bytes"] for b in w.bucket_info()],
                           "trace_events": runner.gather(events)}  # fmt: skip
    params = [p for p in wrappers["torch"].module.parameters() if p.requires_grad]
    row = {"model": spec.name, "label": spec.label, "synthetic": spec.synthetic, "params": len(params),
           "numel": sum(p.numel() for p in params), "inner": inner,
           "methods": {m: {**stats.summarize(s), "setup_step_s": setup_s[m]} for m, s in samples.items()},
           "samples_s": samples, "buckets": {m: (len(w.bucket_info()) if m != "torch" else None) for m, w in wrappers.items()},
           "tuning_report": wrappers["auto"].tuning_report(), "layouts": layouts}  # fmt: skip
    del wrappers, steps, storage
    gc.collect()
    return row


def _ranks(me: runner.Rank) -> dict[str, Any]:
    rows, specs = [], model_specs(me.cfg)
    for spec in specs:
        me.describe(f"timeline: {spec.label}")
        rows.append(bench_model(spec, me))
        me.row(spec.label, len(specs))
    return {"rows": rows}


# Results
def representative(per_rank: Sequence[Sequence[dict[str, Any]]]) -> tuple[int | None, list[dict[str, Any] | None]]:
    """The iteration to chart (present on every rank, its slowest rank's exposed sync the median) and each rank's record
    of it (None where a rank lacks it)."""
    by_num, exposed = _slowest_exposed(per_rank)
    if not exposed:
        return None, [None] * len(per_rank)
    num = sorted((us, n) for n, us in exposed.items())[(len(exposed) - 1) // 2][1]
    return num, [r.get(num) for r in by_num]


def _slowest_exposed(per_rank: Sequence[Sequence[dict[str, Any]]]) -> tuple[list[dict[int, Any]], dict[int, float]]:
    """Each rank's records by iteration, and the slowest rank's exposed sync (us) of each iteration every rank recorded."""
    by_num = [{it["iteration"]: it for it in its} for its in per_rank]
    nums = set.intersection(*(set(r) for r in by_num)) if by_num else set()
    return by_num, {n: max(r[n]["exposed_sync_us"] for r in by_num) for n in nums}


def exposed_median_s(per_rank: Sequence[Sequence[dict[str, Any]]]) -> float | None:
    """Median over the iterations every rank recorded of the slowest rank's exposed sync time (seconds)."""
    exposed = _slowest_exposed(per_rank)[1]
    return statistics.median(exposed.values()) / 1e6 if exposed else None


def summarize_row(row: dict[str, Any]) -> dict[str, Any]:
    """Ratios, targets and exposed sync times of one model's row (added in place; returned)."""
    med = {m: st["median_s"] for m, st in row["methods"].items()}
    best = min(FIXED_METHODS, key=lambda m: med[m])
    samples, how = row.get("samples_s") or {}, "90% bootstrap (rounds)"
    row["best_fixed"] = best
    row["ratios"] = {"auto/best fixed": stats.ratio(med["auto"], med[best]), "auto/torch": stats.ratio(med["auto"], med["torch"]),
                     "25 MiB/torch": stats.ratio(med["25 MiB"], med["torch"])}  # fmt: skip
    ci = {k: stats.bootstrap_ci(stat, samples, paired=True) if samples else None for k, (_, _, stat) in GOALS.items()}
    row["targets"] = {k: stats.target(row["ratios"][r], thr, ci[k], "le", how) for k, (r, thr, _) in GOALS.items()}
    chosen = next((r for r in row.get("tuning_report") or [] if r.get("chosen")), None)
    row["auto_choice"] = chosen["label"] if chosen else None
    row["exposed_sync_s"] = {m: exposed_median_s(lay["timeline"]) for m, lay in row["layouts"].items()}
    return row


# Gantt chart
def _spans(it: dict[str, Any]) -> list[tuple[int, str, int, float, float]]:
    """``(lane, colour kind, bucket or -1, start_ms, end_ms)`` of one iteration record (the spans it has both ends of)."""
    end = it.get("backward_end_us")
    spans = [(0, "forward", -1, it.get("forward_start_us"), it.get("backward_start_us")),
             (0, "backward", -1, it.get("backward_start_us"), end),
             (0, "exposed", -1, end, None if end is None else end + it.get("exposed_sync_us", 0.0))]  # fmt: skip
    spans += [(lane, kind, bucket["bucket"], bucket.get(start), bucket.get(stop))
              for bucket in it.get("buckets", []) for lane, (kind, start, stop) in enumerate(BUCKET_LANES, 1)]  # fmt: skip
    return [(lane, kind, k, a / 1e3, b / 1e3) for lane, kind, k, a, b in spans if a is not None and b is not None and b >= a]


def gantt_chart(path: Path, title: str, panels: dict[str, Sequence[dict[str, Any] | None]]) -> Path | None:
    """Draw one iteration per rank per panel as a Gantt chart (PNG at ``path``); None without matplotlib.

    ``panels``: panel title -> per rank, one record of :meth:`fastcoll.reducer.timeline.Timeline.iterations` (None: that
    rank has none). Each rank gets the lanes of :data:`fastcoll.reducer.timeline.LANES`; times in ms from the backward
    start; the exposed sync time is the red bar after the backward.
    """
    plt = report.pyplot()
    if plt is None or not panels:
        return None
    from matplotlib.patches import Patch

    per_rank = len(LANES) + 1  # a rank's lanes and a gap: rank r's lane l is at r * per_rank + l
    spans = {name: [_spans(it) if it else [] for it in recs] for name, recs in panels.items()}
    every = [s for ranks in spans.values() for rank_spans in ranks for s in rank_spans]
    xmin, xmax = min((s[3] for s in every), default=0.0), max((s[4] for s in every), default=1.0)
    height = 0.32 * per_rank * (max(len(recs) for recs in panels.values()) or 1) * len(panels) + 1.6 * len(panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, height), squeeze=False)
    for ax, (name, ranks) in zip(axes[:, 0], spans.items()):
        for r, rank_spans in enumerate(ranks):
            for lane, kind, k, a, b in rank_spans:
                colour, y = LANE_COLOURS[kind][k % 2 if k >= 0 else 0], r * per_rank + lane
                ax.broken_barh([(a, max(b - a, (xmax - xmin) * 1e-4))], (y - 0.4, 0.8), facecolors=colour)
                if kind == "comm" and (b - a) > 0.04 * (xmax - xmin):
                    ax.text((a + b) / 2, y, str(k), ha="center", va="center", fontsize=6)
        lanes = [(r * per_rank + lane, f"rank {r} · {label}") for r in range(len(ranks)) for lane, label in enumerate(LANES)]
        ax.set_yticks([y for y, _ in lanes], [label for _, label in lanes], fontsize=7)
        ax.set_ylim(len(ranks) * per_rank - 1, -1)
        ax.set_xlim(xmin - 0.01 * (xmax - xmin), xmax + 0.01 * (xmax - xmin))
        ax.set_title(name, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("ms from the start of backward")
    legend = [Patch(color=dark, label=label) for _, dark, label in LANE_COLOURS.values()]
    fig.legend(handles=legend, loc="lower center", ncol=len(legend), fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    return report.save_figure(fig, path)


def model_gantt(path: Path, row: dict[str, Any], device: str) -> Path | None:
    """The Gantt chart of one model's row: the default layout and the autotuned one."""
    panels: dict[str, list[dict[str, Any] | None]] = {}
    for method, lay in row["layouts"].items():
        num, recs = representative(lay["timeline"])
        exposed = max((it["exposed_sync_us"] for it in recs if it), default=None)
        exposed_s = report.fmt_time(exposed and exposed / 1e6)
        panels[f"{_layout_name(row, method)}: {lay['buckets']} buckets, iteration {num}, exposed sync {exposed_s}"] = recs
    return gantt_chart(path, f"fastcoll timeline ({device}): {row['label']}", panels)


# Entry points
def measure(args: Any = None) -> dict[str, Any]:
    """Spawn the ranks, run the benchmark and return its results (rows summarized, each layout with its trace events)."""
    cfg = _config(args, args.device)
    specs = model_specs(cfg)
    short_tuning = cfg["smoke"] and "FASTCOLL_AUTOTUNE_STEPS" not in os.environ  # --smoke: unless the steps are set
    env = {"FASTCOLL_AUTOTUNE_STEPS": SMOKE_AUTOTUNE_STEPS} if short_tuning else {}
    with report.progress("timeline", len(specs) * len(METHODS) * (cfg["max_reps"] + 1)) as prog:
        result = runner.run_ranks(_ranks, {**cfg, "malloc": "keep", "freeze": True, "env": env}, (), cfg["world_size"], prog)
    rows = [summarize_row(r) for r in result["rows"]]
    config = {**cfg, "autotune_steps": int(env.get("FASTCOLL_AUTOTUNE_STEPS") or autotune_steps()),
              "models": [dataclasses.asdict(s) for s in specs], "methods": METHOD_DESCRIPTIONS,
              "step": "module.zero_grad(set_to_none=True); loss(wrapper(x)).backward()  (no optimizer step)",
              "targets": f"auto step <= {AUTO_VS_BEST_FIXED}x the best fixed cap's and <= {AUTO_VS_TORCH}x torch DDP's",
              }  # fmt: skip
    return {"benchmark": "timeline", "config": config, "implementation": result["implementation"], "results": rows}


def _layout_name(row: dict[str, Any], method: str) -> str:
    return f"auto ({row.get('auto_choice') or '?'})" if method == "auto" else f"default ({method})"


def write_traces(path_for: Callable[[str], Path], payload: dict[str, Any]) -> list[Path]:
    """One merged Chrome trace per model (every rank, both layouts), taking the events out of ``payload``; returns the paths.

    Each rank's ``traceEvents`` of a layout become the process ``<layout>, rank r``; process ids offset by 100 per layout.
    """
    written = []
    for row in payload["results"]:
        events: list[dict[str, Any]] = []
        for j, (method, lay) in enumerate(row["layouts"].items()):
            for ev in (ev for rank_events in lay.pop("trace_events", []) for ev in rank_events):
                ev = {**ev, "pid": 100 * j + int(ev.get("pid", 0))}
                if ev.get("ph") == "M" and ev.get("name") == "process_name":
                    ev["args"] = {"name": f"{_layout_name(row, method)}, {ev.get('args', {}).get('name', '')}"}
                elif ev.get("ph") == "M" and ev.get("name") == "process_sort_index":
                    ev["args"] = {"sort_index": ev["pid"]}
                events.append(ev)
        if events:
            out = path_for(row["model"])
            out.parent.mkdir(parents=True, exist_ok=True)
            trace = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"producer": "fastcoll.bench timeline"}}
            out.write_text(json.dumps(trace))
            written.append(out)
    return written


def print_results(payload: dict[str, Any]) -> None:
    cfg = payload["config"]
    columns = ["model", *(m if m != "torch" else "torch DDP" for m in METHODS), "auto chose",
               f"auto/best fixed (≤{AUTO_VS_BEST_FIXED}x)", f"auto/torch (≤{AUTO_VS_TORCH}x)"]  # fmt: skip
    body = []
    for r in payload["results"]:
        times = {m: report.fmt_time(r["methods"][m]["median_s"]) for m in METHODS}
        body.append([r["label"] + (" *" if r["synthetic"] else ""), *(f"[bold]{t}[/bold]" if m == r["best_fixed"] else t
                     for m, t in times.items()), r["auto_choice"] or "-",
                     *(report.target_cell(r["targets"][k]) for k in ("auto vs best fixed", "auto vs torch"))])  # fmt: skip
    where = (f"{cfg['world_size']} gloo ranks on loopback, {cfg['threads']} intra-op thread(s) each" if cfg["device"] == "cpu"
             else f"{cfg['world_size']} rank on NCCL")  # fmt: skip
    report.table(f"fastcoll timeline: bucket caps sweep, median step ({cfg['device']})", columns, body,
                 f"{where}; ops: {payload['implementation']}. Step = zero_grad + forward + backward (slowest rank), samples "
                 f"interleaved across methods; bold: the best fixed cap. auto timed after {cfg['autotune_steps']} tuning "
                 "steps. * synthetic model. Targets are informational, never asserted.")  # fmt: skip
    body = [[r["label"], f"auto: {r['auto_choice'] or '?'}" if m == "auto" else f"default: {m}", str(lay["buckets"]),
             report.fmt_time(r["exposed_sync_s"].get(m)), report.fmt_time(r["methods"][m]["median_s"])]
            for r in payload["results"] for m, lay in r["layouts"].items()]  # fmt: skip
    report.table(f"fastcoll timeline: exposed synchronization ({cfg['device']})",
                 ["model", "layout", "buckets", "exposed sync (median)", "step (median)"], body,
                 "exposed sync = end of backward compute to the last gradient written back (model.sync_timeline(); "
                 "median over the last recorded iterations of the slowest rank).")  # fmt: skip
    for r in payload["results"]:
        tried = [f"{x['label']}{' (chosen)' if x.get('chosen') else ''} {report.fmt_time(x.get('step_median_s'))}"
                 for x in r.get("tuning_report") or [] if not x.get("pruned")]  # fmt: skip
        if tried:
            report.say(f"[dim]{r['label']}: auto tried {', '.join(tried)}[/dim]")


def run(args: Any = None) -> int:
    """``python -m fastcoll.bench timeline``: tables, ``benchmarks/out/timeline_<device>.json``, the targets chart, a Gantt
    chart and a Chrome trace per model; returns 0."""
    device = args.device
    payload = measure(args)
    path = report.json_path(args, f"timeline_{device}")
    traces = write_traces(lambda model: path.with_name(f"{path.stem}_{model}.trace.json"), payload)
    print_results(payload)
    pngs = [model_gantt(path.with_name(f"{path.stem}_{r['model']}.png"), r, device) for r in payload["results"]]
    named = [(f"{r['label']}: {k}", t) for r in payload["results"] for k, t in r["targets"].items()]
    report.conclude("timeline", path, payload, named)
    report.say(f"{len([p for p in pngs if p])} Gantt chart(s) and {len(traces)} Chrome trace(s) beside it", record=False)
    return 0
