"""fastcoll.dist's tensor collectives against a per-tensor loop and the seed projects' cat + all-reduce + split.

Two gloo ranks time ``allreduce_grads`` on ResNet-50's gradients (one fused flatten, one all-reduce, one fused
unflatten; and with 25 MiB buckets) and ``all_reduce_dict(op="mean")`` on a loss dict and a metrics dict. Every method
is checked against a plain per-tensor mean first (docs/benchmarks.md).
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, Dict, List, Sequence

import torch
import torch.distributed as dist

from .. import dist as fd
from . import models, report, runner, stats

WORLD_SIZE = 2
MODEL = "resnet50"
GRAD_METHODS = ("fastcoll", "fastcoll 25MiB", "per-tensor", "seed cat+split")
CONFIGS = {
    "smoke": dict(reps=2, warmup=1, dict_inner=2, grad_inner=1, grad_shapes=24),
    "default": dict(reps=9, warmup=1, dict_inner=20, grad_inner=1, grad_shapes=None),
    "full": dict(reps=15, warmup=2, dict_inner=50, grad_inner=1, grad_shapes=None),
}


def per_tensor_grads(params: Sequence[torch.Tensor], ws: int) -> None:
    """Average gradients one all-reduce per tensor."""
    for p in params:
        if p.grad is not None:
            p.grad.div_(ws)
            dist.all_reduce(p.grad)


def seed_grads(params: Sequence[torch.Tensor], ws: int) -> None:
    """Average gradients the way the seed projects do: cat, all-reduce, divide, split, copy back."""
    grads = [p.grad for p in params if p.grad is not None]
    groups: Dict[torch.dtype, List[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g.dtype, []).append(g)
    for members in groups.values():
        flat = torch.cat([g.reshape(-1) for g in members])
        dist.all_reduce(flat)
        flat.div_(ws)
        for g, piece in zip(members, flat.split([g.numel() for g in members])):
            g.copy_(piece.view_as(g))


def per_tensor_dict(d: Dict[str, torch.Tensor], ws: int) -> Dict[str, torch.Tensor]:
    """Mean of every value, one all-reduce per key (sorted, so ranks agree)."""
    out = {}
    for k in sorted(d):
        t = d[k].float().clone()
        dist.all_reduce(t)
        out[k] = t.div_(ws)
    return {k: out[k] for k in d}


def seed_dict(d: Dict[str, torch.Tensor], ws: int) -> Dict[str, torch.Tensor]:
    """Mean of every value the seed way: broadcast rank 0's key list, cat, all-reduce, divide, split."""
    keys = list(d)
    payload = torch.frombuffer(bytearray(pickle.dumps(keys)), dtype=torch.uint8).clone()
    dist.broadcast(payload, src=0)  # assumes every rank's pickled key list has the same length
    keys = pickle.loads(payload.numpy().tobytes())
    flat = torch.cat([d[k].reshape(-1).float() for k in keys])
    dist.all_reduce(flat)
    flat.div_(ws)
    pieces = flat.split([d[k].numel() for k in keys])
    return {k: p.reshape(d[k].shape) for k, p in zip(keys, pieces)}


# The ranks
def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6))


def _row(rank: runner.Rank, function: str, case: str, fns: Dict[str, Callable[[], object]], checks: Dict[str, bool],
         inner: int) -> Dict[str, Any]:  # fmt: skip
    """Time ``fns`` in rounds (a sample: the slowest rank's) and summarize them against fastcoll's."""
    cfg = rank.cfg
    samples = runner.measure_interleaved(fns, "cpu", cfg["warmup"], cfg["reps"], inner=inner, on_sample=rank.tick)
    samples = {m: runner.all_max(s) for m, s in samples.items()}
    base = stats.summarize(samples["fastcoll"])["median_s"]
    methods = {}
    for m, s in samples.items():
        st = stats.summarize(s)
        ci = stats.bootstrap_ci(stats.median_ratio(m, "fastcoll"), {m: s, "fastcoll": samples["fastcoll"]}, paired=True)
        methods[m] = {**st, "time_vs_fastcoll": stats.ratio(st["median_s"], base), "ci90": ci, "correct": checks[m]}
    rank.row(f"{function}: {case}", 2 if cfg["smoke"] else 3)
    return {"function": function, "case": case, "methods": methods}


