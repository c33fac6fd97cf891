"""What gradient health costs: clipping, the fused norm and the non-finite check (docs/benchmarks.md, "health").

On CPU 2 gloo ranks then 1 (1 intra-op thread each); with ``--device cuda``
1 NCCL rank. Per model (the MLP, the ResNet-50 and GPT-2 shape sets) eight
steps are timed in rounds (zero_grad + forward + backward, then the clipping
if any; no optimizer step): torch DDP with and without torch's clipping;
fastcoll.DDP plain, with torch's clipping, with ``compute_grad_norm`` (with
and without its own clipping), with ``check_nonfinite``, and a second plain
instance (the A/A control). Each cost is the median over rounds of the paired
difference; each target has a 90% bootstrap interval. Also the ops-level
rows: ``unflatten_scale`` with and without ``sumsq`` and ``flatten_scale``
with and without ``nonfinite``, on ResNet-50's 25 MiB bucket at 1 thread.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from . import models, report, runner, stats
from .models import MiB, ModelSpec

CPU_WORLD_SIZES = (2, 1)
CUDA_WORLD_SIZES = (1,)
CLIP_FRACTION = 0.5  # max_norm = this times the measured gradient norm, so clipping scales
CLIP_TARGET = 0.75  # fastcoll clipping cost / torch clipping cost, ResNet-50 and GPT-2 shapes
CLIP_TARGET_MODELS = ("resnet50", "gpt2_small")
NORM_TARGET = 0.03  # compute_grad_norm=True: at most 3% of the step without it
NONFINITE_TARGET = 0.02  # check_nonfinite=True: at most 2%
OPS_TARGET = 1.05  # unflatten_scale with sumsq / without, 25 MiB fp32 bucket, 1 thread
HEALTH_OPS = ("flatten_scale_ex", "unflatten_scale_ex", "sum_of_squares")

# method -> (wrapper it runs on, how it clips)
METHODS: Dict[str, Tuple[str, Optional[str]]] = {
    "torch": ("torch", None),
    "torch+clip": ("torch", "torch"),
    "fastcoll": ("fastcoll", None),
    "fastcoll+torch clip": ("fastcoll", "torch"),
    "fastcoll norm": ("fastcoll_norm", None),
    "fastcoll norm+clip": ("fastcoll_norm", "fastcoll"),
    "fastcoll nonfinite": ("fastcoll_nonfinite", None),
    "fastcoll again": ("fastcoll_again", None),
}
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
# cost name -> (method with the feature, method without it)
COSTS = {
    "clip torch": ("torch+clip", "torch"),
    "clip fastcoll": ("fastcoll norm+clip", "fastcoll"),
    "clip torch on fastcoll": ("fastcoll+torch clip", "fastcoll"),
    "scaling pass fastcoll": ("fastcoll norm+clip", "fastcoll norm"),
    "norm": ("fastcoll norm", "fastcoll"),
    "nonfinite": ("fastcoll nonfinite", "fastcoll"),
    "A/A": ("fastcoll again", "fastcoll"),
}


def supported() -> bool:
    """Whether this checkout's fastcoll.DDP has the issue-11 API (compute_grad_norm, check_nonfinite, clip_grad_norm_)."""
    return runner.ddp_supports(("compute_grad_norm", "check_nonfinite"), ("clip_grad_norm_",))


def health_ops_implementation() -> str:
    """``extension`` when the compiled library has the health ops, else which of them run the pure-PyTorch reference."""
    from .. import ops
    from ..ops import loader

    if ops.implementation() != "extension":
        return "reference (pure PyTorch): the extension is not loaded"
    missing = [n for n in HEALTH_OPS if n in getattr(loader, "REFERENCE_OPS", ())]
    if missing:
        return f"reference (pure PyTorch) for {', '.join(missing)}: the extension was built before them"
    return "extension"


def extension_file() -> Optional[Dict[str, Any]]:
    """Path, size and modification time of the compiled extension's file, read when called (so: at load time)."""
    from ..ops import loader

    mod = getattr(loader, "_C", None)
    path = getattr(mod, "__file__", None)
    if not path:
        return None
    st = os.stat(path)
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(st.st_mtime))
    return {"path": os.path.relpath(path, report.repo_root()), "bytes": st.st_size, "modified": when}


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------


def model_specs(smoke: bool) -> List[ModelSpec]:
    if smoke:
        return [models.SMOKE_MLP, models.SMOKE_RESNET50, models.SMOKE_GPT2]
    return [models.MLP96, models.RESNET50, models.GPT2]


