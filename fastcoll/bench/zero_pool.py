"""ZeRO-2 on a buffer pool: ``ShardedOptimizer(grads="sharded", grad_buffers="pool")`` against persistent buffers.

Part of ``python -m fastcoll.bench zero`` (docs/sharded-optimizer.md). GPT-2's parameter shapes (the synthetic model of
:mod:`fastcoll.bench.zero_bf16`) in bfloat16 with float32 main gradients, float32 masters and AdamW, at 2 and 4 gloo
ranks (on CUDA: one NCCL rank per GPU): bytes held per rank per parameter by kind, the peak resident growth and (CPU)
the peak of torch's tensor bytes (a fresh process group per method), then the step time of every method side by side,
without accumulation and with 4 micro-batches under ``no_sync`` (both accumulation choices of the pool).
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..reducer.shards import PAD_SHARE
from . import models, report, runner, stats, zero_bf16

#: method -> (grad_buffers, accumulate, micro-batches, pool_buffers, bucket_cap_mb: None for the level's)
METHODS = {
    "persistent": ("persistent", None, 1, None, None),
    "pool": ("pool", "reduce_scatter", 1, 2, None),
    "pool 1x10MB": ("pool", "reduce_scatter", 1, 1, 10.0),  # the smallest pool: one buffer of 10 MB buckets
    "persistent x4": ("persistent", None, 4, None, None),
    "pool rs x4": ("pool", "reduce_scatter", 4, 2, None),
    "pool full x4": ("pool", "full", 4, 2, None),
}
MEMORY, TIMED = ("persistent", "pool", "pool 1x10MB"), tuple(METHODS)
#: The control of the resident target (CPU, N=4): these methods' memory again with glibc returning the pages of freed
#: tensors at once (``runner.MALLOC["return"]``), which leaves out what glibc's heap keeps of them.
RETURNED, RETURNED_TAG = ("persistent", "pool"), ", freed memory returned"
STEP_VS_PERSISTENT = 1.05  # pool's step <= this x persistent's (no accumulation)
PEAK_VS_PERSISTENT = 0.75  # pool's peak resident growth per rank <= this x persistent's, at 4 ranks
#: GPT-2 small's shapes with 4 of its 12 layers, for the step times: the six methods live side by side in each rank, and
#: at 12 layers 4 ranks need about 24 GiB (the 2-core box's memory; 4 gloo ranks on 2 cores are slow at 12, too).
GPT2_SMALL_4 = models.GPT2Shapes("gpt2_small_4l_bf16", "GPT-2 small shapes, 4 layers", layers=4)
CONFIGS = {  # memory at ``shapes``, step time at ``timed_shapes``
    "smoke": dict(worlds=(2,), reps=2, max_reps=2, setup_steps=2, shapes=models.GPT2_SMOKE, timed_shapes=models.GPT2_SMOKE),
    "default": dict(worlds=(2, 4), reps=4, max_reps=6, setup_steps=2, shapes=models.GPT2_SMALL, timed_shapes=GPT2_SMALL_4),
    "full": dict(worlds=(2, 4), reps=5, max_reps=12, setup_steps=2, shapes=models.GPT2_SMALL, timed_shapes=GPT2_SMALL_4),
}


def build(me: runner.Rank, dims: Sequence[Sequence[int]], method: str, x: Optional[torch.Tensor] = None) -> runner.Built:
    """``method`` on the bfloat16 model of ``dims``: fastcoll.DDP(main_grad_dtype=float32) + ShardedOptimizer(AdamW,
    grads="sharded", float32 masters); its step: zero_grad, the micro-batches (all but the last under no_sync), step."""
    buffers, accumulate, micro, bound, own_cap = METHODS[method]
    module = zero_bf16.build_model(dims, "sharded", device=me.device)
    # No stall detection: 4 ranks on 2 busy cores can leave one rank seconds behind (it would be diagnosed).
    ddp_kw = {"stall_timeout": 0, "bucket_cap_mb": own_cap or me.cfg["bucket_cap_mb"]}
    kw = {"grad_buffers": "pool", "accumulate": accumulate, "pool_buffers": bound} if buffers == "pool" else {}
    wrapper, opt = zero_bf16.make_method("sharded", module, me.device, ddp_kw, **kw)
    x = models.shape_input(len(dims), me.rank, me.device) if x is None else x
    return runner.Built(module, wrapper, opt, models.train_step(wrapper, opt, x, micro=micro))


def _memory(me: runner.Rank, shapes: models.GPT2Shapes, method: str) -> Dict[str, Any]:
    """This rank's bytes by kind (the pool's slots counted as "pool"), its peak resident growth (CUDA: the allocator's
    peak) and the peak of its tensor bytes (CPU: what the C allocator keeps resident left out; CUDA: the same peak)."""

    def read(probe: runner.MemoryProbe, _live: Any, m: runner.Built) -> Dict[str, Any]:
        held = zero_bf16.account("sharded", m.module, m.wrapper, m.opt, [])
        held["pool"] = m.opt.memory_usage()["grad_pool"]
        held["total"] += held["pool"]
        return {"numel": sum(p.numel() for p in m.module.parameters()), "peak_bytes": probe.peak(),
                "tensor_peak_bytes": probe.tensor_peak(), "held": held}  # fmt: skip

    dims = [s for _, s in shapes.shapes()]
    return runner.memory_phase(me, lambda _live: build(me, dims, method), me.cfg["setup_steps"] + 1, read, tensors=True)


def _timing(me: runner.Rank, shapes: models.GPT2Shapes) -> Dict[str, Any]:
    """Every method side by side in one process group, rounds until the step target resolves."""
    dims = [s for _, s in shapes.shapes()]
    x = models.shape_input(len(dims), me.rank, me.device)
    goal = [(stats.median_ratio("pool", "persistent"), STEP_VS_PERSISTENT, "le")]
    return runner.optimizer_rounds(me, TIMED, lambda m: build(me, dims, m, x), me.cfg["reps"], me.cfg["max_reps"], goal, inner=1)


def analyze(world: int, memory: Dict[str, Any], samples: Dict[str, List[float]], label: str, cpu: bool = True) -> Dict[str, Any]:
    """Bytes per parameter, the peak and step ratios and the targets of one world size (its row named ``label``, N);
    on the CPU (``cpu``) the peak of tensor bytes has a target of its own beside the resident growth's."""
    out: Dict[str, Any] = {"world_size": world, "label": f"{label}, N={world}", "methods": {}, "targets": {}}
    for m, phase in memory.items():
        ranks = phase["ranks"]
        worst = max(ranks, key=lambda r: r["held"]["total"])["held"]
        out["methods"][m] = {"bytes_per_param": {k: v / ranks[0]["numel"] for k, v in worst.items()}, "held": worst,
                             "peak_bytes": [r["peak_bytes"] for r in ranks], "numel": ranks[0]["numel"],
                             "tensor_peak_bytes": [r.get("tensor_peak_bytes") for r in ranks]}  # fmt: skip
    targets, persistent = out["targets"], out["methods"]["persistent"]
    for m in MEMORY[1:]:
        pool = out["methods"][m]
        budget = (2 + 16 / world) * (1 + PAD_SHARE) + pool["bytes_per_param"]["pool"]  # (+ the ranges' padding)
        what = f"{m}: bytes per parameter held, N={world} (<= 2 + 16/N + the pool)"
        targets[f"bytes {m}"] = stats.target(pool["bytes_per_param"]["total"], budget, what=what)
        for (key, kind), name in zip(stats.PEAKS, ("peak", "tensor peak")):
            what = f"peak {kind} per rank, {m} / persistent, N={world}"
            what += f" (the pool at bucket_cap_mb={METHODS[m][4]:g}, persistent at the level's)" if METHODS[m][4] else ""
            t = stats.worst_rank_target(pool[key], persistent[key], PEAK_VS_PERSISTENT, what)
            if t and world == 4 and (key == "peak_bytes" or cpu):  # on CUDA both are the allocator's peak
                targets[f"{name} {m}"] = t
            elif t:
                out[f"{name} {m}/persistent"] = t["value"]
    if "pool" + RETURNED_TAG in memory:  # the control (not a target): the ratio without glibc's kept heap
        pool, base = (out["methods"][m + RETURNED_TAG]["peak_bytes"] for m in RETURNED[::-1])
        what = f"peak resident growth per rank, pool / persistent, N={world}, freed memory returned (control)"
        out["control"] = stats.worst_rank_target(pool, base, PEAK_VS_PERSISTENT, what)
    for name, m in (("step", "pool"), ("step pool 1x10MB", "pool 1x10MB")):
        what = f"step, {m} / persistent, N={world}"
        targets[name] = stats.ratio_target(samples, m, "persistent", STEP_VS_PERSISTENT, what=what)
    out["ratios"] = {f"{a}/{b}": stats.ratio_target(samples, a, b, 1.0)
                     for a, b in (("pool rs x4", "persistent x4"), ("pool full x4", "persistent x4"))}  # fmt: skip
    out["step_s"] = {m: stats.summarize(s)["median_s"] for m, s in samples.items()}
    return out


