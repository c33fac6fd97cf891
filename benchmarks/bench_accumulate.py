"""CPU speed of fastcoll.ops.flatten_accumulate against the obvious PyTorch equivalents.

    python benchmarks/bench_accumulate.py [--threads N] [--reps R] [--quick]

For each bucket (16-bit or float32 gradients added into a float32 main-gradient
buffer by 1/8, as in 8 micro-batches), round-robin and interleaved
(fastcoll.bench.runner.measure_interleaved), median (and minimum) of R samples:

* fused:          ops.flatten_accumulate(grads, main, 1/8), one call;
* add_ mixed:     view.add_(grad, alpha=1/8) per tensor (views of main; torch promotes in the kernel);
* add_ .float():  view.add_(grad.float(), alpha=1/8) per tensor (a temporary per tensor);
* _foreach_add_:  torch._foreach_add_(views, grads, alpha=1/8);
* copy nt:        ops.flatten_scale(grads, main, 1/8), the pack of the same bucket, as it runs by
                  default (buckets writing >= 16 MiB use non-temporal stores: main is only written);
* copy cached:    the same with regular stores (the non-temporal threshold raised for the call):
                  main's lines are read, then written, the memory traffic of an accumulation.

GB/s counts the bytes each method moves to and from memory per element: the gradient read, and
main read and written (the accumulations and the cached copy: src + 2 * dst bytes), or main
only written (the non-temporal copy: src + dst). "per byte vs fused" is the fused op's time per
byte over the method's (above 1: the method moves its bytes faster); GB/s and the ratios use medians.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a clean clone

import torch  # noqa: E402

from fastcoll import _C, ops  # noqa: E402
from fastcoll.bench.models import MiB, model_shapes  # noqa: E402
from fastcoll.bench.runner import measure_interleaved, num_threads  # noqa: E402
from fastcoll.bench.stats import summarize  # noqa: E402


def _first_25mib(shapes):
    """The leading shapes that fit in 25 MiB of float32 (a DDP-sized bucket)."""
    out, total = [], 0
    for shape in shapes:
        n = math.prod(shape)
        if total + n > (25 * MiB) // 4:
            break
        out.append(shape)
        total += n
    return out


def buckets(quick: bool):
    """(name, shapes, gradient dtype): 25 MiB (as float32) of GPT-2 small's transformer blocks (the
    embeddings, 148 MiB of them, left out) and of ResNet-50's last layers, and 1024 small tensors."""
    shapes = model_shapes()
    gpt2 = _first_25mib([s for name, s in shapes["gpt2_small"] if name.startswith("h.")])
    resnet = _first_25mib([s for _, s in reversed(shapes["resnet50"])])  # backward order, as DDP fills buckets
    small = [(64, 48)] * 1024  # 3M elements, 12 MiB of float32
    out = [
        ("gpt2 blocks bf16->f32", gpt2, torch.bfloat16),
        ("gpt2 blocks f32->f32", gpt2, torch.float32),
        ("resnet50 bf16->f32", resnet, torch.bfloat16),
        ("1024 x (64,48) bf16->f32", small, torch.bfloat16),
    ]
    if not quick:
        out.append(("gpt2 blocks f16->f32", gpt2, torch.float16))
    return out


def cached_copy(grads, main, scale) -> None:
    """flatten_scale with regular (cached) stores."""
    saved = _C._cpu_stream_min_bytes()
    _C._set_cpu_stream_min_bytes(1 << 62)
    try:
        ops.flatten_scale(grads, main, scale)
    finally:
        _C._set_cpu_stream_min_bytes(saved)


def run(threads: int, reps: int, quick: bool) -> None:
    scale = 1 / 8
    print(f"torch {torch.__version__}, {threads} thread(s), {ops.implementation()}, median of {reps} samples")
    print(
        f"{'bucket':26s} {'tensors':>7s} {'MiB main':>8s}  {'method':14s} {'ms':>8s} {'min ms':>8s} {'GB/s':>6s} "
        f"{'time/fused':>9s} {'per byte vs fused':>8s}"
    )
    for name, shapes, gdtype in buckets(quick):
        gen = torch.Generator().manual_seed(0)
        grads = [torch.randn(s, generator=gen).to(gdtype) for s in shapes]
        n = sum(g.numel() for g in grads)
        main = torch.zeros(n)
        views = ops.bucket_views(main, grads)
        fns = {
            "fused": lambda: ops.flatten_accumulate(grads, main, scale),
            "add_ mixed": lambda: [v.add_(g, alpha=scale) for v, g in zip(views, grads)],
            "add_ .float()": lambda: [v.add_(g.float(), alpha=scale) for v, g in zip(views, grads)],
            "_foreach_add_": lambda: torch._foreach_add_(views, grads, alpha=scale),
            "copy nt": lambda: ops.flatten_scale(grads, main, scale),
            "copy cached": lambda: cached_copy(grads, main, scale),
        }
        with num_threads(threads):
            samples = measure_interleaved(fns, reps=reps, warmup=2)
        src_bytes = n * grads[0].element_size()
        streams = n * 4 >= _C._cpu_stream_min_bytes()  # the default copy writes with non-temporal stores
        moved = {m: src_bytes + (n * 4 if m == "copy nt" and streams else 2 * n * 4) for m in samples}
        fused = summarize(samples["fused"])["median_s"]
        for method, s in samples.items():
            t = summarize(s)["median_s"]
            per_byte = (fused / moved["fused"]) / (t / moved[method])
            print(
                f"{name:26s} {len(grads):7d} {n * 4 / MiB:8.1f}  {method:14s} {t * 1e3:8.3f} {min(s) * 1e3:8.3f} "
                f"{moved[method] / t / 1e9:6.2f} {t / fused:8.2f}x {per_byte:8.2f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    run(args.threads, args.reps, args.quick)


if __name__ == "__main__":
    main()
