"""CPU speed of fastcoll.ops.flatten_accumulate against the obvious PyTorch equivalents.

    python benchmarks/bench_accumulate.py [--threads N] [--reps R] [--quick]

For each bucket (16-bit or float32 gradients added into a float32 main-gradient
buffer by 1/8, as in 8 micro-batches), round-robin and interleaved
(fastcoll.bench.common.measure_interleaved), median of R samples:

* fused:          ops.flatten_accumulate(grads, main, 1/8), one call;
* add_ mixed:     view.add_(grad, alpha=1/8) per tensor (views of main; torch promotes in the kernel);
* add_ .float():  view.add_(grad.float(), alpha=1/8) per tensor (a temporary per tensor);
* _foreach_add_:  torch._foreach_add_(views, grads, alpha=1/8);
* copy (floor):   ops.flatten_scale(grads, main, 1/8), the pack of the same bucket, for the speed per
                  byte of a copy (it writes large buckets with non-temporal stores).

Bytes moved per element: the gradient read, and main read and written (accumulate),
or main written (copy; a cached store also reads the line first, a non-temporal one does not).
GB/s below counts those bytes: src + 2 * dst for the accumulations, src + dst for the copy.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a clean clone

import torch  # noqa: E402

from fastcoll import ops  # noqa: E402
from fastcoll.bench.common import MiB, measure_interleaved, model_shapes, num_threads, summarize  # noqa: E402


def buckets(quick: bool):
    """(name, shapes, gradient dtype): a GPT-2 bucket of about 25 MiB of float32, 1024 small tensors."""
    gpt2 = model_shapes()["gpt2"]
    shapes, total = [], 0
    for _, shape in gpt2:
        n = 1
        for d in shape:
            n *= d
        if total + n > (25 * MiB) // 4 and shapes:
            break
        shapes.append(shape)
        total += n
    small = [(64, 48)] * 1024  # 3M elements, 12 MiB of float32
    out = [
        ("gpt2 25MiB bf16->f32", shapes, torch.bfloat16),
        ("gpt2 25MiB f32->f32", shapes, torch.float32),
        ("1024 x (64,48) bf16->f32", small, torch.bfloat16),
    ]
    if not quick:
        out.append(("gpt2 25MiB f16->f32", shapes, torch.float16))
    return out


def run(threads: int, reps: int, quick: bool) -> None:
    scale = 1 / 8
    print(f"torch {torch.__version__}, {threads} thread(s), {ops.implementation()}, median of {reps} samples")
    print(f"{'bucket':28s} {'tensors':>7s} {'MiB main':>8s}  {'method':14s} {'ms':>8s} {'GB/s':>6s} {'vs fused':>8s}")
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
            "copy (floor)": lambda: ops.flatten_scale(grads, main, scale),
        }
        with num_threads(threads):
            samples = measure_interleaved(fns, reps=reps, warmup=2)
        src_bytes = n * grads[0].element_size()
        fused = summarize(samples["fused"])["median"]
        for method, s in samples.items():
            t = summarize(s)["median"]
            moved = src_bytes + (n * 4 if method == "copy (floor)" else 2 * n * 4)
            print(
                f"{name:28s} {len(grads):7d} {n * 4 / MiB:8.1f}  {method:14s} {t * 1e3:8.3f} "
                f"{moved / t / 1e9:6.2f} {t / fused:7.2f}x"
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