def measure(args: Any = None) -> Dict[str, Any]:
    """Memory (a process group per method) and timing (one per world size), at each world size of the level.

    On CUDA: one NCCL rank per GPU (on one GPU, the collectives forced as ``bench zero`` sets them).
    """
    cfg = runner.level_config(args, CONFIGS, 2, bucket_cap_mb=getattr(args, "bucket_cap_mb", None) or 25.0)
    if cfg["device"] == "cuda":
        cfg["worlds"] = (torch.cuda.device_count(),)
    shapes, timed_shapes, cpu = cfg["shapes"], cfg["timed_shapes"], cfg["device"] == "cpu"
    units = sum(len(MEMORY) + len(RETURNED) * (ws == 4) + len(TIMED) * (cfg["max_reps"] + 1) for ws in cfg["worlds"])
    rows, started = [], time.perf_counter()
    with report.progress("zero pool", units) as bar:
        for ws in cfg["worlds"]:
            c = {**cfg, "world_size": ws, "threads": runner.threads_per_rank(args, ws), "shapes": None, "timed_shapes": None}
            runs = [(m, m, c) for m in MEMORY] + [(m + RETURNED_TAG, m, {**c, "malloc": "return"})
                                                  for m in RETURNED if ws == 4 and cpu]  # fmt: skip
            memory = {}
            for key, m, rank_cfg in runs:
                bar.describe(f"zero pool: {shapes.label}, N={ws}, memory of {key}")
                memory[key] = runner.run_ranks(_memory, rank_cfg, (shapes, m), ws, bar)
            bar.describe(f"zero pool: {timed_shapes.label}, N={ws}, timing")
            timed = runner.run_ranks(_timing, {**c, "malloc": "keep", "freeze": True}, (timed_shapes,), ws, bar)
            rows.append(analyze(ws, memory, timed["samples"], shapes.label, cpu))
    fields = ("grad_buffers", "accumulate", "micro_batches", "pool_buffers", "bucket_cap_mb")
    settings = {**{k: v for k, v in cfg.items() if "shapes" not in k}, "model": shapes.label, "numel": shapes.numel(),
                "timed_model": timed_shapes.label, "timed_numel": timed_shapes.numel(),
                "methods": {m: dict(zip(fields, v)) for m, v in METHODS.items()},
                "elapsed_s": time.perf_counter() - started}  # fmt: skip
    return {"benchmark": "zero_pool", "config": settings, "results": rows}


