"""Where the gradient synchronization goes, bucket by bucket, and what autotuned buckets gain (docs/benchmarks.md).

Per model, a step (zero_grad + forward + backward) of each of :data:`METHODS`
(torch DDP, fixed bucket caps, ``bucket_cap_mb="auto"`` after its tuning) in
rounds on shared weights. Then, for the 25 MiB and the tuned layout, the
exposed synchronization and every rank's per-bucket timeline (``model.sync_timeline()``, in the JSON).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
from collections.abc import Sequence
from typing import Any, Callable

from torch import nn

from . import models, report, runner, stats

CPU_WORLD_SIZE = 2
CUDA_WORLD_SIZE = 1
FIXED_CAPS_MB = (1, 5, 25, 100)
DEFAULT_CAP_MB = 25
FIXED_METHODS = tuple(f"{c} MiB" for c in FIXED_CAPS_MB)
METHODS = ("torch", *FIXED_METHODS, "auto")
METHOD_DESCRIPTIONS = {
    "torch": "torch.nn.parallel.DistributedDataParallel(module) (bucket_cap_mb=25)",
    **{f"{c} MiB": f"fastcoll.DDP(module, bucket_cap_mb={c})" for c in FIXED_CAPS_MB},
    "auto": 'fastcoll.DDP(module, bucket_cap_mb="auto"), timed after its tuning',
}
AUTO_VS_BEST_FIXED = 1.05  # auto's step <= 1.05x the best fixed cap's
AUTO_VS_TORCH = 1.0  # auto's step <= 1.0x torch DDP's default
TIMELINE_LAYOUTS = (f"{DEFAULT_CAP_MB} MiB", "auto")  # the layouts whose timelines are recorded
SMOKE_AUTOTUNE_STEPS = "12"


CONFIGS = {  # reps..max_reps samples per method, as many as budget_s of a model's sampling allows
    "smoke": {"reps": 2, "max_reps": 2, "budget_s": 0.0, "setup_steps": 3, "target_s": 0.0, "max_inner": 1},
    "default": {"reps": 5, "max_reps": 30, "budget_s": 10.0, "setup_steps": 3, "target_s": 0.03, "max_inner": 50},
    "full": {"reps": 30, "max_reps": 100, "budget_s": 45.0, "setup_steps": 3, "target_s": 0.1, "max_inner": 200},
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


def autotune_env(cfg: dict[str, Any]) -> dict[str, str]:
    """Environment for the ranks: a short tuning under ``--smoke`` (unless FASTCOLL_AUTOTUNE_STEPS is set)."""
    if cfg["smoke"] and "FASTCOLL_AUTOTUNE_STEPS" not in os.environ:
        return {"FASTCOLL_AUTOTUNE_STEPS": SMOKE_AUTOTUNE_STEPS}
    return {}


def make_wrapper(method: str, module: nn.Module, device: str) -> nn.Module:
    if method == "torch":
        return runner.wrap("torch", module, device)
    return runner.wrap("fastcoll", module, device, bucket_cap_mb="auto" if method == "auto" else float(method.split()[0]),
                       record_timeline=True)  # fmt: skip


def sample_count(cfg: dict[str, Any], sample_s: float) -> int:
    """Samples per method: as many as ``budget_s`` of one model's sampling allows, within ``[reps, max_reps]``.

    The steps vary by 10-30% sample to sample on a 2-core machine
    (interquartile range over the median), so 10 samples leave a median
    uncertain by about 5%, as much as the target to resolve; 30 or more
    bring the 90% interval of a ratio to about +-3%.
    """
    fit = int(cfg["budget_s"] / (len(METHODS) * max(sample_s, 1e-6)))
    return max(cfg["reps"], min(cfg["max_reps"], fit))


def _autotune_steps() -> int:
    from ..reducer.autotune import autotune_steps

    return autotune_steps()


def bench_model(spec: Any, rank: int, cfg: dict[str, Any], tick: Callable[[int], None]) -> dict[str, Any]:
    """One model on this rank: the sweep, then the timelines and tuning report (gathered from every rank)."""
    device = cfg["device"]
    storage = models.build_storage(spec, device)
    x = models.make_input(spec, rank, device)
    wrappers: dict[str, nn.Module] = {}
    steps: dict[str, Callable[[], None]] = {}
    setup_s: dict[str, float] = {}
    tune_steps = _autotune_steps() + 5
    for method in METHODS:
        wrapper = make_wrapper(method, models.build_model(spec, device, storage), device)
        step = models.backward_step(spec, wrapper, x)
        runner.run_steps(step, (tune_steps if method == "auto" else cfg["setup_steps"]) - 1)  # the rebuild, auto's tuning
        setup_s[method] = runner.time_calls(step, 1, device)
        wrappers[method], steps[method] = wrapper, step
        tick(1)
    per_step = runner.all_max([max(setup_s.values())], device)[0]
    inner = runner.inner_for(per_step, cfg["target_s"], cfg["max_inner"])
    reps = sample_count(cfg, inner * per_step)  # the same on every rank: per_step is the slowest rank's
    samples = runner.measure_interleaved(steps, device, warmup=0, reps=reps, inner=inner, on_sample=lambda: tick(1))
    samples = {m: runner.all_max(s, device) for m, s in samples.items()}
    tick((cfg["max_reps"] - reps) * len(METHODS))

    layouts: dict[str, Any] = {}
    for method in TIMELINE_LAYOUTS:
        w = wrappers[method]
        layouts[method] = {"timeline": runner.gather(w.sync_timeline()), "buckets": len(w.bucket_info()),  # per rank
                           "bucket_bytes": [b["bytes"] for b in w.bucket_info()]}  # fmt: skip
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
        rows.append(bench_model(spec, me.rank, me.cfg, me.tick))
        me.row(spec.label, len(specs))
    return {"rows": rows}


# Results
def _slowest_exposed(per_rank: Sequence[Sequence[dict[str, Any]]]) -> tuple[list[dict[int, Any]], dict[int, float]]:
    """Each rank's records by iteration, and the slowest rank's exposed sync (us) of each iteration every rank recorded."""
    by_num = [{it["iteration"]: it for it in its} for its in per_rank]
    nums = set.intersection(*(set(r) for r in by_num)) if by_num else set()
    return by_num, {n: max(r[n]["exposed_sync_us"] for r in by_num) for n in nums}


def exposed_median_s(per_rank: Sequence[Sequence[dict[str, Any]]]) -> float | None:
    """Median over the iterations every rank recorded of the slowest rank's exposed sync time (seconds)."""
    exposed = _slowest_exposed(per_rank)[1]
    return statistics.median(exposed.values()) / 1e6 if exposed else None


