"""Benchmark of fastcoll.dist's tensor collectives against the usual ways of doing the same.

    python -m fastcoll.bench dist [--quick] [--threads N|all] [--json PATH]
    python -m fastcoll.bench.dist ...        (same)

Two ranks on gloo over loopback (a FileStore in a temporary directory), spawned
by the benchmark itself, time side by side:

``allreduce_grads`` on the gradients of ResNet-50 (parameter shapes from
``fastcoll/bench/model_shapes.json``, float32, 25.6 M elements):

* ``fastcoll``: :func:`fastcoll.dist.allreduce_grads` (one fused flatten with
  the 1/world_size scale, one all-reduce, one fused unflatten; its 16-byte
  cross-rank consistency check included);
* ``fastcoll 25MiB``: the same with ``bucket_size_mb=25`` (buckets reduced
  asynchronously while the next one is packed);
* ``per-tensor``: ``g.div_(ws); all_reduce(g)`` for every gradient;
* ``seed cat+split``: what the seed projects do: ``torch.cat`` of the
  flattened gradients, all-reduce, ``div_``, ``split`` and a ``copy_`` back
  into every gradient.

``all_reduce_dict`` (op='mean') on a detection-style loss dict (16 scalars)
and a metrics dict (64 vectors of 80 elements), against a per-tensor loop and
the seed approach (broadcast rank 0's pickled key list, ``torch.cat`` of the
float values, all-reduce, divide, ``split``).

Every method is checked against a plain per-tensor reference before it is
timed. A sample is the slowest rank's time for ``inner`` back-to-back calls;
the table shows medians and each method's time relative to fastcoll's
(above 1.00x: fastcoll is faster). ``run(args)`` prints the table and writes
``benchmarks/out/dist_cpu.json``; :func:`measure` returns the results as a dict.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import tempfile
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from . import common

WORLD_SIZE = 2
MODEL = "resnet50"
GRAD_METHODS = ("fastcoll", "fastcoll 25MiB", "per-tensor", "seed cat+split")
DICT_METHODS = ("fastcoll", "per-tensor", "seed cat+split")


def _config(args: Any) -> Dict[str, Any]:
    if getattr(args, "smoke", False):
        return dict(reps=2, warmup=1, dict_inner=2, grad_inner=1, grad_shapes=24, smoke=True, quick=True)
    if getattr(args, "quick", False):
        return dict(reps=5, warmup=1, dict_inner=20, grad_inner=1, grad_shapes=None, smoke=False, quick=True)
    return dict(reps=15, warmup=2, dict_inner=50, grad_inner=1, grad_shapes=None, smoke=False, quick=False)


def _threads_per_rank(args: Any) -> int:
    spec = getattr(args, "threads", None)
    if spec is None:
        return 1
    if str(spec) == "all":
        return max(1, common.available_cpus() // WORLD_SIZE)
    return max(1, int(spec))


def load_shapes(model: str = MODEL) -> List[Sequence[int]]:
    """Parameter shapes of ``model`` (see :func:`common.model_shapes`), in registration order."""
    return [shape for _, shape in common.model_shapes()[model]]


# ---------------------------------------------------------------------------
# The compared implementations
# ---------------------------------------------------------------------------


def per_tensor_grads(params: Sequence[torch.Tensor], ws: int) -> None:
    """Average gradients one all-reduce per tensor."""
    import torch.distributed as dist

    for p in params:
        if p.grad is not None:
            p.grad.div_(ws)
            dist.all_reduce(p.grad)


def seed_grads(params: Sequence[torch.Tensor], ws: int) -> None:
    """Average gradients the way the seed projects do: cat, all-reduce, divide, split, copy back."""
    import torch.distributed as dist

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
    import torch.distributed as dist

    out = {}
    for k in sorted(d):
        t = d[k].float().clone()
        dist.all_reduce(t)
        out[k] = t.div_(ws)
    return {k: out[k] for k in d}


def seed_dict(d: Dict[str, torch.Tensor], ws: int) -> Dict[str, torch.Tensor]:
    """Mean of every value the seed way: broadcast rank 0's key list, cat, all-reduce, divide, split."""
    import torch.distributed as dist

    keys = list(d)
    payload = torch.frombuffer(bytearray(pickle.dumps(keys)), dtype=torch.uint8).clone()
    dist.broadcast(payload, src=0)  # assumes every rank's pickled key list has the same length
    keys = pickle.loads(payload.numpy().tobytes())
    flat = torch.cat([d[k].reshape(-1).float() for k in keys])
    dist.all_reduce(flat)
    flat.div_(ws)
    pieces = flat.split([d[k].numel() for k in keys])
    return {k: p.reshape(d[k].shape) for k, p in zip(keys, pieces)}


