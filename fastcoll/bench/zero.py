"""ZeRO-1: ``fastcoll.ShardedOptimizer`` against torch's ZeroRedundancyOptimizer and DDP, with AdamW (docs/benchmarks.md).

Methods: :data:`METHOD_DESCRIPTIONS` (2 gloo ranks on CPU, one NCCL rank per GPU; only ShardedOptimizer's public API).
First memory, state, traffic and a check of the parameters against torch DDP + AdamW's, each (model, method) in a fresh
process pair; then the step time, a model's methods side by side on shared weights, rounds until every step target
resolves. Then the bfloat16 section (:mod:`fastcoll.bench.zero_bf16`) and, on the CPU, the one-rounding section
(:mod:`fastcoll.bench.zero_one_rounding`) and the ZeRO-2 pool section (:mod:`fastcoll.bench.zero_pool`).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

import fastcoll

from . import models, report, runner, stats, zero_bf16, zero_one_rounding, zero_pool
from .models import ModelSpec

WORLD_SIZE = 2
METHODS = ("torch", "zero", "fastcoll", "full", "sharded", "overlap")
MEMORY_METHODS = METHODS[:5]  # overlap holds what sharded holds
SHARDED = ("full", "sharded")
METHOD_LABELS = {"torch": "torch DDP", "zero": "torch ZeRO", "fastcoll": "fastcoll.DDP", "full": "grads=full",
                 "sharded": "grads=sharded", "overlap": "sharded+overlap"}  # fmt: skip
METHOD_DESCRIPTIONS = {
    "torch": "torch.nn.parallel.DistributedDataParallel(module) + torch.optim.AdamW",
    "zero": "torch DDP + torch.distributed.optim.ZeroRedundancyOptimizer(params, optimizer_class=AdamW)",
    "fastcoll": "fastcoll.DDP(module) + torch.optim.AdamW",
    "full": 'fastcoll.DDP(module) + fastcoll.ShardedOptimizer(AdamW(...), model, grads="full")',
    "sharded": 'fastcoll.DDP(module) + fastcoll.ShardedOptimizer(AdamW(...), model, grads="sharded")',
    "overlap": "the same with overlap_param_gather=True (all-gathers hidden behind the next forward)",
}
STATE_TOLERANCE = 0.01  # state per rank <= (1 + this) x DDP's / N; peak saving >= (1 - this) x the state saved
STEP_VS_ZERO = 0.8  # full, sharded (and overlap): step <= this x ZeroRedundancyOptimizer's
STEP_VS_TORCH = 1.0  # sharded (and overlap): step <= this x torch DDP + AdamW's ...
STEP_VS_TORCH_MODELS = ("resnet50", "gpt2_small")  # ... on these models
#: Above this estimate of per-rank bytes, a model's methods are timed in SPLIT_GROUPS (GPT-2: about 8 GiB together).
GROUP_LIMIT_BYTES = 3 << 30
FOOTPRINT = {"torch": 3.0, "zero": 2.0, "fastcoll": 3.0, "full": 2.0, "sharded": 2.5, "overlap": 2.5}
SPLIT_GROUPS = (("torch", "zero", "sharded", "overlap"), ("zero", "fastcoll", "full"))
verdict = stats.verdict
CONFIGS = {  # rounds: reps..max_reps per timing group until the step targets resolve (large: GPT-2)
    "smoke": dict(reps=2, max_reps=2, reps_large=2, max_reps_large=2, setup_steps=2, target_s=0.0, max_inner=1),
    "default": dict(reps=6, max_reps=20, reps_large=4, max_reps_large=10, setup_steps=3, target_s=0.05, max_inner=20),
    "full": dict(reps=10, max_reps=60, reps_large=6, max_reps_large=20, setup_steps=3, target_s=0.1, max_inner=50),
}


def model_specs(level: str) -> List[ModelSpec]:
    """The MLP and the ResNet-50 shapes (``full``: and GPT-2 small's; smoke: tiny ResNet-50 shapes)."""
    if level == "smoke":
        return [models.SMOKE_RESNET50]
    return [models.MLP96, models.RESNET50] + ([models.GPT2] if level == "full" else [])


def timing_groups(param_bytes: int) -> List[Tuple[str, ...]]:
    """The methods timed together in one process pair: all, or :data:`SPLIT_GROUPS` above :data:`GROUP_LIMIT_BYTES`."""
    return [METHODS] if param_bytes * (2.0 + sum(FOOTPRINT.values())) <= GROUP_LIMIT_BYTES else [tuple(g) for g in SPLIT_GROUPS]


def step_goals(model: str, methods: Sequence[str]) -> List[Tuple[str, str, float]]:
    """The step targets among ``methods``: (method, baseline, threshold)."""
    goals = [(m, "zero", STEP_VS_ZERO) for m in ("full", "sharded", "overlap")]
    if model in STEP_VS_TORCH_MODELS:
        goals += [(m, "torch", STEP_VS_TORCH) for m in ("sharded", "overlap")]
    return [g for g in goals if g[0] in methods and g[1] in methods]


# Inside the ranks
def make_method(method: str, module: nn.Module, device: str) -> Tuple[nn.Module, torch.optim.Optimizer]:
    """The wrapper and the optimizer of ``method`` around ``module``."""
    adamw = models.adamw_kwargs(device)
    wrapper: nn.Module = runner.wrap("torch" if method in ("torch", "zero") else "fastcoll", module, device)
    if method == "zero":
        return wrapper, ZeroRedundancyOptimizer(wrapper.parameters(), optimizer_class=torch.optim.AdamW, **adamw)
    if method in ("full", "sharded", "overlap"):
        extra = {"overlap_param_gather": True} if method == "overlap" else {}
        grads = "full" if method == "full" else "sharded"
        return wrapper, fastcoll.ShardedOptimizer(torch.optim.AdamW(wrapper.parameters(), **adamw), wrapper, grads=grads, **extra)
    return wrapper, torch.optim.AdamW(wrapper.parameters(), **adamw)


def build(me: runner.Rank, spec: ModelSpec, method: str, storage: Any = None, x: Optional[torch.Tensor] = None) -> runner.Built:
    """``method`` on ``spec``'s model (on ``storage``'s weights, with input ``x``, if given) and its AdamW training step."""
    module = models.build_model(spec, me.device, storage, layered=True)
    wrapper, opt = make_method(method, module, me.device)
    x = models.make_input(spec, me.rank, me.device) if x is None else x
    step = models.train_step(wrapper, opt, x, lambda out: models.loss_of(spec, out))
    return runner.Built(module, wrapper, opt, step)


def state_bytes(method: str, opt: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer-state tensors this rank holds (ZeRO: its local optimizer's)."""
    state = opt.optim.state if method == "zero" else opt.state  # type: ignore[attr-defined]
    return sum(v.numel() * v.element_size() for s in state.values() for v in s.values() if torch.is_tensor(v))


def _memory(me: runner.Rank, spec: ModelSpec, method: str) -> Dict[str, Any]:
    """Phase 1 for one method: peak tensor and resident growth, state bytes, bytes sent per iteration, parameter digest."""

    def read(probe: runner.MemoryProbe, _heap: Any, m: runner.Built) -> Dict[str, Any]:
        _, sent = runner.bytes_sent(lambda: (runner.run_steps(m.step, 1, m.opt), runner.synchronize(me.device)))
        buckets = len(m.wrapper.bucket_info()) if method not in ("torch", "zero") else None
        resident = probe.peak() if me.device == "cpu" else None
        peak = probe.tensor_peak()  # stops the recording: the digest's float64 copies below do not count
        with torch.no_grad():  # the digest: float64 sum and sum of squares of every parameter, compared across methods
            flat = (p.detach().double().view(-1) for p in m.module.parameters())
            sums = [(float(d.sum()), float(torch.dot(d, d))) for d in flat]
        return {"peak_bytes": peak, "resident_peak_bytes": resident, "state_bytes": state_bytes(method, m.opt),
                "sent_bytes": sent, "digest": [sum(s for s, _ in sums), sum(q for _, q in sums)], "buckets": buckets}  # fmt: skip

    return runner.memory_phase(me, lambda _heap: build(me, spec, method), me.cfg["setup_steps"], read,
                               lambda: build(me, models.WARMUP, method), tensors=True)  # fmt: skip


def _timing(me: runner.Rank, spec: ModelSpec, methods: Sequence[str]) -> Dict[str, Any]:
    """Phase 2: ``methods`` side by side on shared weights, in steady state (each forward waits for the last step's gathers)."""
    cfg, large = me.cfg, spec.name == "gpt2_small"
    storage, x = models.build_storage(spec, me.device), models.make_input(spec, me.rank, me.device)
    lo, hi = (cfg["reps_large"], cfg["max_reps_large"]) if large else (cfg["reps"], cfg["max_reps"])
    checks = [(stats.median_ratio(a, b), thr, "le") for a, b, thr in step_goals(spec.name, methods)]
    return runner.optimizer_rounds(me, methods, lambda m: build(me, spec, m, storage, x), lo, hi, checks)


# Analysis
def analyze(row: Dict[str, Any]) -> Dict[str, Any]:
    """Add per-method summaries, checks, resident margins, ratios and the targets to a model's row (in place)."""
    groups, ws = row["groups"], row["world_size"]
    ranks = {m: row["memory"].get(m, {}).get("ranks") or [] for m in METHODS}
    keys = ("state_bytes", "peak_bytes", "resident_peak_bytes", "sent_bytes")
    methods = row["methods"] = {m: stats.method_entry(groups, ranks[m], m, keys) for m in METHODS}
    ref = (ranks["torch"] or [{}])[0].get("digest")
    row["checks"] = {}
    for m in MEMORY_METHODS:
        if ranks[m] and ref is not None:
            rel = max(abs(a - b) / max(abs(b), 1e-30) for r in ranks[m] for a, b in zip(r["digest"], ref))
            row["checks"][m] = {"max_rel_diff": rel, "ok": rel <= 1e-5}
    t_state = methods["torch"].get("state_bytes")

    def margins(m: str, key: str) -> Optional[List[float]]:
        """Per rank: (torch DDP's ``key`` - ``m``'s) - the state ``m`` saves; None unless every rank measured both."""
        base, mine, st = methods["torch"].get(key), methods[m].get(key), methods[m].get("state_bytes")
        if not (t_state and st and base and mine) or None in base or None in mine:
            return None
        return [(b - v) - (ts - s) for b, v, ts, s in zip(base, mine, t_state, st)]

    state, memory = {}, {}  # the targets: the state ones, then the step ones, then the memory ones
    for m in SHARDED:
        if t_state and methods[m].get("state_bytes"):
            state[f"state {m}"] = stats.target(max(methods[m]["state_bytes"]) / (max(t_state) / ws), 1 + STATE_TOLERANCE)
        if (peak := margins(m, "peak_bytes")) is not None:
            slack = -STATE_TOLERANCE * min(ts - s for ts, s in zip(t_state, methods[m]["state_bytes"]))  # bookkeeping scalars
            memory[f"memory {m}"] = stats.target(min(peak), slack, (min(peak), max(peak)), "ge", "range over ranks", unit="bytes")
    steps = {f"step {m}/{base}": stats.group_target(groups, m, base, thr) for m, base, thr in step_goals(row["model"], METHODS)}
    row["targets"] = {**state, **steps, **memory}
    # the same margin in resident memory: what the C allocator keeps counts (no target)
    row["resident_margins"] = {m: min(r) for m in MEMORY_METHODS[1:] if (r := margins(m, "resident_peak_bytes")) is not None}
    row["ratios"] = {f"{m}/torch": stats.group_target(groups, m, "torch")["value"] for m in METHODS[1:]}
    row["ratios"]["sharded/overlap"] = stats.group_target(groups, "sharded", "overlap")["value"]  # what not overlapping costs
    return row


def target_label(name: str) -> str:
    """A target's key (``"step sharded/zero"``, ``"state full"``, ``"memory sharded"``) in words."""
    kind, what = name.split(" ", 1)
    if kind == "step":
        mine, base = what.split("/")
        return f"step, {METHOD_LABELS[mine]} / {METHOD_LABELS[base]}'s"
    if kind == "state":
        return f"state per rank, grads={what} / (DDP's / N)"
    return f"peak below torch DDP's - state saved, grads={what}"


# Output and entry
def print_results(payload: Dict[str, Any]) -> None:
    """The step table, the targets table and the memory table."""
    cfg, rows, mib, per_rank = payload["config"], payload["results"], report.mib, report.per_rank_mib
    body = [[r["label"] + (" *" if r["synthetic"] else ""), *(report.fmt_time(r["methods"][k].get("median_s")) for k in METHODS),
             report.fmt_ratio(r["ratios"]["sharded/overlap"]), " | ".join(f"{g['reps']} x {g['inner']}" for g in r["groups"])]
            for r in rows]  # fmt: skip
    adamw = ", ".join(f"{k}={v}" for k, v in cfg["adamw"].items())
    report.table(f"fastcoll zero: step time with AdamW ({cfg['device']})",
                 ["model", *(METHOD_LABELS[k] for k in METHODS), "sharded/overlap", "rounds x inner"], body,
                 f"{cfg['world_size']} {cfg['backend']} ranks, {cfg['threads']} thread(s) each; AdamW({adamw}); "
                 f"overlap_param_gather default: {cfg['overlap_default']}. Median step of the slowest rank = zero_grad + "
                 "forward + backward + step in steady state; rounds in rotating order until the step targets resolve. "
                 "* synthetic: one module per parameter of the model's shapes, forward = one read of each.")  # fmt: skip
    body = []
    for r in rows:
        for i, (name, t) in enumerate(r["targets"].items()):
            fmt = {"memory": mib, "state": lambda v: f"{v:.4f}"}.get(name.split()[0], report.fmt_ratio)
            bound = f"{'≥' if t['op'] == 'ge' else '≤'} {mib(t['threshold']) if name.startswith('memory') else t['threshold']}"
            body.append([r["label"] if i == 0 else "", target_label(name), report.target_cell(t, fmt), bound, t["interval"]])
    report.table(f"fastcoll zero: targets ({cfg['device']})", ["model", "target", "value (interval) verdict", "target",
                 "interval"], body, "step: ratio of median steps; state: exact bytes, worst rank; memory: (torch DDP + AdamW's "
                 "peak - this peak) - state saved, MiB, range over ranks, at least -1% of the state saved (peak: tensor bytes). "
                 "Reported, never asserted.")  # fmt: skip
    body = []
    for r in rows:
        m, t = r["methods"], r["methods"]["torch"]
        for k in MEMORY_METHODS:
            st, check = m[k].get("state_bytes"), r["checks"].get(k)
            saved = max(a - b for a, b in zip(t["state_bytes"], st)) if st and t.get("state_bytes") else None
            ok = "-" if check is None else "equal" if check["max_rel_diff"] == 0 else "close" if check["ok"] else "[red]DIFFER"
            body.append([r["label"] if k == "torch" else "", METHOD_LABELS[k], per_rank(st), per_rank(m[k].get("peak_bytes")),
                         mib(saved), report.verdict_cell(r["targets"].get(f"memory {k}")) if k in SHARDED else "",
                         per_rank(m[k].get("resident_peak_bytes")), mib(r["resident_margins"].get(k)),
                         per_rank(m[k].get("sent_bytes")), ok])  # fmt: skip
    report.table(f"fastcoll zero: optimizer state, peak memory and traffic per rank ({cfg['device']})",
                 ["model", "method", "state MiB", "peak MiB", "saved", "memory target", "resident MiB", "resident margin",
                  "sent MiB", "params"],
                 body, "per rank (rank 0 / rank 1), each method in a fresh process pair; peak: most bytes held by tensors "
                 "at once, above what they held before the build (CPU: torch.profiler's record of every allocation; CUDA: "
                 "max_memory_allocated); resident: growth of the resident high-water mark (CPU), with what the C allocator "
                 "keeps; sent: bytes written to sockets in one iteration; params: after the same iterations, against torch "
                 "DDP + AdamW's.")  # fmt: skip


def run(args: Any) -> int:
    """``python -m fastcoll.bench zero``: tables, ``benchmarks/out/zero_<device>.json``, a chart; then the bf16 section."""
    device = args.device
    if device == "cuda" and torch.cuda.device_count() == 1:
        # One GPU: one NCCL rank whose reduce-scatters and all-gathers are issued as at any world size.
        os.environ["FASTCOLL_FORCE_COLLECTIVES"] = "1"
        report.say("fastcoll.bench zero: one GPU, one NCCL rank with FASTCOLL_FORCE_COLLECTIVES=1", record=False)
    ws = torch.cuda.device_count() if device == "cuda" else WORLD_SIZE
    cfg = runner.level_config(args, CONFIGS, ws, group_limit_bytes=GROUP_LIMIT_BYTES)
    specs = model_specs(args.level)
    plans = [(s, n, timing_groups(4 * n)) for s in specs for n in [models.param_count(s)]]
    units = sum(len(MEMORY_METHODS) + sum(len(g) * (1 + cfg["max_reps_large" if s.name == "gpt2_small" else "max_reps"])
                                          for g in groups) for s, _, groups in plans)  # fmt: skip
    results, implementation = [], None
    with report.progress("zero", units) as prog:
        for spec, numel, groups in plans:
            memory = {}
            for m in MEMORY_METHODS:
                prog.describe(f"zero: {spec.label}, memory of {METHOD_LABELS[m]}")
                memory[m] = runner.run_ranks(_memory, cfg, (spec, m), ws, prog)
            timed = []
            for g in groups:
                prog.describe(f"zero: {spec.label}, timing {', '.join(METHOD_LABELS[m] for m in g)}")
                timed.append(runner.run_ranks(_timing, {**cfg, "malloc": "keep", "freeze": True}, (spec, g), ws, prog))
                implementation = timed[-1].pop("implementation")
            row = {"model": spec.name, "label": spec.label, "synthetic": spec.synthetic, "world_size": ws, "numel": numel,
                   "param_bytes": 4 * numel, "memory": memory, "groups": timed}  # fmt: skip
            results.append(analyze(row))
            prog.row(spec.label, len(plans))
    overlap = inspect.signature(fastcoll.ShardedOptimizer).parameters.get("overlap_param_gather")  # None: no such argument
    config = {**cfg, "models": [dataclasses.asdict(s) for s in specs], "methods": METHOD_DESCRIPTIONS,
              "adamw": models.adamw_kwargs(device), "overlap_default": None if overlap is None else bool(overlap.default),
              "targets": {"state": f"optimizer state per rank <= (1 + {STATE_TOLERANCE}) x torch DDP + AdamW's / N",
                          "step vs zero": f"step <= {STEP_VS_ZERO}x ZeroRedundancyOptimizer's (full, sharded, overlap)",
                          "step vs torch": f"sharded step <= {STEP_VS_TORCH}x torch DDP + AdamW's ({STEP_VS_TORCH_MODELS})",
                          "memory": "peak tensor bytes per rank below torch DDP + AdamW's by the state saved, within "
                                    f"{STATE_TOLERANCE:.0%} of it"}}  # fmt: skip
    payload = {"benchmark": "zero", "config": config, "implementation": implementation, "results": results}
    print_results(payload)
    named = [(f"{r['label']}: {target_label(k)}", t) for r in results for k, t in r["targets"].items()]
    ok = all(c["ok"] for r in results for c in r["checks"].values())
    if not ok:
        report.say("[red]warning: some method's parameters differ from torch DDP + AdamW's (params column)[/red]")
    report.conclude("zero", report.json_path(args, f"zero_{device}"), payload, named)
    rc = zero_bf16.run_section(args)
    if device == "cpu":  # gloo ranks on the CPU: at one GPU rank there is nothing to sum
        rc = zero_one_rounding.run_section(args) or rc
    if device == "cpu" and args.level == "default":  # GPT-2 small at 4 gloo ranks: minutes beyond make bench's 10
        report.say("fastcoll.bench zero: the ZeRO-2 pool section runs with --full (make bench-full)")
    else:
        rc = zero_pool.run_section(args) or rc
    return rc if ok else 1