CONFIGS = {  # rounds: reps..max_reps (GPT-2: reps_large..) until the norm, non-finite and clip targets resolve
    "smoke": dict(reps=2, max_reps=2, reps_large=2, max_large=2, setup_steps=2, target_s=0.0, max_inner=1, ops_reps=3,
                  ops_target_s=0.0),
    "default": dict(reps=9, max_reps=21, reps_large=6, max_large=12, setup_steps=2, target_s=0.03, max_inner=50, ops_reps=15,
                    ops_target_s=0.03),
    "full": dict(reps=21, max_reps=41, reps_large=21, max_large=31, setup_steps=3, target_s=0.1, max_inner=200, ops_reps=25,
                 ops_target_s=0.1),
}  # fmt: skip


def _config(args: Any, device: str) -> Dict[str, Any]:
    cfg = {**CONFIGS[args.level], "level": args.level, "smoke": args.level == "smoke", "quick": args.level != "full",
           "device": device}  # fmt: skip
    if device == "cuda":
        cfg.update(world_sizes=list(CUDA_WORLD_SIZES), backend="nccl")
    else:  # the 1-rank pass (no communication) only in the full run
        cfg.update(world_sizes=list(CPU_WORLD_SIZES) if args.level == "full" else [2], backend="gloo")
    cfg["threads"] = runner.threads_per_rank(args, 2 if device == "cpu" else 1)
    return cfg


def _reps_for(spec: ModelSpec, cfg: Dict[str, Any]) -> Tuple[int, int]:
    return (cfg["reps_large"], cfg["max_large"]) if spec.name == "gpt2_small" else (cfg["reps"], cfg["max_reps"])


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------


paired_cost = stats.paired_cost


def _target(value: Optional[float], threshold: float, ci: Optional[Tuple[float, float]] = None) -> Dict[str, Any]:
    return stats.target(value, threshold, ci, "le", "90% bootstrap (rounds)")


# ---------------------------------------------------------------------------
# The ops-level rows (parent process, 1 intra-op thread)
# ---------------------------------------------------------------------------


