"""bfloat16 on the wire, rounded once: how far reduced gradients land from the exact mean, against N.

The last section of ``python -m fastcoll.bench zero`` (docs/benchmarks.md). Two parts, on gloo CPU ranks:

* precision: every rank holds bfloat16 gradients that are exact in bf16 (a bf16 model's), of both signs over 25 binades;
  each is averaged over N = 2, 4 and 8 ranks three ways: ``comm_dtype=torch.bfloat16`` (a bf16 all-reduce: gloo rounds
  every partial sum), ``comm_accum_dtype=torch.float32`` (an all-to-all of the bf16 ranges, the exact sum rounded to
  float32, one rounding to bf16, an all-gather), and the same under ``ShardedOptimizer(grads="sharded")`` with float32
  main gradients (the rank's range keeps the float32 value, read back through the float32 master weights of an SGD
  step from zero). The distance from the float64 mean is counted in bf16 ulps of that mean, per element. Target: the
  one-rounding paths within 1 ulp at every N.
* the tiny causal LM of the bf16 section at 4 ranks, bf16 weights with float32 main gradients and sharded masters, with
  ``comm_dtype=torch.bfloat16`` with and without ``comm_accum_dtype=torch.float32``: the final weights' distance from
  the float32 run's (reported, no target).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from torch import nn

import fastcoll

from ..optim import checkpoint as ckpt
from . import report, runner, stats, tiny_lm

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
METHODS = ("bf16", "accum", "accum_rs")
LABELS = {"bf16": "bf16 all-reduce (comm_dtype)", "accum": "one rounding, all-reduce (+ comm_accum_dtype)",
          "accum_rs": 'one rounding, reduce-scatter (grads="sharded")'}  # fmt: skip
SHORT = {"bf16": "bf16 all-reduce", "accum": "1 rounding, AR", "accum_rs": "1 rounding, RS"}
ULP_TARGET = 1.0  # the one-rounding paths: max distance <= 1 bf16 ulp of the exact mean, at every N
LM_WORLD = 4
LM_RUNS = {"fp32": "(a) float32, torch DDP", "bf16_wire": "(d) bf16, comm_dtype=bf16",
           "one_rounding": "(e) bf16, comm_dtype=bf16 + comm_accum_dtype=fp32"}  # fmt: skip
CONFIGS = {
    "smoke": dict(worlds=(2,), numel=4096, lm_steps=3),
    "default": dict(worlds=(2, 4, 8), numel=1 << 16, lm_steps=100),
    "full": dict(worlds=(2, 4, 8), numel=1 << 18, lm_steps=300),
}


class _Weights(nn.Module):
    """``loss = (w * x).sum()``: the gradient of ``w`` is ``x``, exactly."""

    def __init__(self, numel: int):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(numel, dtype=BF16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum()


def gradients(rank: int, numel: int) -> torch.Tensor:
    """Rank ``rank``'s bf16 gradient: both signs, magnitudes 2**-12 .. 2**12."""
    g = torch.Generator().manual_seed(7 + rank)
    mag = torch.exp2(torch.randint(-12, 13, (numel,), generator=g).to(F64))
    return (torch.randn(numel, generator=g, dtype=F64) * mag).to(BF16)


def _reduced(method: str, rank: int, numel: int) -> torch.Tensor:
    """This rank's mean of every rank's gradient by ``method``, as float64."""
    model, x = _Weights(numel), gradients(rank, numel)
    accum = {} if method == "bf16" else {"comm_accum_dtype": F32}
    if method != "accum_rs":
        ddp = fastcoll.DDP(model, comm_dtype=BF16, **accum)
        ddp(x).backward()
        return model.w.grad.to(F64)
    ddp = fastcoll.DDP(model, comm_dtype=BF16, **accum, main_grad_dtype=F32)
    opt = fastcoll.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), ddp, grads="sharded", master_dtype=F32)
    ddp(x).backward()
    opt.step()  # the float32 master of w (zero) becomes exactly -(the rank's float32 range of the mean)
    (state,) = opt.state_dict()["state"].values()  # a collective: the masters of every range
    return -state[ckpt.MASTER].to(F64)