def _loss_dict(rank: int, n: int = 16) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return {f"loss_{i}": torch.rand((), generator=g) for i in range(n)}


def _metric_dict(rank: int, n: int = 64, width: int = 80) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    keys = [f"metric_{i}" for i in range(n)]
    if rank % 2:
        keys.reverse()  # fastcoll accepts any key order; the others need the same order
    return {k: torch.rand(width, generator=g) for k in keys}


# ---------------------------------------------------------------------------
# The ranks
# ---------------------------------------------------------------------------


def _slowest(samples: List[float]) -> List[float]:
    import torch.distributed as dist

    t = torch.tensor(samples, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6))


def _bench_dicts(rank: int, ws: int, cfg: Dict[str, Any]) -> List[Dict[str, Any]]:
    from .. import dist as fd

    cases = {"loss dict, 16 scalars": _loss_dict(rank), "metric dict, 64 x 80": _metric_dict(rank)}
    if cfg["smoke"]:
        cases = {"loss dict, 4 scalars": _loss_dict(rank, 4)}
    rows = []
    for name, d in cases.items():
        fns: Dict[str, Callable[[], object]] = {
            "fastcoll": lambda d=d: fd.all_reduce_dict(d, op="mean"),
            "per-tensor": lambda d=d: per_tensor_dict(d, ws),
            "seed cat+split": lambda d=d: seed_dict(d, ws),
        }
        reference = {k: v.float().clone() for k, v in d.items()}
        for k in sorted(reference):  # the plain per-tensor mean every method is checked against
            torch.distributed.all_reduce(reference[k])
            reference[k] = reference[k] / ws
        checks = {}
        for method, fn in fns.items():
            got = fn()
            checks[method] = all(_close(got[k], reference[k]) for k in d)  # type: ignore[index]
        samples = common.measure_interleaved(fns, "cpu", cfg["warmup"], cfg["reps"], inner=cfg["dict_inner"])
        rows.append(_row("all_reduce_dict", name, {m: _slowest(s) for m, s in samples.items()}, checks))
    return rows


def _bench_grads(rank: int, ws: int, cfg: Dict[str, Any]) -> List[Dict[str, Any]]:
    import torch.distributed as dist

    from .. import dist as fd

    shapes = load_shapes(MODEL)
    if cfg["grad_shapes"]:
        shapes = shapes[: cfg["grad_shapes"]]
    g = torch.Generator().manual_seed(rank)
    params = [torch.nn.Parameter(torch.empty(s)) for s in shapes]
    originals = [torch.randn(s, generator=g) for s in shapes]
    for p, o in zip(params, originals):
        p.grad = o.clone()
    reference = [o.clone() for o in originals]
    for r in reference:  # the plain per-tensor mean every method is checked against
        dist.all_reduce(r)
        r.div_(ws)

    fns: Dict[str, Callable[[], object]] = {
        "fastcoll": lambda: fd.allreduce_grads(params),
        "fastcoll 25MiB": lambda: fd.allreduce_grads(params, bucket_size_mb=25),
        "per-tensor": lambda: per_tensor_grads(params, ws),
        "seed cat+split": lambda: seed_grads(params, ws),
    }
    checks = {}
    for method, fn in fns.items():
        for p, o in zip(params, originals):
            p.grad.copy_(o)
        fn()
        checks[method] = all(_close(p.grad, r) for p, r in zip(params, reference))
    del originals, reference
    # From here on every rank holds the same (averaged) gradients, so repeated
    # averaging leaves the values unchanged: every sample sees the same data.
    samples = common.measure_interleaved(fns, "cpu", cfg["warmup"], cfg["reps"], inner=cfg["grad_inner"])
    numel = sum(p.numel() for p in params)
    name = f"{MODEL} grads, {len(params)} tensors, {numel * 4 / common.MiB:.1f} MiB"
    return [_row("allreduce_grads", name, {m: _slowest(s) for m, s in samples.items()}, checks)]


