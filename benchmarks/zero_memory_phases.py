"""Where the resident memory of a ZeRO-1 step goes: torch DDP + AdamW against ShardedOptimizer, phase by phase.

    python benchmarks/zero_memory_phases.py [--model resnet50|gpt2_small|mlp96] [--methods torch,full,sharded]
    MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/zero_memory_phases.py ...   # glibc's threshold fixed

One fresh pair of gloo ranks per method (the models and methods of ``python -m
fastcoll.bench zero``). Rank 0 prints its resident set (VmRSS) and high-water
mark (VmHWM), in MiB above the level before the model is built, after the
model, the wrapper and optimizer, and each phase of four iterations; then the
optimizer state it holds. The bench's memory target compares the peaks:
(torch's peak - this peak) >= (torch's state - this state).

glibc raises its mmap threshold to the size of each mapped block it frees (up
to 32 MiB), so a process that freed blocks early (parameters moved into flat
buffers when the optimizer is built) serves later gradients from its heap,
which keeps freed memory resident. ``MALLOC_MMAP_THRESHOLD_`` fixes the
threshold and shows the live data alone. Not part of ``make bench``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a clean clone

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from fastcoll.bench import models, runner, zero  # noqa: E402

WORLD_SIZE = 2
ITERATIONS = 4


def _mib_above(base: int, key: str) -> float:
    return ((runner._proc_field("/proc/self/status", key) or 0) * 1024 - base) / 2**20


def phases(rank: int, spec: models.ModelSpec, method: str) -> Tuple[List[Tuple[str, float, float]], float]:
    """This rank's (phase, RSS MiB, high-water MiB) after each phase, and its optimizer state in MiB."""
    probe = runner.MemoryProbe("cpu")
    probe.start()
    marks: List[Tuple[str, float, float]] = []

    def mark(what: str) -> None:
        marks.append((what, _mib_above(probe.base, "VmRSS"), _mib_above(probe.base, "VmHWM")))

    module = models.build_model(spec, "cpu", layered=True)
    mark("model built")
    x = models.make_input(spec, rank, "cpu")
    wrapper, opt = zero.make_method(method, module, "cpu")
    mark("wrapper + optimizer")
    for it in range(ITERATIONS):
        opt.zero_grad(set_to_none=True)
        mark(f"{it}: zero_grad")
        loss = models.loss_of(spec, wrapper(x))
        mark(f"{it}: forward")
        loss.backward()
        mark(f"{it}: backward")
        opt.step()
        mark(f"{it}: step")
    runner.settle(opt)
    mark("all-gathers done")
    return marks, zero.state_bytes(method, opt) / 2**20


def _worker(rank: int, store_path: str, out: Dict[str, Any], model: str, method: str) -> None:
    with runner.Rank(rank, WORLD_SIZE, store_path, "", None, {"threads": 1}) as me:
        runner.warm_up(lambda: zero.build(me, models.WARMUP, method))
        spec = next(s for s in zero.model_specs("full") if s.name == model)
        result = phases(rank, spec, method)
        if rank == 0:
            out["result"] = result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50", choices=["mlp96", "resnet50", "gpt2_small"])
    parser.add_argument("--methods", default="torch,full,sharded", help="comma-separated: torch, zero, fastcoll, full, sharded")
    args = parser.parse_args()
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc's default (dynamic)")
    print(f"{args.model}, {WORLD_SIZE} gloo ranks, rank 0; MALLOC_MMAP_THRESHOLD_: {threshold}; MiB above the start")
    peaks: Dict[str, Tuple[float, float]] = {}
    for method in args.methods.split(","):
        with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
            out = manager.dict()
            mp.spawn(_worker, args=(os.path.join(tmp, "store"), out, args.model, method), nprocs=WORLD_SIZE)
            marks, state = out["result"]
        print(f"\n{method}: optimizer state {state:.1f} MiB")
        for what, rss, hwm in marks:
            print(f"  {what:<20} RSS {rss:9.1f}   peak {hwm:9.1f}")
        peaks[method] = (max(h for _, _, h in marks), state)
    if "torch" in peaks:
        torch_peak, torch_state = peaks["torch"]
        for method, (peak, state) in peaks.items():
            if method != "torch":
                below, saved = torch_peak - peak, torch_state - state
                print(f"\n{method}: peak {below:+.1f} MiB below torch's, state saved {saved:.1f}, margin {below - saved:+.1f}")
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