def _auto_vs_best_fixed(samples: dict[str, list[float]]) -> float | None:
    return stats.ratio(statistics.median(samples["auto"]), min(statistics.median(samples[m]) for m in FIXED_METHODS))


def summarize_row(row: dict[str, Any]) -> dict[str, Any]:
    """Ratios, targets and exposed sync times of one model's row (added in place; returned)."""
    med = {m: st["median_s"] for m, st in row["methods"].items()}
    best = min(FIXED_METHODS, key=lambda m: med[m])
    samples, how = row.get("samples_s") or {}, "90% bootstrap (rounds)"
    stat = {"auto vs best fixed": _auto_vs_best_fixed, "auto vs torch": stats.median_ratio("auto", "torch")}
    ci = {k: stats.bootstrap_ci(f, samples, paired=True) if samples else None for k, f in stat.items()}
    row["best_fixed"] = best
    row["ratios"] = {"auto/best fixed": stats.ratio(med["auto"], med[best]), "auto/torch": stats.ratio(med["auto"], med["torch"]),
                     "25 MiB/torch": stats.ratio(med["25 MiB"], med["torch"])}  # fmt: skip
    goals = {"auto vs best fixed": ("auto/best fixed", AUTO_VS_BEST_FIXED), "auto vs torch": ("auto/torch", AUTO_VS_TORCH)}
    row["targets"] = {k: stats.target(row["ratios"][r], thr, ci[k], "le", how) for k, (r, thr) in goals.items()}
    chosen = next((r for r in row.get("tuning_report") or [] if r.get("chosen")), None)
    row["auto_choice"] = chosen["label"] if chosen else None
    row["exposed_sync_s"] = {m: exposed_median_s(lay["timeline"]) for m, lay in row["layouts"].items()}
    return row


# Entry points
def measure(args: Any = None) -> dict[str, Any]:
    """Spawn the ranks, run the benchmark and return its results (rows summarized)."""
    device = args.device
    cfg = _config(args, device)
    ws = cfg["world_size"]
    specs = model_specs(cfg)
    rank_cfg = {**cfg, "keep_freed_memory": True, "freeze": True, "env": autotune_env(cfg)}
    with report.progress("timeline", len(specs) * len(METHODS) * (cfg["max_reps"] + 1)) as prog:
        result = runner.run_ranks(_ranks, rank_cfg, (), ws, prog)
    rows = [summarize_row(r) for r in result["rows"]]
    config = {**cfg, "autotune_steps": int(autotune_env(cfg).get("FASTCOLL_AUTOTUNE_STEPS") or _autotune_steps()),
              "models": [dataclasses.asdict(s) for s in specs], "methods": METHOD_DESCRIPTIONS,
              "step": "module.zero_grad(set_to_none=True); loss(wrapper(x)).backward()  (no optimizer step)",
              "targets": f"auto step <= {AUTO_VS_BEST_FIXED}x the best fixed cap's and <= {AUTO_VS_TORCH}x torch DDP's",
              }  # fmt: skip
    return {"benchmark": "timeline", "config": config, "implementation": result["implementation"], "results": rows}


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
        tried = [x for x in r.get("tuning_report") or [] if not x.get("pruned")]
        if tried:
            alts = ", ".join(f"{x['label']}{' (chosen)' if x.get('chosen') else ''} {report.fmt_time(x.get('step_median_s'))}"
                             for x in tried)  # fmt: skip
            report.say(f"[dim]{r['label']}: auto tried {alts}[/dim]")


def run(args: Any = None) -> int:
    """CLI entry (``python -m fastcoll.bench timeline``): measure, print, write the JSON and the targets chart.

    Returns:
        0 on success (also when fastcoll.DDP lacks the API: skipped with a
        message), 2 if ``--device cuda`` is asked for without a GPU.
    """
    device = args.device
    payload = measure(args)
    path = report.json_path(args, f"timeline_{device}")
    print_results(payload)
    named = [(f"{r['label']}: {k}", t) for r in payload["results"] for k, t in r["targets"].items()]
    report.conclude("timeline", path, payload, named)
    return 0
