"""bfloat16 training at float32 quality: fastcoll's main gradients + sharded float32 masters (docs/benchmarks.md).

Part of ``python -m fastcoll.bench zero``: the recipes of :data:`METHOD_DESCRIPTIONS` on GPT-2's parameter shapes
(default run: width 256), bytes per rank by kind, peak memory and step time; then a tiny causal LM trained each way
(:mod:`fastcoll.bench.tiny_lm`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

import fastcoll

from ..reducer.grad_guard import is_guard
from ..reducer.sharding import storage_bytes
from . import models, report, runner, stats, tiny_lm
from .models import GPT2_QUICK, GPT2_SMALL, GPT2_SMOKE, GPT2Shapes

METHODS = ("bf16", "autocast", "sharded", "full")
TIMED = ("bf16", "autocast", "sharded")
FASTCOLL = ("sharded", "full")
#: Short names in tables ("fastcoll ...": main gradients + float32 masters, grads="sharded" / "full").
METHOD_LABELS = {"bf16": "torch bf16", "autocast": "torch fp32+autocast", "sharded": "fastcoll sharded", "full": "fastcoll full"}
METHOD_DESCRIPTIONS = {
    "bf16": "torch DDP(module.to(bfloat16)) + torch.optim.AdamW: bfloat16 parameters, gradients, buckets and state",
    "autocast": "torch DDP(float32 module) + torch.optim.AdamW, forward in torch.autocast(dtype=torch.bfloat16)",
    "sharded": "fastcoll.DDP(module.to(bfloat16), main_grad_dtype=torch.float32) + fastcoll.ShardedOptimizer(AdamW(...), "
    'model, grads="sharded", master_dtype=torch.float32)',
    "full": 'the same with grads="full"',
}
#: README's bytes per parameter at 2 ranks ("Sharding the optimizer"), or derived the same way where it has no row.
README_BYTES_PER_PARAM = {
    "bf16": (10.0, "2 + 2 + 2 + 4 (derived: the float32 row in bfloat16)"),
    "autocast": (20.0, "4 + 4 + 4 + 8 (README's torch DDP float32 row; + 2 of bf16 copies during the forward)"),
    "sharded": (12.0, "2 + 0 + 4 + 12/N (README's last row)"),
    "full": (12.0, "2 + 0 + 4 + 12/N (derived: the float32 main gradients are all-reduced in place)"),
}
QUALITY_RUNS = ("fp32", "torch_bf16", "sharded", "full")
QUALITY_LABELS = {"fp32": "(a) float32, torch DDP", "torch_bf16": "(b) bf16, torch DDP + AdamW",
                  "sharded": "(c) bf16, main grads + fp32 masters, sharded", "full": "(c') the same, grads=full"}  # fmt: skip
MEMORY_VS_AUTOCAST = 0.6  # peak per rank <= this x autocast's
STEP_VS_AUTOCAST = 1.1  # step <= this x autocast's
DISTANCE_VS_BF16 = 0.1  # (c)'s weight distance from (a) <= this x (b)'s
LOSS_GAP = 0.01  # |(c)'s final loss - (a)'s| <= this x (a)'s
QUALITY_LR = 1e-4
QUALITY_MICRO_BATCHES = 4

BF16 = torch.bfloat16
CONFIGS = {  # rounds: reps..max_reps until the step target resolves; default: 100 quality steps, (a), (b) and (c) (~25 s)
    "smoke": dict(reps=2, max_reps=2, setup_steps=2, quality_steps=3, quality_runs=QUALITY_RUNS),
    "default": dict(reps=5, max_reps=10, setup_steps=3, quality_steps=100, quality_runs=QUALITY_RUNS[:3]),
    "full": dict(reps=6, max_reps=12, setup_steps=3, quality_steps=300, quality_runs=QUALITY_RUNS),
}
#: The peaks a memory phase reads per rank, and their names in ``bytes_per_param``.
PEAK_NAMES = {"peak_bytes": "peak", "tensor_peak_bytes": "tensor peak", "live_peak_bytes": "live"}
#: Where the live heap is read: after zero_grad; at the model's last forward hook (inside autocast's region, its
#: bfloat16 weight copies still cached); after the forward (the region ended); after backward; after step.
PHASES = ("zero_grad", "forward end", "forward", "backward", "step")
#: The warm-up's shapes: a few iterations on them first, so that the measured model pays no one-time costs.
WARMUP = [(4, 3), (5,), (3, 2)]


def config(args: Any) -> Dict[str, Any]:
    """The configuration of ``args.level`` on ``args.device`` (2 gloo ranks on CPU, one NCCL rank per GPU)."""
    ws = torch.cuda.device_count() if getattr(args, "device", "cpu") == "cuda" else 2
    quality = {"lr": QUALITY_LR, "micro_batches": QUALITY_MICRO_BATCHES, "world_size": 2}
    return runner.level_config(args, CONFIGS, ws, quality=quality)


def model_shapes(cfg: Dict[str, Any]) -> GPT2Shapes:
    return {"smoke": GPT2_SMOKE, "default": GPT2_QUICK, "full": GPT2_SMALL}[cfg["level"]]


def param_dtype(method: str) -> torch.dtype:
    return torch.float32 if method == "autocast" else BF16


def forward_context(method: str, device: str) -> Any:
    return torch.autocast(device, dtype=BF16) if method == "autocast" else contextlib.nullcontext()


def build_model(shapes: Sequence[Sequence[int]], method: str, storage: Any = None, device: Any = "cpu") -> nn.Module:
    """GPT-2's shapes, one module each, whose forward is a row-wise dot product autocast runs in bfloat16."""
    return models.LayeredShapeModel(shapes, storage, device, param_dtype(method), matmul=True)


