"""Sparse embedding gradients: fastcoll.DDP against torch DDP, one step's backward + sync.

    python benchmarks/bench_sparse.py [--steps N] [--world-size N] [--json PATH]

Model: nn.EmbeddingBag(rows, dim, sparse=True) feeding a Linear head; each rank
looks up its own random bags, so the rows touched differ across ranks. torch DDP
sums the sparse gradient with the process group's sparse all-reduce (gloo); fastcoll
all-gathers each rank's row count, then its rows (fastcoll/distributed/sparse.py). Timed: forward
+ backward (which includes the gradient sync) after a barrier, median over the steps
after 3 warm-ups; torch and fastcoll alternate for two rounds each, and each method's
figure is the lower of its two round medians. Not part of ``make bench``: gloo's
sparse all-reduce, which the torch side needs, has crashed intermittently on a loaded
machine (see README.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a clean clone

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

# (rows, dim, bags per rank, indices per bag)
CASES = [(10_000, 128, 64, 8), (100_000, 64, 256, 20), (1_000_000, 32, 1024, 20)]


class BagModel(nn.Module):
    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.bag = nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(x))


def _time_steps(wrapper: nn.Module, rank: int, case, steps: int) -> float:
    rows, _, bags, per_bag = case
    g = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(steps + 3):
        x = torch.randint(0, rows, (bags, per_bag), generator=g)
        wrapper.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        wrapper(x).sum().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:])


def _rank(rank: int, world_size: int, store_path: str, steps: int, out_path: str) -> None:
    import fastcoll

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    wrappers = {"torch DDP": nn.parallel.DistributedDataParallel, "fastcoll.DDP": fastcoll.DDP}
    results = []
    for case in CASES:
        best = {name: float("inf") for name in wrappers}
        for _ in range(2):
            for name, wrap in wrappers.items():
                torch.manual_seed(0)
                best[name] = min(best[name], _time_steps(wrap(BagModel(case[0], case[1])), rank, case, steps))
        results.append(
            {
                "rows": case[0],
                "dim": case[1],
                "bags": case[2],
                "per_bag": case[3],
                **{f"{k} ms": v * 1e3 for k, v in best.items()},
            }
        )
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(
                {
                    "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "torch": torch.__version__,
                    "world_size": world_size,
                    "steps": steps,
                    "results": results,
                },
                f,
                indent=1,
            )
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "sparse_cpu.json"))
    args = parser.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(args.world_size, os.path.join(tmp, "store"), args.steps, args.json), nprocs=args.world_size)
    with open(args.json) as f:
        report = json.load(f)
    print(f"{args.world_size} gloo ranks, torch {report['torch']}, median of {args.steps} steps (forward + backward + sync)")
    print("| rows x dim | lookups per rank | torch DDP | fastcoll.DDP | fastcoll / torch |")
    print("|---|---|---|---|---|")
    for r in report["results"]:
        t, f_ = r["torch DDP ms"], r["fastcoll.DDP ms"]
        print(f"| {r['rows']:,} x {r['dim']} | {r['bags']} x {r['per_bag']} | {t:.2f} ms | {f_:.2f} ms | {f_ / t:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