def print_results(payload: Dict[str, Any]) -> None:
    cfg, mib, rows = payload["config"], report.mib, payload["results"]
    body = [[row["world_size"], m, mib(h["params"]), mib(h["buckets"]), mib(h["pool"]), mib(h["state"] + h["masters"]),
             f"{e['bytes_per_param']['total']:.2f}", f"{2 + 16 / row['world_size']:.1f} / {6 + 12 / row['world_size']:.1f}",
             report.per_rank_mib(e["peak_bytes"]), report.per_rank_mib(e.get("tensor_peak_bytes"))]
            for row in rows for m, e in row["methods"].items() for h in [e["held"]]]  # fmt: skip
    report.table(f"fastcoll zero pool: bytes per rank, {cfg['model']} ({cfg['numel'] / 1e6:.1f} M parameters, bf16 + fp32 "
                 "main grads + fp32 masters + AdamW)",
                 ["N", "grad buffers", "params", "buckets + ranges", "pool", "state + masters", "B/P held",
                  "2+16/N / Megatron 6+12/N", "peak growth per rank", "tensor peak per rank"], body,
                 f"bucket_cap_mb={cfg['bucket_cap_mb']} (pool 1x10MB: pool_buffers=1, bucket_cap_mb=10); MiB, worst rank; "
                 "buckets + ranges: full-size bucket buffers, the kept ranges, all-gather stages; peak growth: resident "
                 "high-water mark (CUDA: max_memory_allocated); tensor peak: the most bytes torch's tensors held at once "
                 "(CPU: c10's running total as torch.profiler records it); freed memory returned: glibc's mmap threshold "
                 "fixed at 128 KiB, so a freed tensor's pages go back to the kernel at once (by default its heap keeps "
                 "some: the difference between the two peaks)")  # fmt: skip
    span = lambda r: f"{report.fmt_ratio(r['value'])} ({'...'.join(map(report.fmt_ratio, r['ci90'] or [None, None]))})"  # noqa: E731
    body = [[row["world_size"], *(report.fmt_time(row["step_s"][m]) for m in TIMED), report.target_cell(row["targets"]["step"]),
             report.target_cell(row["targets"]["step pool 1x10MB"]), *map(span, row["ratios"].values())]
            for row in rows]  # fmt: skip
    report.table(f"fastcoll zero pool: step time, {cfg['timed_model']} ({cfg['timed_numel'] / 1e6:.1f} M, {cfg['device']})",
                 ["N", *TIMED, "pool/persistent", "1x10MB/persistent", "rs x4/persistent x4", "full x4/persistent x4"], body,
                 "median step of the slowest rank, steady state; ratios: median ratio (90% paired bootstrap interval); "
                 "x4: 4 micro-batches, the first 3 under no_sync")  # fmt: skip
    report.targets_table("fastcoll zero pool: targets", [t for row in rows for t in row["targets"].values()])
    for t in (row["control"] for row in rows if row.get("control")):
        report.say(f"{t['what']}: {t['value']:.3f} (range over ranks {t['ci90'][0]:.3f}..{t['ci90'][1]:.3f})")


def run_section(args: Any = None) -> int:
    """Measure, print and write ``benchmarks/out/zero_pool_<device>.json``. Returns 0."""
    payload = measure(args)
    print_results(payload)
    named = [(t["what"], t) for row in payload["results"] for t in row["targets"].values()]
    report.conclude("pool", report.section_json_path(args, "zero", "pool", payload["config"]["device"]), payload, named)
    return 0