def make_method(method: str, module: nn.Module, device: str, ddp_kwargs: Optional[Dict[str, Any]] = None,
                **sharded_kwargs: Any) -> Tuple[nn.Module, torch.optim.Optimizer]:  # fmt: skip
    """The wrapper and the optimizer of ``method`` (one of :data:`METHODS`) around ``module`` (already in its dtype); the
    fastcoll methods pass ``ddp_kwargs`` to ``fastcoll.DDP`` and ``sharded_kwargs`` to ``ShardedOptimizer``."""
    kind, kw = ("fastcoll", {"main_grad_dtype": torch.float32, **(ddp_kwargs or {})}) if method in FASTCOLL else ("torch", {})
    wrapper = runner.wrap(kind, module, device, **kw)
    opt = torch.optim.AdamW(wrapper.parameters(), **models.adamw_kwargs(device, (torch.float32, BF16)))
    if method in FASTCOLL:
        opt = fastcoll.ShardedOptimizer(opt, wrapper, grads=method, master_dtype=torch.float32, **sharded_kwargs)
    return wrapper, opt


def build(me: runner.Rank, dims: Sequence[Sequence[int]], method: str, storage: Any = None, x: Optional[torch.Tensor] = None,
          sample: Callable[[str], None] = lambda phase: None) -> runner.Built:  # fmt: skip
    """``method`` on the model of ``dims`` (``storage``'s weights and input ``x`` if given); its step calls ``sample(phase)``."""
    module = build_model(dims, method, storage, me.device)
    wrapper, opt = make_method(method, module, me.device)
    x = models.shape_input(len(dims), me.rank, me.device) if x is None else x
    step = models.train_step(wrapper, opt, x, note=sample, context=lambda: forward_context(method, me.device))
    return runner.Built(module, wrapper, opt, step)


def account(
    method: str, module: nn.Module, wrapper: nn.Module, opt: torch.optim.Optimizer, grads: Sequence[torch.Tensor]
) -> Dict[str, int]:
    """Bytes this rank holds, by kind (``grads``: the ``.grad`` tensors taken right after a backward); each storage is
    counted once (views too), by the first kind that holds it. fastcoll's buffers: its ``memory_usage()``."""
    seen: set = set()
    params = storage_bytes(module.parameters(), seen)
    if method in FASTCOLL:  # bucket storage, narrower wire buffers, kept ranges, all-gather stages
        buckets = sum(wrapper.memory_usage().values())
    else:  # torch DDP's flat buckets, from its logging data; else every gradient once, in the parameters' dtype
        sizes = runner.torch_bucket_sizes(wrapper, "bucket_sizes")
        buckets = int(sum(sizes if sizes is not None else [p.numel() * p.element_size() for p in module.parameters()
                                                           if p.requires_grad]))  # fmt: skip
    dot_grad = storage_bytes(grads, seen)
    if isinstance(opt, fastcoll.ShardedOptimizer):
        usage = opt.memory_usage()
        master, state = usage["masters"], usage["state"]
    else:
        master, state = 0, storage_bytes((v for s in opt.state.values() for v in s.values()), seen)
    held = {"params": params, "grads": dot_grad, "buckets": buckets, "state": state, "masters": master}
    return {**held, "total": sum(held.values())}