def ulps(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """``|got - exact|`` in bfloat16 ulps of ``exact``, where ``exact`` is not zero."""
    keep = exact != 0
    e = exact[keep]
    return (got[keep] - e).abs() / torch.exp2(torch.floor(torch.log2(e.abs())) - 7)


def _precision(me: runner.Rank, numel: int) -> None:
    exact = sum(gradients(r, numel).to(F64) for r in range(me.ws)) / me.ws
    mine = {}
    for m in METHODS:
        d = ulps(_reduced(m, me.rank, numel), exact)
        mine[m] = (d.max().item(), d.sum().item(), d.numel())
        me.tick()
    per_rank = runner.gather(mine)
    me.save({m: {"max_ulp": max(r[m][0] for r in per_rank), "mean_ulp": sum(r[m][1] for r in per_rank)
                 / sum(r[m][2] for r in per_rank)} for m in METHODS})  # fmt: skip


def _lm(me: runner.Rank, steps: int) -> None:
    wire = {"recipe": "fastcoll", "masters": True, "ddp_kwargs": {"comm_dtype": BF16}}
    accum = {**wire, "ddp_kwargs": {"comm_dtype": BF16, "comm_accum_dtype": F32}}
    runs = {"fp32": {"recipe": "fp32"}, "bf16_wire": wire, "one_rounding": accum}  # LM_RUNS
    me.save({"steps": steps, "runs": tiny_lm.train_runs(me.rank, me.ws, steps, runs, me.tick)})


def measure(args: Any) -> Dict[str, Any]:
    """Both parts; returns the payload (``results``: one row per N with its targets, ``quality``: the LM runs)."""
    level = getattr(args, "level", "default")
    cfg = {**CONFIGS[level], "level": level, "threads": 1, "backend": "gloo", "device": "cpu"}
    started, results = time.perf_counter(), []
    with report.progress("zero one rounding", len(cfg["worlds"]) * len(METHODS) + len(LM_RUNS)) as bar:
        for n in cfg["worlds"]:
            bar.describe(f"zero one rounding: precision at {n} ranks")
            got = runner.run_ranks(_precision, cfg, (cfg["numel"],), n, bar)
            del got["implementation"], got["malloc"]
            targets = {f"max ulp {m}, {n} ranks": stats.target(got[m]["max_ulp"], ULP_TARGET,
                                                               what=f"{LABELS[m]}: max distance, bf16 ulps")
                       for m in METHODS[1:]}  # fmt: skip
            results.append({"label": f"{n} ranks", "world_size": n, "methods": got, "targets": targets})
            bar.row(f"{n} ranks", len(cfg["worlds"]) + 1)
        bar.describe(f"zero one rounding: the tiny causal LM at {LM_WORLD} ranks ({len(LM_RUNS)} runs)")
        quality = runner.run_ranks(_lm, cfg, (cfg["lm_steps"],), LM_WORLD, bar)
        bar.row("tiny LM", len(cfg["worlds"]) + 1)
    del quality["implementation"], quality["malloc"]
    settings = {**cfg, "methods": LABELS, "lm_runs": LM_RUNS, "lm_world_size": LM_WORLD,
                "target": f"one-rounding paths: max distance <= {ULP_TARGET} bf16 ulp of the float64 mean at every N",
                "elapsed_s": time.perf_counter() - started}  # fmt: skip
    return {"benchmark": "zero_one_rounding", "config": settings, "results": results, "quality": quality}


def print_results(payload: Dict[str, Any]) -> None:
    """The distances per N and method, the LM runs."""
    cfg = payload["config"]
    body = [[r["label"], *(f"{r['methods'][m]['max_ulp']:.3f} / {r['methods'][m]['mean_ulp']:.4f}" for m in METHODS),
             *(report.target_cell(t, lambda v: f"{v:.3f}") for t in r["targets"].values())]
            for r in payload["results"]]  # fmt: skip
    report.table("fastcoll zero: bf16 reductions, distance from the float64 mean (bf16 ulps, max / mean)",
                 ["ranks", *(SHORT[m] for m in METHODS), *(f"{SHORT[m]} max (<= {ULP_TARGET:g})" for m in METHODS[1:])],
                 body, "; ".join(f"{SHORT[m]}: {LABELS[m]}" for m in METHODS) + f". {cfg['numel']} bf16 gradients "
                 "per rank, exact in bf16, both signs over 2**-12..2**12; gloo CPU ranks; "
                 "ulp: 2**(floor(log2|mean|) - 7)")  # fmt: skip
    q = payload["quality"]
    body = [[LM_RUNS[n], f"{r['final_loss']:.4f}", f"{r['loss_gap']:+.2%}", f"{r['weight_distance']:.3e}",
             "-" if r.get("master_distance") is None else f"{r['master_distance']:.3e}", f"{r['seconds']:.1f} s"]
            for n, r in q["runs"].items()]  # fmt: skip
    report.table(f"fastcoll zero: tiny causal LM, {q['steps']} AdamW steps, {cfg['lm_world_size']} gloo ranks, bf16 wire",
                 ["run", "final loss", "gap vs (a)", "weight distance", "master distance", "time"], body,
                 "(d), (e): bf16 weights, float32 main gradients, sharded float32 masters; "
                 "distance: ||w - w(a)|| / ||w(a)||")  # fmt: skip


def chart(path: Path, payload: Dict[str, Any]) -> Optional[Path]:
    """Max and mean distance against N, per method."""
    plt = report.pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    ns = [r["world_size"] for r in payload["results"]]
    for ax, key in zip(axes, ("max_ulp", "mean_ulp")):
        for m in METHODS:
            ax.plot(ns, [r["methods"][m][key] for r in payload["results"]], marker="o", label=LABELS[m])
        if key == "max_ulp":
            ax.axhline(ULP_TARGET, color="black", linewidth=0.8, linestyle="--")
        ax.set_xscale("log", base=2)
        ax.set(xticks=ns, xticklabels=[str(n) for n in ns], xlabel="ranks", ylabel=f"{key.split('_')[0]} distance, bf16 ulps")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("bf16 gradient reduction: distance from the float64 mean against the number of ranks")
    fig.tight_layout()
    return report.save_figure(fig, path)


def run_section(args: Any) -> int:
    """Measure, print, write ``zero_one_rounding_cpu.json``, its targets chart and the distance against N
    (``..._vs_ranks.png``). Returns 0 (nothing is asserted)."""
    payload = measure(args)
    print_results(payload)
    named = [(t["what"] + f" ({r['label']})", t) for r in payload["results"] for t in r["targets"].values()]
    path = report.conclude("one rounding", report.section_json_path(args, "zero", "one_rounding", "cpu"), payload, named)
    if png := chart(path.with_name(f"{path.stem}_vs_ranks.png"), payload):
        report.say(f"wrote {png}", record=False)
    return 0
