"""What gradient health costs: clipping, the fused norm and the non-finite check (docs/benchmarks.md, "health").

The steps of :data:`METHODS` (zero_grad + forward + backward, then the clipping if any) are timed in rounds per model,
on 2 gloo ranks (the full run: then 1) or one NCCL rank; each of :data:`COSTS` is the median over rounds of a paired
difference, ``fastcoll again`` the A/A control. Also the ops-level rows: the fused ops with and without their health
outputs on ResNet-50's 25 MiB bucket.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
import os
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from .. import ops
from ..ops import loader
from . import models, report, runner, stats
from .models import MiB, ModelSpec

CLIP_FRACTION = 0.5  # max_norm = this times the measured gradient norm, so clipping scales
CLIP_TARGET = 0.75  # fastcoll clipping cost / torch clipping cost, ResNet-50 and GPT-2 shapes
CLIP_TARGET_MODELS = ("resnet50", "gpt2_small")
NORM_TARGET = 0.03  # compute_grad_norm=True: at most 3% of the step without it
NONFINITE_TARGET = 0.02  # check_nonfinite=True: at most 2%
OPS_TARGET = 1.05  # unflatten_scale with sumsq / without, 25 MiB fp32 bucket, 1 thread
HEALTH_OPS = ("flatten_scale_ex", "unflatten_scale_ex", "sum_of_squares")

METHODS: Dict[str, Tuple[str, Optional[str]]] = {  # method -> (wrapper it runs on, how it clips)
    "torch": ("torch", None), "torch+clip": ("torch", "torch"),
    "fastcoll": ("fastcoll", None), "fastcoll+torch clip": ("fastcoll", "torch"),
    "fastcoll norm": ("fastcoll_norm", None), "fastcoll norm+clip": ("fastcoll_norm", "fastcoll"),
    "fastcoll nonfinite": ("fastcoll_nonfinite", None), "fastcoll again": ("fastcoll_again", None),
}  # fmt: skip
WRAPPERS = {
    "torch": "torch.nn.parallel.DistributedDataParallel(module)",
    "fastcoll": "fastcoll.DDP(module)  (compute_grad_norm=False, check_nonfinite=False)",
    "fastcoll_norm": "fastcoll.DDP(module, compute_grad_norm=True)",
    "fastcoll_nonfinite": "fastcoll.DDP(module, check_nonfinite=True)",
    "fastcoll_again": "fastcoll.DDP(module), a second instance (the control: what two identical wrappers differ by)",
}
CLIPS = {
    "torch": "torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm, foreach=True)",
    "fastcoll": "model.clip_grad_norm_(max_norm)  (norm fused into the write-back: one scaling pass)",
}
COSTS = {  # cost name -> (method with the feature, method without it)
    "clip torch": ("torch+clip", "torch"), "clip fastcoll": ("fastcoll norm+clip", "fastcoll"),
    "clip torch on fastcoll": ("fastcoll+torch clip", "fastcoll"),
    "scaling pass fastcoll": ("fastcoll norm+clip", "fastcoll norm"),
    "norm": ("fastcoll norm", "fastcoll"), "nonfinite": ("fastcoll nonfinite", "fastcoll"), "A/A": ("fastcoll again", "fastcoll"),
}  # fmt: skip
CONFIGS = {  # rounds: reps..max_reps (GPT-2: reps_large..) until the norm, non-finite and clip targets resolve
    "smoke": dict(reps=2, max_reps=2, reps_large=2, max_large=2, setup_steps=2, target_s=0.0, max_inner=1, ops_reps=3,
                  ops_target_s=0.0),
    "default": dict(reps=9, max_reps=21, reps_large=6, max_large=12, setup_steps=2, target_s=0.03, max_inner=50, ops_reps=15,
                    ops_target_s=0.03),
    "full": dict(reps=21, max_reps=41, reps_large=21, max_large=31, setup_steps=3, target_s=0.1, max_inner=200, ops_reps=25,
                 ops_target_s=0.1),
}  # fmt: skip
_target = functools.partial(stats.target, op="le", interval="90% bootstrap (rounds)")


def extension_file() -> Optional[Dict[str, Any]]:
    """Path, size and modification time of the compiled extension's file, read when called (so: at load time)."""
    path = getattr(getattr(loader, "_C", None), "__file__", None)
    if not path:
        return None
    st = os.stat(path)
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(st.st_mtime))
    return {"path": os.path.relpath(path, report.repo_root()), "bytes": st.st_size, "modified": when}