def _memory(me: runner.Rank, shapes: GPT2Shapes, method: str) -> Dict[str, Any]:
    """Phase 1, a fresh process pair per method: every rank's bytes by kind, peak resident growth, peak tensor bytes and
    live heap per phase for ``method``."""
    kept: List[weakref.ref] = []  # weak: a reference would keep one step's gradients alive into the next backward
    steps = me.cfg["setup_steps"] + 1

    def measured(live: Optional[runner.LiveBytes]) -> runner.Built:
        def sample(phase: str) -> None:
            if live is not None:
                live.sample(phase)
            if phase == "backward":  # the gradients as backward leaves them (counted at the end, if still alive)
                kept[:] = [weakref.ref(p.grad) for p in built.module.parameters() if p.grad is not None and not is_guard(p.grad)]

        built = build(me, [s for _, s in shapes.shapes()], method, sample=sample)
        built.module.register_forward_hook(lambda *_: sample("forward end"))
        return built

    def read(probe: runner.MemoryProbe, live: Optional[runner.LiveBytes], m: runner.Built) -> Dict[str, Any]:
        runner.synchronize(me.device)
        held = account(method, m.module, m.wrapper, m.opt, [g for ref in kept if (g := ref()) is not None])
        has_live = live is not None and live.available
        return {"numel": sum(p.numel() for p in m.module.parameters()), "peak_bytes": probe.peak(),
                "tensor_peak_bytes": probe.tensor_peak(), "live_peak_bytes": live.peak if has_live else None,
                "live_by_phase": {p: live.by_phase.get(p, 0) for p in PHASES} if has_live else None, "held": held,
                "buckets": len(m.wrapper.bucket_info()) if hasattr(m.wrapper, "bucket_info") else None,
                "iterations": steps}  # fmt: skip

    return runner.memory_phase(me, measured, steps, read, lambda: build(me, WARMUP, method), live=True, tensors=True)


def _timing(me: runner.Rank, shapes: GPT2Shapes) -> Dict[str, Any]:
    """Phase 2, step time: the timed recipes side by side in one process pair on shared weights (one copy per dtype),
    rounds until the step target resolves."""
    dims = [s for _, s in shapes.shapes()]
    storage = {dtype: models.filled(dims, dtype, me.device) for dtype in (BF16, torch.float32)}
    x = models.shape_input(len(dims), me.rank, me.device)
    goal = [(stats.median_ratio("sharded", "autocast"), STEP_VS_AUTOCAST, "le")]
    return runner.optimizer_rounds(me, TIMED, lambda m: build(me, dims, m, storage[param_dtype(m)], x), me.cfg["reps"],
                                   me.cfg["max_reps"], goal, inner=1)  # fmt: skip


def _quality(me: runner.Rank) -> Optional[Dict[str, Any]]:
    """Phase 3, quality: the tiny causal LM trained by every recipe in one process pair (rank 0 returns the runs)."""
    init, kw = tiny_lm.flat_weights(tiny_lm.TinyCausalLM()), {"lr": QUALITY_LR, "micro_batches": QUALITY_MICRO_BATCHES}
    fc = {n: {"recipe": "fastcoll", "grads": n} for n in FASTCOLL}  # the others: recipe = name
    runs = {n: {**fc.get(n, {"recipe": n}), "masters": True, **kw} for n in me.cfg["quality_runs"]}
    runs = tiny_lm.train_runs(me.rank, me.ws, me.cfg["quality_steps"], runs, me.tick, init)
    return {"steps": me.cfg["quality_steps"], "params": int(init.numel()), "runs": runs} if me.rank == 0 else None


