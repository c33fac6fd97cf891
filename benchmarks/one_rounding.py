"""How far bfloat16 gradient reductions land from the exact mean, against the number of ranks.

    python benchmarks/one_rounding.py [--worlds 2,4,8] [--numel 65536]

Every rank holds bfloat16 gradients (a bf16 model's: the values are exact in
bf16, so any error is the reduction's), of both signs over many binades. Each
is averaged over the ranks three ways, on fresh gloo ranks per world size:

* ``bf16 all-reduce``: ``fastcoll.DDP(comm_dtype=torch.bfloat16)``, the
  all-reduce in bfloat16 (gloo sums in bf16: a rounding per partial sum);
* ``one rounding (all-reduce)``: ``comm_accum_dtype=torch.float32``: an
  all-to-all of the bf16 ranges, the float32 sum, one rounding to bf16, an
  all-gather;
* ``one rounding (reduce-scatter)``: the same with
  ``ShardedOptimizer(grads="sharded")`` and float32 main gradients: the
  rank's range keeps the float32 sum.

The distance is measured in bfloat16 ulps of the exact (float64) mean, per
element (the ulp of a bf16 value x is 2**(floor(log2|x|) - 7)): the maximum
and the mean over all elements. Target: the one-rounding paths within 1 ulp
at every world size. The table is printed and written as JSON to
benchmarks/out/one_rounding.json. Not part of ``make bench``; a few MiB per
rank, 8 processes are fine on a small box.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a clean clone

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

import fastcoll  # noqa: E402
from fastcoll.bench import runner  # noqa: E402

BF16, F32 = torch.bfloat16, torch.float32
METHODS = ("bf16 all-reduce", "one rounding (all-reduce)", "one rounding (reduce-scatter)")
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "one_rounding.json")


class Linear(nn.Module):
    """``loss = (w * x).sum()``: the gradient of ``w`` is ``x`` exactly."""

    def __init__(self, numel: int):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(numel, dtype=BF16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum()


def gradients(rank: int, numel: int) -> torch.Tensor:
    """Rank ``rank``'s bf16 gradient: both signs over 2**-12 .. 2**12."""
    g = torch.Generator().manual_seed(7 + rank)
    mag = torch.exp2(torch.randint(-12, 13, (numel,), generator=g).to(torch.float64))
    return (torch.randn(numel, generator=g, dtype=torch.float64) * mag).to(BF16)


def reduced(method: str, rank: int, numel: int) -> torch.Tensor:
    """This rank's result of ``method``: the whole mean, or (reduce-scatter) its range as a float64 NaN-padded vector."""
    model = Linear(numel)
    x = gradients(rank, numel)
    if method == "bf16 all-reduce":
        ddp = fastcoll.DDP(model, comm_dtype=BF16)
        ddp(x).backward()
        return model.w.grad.to(torch.float64)
    if method == "one rounding (all-reduce)":
        ddp = fastcoll.DDP(model, comm_dtype=BF16, comm_accum_dtype=F32)
        ddp(x).backward()
        return model.w.grad.to(torch.float64)
    ddp = fastcoll.DDP(model, comm_dtype=BF16, comm_accum_dtype=F32, main_grad_dtype=F32)
    opt = fastcoll.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), ddp, grads="sharded", master_dtype=F32)
    ddp(x).backward()
    out = torch.full((numel,), float("nan"), dtype=torch.float64)
    for pos, pc in opt._pieces:
        out[pc.lo : pc.hi] = opt.reducer.kept.source(pos, pc).to(torch.float64)
    return out


def ulps(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """``|got - exact|`` in bfloat16 ulps of ``exact`` (elements where got is NaN, another rank's range, are dropped)."""
    keep = ~torch.isnan(got) & (exact != 0)
    e = exact[keep]
    ulp = torch.exp2(torch.floor(torch.log2(e.abs())) - 7)
    return (got[keep] - e).abs() / ulp


def _worker(rank: int, world: int, store_path: str, out: Dict[str, Any], numel: int) -> None:
    with runner.Rank(rank, world, store_path, "", None, {"threads": 1}):
        exact = sum(gradients(r, numel).to(torch.float64) for r in range(world)) / world
        for method in METHODS:
            d = ulps(reduced(method, rank, numel), exact)
            out[f"{method}|{rank}"] = (d.max().item(), d.sum().item(), d.numel())


def measure(world: int, numel: int) -> Dict[str, Dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(world, os.path.join(tmp, "store"), out, numel), nprocs=world)
        got = dict(out)
    rows = {}
    for method in METHODS:
        per_rank = [got[f"{method}|{r}"] for r in range(world)]
        total = sum(n for _, _, n in per_rank)
        rows[method] = {"max_ulp": max(m for m, _, _ in per_rank), "mean_ulp": sum(s for _, s, _ in per_rank) / total}
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4,8")
    parser.add_argument("--numel", type=int, default=65536)
    args = parser.parse_args()
    worlds: List[int] = [int(w) for w in args.worlds.split(",")]
    results = {w: measure(w, args.numel) for w in worlds}
    print(f"distance from the float64 mean, in bf16 ulps of it ({args.numel} bf16 gradients per rank, gloo, CPU)")
    print(f"{'ranks':>5}  " + "  ".join(f"{m + ' max / mean':>40}" for m in METHODS))
    for w in worlds:
        cells = [f"{results[w][m]['max_ulp']:>18.3f} / {results[w][m]['mean_ulp']:<19.4f}" for m in METHODS]
        print(f"{w:>5}  " + "  ".join(cells))
    ok = all(results[w][m]["max_ulp"] <= 1.0 for w in worlds for m in METHODS[1:])
    print(f"target (one rounding within 1 ulp at every N): {'met' if ok else 'NOT met'}")
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    payload = {
        "numel": args.numel,
        "methods": list(METHODS),
        "results": {str(w): r for w, r in results.items()},
        "target_met": ok,
    }
    with open(OUT, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"wrote {OUT}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