def _ranks(rank: runner.Rank) -> Dict[str, Any]:
    """One rank: the dicts' rows, then the gradients'; every method checked against a plain per-tensor mean first."""
    ws, r, cfg = rank.ws, rank.rank, rank.cfg
    g = torch.Generator().manual_seed(r)
    n = 4 if cfg["grad_shapes"] else 16  # smoke: 4
    cases = {f"loss dict, {n} scalars": {f"loss_{i}": torch.rand((), generator=g) for i in range(n)}}
    if not cfg["grad_shapes"]:  # fastcoll accepts any key order; the others need the same: odd ranks reverse it
        keys, g = [f"metric_{i}" for i in range(64)], torch.Generator().manual_seed(1000 + r)
        cases["metric dict, 64 x 80"] = {k: torch.rand(80, generator=g) for k in (keys[::-1] if r % 2 else keys)}
    rows = []
    for name, d in cases.items():
        fns: Dict[str, Callable[[], object]] = {
            "fastcoll": lambda d=d: fd.all_reduce_dict(d, op="mean"),
            "per-tensor": lambda d=d: per_tensor_dict(d, ws),
            "seed cat+split": lambda d=d: seed_dict(d, ws),
        }
        reference = {k: d[k].float().clone() for k in sorted(d)}  # the plain mean, apart from every method
        for t in reference.values():
            dist.all_reduce(t)
            t.div_(ws)
        checks = {m: all(_close(fn()[k], reference[k]) for k in d) for m, fn in fns.items()}  # type: ignore[index]
        rows.append(_row(rank, "all_reduce_dict", name, fns, checks, cfg["dict_inner"]))
    # the gradients
    shapes = [s for _, s in models.model_shapes()[MODEL]][: cfg["grad_shapes"]]
    g = torch.Generator().manual_seed(r)
    params = [torch.nn.Parameter(torch.empty(s)) for s in shapes]
    originals = [torch.randn(s, generator=g) for s in shapes]
    reference = [o.clone() for o in originals]
    for t in reference:  # the plain per-tensor mean
        dist.all_reduce(t)
        t.div_(ws)
    fns = {
        "fastcoll": lambda: fd.allreduce_grads(params),
        "fastcoll 25MiB": lambda: fd.allreduce_grads(params, bucket_size_mb=25),
        "per-tensor": lambda: per_tensor_grads(params, ws),
        "seed cat+split": lambda: seed_grads(params, ws),
    }
    checks = {}
    for method, fn in fns.items():
        for p, o in zip(params, originals):
            p.grad = o.clone()
        fn()
        checks[method] = all(_close(p.grad, t) for p, t in zip(params, reference))
    # every rank now holds the same averaged gradients: averaging again leaves them unchanged
    case = f"{MODEL} grads, {len(params)} tensors, {sum(p.numel() for p in params) * 4 / models.MiB:.1f} MiB"
    return {"rows": rows + [_row(rank, "allreduce_grads", case, fns, checks, cfg["grad_inner"])]}


def run(args: Any) -> int:
    """``python -m fastcoll.bench dist``: the table and ``benchmarks/out/dist_cpu.json``; 1 if a method is wrong."""
    if getattr(args, "device", "cpu") == "cuda":
        report.say("[yellow]fastcoll.bench dist: runs on gloo CPU ranks; --device cuda is ignored[/yellow]")
    cfg = {**CONFIGS[args.level], "threads": runner.threads_per_rank(args, WORLD_SIZE), "level": args.level,
           "smoke": args.level == "smoke", "quick": args.level != "full"}  # fmt: skip
    with report.progress("dist", (2 if cfg["smoke"] else 3) * len(GRAD_METHODS) * cfg["reps"]) as prog:  # rows x methods x rounds
        result = runner.run_ranks(_ranks, cfg, (), WORLD_SIZE, prog)
    body = []
    for row in result["rows"]:
        for i, (m, st) in enumerate(row["methods"].items()):
            ci = st["ci90"]
            vs = report.fmt_ratio(st["time_vs_fastcoll"]) + (f" ({ci[0]:.2f}..{ci[1]:.2f})" if ci and m != "fastcoll" else "")
            body.append([f"{row['function']}: {row['case']}" if i == 0 else "", m, report.fmt_time(st["median_s"]),
                         report.fmt_time(st["iqr_s"]), vs, report.pass_miss(st["correct"])])  # fmt: skip
    report.table("fastcoll dist: collectives side by side", ["function / case", "method", "median", "IQR", "vs fastcoll",
                 "correct"], body, f"{WORLD_SIZE} gloo ranks on loopback, {cfg['threads']} thread(s) each, ops: "
                 f"{result['implementation']}; vs fastcoll = method time / fastcoll's (>1: fastcoll faster), 90% paired "
                 "bootstrap interval")  # fmt: skip
    payload = {"benchmark": "dist", "config": {"world_size": WORLD_SIZE, "backend": "gloo", "model": MODEL, **cfg},
               "implementation": result["implementation"], "results": result["rows"]}  # fmt: skip
    report.conclude("dist", report.json_path(args, "dist_cpu"), payload)
    return 0 if all(st["correct"] for row in result["rows"] for st in row["methods"].values()) else 1