def analyze(row: Dict[str, Any], quality: Optional[Dict[str, Any]], device: str = "cpu") -> Dict[str, Any]:
    """Per-method summaries, the ratios to ``autocast`` and the targets (in place; returns ``row``); on the CPU the peak of
    tensor bytes has a memory target of its own beside the resident growth's (on CUDA the two are one peak)."""
    mem, groups = row["memory"], row["groups"]
    methods: Dict[str, Dict[str, Any]] = {}
    for m in METHODS:
        ranks = mem.get(m, {}).get("ranks") or []
        entry = methods[m] = stats.method_entry(groups, ranks, m, ("held", *PEAK_NAMES, "live_by_phase"))
        if ranks:
            numel = ranks[0]["numel"]
            bpp = entry["bytes_per_param"] = {k: max(r["held"][k] for r in ranks) / numel for k in ranks[0]["held"]}
            bpp["held"] = max(r["held"]["total"] for r in ranks) / numel
            for key, name in PEAK_NAMES.items():  # the worst rank's
                bpp[name] = max((p / numel for p in entry[key] if p is not None), default=None)
        entry["readme_bytes_per_param"] = README_BYTES_PER_PARAM[m][0]

    base, targets, ratios = methods["autocast"], {}, {}
    for m in [m for m in METHODS if m != "autocast"]:
        own = methods[m]
        step = stats.group_target(groups, m, "autocast", STEP_VS_AUTOCAST, f"step, {METHOD_LABELS[m]} / autocast's")
        ratios[f"step {m}/autocast"] = {"value": step["value"], "ci90": step["ci90"]}
        for key in PEAK_NAMES:
            per_rank = stats.per_rank_ratios(own.get(key), base.get(key))
            if per_rank:
                ratios[f"{key} {m}/autocast"] = max(per_rank)
        if own.get("held") and base.get("held"):
            ratios[f"held {m}/autocast"] = max(x["total"] / y["total"] for x, y in zip(own["held"], base["held"]))
        if m not in FASTCOLL:
            continue
        for (key, kind), name in zip(stats.PEAKS[: 2 if device == "cpu" else 1], ("memory", "tensor memory")):  # CUDA: one peak
            t = stats.worst_rank_target(own.get(key), base.get(key), MEMORY_VS_AUTOCAST,
                                        f"peak {kind} per rank, {METHOD_LABELS[m]} / autocast's")  # fmt: skip
            if t:
                targets[f"{name} {m}/autocast"] = t
        if step["value"] is not None:
            targets[f"step {m}/autocast"] = step
    if quality is not None:
        runs, plain = quality["runs"], quality["runs"]["torch_bf16"]["weight_distance"]
        for m in [m for m in FASTCOLL if m in runs]:
            r = runs[m]
            r["distance_vs_bf16"] = share = r["weight_distance"] / plain if plain > 0 else None
            targets[f"distance {m}/torch_bf16"] = stats.target(share, DISTANCE_VS_BF16, what=f"weight distance from float32, "
                                                               f"{QUALITY_LABELS[m]} / (b)'s")  # fmt: skip
            targets[f"loss {m}"] = stats.target(abs(r["loss_gap"]), LOSS_GAP,
                                                what=f"relative final-loss gap from float32, {QUALITY_LABELS[m]}")  # fmt: skip
    row.update(methods=methods, ratios=ratios, targets=targets)
    return row