def _reps_for(spec: ModelSpec, cfg: Dict[str, Any]) -> Tuple[int, int]:
    return (cfg["reps_large"], cfg["max_large"]) if spec.name == "gpt2_small" else (cfg["reps"], cfg["max_reps"])


# The ops-level rows (parent process, 1 intra-op thread)
def bench_ops_rows(cfg: Dict[str, Any]) -> List[Dict[str, Any]]:
    """``unflatten_scale`` with/without ``sumsq`` and ``flatten_scale`` with/without ``nonfinite``, interleaved, on ResNet-50's
    25 MiB float32 DDP bucket (the one whose size is closest to 25 MiB; 1/64 of it for --smoke)."""
    device, buckets = cfg["device"], models.ddp_buckets(models.model_shapes()["resnet50"])
    b = min((b for b in buckets if b["cap"] == models.BUCKET_CAP), key=lambda b: abs(b["bytes"] - models.BUCKET_CAP))
    shapes = [tuple(s) if not cfg["smoke"] else (max(1, math.prod(s) // 64),) for s in b["shapes"]]
    name = f"resnet50 b{b['index']} ({len(shapes)} tensors, {b['bytes'] / MiB:.1f} MiB fp32)" + (" x1/64" if cfg["smoke"] else "")
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen).to(device) for s in shapes]
    dests = [torch.empty_like(g) for g in grads]
    n = sum(g.numel() for g in grads)
    flat, bucket = torch.randn(n, generator=gen).to(device), torch.empty(n, device=device)
    sumsq, flag = torch.zeros(1, dtype=torch.float64, device=device), torch.zeros(1, dtype=torch.int32, device=device)
    pairs = {  # op -> (without the health output, with it, what it adds)
        "unflatten_scale": (lambda: ops.unflatten_scale(flat, dests), lambda: ops.unflatten_scale(flat, dests, sumsq=sumsq),
                            "sumsq=s (float64 sum of squares of the written values)"),
        "flatten_scale": (lambda: ops.flatten_scale(grads, bucket, 0.5),
                          lambda: ops.flatten_scale(grads, bucket, 0.5, nonfinite=flag),
                          "nonfinite=flag (NaN/Inf flag of the packed values)"),
    }  # fmt: skip
    # Correctness first: the health variant writes the same bits and the right sum.
    ops.unflatten_scale(flat, dests, sumsq=sumsq)
    want = sum(float(torch.sum(d.double() * d.double())) for d in dests)
    checks = {"unflatten_scale": {"sumsq matches float64": math.isclose(float(sumsq), want, rel_tol=1e-9)}}
    ops.flatten_scale(grads, bucket, 0.5, nonfinite=flag)
    checks["flatten_scale"] = {"flag clear": int(flag) == 0}

    rows, threads = [], 1 if device == "cpu" else None
    with runner.num_threads(1) if device == "cpu" else contextlib.nullcontext():
        for op, (plain, health, added) in pairs.items():
            fns = {"plain": plain, "health": health}
            for fn in fns.values():
                runner.run_steps(fn, 3)
            inner = max(runner.calibrate(f, device, cfg["ops_target_s"], 1000) for f in fns.values())
            samples = runner.measure_interleaved(fns, device, 0, cfg["ops_reps"], inner)
            summary = {k: stats.summarize(s) for k, s in samples.items()}
            ratio = summary["health"]["median_s"] / summary["plain"]["median_s"]
            ci = stats.bootstrap_ci(stats.median_ratio("health", "plain"), samples, paired=True)
            rows.append({"op": op, "with": added, "bucket": name, "bytes": 4 * n, "threads": threads, "inner": inner,
                         "methods": summary, "samples": samples, "paired": stats.paired_cost(samples["health"], samples["plain"]),
                         "ratio": ratio, "check": checks[op],
                         "targets": {"health/plain": _target(ratio, OPS_TARGET, ci)}})  # fmt: skip
    return rows


# The ranks
def make_wrapper(kind: str, module: nn.Module, device: str) -> nn.Module:
    """The wrapper of :data:`WRAPPERS` ``[kind]`` around ``module``."""
    flags = {"fastcoll_norm": {"compute_grad_norm": True}, "fastcoll_nonfinite": {"check_nonfinite": True}}
    return runner.wrap(kind, module, device, **flags.get(kind, {}))


def make_step(wrapper: nn.Module, clip: str | None, spec: ModelSpec, x: torch.Tensor, max_norm: List[float]) -> Callable[[], Any]:
    """One step: zero_grad + forward + loss + backward, then the clipping; returns the norm clipping saw (or None)."""
    module = wrapper.module
    params = [p for p in module.parameters() if p.requires_grad]
    clip_now = {None: lambda: None, "fastcoll": lambda: wrapper.clip_grad_norm_(max_norm[0]),
                "torch": lambda: torch.nn.utils.clip_grad_norm_(params, max_norm[0], foreach=True)}[clip]  # fmt: skip

    def step() -> Optional[torch.Tensor]:
        module.zero_grad(set_to_none=True)
        models.loss_of(spec, wrapper(x)).backward()
        return clip_now()

    return step


def global_norm(module: nn.Module) -> float:
    """The L2 norm of the module's gradients, in float64."""
    return math.sqrt(sum(float(torch.sum(p.grad.double() * p.grad.double())) for p in module.parameters() if p.grad is not None))


def bench_model(spec: ModelSpec, me: runner.Rank) -> Dict[str, Any]:
    """One model on this rank: the warm-up, the clipping checks, then the timed rounds of every method."""
    cfg, tick, device = me.cfg, me.tick, me.device
    started = time.perf_counter()
    storage = models.build_storage(spec, device)  # synthetic models: every wrapper shares the weights
    x = models.make_input(spec, me.rank, device)
    wrappers = {kind: make_wrapper(kind, models.build_model(spec, device, storage), device) for kind in WRAPPERS}
    max_norm = [float("inf")]
    steps = {m: make_step(wrappers[w], clip, spec, x, max_norm) for m, (w, clip) in METHODS.items()}
    drop_grads = lambda method: wrappers[METHODS[method][0]].module.zero_grad(set_to_none=True)  # noqa: E731

    # Warm-up of each wrapper (its bucket rebuild), one step of each method (the slowest sets inner), then max_norm.
    for kind in WRAPPERS:
        runner.run_steps(steps[next(m for m, (w, clip) in METHODS.items() if w == kind and clip is None)], cfg["setup_steps"] - 1)
    slowest = 0.0
    for m, step in steps.items():
        slowest = max(slowest, runner.time_calls(step, 1, device))
        drop_grads(m)
        tick(1)
    steps["torch"]()
    norm = global_norm(wrappers["torch"].module)
    max_norm[0] = CLIP_FRACTION * norm

    # Checks against the float64 norm of the synchronized gradients: the norm each clipping saw, the clipped norm, fastcoll's
    # clipped gradients against torch's. torch's foreach norm sums in float32 (relative error up to ~1e-4 over 10^8 elements).
    torch_norm, fc_norm, fc_torch_norm = (float(steps[m]()) for m in ("torch+clip", "fastcoll norm+clip", "fastcoll+torch clip"))
    after = global_norm(wrappers["fastcoll_norm"].module)
    grads = models.compare_grads(wrappers["fastcoll_norm"].module, wrappers["torch"].module, rtol=1e-3)
    rel = lambda a, b: abs(a - b) / max(abs(b), 1e-30)  # noqa: E731
    checks = {"norm float64": norm, "max_norm": max_norm[0], "norm torch clip": torch_norm, "norm fastcoll clip": fc_norm,
              "norm torch clip on fastcoll": fc_torch_norm, "rel err torch": rel(torch_norm, norm),
              "rel err fastcoll": rel(fc_norm, norm), "norm after fastcoll clip": after,
              # torch's contract: the gradients are scaled by max_norm / (norm + 1e-6)
              "clipped": fc_norm > max_norm[0] and rel(after, fc_norm * max_norm[0] / (fc_norm + 1e-6)) <= 1e-5,
              "grads fastcoll vs torch after clip": grads}  # fmt: skip
    checks["ok"] = bool(checks["clipped"] and rel(fc_norm, norm) <= 1e-6 and rel(torch_norm, norm) <= 1e-3 and grads["close"])
    for m in METHODS:
        drop_grads(m)
    gc.collect()

    n_inner = me.inner(slowest)
    goals = [(functools.partial(_target_value, name=n), thr, "le") for n, thr in _thresholds(spec.name).items()]
    samples, cpu_samples = runner.timed_rounds(steps, n_inner, *_reps_for(spec, cfg), goals, device, tick, after=drop_grads)
    params = [p for p in wrappers["fastcoll"].module.parameters() if p.requires_grad]
    buckets = len(wrappers["fastcoll"].bucket_info())
    steps.clear()
    wrappers.clear()
    del storage  # the shared weights go before the next model is built
    gc.collect()
    return {"model": spec.name, "label": spec.label, "synthetic": spec.synthetic, "world_size": me.ws, "params": len(params),
            "numel": sum(p.numel() for p in params), "buckets": buckets, "inner": n_inner,
            "elapsed_s": time.perf_counter() - started, **analyze(spec.name, samples),
            "cpu_time": analyze(spec.name, cpu_samples), "checks": checks}  # fmt: skip


def _target_value(samples: Dict[str, List[float]], name: str) -> Optional[float]:
    """One target's statistic: the fused norm's or the check's cost per fastcoll step, or fastcoll's clipping cost per torch's."""
    paired = lambda cost: statistics.median(x - y for x, y in zip(samples[COSTS[cost][0]], samples[COSTS[cost][1]]))  # noqa: E731
    if name == "clip":
        ct = paired("clip torch")
        return paired("clip fastcoll") / ct if ct > 0 else None
    return paired(name) / statistics.median(samples["fastcoll"])


def _thresholds(model: str) -> Dict[str, float]:
    return {"norm": NORM_TARGET, "nonfinite": NONFINITE_TARGET, **({"clip": CLIP_TARGET} if model in CLIP_TARGET_MODELS else {})}


def analyze(model: str, samples: Dict[str, List[float]]) -> Dict[str, Any]:
    """Per-method summaries, paired costs, cost ratios and targets (with 90% bootstrap intervals, rounds resampled)."""
    summary = {m: stats.summarize(s) for m, s in samples.items()}
    costs = {name: stats.paired_cost(samples[a], samples[b]) for name, (a, b) in COSTS.items()}
    values = {name: _target_value(samples, name) for name in ("norm", "nonfinite", "clip")}
    ci = lambda name: stats.bootstrap_ci(functools.partial(_target_value, name=name), samples, paired=True)  # noqa: E731
    targets = {name: _target(values[name], threshold, ci(name) if len(samples["fastcoll"]) > 1 else None)
               for name, threshold in _thresholds(model).items()}  # fmt: skip
    base_fc = summary["fastcoll"]["median_s"]
    ratios = {"clip fastcoll/torch": values["clip"], "norm/fastcoll step": values["norm"],
              "nonfinite/fastcoll step": values["nonfinite"], "A/A/fastcoll step": costs["A/A"]["median_s"] / base_fc,
              "clip torch/torch step": costs["clip torch"]["median_s"] / summary["torch"]["median_s"],
              "clip fastcoll/fastcoll step": costs["clip fastcoll"]["median_s"] / base_fc}  # fmt: skip
    return {"methods": summary, "samples": samples, "costs": costs, "ratios": ratios, "targets": targets}


def _ranks(me: runner.Rank, specs: List[ModelSpec]) -> Dict[str, Any]:
    library = extension_file()  # the one this process loaded (another build may replace the file later)
    x = models.make_input(models.WARMUP, me.rank, me.device)
    for w, clip in METHODS.values():  # every wrapper kind and clipping once on a tiny model: no one-time costs later
        wrapper = make_wrapper(w, models.build_model(models.WARMUP, me.device), me.device)
        runner.run_steps(make_step(wrapper, clip, models.WARMUP, x, [1e-3]), 3)
    gc.collect()
    gc.freeze()
    rows, ranks = [], f"{me.ws} rank{'s' if me.ws > 1 else ''}"
    for spec in specs:
        me.describe(f"health, {ranks}: {spec.label}")
        rows.append(bench_model(spec, me))
        me.row(f"{spec.label}, {ranks}", len(specs) * len(me.cfg["world_sizes"]))
    missing = [n for n in HEALTH_OPS if n in loader.REFERENCE_OPS]  # the health ops that run the pure-PyTorch reference
    health_ops = ("reference (pure PyTorch): the extension is not loaded" if ops.implementation() != "extension"
                  else f"reference (pure PyTorch) for {', '.join(missing)}: the extension was built before them" if missing
                  else "extension")  # fmt: skip
    return {"rows": rows, "health_ops": health_ops, "library": library}


# Entry points
def measure(args: Any = None) -> Dict[str, Any]:
    """Run the ops rows, then the ranks for each world size: ``{"benchmark", "config", "health_ops", "ops", "results"}``; each
    result row has per method the timing summary and samples, the paired ``costs``, ``ratios``, ``targets``, ``checks``."""
    cfg = runner.level_config(args, CONFIGS, 2 if args.device == "cpu" else 1)
    del cfg["world_size"]  # one NCCL rank; on CPU 2 gloo ranks, then (full run) the 1-rank pass without communication
    cfg["world_sizes"] = [1] if args.device == "cuda" else [2, 1] if cfg["level"] == "full" else [2]
    smoke = [models.SMOKE_MLP, models.SMOKE_RESNET50, models.SMOKE_GPT2]
    specs = smoke if cfg["smoke"] else [models.MLP96, models.RESNET50, models.GPT2]
    ops_rows = bench_ops_rows(cfg)
    libraries = {"parent (ops rows)": extension_file()}
    units = len(cfg["world_sizes"]) * sum(len(METHODS) * (_reps_for(s, cfg)[1] + 1) for s in specs)
    with report.progress("health", units) as prog:
        outs = {ws: runner.run_ranks(_ranks, {**cfg, "malloc": "keep"}, (specs,), ws, prog) for ws in cfg["world_sizes"]}
    libraries.update({f"{ws} rank{'s' if ws > 1 else ''}": out["library"] for ws, out in outs.items()})
    last = list(outs.values())[-1]  # the health ops and malloc settings as the last ranks had them
    targets = {
        "clip": f"fastcoll clipping cost <= {CLIP_TARGET}x torch's ({', '.join(CLIP_TARGET_MODELS)})",
        "norm": f"compute_grad_norm=True costs <= {NORM_TARGET:.0%} of fastcoll's step",
        "nonfinite": f"check_nonfinite=True costs <= {NONFINITE_TARGET:.0%} of fastcoll's step",
        "ops": f"unflatten_scale with sumsq <= {OPS_TARGET}x without (25 MiB fp32, 1 thread)",
    }
    config = {**cfg, "models": [dataclasses.asdict(s) for s in specs], "wrappers": WRAPPERS, "clipping": CLIPS,
              "methods": {m: {"wrapper": w, "clip": c} for m, (w, c) in METHODS.items()},
              "costs": {k: f"median over rounds of ({a}) - ({b})" for k, (a, b) in COSTS.items()},
              "step": "module.zero_grad(set_to_none=True); loss(wrapper(x)).backward(); then the clipping, if any "
              "(no optimizer step); gradients dropped after each sample, outside the timing",
              "malloc": last["malloc"] or "unchanged", "targets": targets,
              "max_norm": f"{CLIP_FRACTION} x the measured global gradient norm (clipping scales every gradient)"}  # fmt: skip
    return {"benchmark": "health", "config": config, "health_ops": last["health_ops"], "extension_files": libraries,
            "ops": ops_rows, "results": [r for out in outs.values() for r in out["rows"]]}  # fmt: skip


def costs_table(rows: List[Dict[str, Any]], title: str, key: Optional[str]) -> None:
    """Each feature's cost per model: paired per-round differences, share of the step without it, targets."""
    pct = lambda t: report.target_cell(t, report.fmt_pct) if t else ""  # noqa: E731
    body = []
    for r in rows:
        a = r if key is None else r[key]
        c, t, q = a["costs"], a["targets"], a["ratios"]
        sign = lambda k: report.fmt_signed_time(c[k]["median_s"])  # noqa: E731
        share = lambda k, of: f"{sign(k)} ({report.fmt_pct(q[of])})"  # noqa: E731
        line = [r["label"] + (" *" if r["synthetic"] else ""), r["world_size"], share("clip torch", "clip torch/torch step"),
                share("clip fastcoll", "clip fastcoll/fastcoll step"), report.target_cell(t["clip"]) if "clip" in t else "",
                f"{sign('norm')} {pct(t['norm'])}", f"{sign('nonfinite')} {pct(t['nonfinite'])}",
                sign("clip torch on fastcoll"), sign("scaling pass fastcoll"), share("A/A", "A/A/fastcoll step")]  # fmt: skip
        body.append(line + (["[green]ok[/green]" if r["checks"]["ok"] else "[red]FAIL[/red]"] if key is None else []))
    columns = ["model", "ranks", "clip torch", "clip fastcoll", f"fc/torch (≤{CLIP_TARGET})", f"norm (≤{NORM_TARGET:.0%})",
               f"nonfinite (≤{NONFINITE_TARGET:.0%})", "fc+torch clip", "scaling", "A/A control"]  # fmt: skip
    report.table(title, columns + (["checks"] if key is None else []), body,
                 "clip torch = (torch+clip) - torch; clip fastcoll = (fastcoll norm+clip) - fastcoll, the fused norm "
                 "included (% of the step without); norm, nonfinite: fastcoll.DDP with the feature - without (% of "
                 "fastcoll's step); scaling = (norm+clip) - norm; A/A: a second identical fastcoll.DDP, the noise floor. "
                 f"max_norm = {CLIP_FRACTION} x the measured norm; 90% paired bootstrap intervals.")  # fmt: skip


def print_results(payload: Dict[str, Any]) -> None:
    """The step-time table, the costs tables (wall clock; CPU time on CPU) and the ops rows."""
    cfg, rows = payload["config"], payload["results"]
    body = [[r["label"] + (" *" if r["synthetic"] else ""), r["world_size"],
             *(report.fmt_time(r["methods"][k]["median_s"]) for k in METHODS)] for r in rows]  # fmt: skip
    report.table(f"fastcoll health: step time per method ({cfg['device']})", ["model", "ranks", *METHODS], body,
                 f"{cfg['backend']} ranks, {cfg['threads']} thread(s) each; health ops: {payload['health_ops']}. "
                 "Median step of the slowest rank (zero_grad + forward + backward, + clipping), rounds in rotating order. "
                 "* synthetic.")  # fmt: skip
    costs_table(rows, f"fastcoll health: costs, wall clock ({cfg['device']})", None)
    if cfg["device"] == "cpu":
        costs_table(rows, "fastcoll health: the same costs in CPU time of the training thread (less sensitive to other load)",
                    "cpu_time")  # fmt: skip
    body = [[r["op"], r["with"], r["bucket"], r["threads"] or "-", report.fmt_time(r["methods"]["plain"]["median_s"]),
             report.fmt_time(r["methods"]["health"]["median_s"]),
             report.target_cell(r["targets"]["health/plain"]) if r["op"] == "unflatten_scale" else report.fmt_ratio(r["ratio"]),
             ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in r["check"].items())] for r in payload["ops"]]  # fmt: skip
    if body:
        report.table(f"fastcoll health: the fused ops with and without the health outputs ({cfg['device']})",
                     ["op", "with", "bucket", "threads", "without", "with", f"ratio (≤{OPS_TARGET}x for sumsq)", "check"],
                     body)  # fmt: skip


def run(args: Any = None) -> int:
    """``python -m fastcoll.bench health``: tables, JSON, a chart; 1 if a clipping check failed."""
    payload = measure(args)
    print_results(payload)
    named = [(f"{r['label']}, {r['world_size']} rank(s): {k}", t) for r in payload["results"] for k, t in r["targets"].items()]
    named += [(f"ops {r['op']} with {r['with'].split(' ')[0]}", r["targets"]["health/plain"])
              for r in payload["ops"] if r["op"] == "unflatten_scale"]  # fmt: skip
    for r in payload["results"]:
        if not r["checks"]["ok"]:
            report.say(f"[red]warning: {r['label']}, {r['world_size']} rank(s): clipping check failed: {r['checks']}[/red]")
    report.conclude("health", report.json_path(args, f"health_{args.device}"), payload, named)
    return 0 if all(r["checks"]["ok"] for r in payload["results"]) else 1