def ops_bucket(smoke: bool) -> Tuple[str, List[Tuple[int, ...]]]:
    """ResNet-50's 25 MiB float32 DDP bucket (the one whose size is closest to 25 MiB); 1/64 of it for --smoke."""
    from . import models as bench_ops

    buckets = bench_ops.ddp_buckets(models.model_shapes()["resnet50"])
    b = min((b for b in buckets if b["cap"] == bench_ops.BUCKET_CAP), key=lambda b: abs(b["bytes"] - bench_ops.BUCKET_CAP))
    shapes = [tuple(s) for s in b["shapes"]]
    name = f"resnet50 b{b['index']} ({len(shapes)} tensors, {b['bytes'] / MiB:.1f} MiB fp32)"
    if smoke:
        shapes = [(max(1, math.prod(s) // 64),) for s in shapes]
        name += " x1/64"
    return name, shapes


def bench_ops_rows(cfg: Dict[str, Any]) -> List[Dict[str, Any]]:
    """``unflatten_scale`` with/without ``sumsq`` and ``flatten_scale`` with/without ``nonfinite``, interleaved."""
    from .. import ops

    device = cfg["device"]
    name, shapes = ops_bucket(cfg["smoke"])
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen).to(device) for s in shapes]
    dests = [torch.empty_like(g) for g in grads]
    n = sum(g.numel() for g in grads)
    flat = torch.randn(n, generator=gen).to(device)
    bucket = torch.empty(n, device=device)
    sumsq = torch.zeros(1, dtype=torch.float64, device=device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    pairs = {
        "unflatten_scale": {
            "plain": lambda: ops.unflatten_scale(flat, dests),
            "health": lambda: ops.unflatten_scale(flat, dests, sumsq=sumsq),
            "with": "sumsq=s (float64 sum of squares of the written values)",
        },
        "flatten_scale": {
            "plain": lambda: ops.flatten_scale(grads, bucket, 0.5),
            "health": lambda: ops.flatten_scale(grads, bucket, 0.5, nonfinite=flag),
            "with": "nonfinite=flag (NaN/Inf flag of the packed values)",
        },
    }
    # Correctness first: the health variant writes the same bits and the right sum.
    ops.unflatten_scale(flat, dests, sumsq=sumsq)
    want = sum(float(torch.sum(d.double() * d.double())) for d in dests)
    sumsq_ok = math.isclose(float(sumsq), want, rel_tol=1e-9)
    ops.flatten_scale(grads, bucket, 0.5, nonfinite=flag)
    flag_ok = int(flag) == 0

    rows = []
    threads = 1 if device == "cpu" else None
    ctx = runner.num_threads(1) if device == "cpu" else _Null()
    with ctx:
        for op, p in pairs.items():
            fns = {"plain": p["plain"], "health": p["health"]}
            for fn in fns.values():
                for _ in range(3):
                    fn()
            target_s = cfg["ops_target_s"]
            one = max(1 if target_s <= 0 else runner.calibrate(f, device, target_s, 1000) for f in fns.values())
            inner = dict.fromkeys(fns, one)
            samples = runner.measure_interleaved(fns, device, 0, cfg["ops_reps"], one)
            summary = {k: stats.summarize(s) for k, s in samples.items()}
            ratio = summary["health"]["median_s"] / summary["plain"]["median_s"]
            ci = stats.bootstrap_ci(stats.median_ratio("health", "plain"), samples, paired=True)
            rows.append(
                {
                    "op": op,
                    "with": p["with"],
                    "bucket": name,
                    "bytes": 4 * n,
                    "threads": threads,
                    "inner": inner["plain"],
                    "methods": summary,
                    "samples": samples,
                    "paired": paired_cost(samples["health"], samples["plain"]),
                    "ratio": ratio,
                    "check": {"sumsq matches float64": sumsq_ok} if op == "unflatten_scale" else {"flag clear": flag_ok},
                    "targets": {"health/plain": _target(ratio, OPS_TARGET, ci)},
                }
            )
    return rows


def ops_row_elsewhere() -> bool:
    """Whether the ops benchmark (fastcoll/bench/ops.py) already times unflatten_scale with sumsq (then skip it here)."""
    try:
        text = Path(__file__).with_name("ops.py").read_text()
    except OSError:  # pragma: no cover
        return False
    return "sumsq=" in text


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------------------
# The ranks
# ---------------------------------------------------------------------------


def make_wrapper(kind: str, module: nn.Module, device: str) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import fastcoll

    kw: Dict[str, Any] = {}
    if device == "cuda":
        kw["device_ids"] = [torch.cuda.current_device()]
    if kind == "torch":
        return TorchDDP(module, **kw)
    if kind == "fastcoll_norm":
        kw["compute_grad_norm"] = True
    elif kind == "fastcoll_nonfinite":
        kw["check_nonfinite"] = True
    return fastcoll.DDP(module, **kw)


def make_step(
    wrapper: nn.Module, clip: Optional[str], spec: ModelSpec, x: torch.Tensor, max_norm: List[float]
) -> Callable[[], Optional[torch.Tensor]]:
    """One step: zero_grad + forward + loss + backward, then the clipping; returns the norm clipping saw (or None)."""
    module = wrapper.module
    params = [p for p in module.parameters() if p.requires_grad]
    loss_of = models.loss_of

    if clip is None:

        def step():
            module.zero_grad(set_to_none=True)
            loss_of(spec, wrapper(x)).backward()

    elif clip == "torch":

        def step():
            module.zero_grad(set_to_none=True)
            loss_of(spec, wrapper(x)).backward()
            return torch.nn.utils.clip_grad_norm_(params, max_norm[0], foreach=True)

    else:

        def step():
            module.zero_grad(set_to_none=True)
            loss_of(spec, wrapper(x)).backward()
            return wrapper.clip_grad_norm_(max_norm[0])

    return step


def global_norm(module: nn.Module) -> float:
    """The L2 norm of the module's gradients, in float64."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return math.sqrt(sum(float(torch.sum(g.double() * g.double())) for g in grads))


def bench_model(spec: ModelSpec, me: runner.Rank) -> Dict[str, Any]:
    rank, ws, cfg, tick, device = me.rank, me.ws, me.cfg, me.tick, me.device
    started = time.perf_counter()
    storage = models.build_storage(spec, device)  # synthetic models: every wrapper shares the weights
    x = models.make_input(spec, rank, device)
    wrappers = {kind: make_wrapper(kind, models.build_model(spec, device, storage), device) for kind in WRAPPERS}
    max_norm = [float("inf")]
    steps = {m: make_step(wrappers[w], clip, spec, x, max_norm) for m, (w, clip) in METHODS.items()}

    def drop_grads(method: str) -> None:
        wrappers[METHODS[method][0]].module.zero_grad(set_to_none=True)

    # Warm-up of each wrapper (its bucket rebuild), one step of each method (the slowest sets inner), then max_norm.
    for kind in WRAPPERS:
        plain = next(m for m, (w, clip) in METHODS.items() if w == kind and clip is None)
        for _ in range(cfg["setup_steps"] - 1):
            steps[plain]()
    slowest = 0.0
    for m, step in steps.items():
        runner.synchronize(device)
        t0 = time.perf_counter()
        step()
        runner.synchronize(device)
        slowest = max(slowest, time.perf_counter() - t0)
        drop_grads(m)
        tick(1)
    steps["torch"]()
    norm = global_norm(wrappers["torch"].module)
    max_norm[0] = CLIP_FRACTION * norm

    # Checks against the float64 norm of the synchronized gradients: the norm each clipping saw, the
    # clipped norm, and fastcoll's clipped gradients against torch's. torch's foreach norm sums in
    # float32 (relative error up to ~1e-4 over 10^8 elements here); fastcoll's sums are float64.
    torch_norm = float(steps["torch+clip"]())
    fc_norm = float(steps["fastcoll norm+clip"]())
    fc_torch_norm = float(steps["fastcoll+torch clip"]())
    after = global_norm(wrappers["fastcoll_norm"].module)
    grads = models.compare_grads(wrappers["fastcoll_norm"].module, wrappers["torch"].module, rtol=1e-3)
    rel = lambda a, b: abs(a - b) / max(abs(b), 1e-30)  # noqa: E731
    checks = {
        "norm float64": norm,
        "max_norm": max_norm[0],
        "norm torch clip": torch_norm,
        "norm fastcoll clip": fc_norm,
        "norm torch clip on fastcoll": fc_torch_norm,
        "rel err torch": rel(torch_norm, norm),
        "rel err fastcoll": rel(fc_norm, norm),
        "norm after fastcoll clip": after,
        # torch's contract: the gradients are scaled by max_norm / (norm + 1e-6)
        "clipped": fc_norm > max_norm[0] and rel(after, fc_norm * max_norm[0] / (fc_norm + 1e-6)) <= 1e-5,
        "grads fastcoll vs torch after clip": grads,
    }
    checks["ok"] = bool(
        checks["clipped"] and checks["rel err fastcoll"] <= 1e-6 and checks["rel err torch"] <= 1e-3 and grads["close"]
    )
    for m in METHODS:
        drop_grads(m)
    gc.collect()

    n_inner = runner.inner_for(runner.all_max([slowest], device)[0], cfg["target_s"], cfg["max_inner"])
    lo, hi = _reps_for(spec, cfg)
    goals = [(lambda s, n=n: _target_value(s, n), thr, "le") for n, thr in _thresholds(spec.name).items()]
    samples, cpu_samples = runner.timed_rounds(steps, n_inner, lo, hi, goals, device, tick, after=drop_grads)
    tick(len(steps) * (hi - len(samples["torch"])))
    params = [p for p in wrappers["fastcoll"].module.parameters() if p.requires_grad]
    buckets = len(wrappers["fastcoll"].bucket_info())
    steps.clear()
    wrappers.clear()
    storage = None  # noqa: F841 (the shared weights go before the next model is built)
    gc.collect()
    row = {
        "model": spec.name,
        "label": spec.label,
        "synthetic": spec.synthetic,
        "world_size": ws,
        "params": len(params),
        "numel": sum(p.numel() for p in params),
        "buckets": buckets,
        "inner": n_inner,
        "elapsed_s": time.perf_counter() - started,
        **analyze(spec.name, samples),
        "cpu_time": analyze(spec.name, cpu_samples),
        "checks": checks,
    }
    return row


def _paired_median(samples: Dict[str, List[float]], cost: str) -> float:
    a, b = COSTS[cost]
    return statistics.median(x - y for x, y in zip(samples[a], samples[b]))


def _target_value(samples: Dict[str, List[float]], name: str) -> Optional[float]:
    """One target's statistic: the fused norm's or the check's cost per fastcoll step, or fastcoll's clipping cost per torch's."""
    if name == "clip":
        ct = _paired_median(samples, "clip torch")
        return _paired_median(samples, "clip fastcoll") / ct if ct > 0 else None
    return _paired_median(samples, name) / statistics.median(samples["fastcoll"])


def _thresholds(model: str) -> Dict[str, float]:
    out = {"norm": NORM_TARGET, "nonfinite": NONFINITE_TARGET}
    return {**out, "clip": CLIP_TARGET} if model in CLIP_TARGET_MODELS else out


def analyze(model: str, samples: Dict[str, List[float]]) -> Dict[str, Any]:
    """Per-method summaries, paired costs, the cost ratios and the targets of one model's samples.

    Each target also carries the 90% bootstrap interval of its statistic (rounds resampled).
    """
    summary = {m: stats.summarize(s) for m, s in samples.items()}
    costs = {name: paired_cost(samples[a], samples[b]) for name, (a, b) in COSTS.items()}
    base_fc = summary["fastcoll"]["median_s"]
    ct, cf = costs["clip torch"]["median_s"], costs["clip fastcoll"]["median_s"]
    values = {name: _target_value(samples, name) for name in ("norm", "nonfinite", "clip")}
    clip_ratio, norm_frac, nonfinite_frac = values["clip"], values["norm"], values["nonfinite"]
    targets = {}
    for name, threshold in _thresholds(model).items():

        def stat(s: Dict[str, List[float]], name: str = name) -> Optional[float]:
            return _target_value(s, name)

        ci = stats.bootstrap_ci(stat, samples, paired=True) if len(samples["fastcoll"]) > 1 else None
        targets[name] = _target(values[name], threshold, ci)
    return {
        "methods": summary,
        "samples": samples,
        "costs": costs,
        "ratios": {
            "clip fastcoll/torch": clip_ratio,
            "norm/fastcoll step": norm_frac,
            "nonfinite/fastcoll step": nonfinite_frac,
            "A/A/fastcoll step": costs["A/A"]["median_s"] / base_fc,
            "clip torch/torch step": ct / summary["torch"]["median_s"],
            "clip fastcoll/fastcoll step": cf / base_fc,
        },
        "targets": targets,
    }


def _worker(
    rank: int, ws: int, store_path: str, out_path: str, progress_q: Any, cfg: Dict[str, Any], specs: List[ModelSpec]
) -> None:  # noqa: E501
    library = extension_file()  # the one this process loaded (another build may replace the file later)
    with runner.Rank(rank, ws, store_path, out_path, progress_q, {**cfg, "keep_freed_memory": True}) as me:
        x = models.make_input(models.WARMUP, rank, me.device)
        for w, clip in METHODS.values():  # every wrapper kind and clipping once on a tiny model: no one-time costs later
            wrapper = make_wrapper(w, models.build_model(models.WARMUP, me.device), me.device)
            step = make_step(wrapper, clip, models.WARMUP, x, [1e-3])
            for _ in range(3):
                step()
        gc.collect()
        gc.freeze()
        rows = []
        for spec in specs:
            me.describe(f"health, {ws} rank{'s' if ws > 1 else ''}: {spec.label}")
            rows.append(bench_model(spec, me))
            me.row(f"{spec.label}, {ws} rank{'s' if ws > 1 else ''}", len(specs) * len(cfg["world_sizes"]))
        me.save({"rows": rows, "health_ops": health_ops_implementation(), "library": library})


# ---------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------


def measure(args: Any = None) -> Dict[str, Any]:
    """Run the ops rows, then spawn the ranks for each world size; return the results.

    Returns:
        ``{"benchmark": "health", "config": {...}, "health_ops": ..., "ops": [row, ...],
        "results": [row, ...]}``; each result row has the model, the world size,
        per method the timing summary (seconds) and raw samples, the paired
        ``costs``, ``ratios``, ``targets`` and the clipping ``checks``.
    """
    device = getattr(args, "device", "cpu") or "cpu"
    cfg = _config(args, device)
    specs = model_specs(cfg["smoke"])
    skip_ops = ops_row_elsewhere()
    ops_rows = [] if skip_ops else bench_ops_rows(cfg)
    results: List[Dict[str, Any]] = []
    health_ops, malloc = health_ops_implementation(), None
    libraries = {"parent (ops rows)": extension_file()}
    units = len(cfg["world_sizes"]) * sum(len(METHODS) * (_reps_for(s, cfg)[1] + 1) for s in specs)
    with report.progress("health", units) as prog:
        outs = [(ws, runner.run_ranks(_worker, (cfg, specs), ws, prog)) for ws in cfg["world_sizes"]]
    for ws, out in outs:
        results += out["rows"]
        health_ops, malloc = out["health_ops"], out["malloc"]
        libraries[f"{ws} rank{'s' if ws > 1 else ''}"] = out["library"]
    return {
        "benchmark": "health",
        "config": {
            **cfg,
            "models": [dataclasses.asdict(s) for s in specs],
            "wrappers": WRAPPERS,
            "clipping": CLIPS,
            "methods": {m: {"wrapper": w, "clip": c} for m, (w, c) in METHODS.items()},
            "costs": {k: f"median over rounds of ({a}) - ({b})" for k, (a, b) in COSTS.items()},
            "step": "module.zero_grad(set_to_none=True); loss(wrapper(x)).backward(); then the clipping, if any "
            "(no optimizer step); gradients dropped after each sample, outside the timing",
            "malloc": malloc or "unchanged",
            "max_norm": f"{CLIP_FRACTION} x the measured global gradient norm (clipping scales every gradient)",
            "targets": {
                "clip": f"fastcoll clipping cost <= {CLIP_TARGET}x torch's ({', '.join(CLIP_TARGET_MODELS)})",
                "norm": f"compute_grad_norm=True costs <= {NORM_TARGET:.0%} of fastcoll's step",
                "nonfinite": f"check_nonfinite=True costs <= {NONFINITE_TARGET:.0%} of fastcoll's step",
                "ops": f"unflatten_scale with sumsq <= {OPS_TARGET}x without (25 MiB fp32, 1 thread)",
            },
            "ops_rows_skipped": "fastcoll/bench/ops.py already times unflatten_scale with sumsq" if skip_ops else None,
        },
        "health_ops": health_ops,
        "extension_files": libraries,
        "ops": ops_rows,
        "results": results,
    }


def _pct(x: Optional[float]) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x * 100:+.1f}%"


def _signed(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    return ("-" if seconds < 0 else "+") + report.fmt_time(abs(seconds))


def _pm(t: Optional[Dict[str, Any]]) -> str:
    return "" if t is None else report.pass_miss(t["pass"])


def costs_table(rows: List[Dict[str, Any]], title: str, key: Optional[str]) -> None:
    """The costs of every row, from its wall-clock analysis (``key`` None) or ``row[key]`` (``"cpu_time"``)."""
    columns = [
        "model",
        "ranks",
        "clip torch",
        "clip fastcoll",
        f"fc/torch ≤{CLIP_TARGET}",
        f"norm ≤{NORM_TARGET:.0%}",
        f"nonfinite ≤{NONFINITE_TARGET:.0%}",
        "fc+torch clip",
        "scaling",
        "A/A control",
    ]
    if key is None:
        columns.append("checks")
    table = []
    for r in rows:
        a = r if key is None else r[key]
        c, t, q = a["costs"], a["targets"], a["ratios"]
        line = [
            r["label"] + (" *" if r["synthetic"] else ""),
            str(r["world_size"]),
            f"{_signed(c['clip torch']['median_s'])} ({_pct(q['clip torch/torch step'])})",
            f"{_signed(c['clip fastcoll']['median_s'])} ({_pct(q['clip fastcoll/fastcoll step'])})",
            f"{report.fmt_ratio(q['clip fastcoll/torch'])} {_pm(t.get('clip'))}".strip(),
            f"{_signed(c['norm']['median_s'])} ({_pct(q['norm/fastcoll step'])}) {_pm(t['norm'])}",
            f"{_signed(c['nonfinite']['median_s'])} ({_pct(q['nonfinite/fastcoll step'])}) {_pm(t['nonfinite'])}",
            _signed(c["clip torch on fastcoll"]["median_s"]),
            _signed(c["scaling pass fastcoll"]["median_s"]),
            f"{_signed(c['A/A']['median_s'])} ({_pct(q['A/A/fastcoll step'])})",
        ]
        if key is None:
            line.append("[green]ok[/green]" if r["checks"]["ok"] else "[red]FAIL[/red]")
        table.append(line)
    caption = (
        "clip torch = (torch+clip) - torch; clip fastcoll = (fastcoll norm+clip) - fastcoll, the fused norm included; "
        "(%) of the step without the feature.\n"
        "norm = fastcoll(compute_grad_norm=True) - fastcoll; nonfinite = fastcoll(check_nonfinite=True) - fastcoll (% of "
        "fastcoll's step). fc+torch clip = torch's clip_grad_norm_ on fastcoll.DDP's gradients; scaling = "
        "(fastcoll norm+clip) - (fastcoll norm). A negative cost (or ratio) is below this machine's noise."
    )
    if key is None:
        caption += (
            f"\nmax_norm = {CLIP_FRACTION} x the measured norm; checks: the norm each clipping saw against the float64 norm "
            "(fastcoll rel 1e-6, torch's float32 sum rel 1e-3), the clipped norm is max_norm, fastcoll's clipped gradients "
            "match torch's. Targets informational, never asserted."
        )
    else:
        caption += (
            "\nCPU time of the thread that runs forward, backward (and the wrappers' hooks) and the clipping; slowest rank."
        )
    report.table(title, columns, table, caption=caption)


def print_results(payload: Dict[str, Any]) -> None:
    cfg = payload["config"]
    device = cfg["device"]
    rows = payload["results"]
    where = (
        f"gloo ranks on loopback, {cfg['threads']} intra-op thread(s) each"
        if device == "cpu"
        else "1 rank on NCCL" + (f" ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else "")
    )
    impl = payload["health_ops"]
    columns = ["model", "ranks", *METHODS, "IQR fastcoll"]
    table = []
    for r in rows:
        m = r["methods"]
        fc = m["fastcoll"]
        table.append(
            [r["label"] + (" *" if r["synthetic"] else ""), str(r["world_size"])]
            + [report.fmt_time(m[k]["median_s"]) for k in METHODS]
            + [f"{fc['iqr_s'] / fc['median_s'] * 100:.1f}%"]
        )
    report.table(
        f"fastcoll health: step time per method ({device})",
        columns,
        table,
        caption=f"{where}; health ops: {impl}. Median step (slowest rank) = zero_grad + forward + backward (+ clipping), "
        "no optimizer step; samples interleaved, order rotated each round.\n"
        "* synthetic: parameters of the model's shapes, forward = sum_i p_i.sum() * x_i.",
    )

    costs_table(rows, f"fastcoll health: costs, wall clock (median of paired per-round differences; {device})", None)
    if device == "cpu":
        costs_table(
            rows,
            "fastcoll health: the same costs in CPU time of the training thread (a cross-check less sensitive to other load)",
            "cpu_time",
        )

    if payload["ops"]:
        table = []
        for r in payload["ops"]:
            m = r["methods"]
            table.append(
                [
                    r["op"],
                    r["with"],
                    r["bucket"],
                    str(r["threads"] or "-"),
                    report.fmt_time(m["plain"]["median_s"]),
                    report.fmt_time(m["health"]["median_s"]),
                    report.fmt_ratio(r["ratio"]),
                    _pm(r["targets"]["health/plain"]) if r["op"] == "unflatten_scale" else "",
                    ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in r["check"].items()),
                ]
            )
        report.table(
            f"fastcoll health: the fused ops with and without the health outputs ({device})",
            ["op", "with", "bucket", "threads", "without", "with", "ratio", f"≤{OPS_TARGET}x", "check"],
            table,
            caption=f"health ops: {impl}. Median per call, samples interleaved; the target applies to unflatten_scale (sumsq).",
        )
    elif cfg.get("ops_rows_skipped"):
        report.say(f"[dim]ops rows skipped: {cfg['ops_rows_skipped']}[/dim]")


def _target_lines(payload: Dict[str, Any], key: Optional[str]) -> Tuple[List[str], int, int]:
    lines, total, passed = [], 0, 0
    for r in payload["results"]:
        a = r if key is None else r[key]
        for name, t in a["targets"].items():
            if t["pass"] is None:
                continue
            total += 1
            passed += bool(t["pass"])
            fmt = (lambda x: f"{x:.2f}x") if name == "clip" else _pct
            value = fmt(t["value"])
            if t.get("ci90"):
                value += f" (90%: {fmt(t['ci90'][0])} to {fmt(t['ci90'][1])}{'' if t['resolved'] else ', not resolved'})"
            thr = f"{t['threshold']}x" if name == "clip" else f"{t['threshold']:.0%}"
            lines.append(f"  {r['label']}, {r['world_size']} rank(s): {name} {value} (<= {thr}) {report.pass_miss(t['pass'])}")
    return lines, total, passed


def _summary(payload: Dict[str, Any]) -> None:
    lines, total, passed = _target_lines(payload, None)
    for r in payload["ops"]:
        t = r["targets"]["health/plain"]
        if r["op"] == "unflatten_scale" and t["pass"] is not None:
            total += 1
            passed += bool(t["pass"])
            lines.append(
                f"  ops {r['op']} {r['with'].split(' ')[0]}: {t['value']:.2f}x (<= {OPS_TARGET}x) {report.pass_miss(t['pass'])}"
            )
    if total:
        report.say(f"[bold]targets (issue 11; informational, never asserted), wall clock:[/bold] {passed}/{total} PASS")
        for line in lines:
            report.say(line)
    if payload["config"]["device"] == "cpu" and payload["results"]:
        lines, total, passed = _target_lines(payload, "cpu_time")
        report.say(f"[bold]the same targets in training-thread CPU time:[/bold] {passed}/{total} PASS")
        for line in lines:
            report.say(line)
    for r in payload["results"]:
        if not r["checks"]["ok"]:
            report.say(f"[red]warning: {r['label']}, {r['world_size']} rank(s): clipping check failed: {r['checks']}[/red]")


def chart(path: Path, payload: Dict[str, Any]) -> Optional[Path]:
    """Two panels: clipping cost (% of the step without clipping), torch vs fastcoll; norm and non-finite costs (%)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = payload["results"]
    if not rows:
        return None
    names = [f"{r['label']}\n{r['world_size']} rank{'s' if r['world_size'] > 1 else ''}" for r in rows]
    xs = list(range(len(rows)))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, 1.6 * len(rows) + 2), 8))
    w = 0.38
    ct = [100 * r["ratios"]["clip torch/torch step"] for r in rows]
    cf = [100 * r["ratios"]["clip fastcoll/fastcoll step"] for r in rows]
    top.bar([x - w / 2 for x in xs], ct, w, label="torch DDP + clip_grad_norm_(foreach=True)")
    top.bar([x + w / 2 for x in xs], cf, w, label="fastcoll.DDP(compute_grad_norm=True) + clip_grad_norm_")
    cpu = [r.get("cpu_time") for r in rows]
    if payload["config"]["device"] == "cpu" and all(cpu):
        top.scatter(
            [x - w / 2 for x in xs],
            [100 * a["ratios"]["clip torch/torch step"] for a in cpu],
            marker="x",
            color="k",
            label="x: training-thread CPU time",
        )
        top.scatter(
            [x + w / 2 for x in xs], [100 * a["ratios"]["clip fastcoll/fastcoll step"] for a in cpu], marker="x", color="k"
        )
    for x, r, a, b in zip(xs, rows, ct, cf):
        ratio = r["ratios"]["clip fastcoll/torch"]
        if ratio is not None:
            top.annotate(f"{ratio:.2f}x", (x, max(a, b)), ha="center", va="bottom", fontsize=8)
    top.set_ylabel("clipping cost, % of the step (bars: wall clock)")
    top.set_title(
        f"clipping cost (fastcoll/torch annotated; target <= {CLIP_TARGET}x on ResNet-50 and GPT-2 shapes)", fontsize=10
    )
    top.legend(fontsize=8)
    nc = [100 * r["ratios"]["norm/fastcoll step"] for r in rows]
    nf = [100 * r["ratios"]["nonfinite/fastcoll step"] for r in rows]
    bottom.bar([x - w / 2 for x in xs], nc, w, label="compute_grad_norm=True (target <= 3%)", color="tab:green")
    bottom.bar([x + w / 2 for x in xs], nf, w, label="check_nonfinite=True (target <= 2%)", color="tab:red")
    if payload["config"]["device"] == "cpu" and all(cpu):
        bottom.scatter(
            [x - w / 2 for x in xs],
            [100 * a["ratios"]["norm/fastcoll step"] for a in cpu],
            marker="x",
            color="k",
            label="x: training-thread CPU time",
        )
        bottom.scatter(
            [x + w / 2 for x in xs], [100 * a["ratios"]["nonfinite/fastcoll step"] for a in cpu], marker="x", color="k"
        )
    bottom.axhline(100 * NORM_TARGET, color="tab:green", linestyle="--", linewidth=0.8)
    bottom.axhline(100 * NONFINITE_TARGET, color="tab:red", linestyle="--", linewidth=0.8)
    bottom.axhline(0, color="black", linewidth=0.6)
    bottom.set_ylabel("% of fastcoll.DDP's step")
    bottom.set_title("cost of the fused norm and of the non-finite check (median of paired differences)", fontsize=10)
    bottom.legend(fontsize=8)
    for ax in (top, bottom):
        ax.set_xticks(xs)
        ax.set_xticklabels(names, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"fastcoll health ({payload['config']['device']}; health ops: {payload['health_ops'].split(':')[0]})")
    fig.tight_layout()
    return report.save_figure(fig, path)


def run(args: Any = None) -> int:
    """CLI entry (``python -m fastcoll.bench health``): measure, print the tables, write JSON and a chart.

    Returns:
        0 on success (also when this checkout has no issue-11 API: it says so and skips),
        1 if a clipping check failed, 2 if ``--device cuda`` is asked for without a GPU.
    """
    device = getattr(args, "device", "cpu") or "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        report.say("[red]fastcoll.bench health: --device cuda but torch.cuda.is_available() is False[/red]")
        return 2
    if not supported():
        report.say(
            "[yellow]fastcoll.bench health: fastcoll.DDP has no compute_grad_norm/check_nonfinite (issue 11); skipping[/yellow]"
        )
        return 0
    impl = health_ops_implementation()
    if impl != "extension":
        report.say(
            f"[yellow]fastcoll.bench health: the health ops run the {impl}; the fused numbers are not the kernels'[/yellow]"
        )
    report.say(
        "[dim]ResNet-50 and GPT-2 rows (*) are synthetic: parameters of those shapes with a forward of one "
        "read per parameter, so their step is dominated by gradient synchronization.[/dim]"
    )
    payload = measure(args)
    print_results(payload)
    _summary(payload)
    path = report.json_path(args, f"health_{device}")
    report.write_json(path, payload, device)
    png = chart(path.with_suffix(".png"), payload)
    report.say(f"wrote {path}" + (f" and {png}" if png else " (matplotlib missing: no chart)"))
    return 0 if all(r["checks"]["ok"] for r in payload["results"]) else 1