def measure(args: Any = None) -> Dict[str, Any]:
    """Run the three phases; return ``{"benchmark": "zero_bf16", "config", "implementation", "results": [row], "quality"}``."""
    device, cfg, started = args.device, config(args), time.perf_counter()
    ws, shapes = cfg["world_size"], model_shapes(cfg)
    with report.progress("zero bf16", len(METHODS) + len(TIMED) * (cfg["max_reps"] + 1) + len(cfg["quality_runs"])) as bar:
        memory: Dict[str, Any] = {}
        for m in METHODS:
            bar.describe(f"zero bf16: {shapes.label}, memory of {METHOD_LABELS[m]}")
            memory[m] = runner.run_ranks(_memory, cfg, (shapes, m), ws, bar)
        bar.describe(f"zero bf16: {shapes.label}, timing {', '.join(METHOD_LABELS[m] for m in TIMED)}")
        timed = runner.run_ranks(_timing, {**cfg, "malloc": "keep", "freeze": True}, (shapes,), ws, bar)
        implementation, malloc = timed.pop("implementation"), timed.pop("malloc")
        bar.describe(f"zero bf16: quality, the tiny causal LM ({len(cfg['quality_runs'])} runs)")
        quality = runner.run_ranks(_quality, {**cfg, "threads": 1, "backend": "gloo", "device": "cpu"}, (), 2, bar)
    row = {"model": shapes.name, "label": shapes.label, "shapes": dataclasses.asdict(shapes), "numel": shapes.numel(),
           "world_size": ws, "memory": memory, "groups": [timed]}  # fmt: skip
    analyze(row, quality, device)
    settings = {
        **cfg, "methods": METHOD_DESCRIPTIONS, "timed": list(TIMED), "adamw": models.adamw_kwargs(device, (torch.float32, BF16)),
        "model": "MatmulShapeModel: one module per parameter of GPT-2's shapes, forward = sum_i "
        "linalg.vecdot(W_i, ones(cols_i)).sum() * x_i (1-D: W_i.sum()), float32 terms",
        "step": "opt.zero_grad(set_to_none=True); loss = wrapper(x) (autocast: in torch.autocast(bfloat16)); loss.backward(); "
        "opt.step()  (steady state: an untimed lead-in iteration, timed iterations each waiting for the previous one's "
        "all-gathers, the last all-gathers drained untimed)",
        "memory": "held: bytes of the distinct storages of the parameters, .grad after backward, buckets, optimizer state and "
        "masters; peak: growth of VmHWM over VmRSS before the model is built (fresh process pair per method, after a warm-up "
        "on tiny shapes and malloc_trim); tensor peak: the most bytes torch's tensors held at once (c10's running total as "
        "torch.profiler records it); live: glibc mallinfo2 after each phase" if device == "cpu"
        else "held bytes; peak: max_memory_allocated growth",
        "malloc_timing": malloc or "unchanged",
        "readme_bytes_per_param": {m: {"value": v, "how": how} for m, (v, how) in README_BYTES_PER_PARAM.items()},
        "quality_model": "tiny_lm.TinyCausalLM (2 pre-norm layers, d=32, 4 heads, vocabulary 32, 16 tokens), "
        f"{tiny_lm.BATCH} sequences per micro-batch and rank, {QUALITY_MICRO_BATCHES} micro-batches per step, "
        f"AdamW lr {QUALITY_LR}, 2 gloo ranks",
        "targets": {"memory": f"sharded's peak per rank <= {MEMORY_VS_AUTOCAST}x autocast's (resident; CPU: also tensor bytes)",
                    "step": f"sharded's step <= {STEP_VS_AUTOCAST}x autocast's",
                    "distance": f"(c)'s weight distance from (a) <= {DISTANCE_VS_BF16} x (b)'s",
                    "loss": f"(c)'s final loss within {LOSS_GAP:.0%} of (a)'s"},
        "elapsed_s": time.perf_counter() - started,
    }  # fmt: skip
    return {"benchmark": "zero_bf16", "config": settings, "implementation": implementation, "results": [row], "quality": quality}