def _row(function: str, case: str, samples: Dict[str, List[float]], checks: Dict[str, bool]) -> Dict[str, Any]:
    stats = {m: common.summarize(s) for m, s in samples.items()}
    base = stats["fastcoll"]["median_s"]
    return {
        "function": function,
        "case": case,
        "methods": {
            m: {**st, "time_vs_fastcoll": st["median_s"] / base if base else None, "correct": checks.get(m)}
            for m, st in stats.items()
        },
    }


def _worker(rank: int, ws: int, store_path: str, cfg: Dict[str, Any], out_path: str) -> None:
    with common.rank_process_group(rank, ws, store_path, cfg["threads"], "gloo", timeout_s=300):
        common.save_rank_rows(rank, out_path, _bench_dicts(rank, ws, cfg) + _bench_grads(rank, ws, cfg))


# ---------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------


def measure(args: Any = None) -> Dict[str, Any]:
    """Spawn the ranks, run the benchmark and return its results.

    Args:
        args: An argparse namespace (or None) with optional ``quick``,
            ``smoke`` and ``threads`` attributes, as the CLI gives.

    Returns:
        ``{"benchmark": "dist", "config": {...}, "implementation": ...,
        "results": [row, ...]}``; each row has ``function``, ``case`` and, per
        method, the timing summary (seconds), ``time_vs_fastcoll`` and
        ``correct``.
    """
    import torch.multiprocessing as tmp

    cfg = _config(args)
    cfg["threads"] = _threads_per_rank(args)
    with tempfile.TemporaryDirectory(prefix="fastcoll_bench_dist_") as tmpdir:
        out_path = os.path.join(tmpdir, "result.json")
        tmp.spawn(_worker, args=(WORLD_SIZE, os.path.join(tmpdir, "store"), cfg, out_path), nprocs=WORLD_SIZE, join=True)
        with open(out_path) as f:
            result = json.load(f)
    return {
        "benchmark": "dist",
        "config": {"world_size": WORLD_SIZE, "backend": "gloo", "model": MODEL, **cfg},
        "implementation": result["implementation"],
        "results": result["rows"],
    }


def print_results(payload: Dict[str, Any]) -> None:
    """Print one table row per (function, case, method)."""
    columns = ["function / case", "method", "median", "IQR", "vs fastcoll", "correct"]
    table = []
    for row in payload["results"]:
        for i, (method, st) in enumerate(row["methods"].items()):
            label = f"{row['function']}: {row['case']}" if i == 0 else ""
            table.append(
                [
                    label,
                    method,
                    common.fmt_time(st["median_s"]),
                    common.fmt_time(st["iqr_s"]),
                    common.fmt_ratio(st["time_vs_fastcoll"]),
                    common.pass_miss(st["correct"]),
                ]
            )
    caption = (
        f"{payload['config']['world_size']} gloo ranks on loopback, {payload['config']['threads']} thread(s) each, "
        f"ops: {payload['implementation']}. 'vs fastcoll' = method time / fastcoll time (>1: fastcoll faster)."
    )
    common.render_table("fastcoll dist: collectives side by side", columns, table, caption=caption)


def run(args: Any = None) -> int:
    """CLI entry (``python -m fastcoll.bench dist``): measure, print the table, write JSON.

    Returns:
        0 on success, 1 if some method produced a wrong result.
    """
    if getattr(args, "device", "cpu") == "cuda":
        common.say("[yellow]fastcoll.bench dist: runs on gloo CPU ranks; --device cuda is ignored[/yellow]")
    payload = measure(args)
    if payload["implementation"] != "extension":
        common.say(
            "[yellow]fastcoll.bench dist: the C++ extension is not loaded; fastcoll packs with the "
            "pure-PyTorch reference ops (one copy per tensor), not the fused kernels[/yellow]"
        )
    print_results(payload)
    path = common.resolve_json_path(args, "dist_cpu")
    common.write_json(path, payload, "cpu")
    common.say(f"wrote {path}")
    ok = all(st["correct"] for row in payload["results"] for st in row["methods"].values())
    return 0 if ok else 1


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m fastcoll.bench.dist [--quick] [--threads N|all] [--json PATH]``."""
    from .__main__ import main as cli

    return cli(["dist", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