def print_results(payload: Dict[str, Any]) -> None:
    """Step times, bytes per rank by kind, live heap by phase, the quality runs and the targets."""
    cfg, (row,), mib, per_rank = payload["config"], payload["results"], report.mib, report.per_rank_mib
    m, device, ratios = row["methods"], cfg["device"], row["ratios"]
    sharded = ratios["step sharded/autocast"]
    cells = [f"{row['label']} ({row['numel'] / 1e6:.1f} M)",
             *(report.fmt_time(m[k].get("median_s")) if k in TIMED else "not timed" for k in METHODS),
             report.fmt_ratio(ratios["step bf16/autocast"]["value"]),
             report.target_cell(stats.target(sharded["value"], STEP_VS_AUTOCAST, sharded["ci90"])),
             row["groups"][0]["reps"]]  # fmt: skip
    adamw = ", ".join(f"{k}={v}" for k, v in cfg["adamw"].items())
    report.table(f"fastcoll zero bf16: step time with AdamW, bfloat16 recipes ({device})",
                 ["model", *(METHOD_LABELS[k] for k in METHODS), "bf16/autocast", "sharded/autocast", "rounds"], [cells],
                 f"{cfg['world_size']} {cfg['backend']} ranks; AdamW({adamw}); median step of the slowest rank, steady state, "
                 "rounds until the step target resolves (90% paired interval). grads=full is not timed: on gloo it "
                 "issues sharded's collectives.")  # fmt: skip
    body = []
    for k, e in m.items():
        h = max(e.get("held") or [{}], key=lambda x: x.get("total", 0))
        state = mib(h.get("state", 0) + h.get("masters", 0)) + (f" ({mib(h['masters'])})" if h.get("masters") else "")
        body.append([METHOD_LABELS[k], *(mib(h.get(kind)) for kind in ("params", "grads", "buckets")), state, mib(h.get("total")),
                     f"{(e.get('bytes_per_param') or {}).get('held') or 0:.2f} ({e['readme_bytes_per_param']:.0f})",
                     *(per_rank(e.get(key)) for key in PEAK_NAMES),
                     *(report.fmt_ratio(ratios.get(f"{key} {k}/autocast")) for key in list(PEAK_NAMES)[:2])])  # fmt: skip
    report.table(f"fastcoll zero bf16: bytes per rank, {row['label']} ({row['numel'] / 1e6:.1f} M parameters, {device})",
                 ["method", "params", ".grad", "buckets", "state (masters)", "held", "held B/P (README)", "peak (r0 / r1)",
                  "tensor peak (r0 / r1)", "live (r0 / r1)", "peak/autocast", "tensor peak/autocast"], body,
                 "MiB per rank; held: the distinct storages a rank holds (worst rank), .grad right after backward, buckets "
                 "(fastcoll: float32 main-gradient buckets), optimizer state (+ float32 masters); B/P: bytes per "
                 "parameter, README's at N = 2 in brackets; peak: resident high-water growth, a fresh process pair per "
                 "method; tensor peak: the most bytes torch's tensors held at once (CPU: c10's running total as "
                 "torch.profiler records it; CUDA: max_memory_allocated); live: most heap bytes alive after a phase (glibc "
                 "mallinfo2).")  # fmt: skip
    by_phase = [[METHOD_LABELS[k], *(mib(max(p[ph] for p in ps)) for ph in PHASES)]
                for k in METHODS if (ps := [p for p in (m[k].get("live_by_phase") or []) if p])]  # fmt: skip
    if by_phase:
        report.table(f"fastcoll zero bf16: live heap MiB after each phase (worst rank, {device})",
                     ["method", *(f"after {p}" for p in PHASES)], by_phase,
                     "at the forward's end autocast's bfloat16 weight copies are still cached, after it freed")  # fmt: skip
    if q := payload.get("quality"):
        body = [[QUALITY_LABELS[n], f"{r['final_loss']:.4f}", f"{r['loss_gap']:+.2%}", f"{r['weight_distance']:.2e}",
                 "-" if r.get("master_distance") is None else f"{r['master_distance']:.2e}",
                 "-" if r.get("distance_vs_bf16") is None else f"{r['distance_vs_bf16']:.3f}", f"{r['seconds']:.1f} s"]
                for n in QUALITY_RUNS if (r := q["runs"].get(n))]  # fmt: skip
        report.table(f"fastcoll zero bf16: quality, tiny causal LM, {q['steps']} AdamW steps (2 gloo ranks)",
                     ["run", "final loss", "gap vs (a)", "weight distance", "master distance", "distance / (b)'s", "time"], body,
                     "distance: ||w - w(a)|| / ||w(a)|| over every parameter; master distance: the float32 masters'")  # fmt: skip
    report.targets_table(f"fastcoll zero bf16: targets ({device})", list(row["targets"].values()),
                         "the issue's targets are sharded's; full's against the same levels for information")  # fmt: skip


def json_path(args: Any, device: str) -> Path:
    """``benchmarks/out/zero_bf16_<device>.json``, or beside ``--json PATH`` (:func:`report.section_json_path`)."""
    return report.section_json_path(args, "zero", "bf16", device)


def run_section(args: Any = None) -> int:
    """Measure, print, write JSON and the chart (the caller checked the device). Returns 0 (nothing is asserted)."""
    report.say("[dim]bf16 section: GPT-2 shapes (synthetic: one module per parameter, forward = each weight's rows dotted "
               "with ones) in bfloat16 with torch DDP, in float32 with autocast, and with fastcoll's main gradients + "
               "sharded float32 masters; then the tiny causal LM's quality runs.[/dim]")  # fmt: skip
    payload = measure(args)
    print_results(payload)
    named = [(t["what"], t) for t in payload["results"][0]["targets"].values()]
    report.conclude("bf16", json_path(args, payload["config"]["device"]), payload, named)
    return 0


def run(args: Any = None) -> int:
    """This section alone (``python -m fastcoll.bench.zero_bf16``), with :func:`fastcoll.bench.zero.run`'s device checks."""
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        report.say("[yellow]fastcoll.bench zero bf16: sharding needs at least 2 ranks, and there is 1 GPU; skipping[/yellow]")
        return 0
    return run_section(args)
