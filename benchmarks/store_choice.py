"""Streaming against cached stores on this machine, and whether fastcoll's automatic choice took the faster.

For every bucket of the ops benchmark (fastcoll/bench/ops.py: the 25 MiB DDP
buckets of ResNet-50, GPT-2 small and BERT-base, and the synthetic buckets of
1 to 1024 tensors in float32 and bfloat16), at 1 intra-op thread and at all
the CPUs this process may use, one round trip (``flatten_scale`` x 1/8 into
the bucket, ``unflatten_scale`` back into separate tensors) is timed with the
CPU kernels' non-temporal stores forced on (threshold 0) and forced off
(threshold never reached), the two interleaved sample by sample in one run.
Before timing, both kinds are checked to give the same bits, and those to
match a float64 reference.

Per bucket it prints the median of each, the ratio stream/cached with its 90%
paired bootstrap interval (rounds resampled), and a verdict: which kind the
automatic choice (``fastcoll.build_info()["cpu_stream_choice"]``, fastcoll/ops/stores.py)
takes for this bucket, and whether that is within 5% of the faster: "met"
when the interval of auto/other lies below 1.05, "MISSED" when it lies above,
"unresolved" when it straddles 1.05 (the box was too noisy to say).

Not part of the CLI. Run from the repository root::

    PYTHONPATH=$PWD python benchmarks/store_choice.py [--reps 101] [--threads 1] [--only resnet50] [--sweep] [--ddp 40]

``--sweep`` adds buckets of 1/32 to 1x the usable last-level cache (where the
two kinds cross); ``--ddp N`` adds N steps per kind of fastcoll.DDP on
8 layers of 1024x1024 over 2 gloo ranks, the kinds alternating step by step.

Writes benchmarks/out/store_choice.json (``--json PATH`` elsewhere).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

import fastcoll
from fastcoll import _knobs
from fastcoll.bench import ops as bench_ops
from fastcoll.bench import report, runner, stats
from fastcoll.ops import loader, stores


class common:  # noqa: N801 (the benchmark framework's pieces this script uses, under one name)
    bootstrap_ci = staticmethod(stats.bootstrap_ci)
    summarize = staticmethod(stats.summarize)
    fmt_time = staticmethod(report.fmt_time)
    machine_info = staticmethod(report.machine_info)
    repo_root = staticmethod(report.repo_root)
    render_table = staticmethod(report.table)
    set_malloc = staticmethod(runner.set_malloc)
    measure_interleaved = staticmethod(runner.measure_interleaved)
    num_threads = staticmethod(runner.num_threads)
    thread_counts = staticmethod(runner.thread_counts)

    @staticmethod
    @contextlib.contextmanager
    def rank_process_group(rank: int, world_size: int, store_path: str, threads: int) -> Iterator[None]:
        """Inside a spawned rank: its threads set, the gloo group joined over a FileStore, torn down after."""
        torch.set_num_threads(threads)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        try:
            yield
        finally:
            dist.destroy_process_group()


class Case(NamedTuple):
    """One bucket's round trip: the gradients packed, the tensors unpacked into, the bucket, the scale."""

    grads: List[torch.Tensor]
    dests: List[torch.Tensor]
    bucket: torch.Tensor
    scale: float


def make_case(layout: bench_ops.Layout, device: str, seed: int = 0) -> Case:
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(s, generator=gen, dtype=layout.dtype).to(device) for s in layout.shapes]
    bucket = torch.empty(layout.numel, dtype=layout.dtype, device=device)
    return Case(grads, [torch.empty_like(g) for g in grads], bucket, 1.0 / 8)


MiB = 1 << 20
TARGET = 1.05  # the automatic choice within 5% of the faster kind
KINDS = ("stream", "cached")
THRESHOLDS = {"stream": 0, "cached": _knobs.STREAM_NEVER}


def lscpu() -> Dict[str, str]:
    """lscpu's vendor, model and cache lines (empty where lscpu is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    keep = ("Vendor ID", "Model name", "CPU family", "Model", "Hypervisor vendor", "CPU(s)", "L2 cache", "L3 cache")
    info = {}
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in keep:
            info[key.strip()] = value.strip()
    return info


SWEEP_SHARES = (0.03125, 0.0625, 0.125, 0.25, 0.3, 0.36, 0.45, 0.55, 0.75, 1.0)


def sweep_layouts(llc_bytes: int, count: int = 64) -> List[bench_ops.Layout]:
    """Buckets of ``count`` float32 tensors writing SWEEP_SHARES of ``llc_bytes``: where the two kinds cross."""
    out = []
    for share in SWEEP_SHARES:
        numel = int(llc_bytes * share) // 4
        out.append(
            bench_ops.Layout(
                name=f"sweep {share:g} LLC",
                kind="synthetic",
                shapes=bench_ops.equal_split(count, numel),
                dtype=torch.float32,
                note=f"{count} float32 tensors, {share:g} x the usable last-level cache",
            )
        )
    return out


def round_trip(case: Case, threshold: int) -> Callable[[], None]:
    """One pack + unpack with the streaming threshold set to ``threshold`` (a call each: noise-free next to ms)."""
    ext = loader._C

    def run() -> None:
        ext._set_cpu_stream_min_bytes(threshold)
        fastcoll.ops.flatten_scale(case.grads, case.bucket, case.scale)
        fastcoll.ops.unflatten_scale(case.bucket, case.dests, 1.0)

    return run


def check_identical(case: Case, fns: Dict[str, Callable[[], None]]) -> None:
    """Both kinds leave the same bits in the bucket and the unpacked tensors, equal to the float64 reference."""
    results = {}
    for kind, fn in fns.items():
        case.bucket.fill_(float("nan"))
        for d in case.dests:
            d.fill_(float("nan"))
        fn()
        results[kind] = (case.bucket.clone(), [d.clone() for d in case.dests])
    expected = torch.cat([(g.double() * case.scale).flatten() for g in case.grads]).to(case.bucket.dtype)
    for kind, (bucket, dests) in results.items():
        if not torch.equal(bucket, expected):
            raise RuntimeError(f"{kind} stores: the bucket differs from the float64 reference")
        for i, (d, ref) in enumerate(zip(dests, results["cached"][1])):
            if not torch.equal(d, ref):
                raise RuntimeError(f"{kind} stores: unpacked tensor {i} differs from the cached stores' result")


def ratio_ci(samples: Dict[str, List[float]], num: str, den: str) -> Tuple[float, Tuple[float, float]]:
    """Median of ``num`` over median of ``den``, with its 90% paired bootstrap interval."""

    def stat(s: Dict[str, List[float]]) -> float:
        return float(torch.tensor(s[num]).median()) / float(torch.tensor(s[den]).median())

    ci = common.bootstrap_ci(stat, {num: samples[num], den: samples[den]}, paired=True, resamples=1000)
    assert ci is not None
    return stat(samples), ci


def verdict(ci: Tuple[float, float]) -> str:
    """The verdict on auto/other <= TARGET: "met", "MISSED" or "unresolved"."""
    if ci[1] <= TARGET:
        return "met"
    if ci[0] > TARGET:
        return "MISSED"
    return "unresolved"


def bench_bucket(layout: bench_ops.Layout, threads: int, threshold: int, reps: int, target_s: float) -> Dict[str, object]:
    """Time both store kinds on one bucket at ``threads``; the row of the table."""
    case = make_case(layout, "cpu")
    fns = {kind: round_trip(case, THRESHOLDS[kind]) for kind in KINDS}
    try:
        check_identical(case, fns)
        with common.num_threads(threads):
            samples = common.measure_interleaved(fns, "cpu", warmup=2, reps=reps, target_s=target_s)
    finally:
        loader._C._set_cpu_stream_min_bytes(threshold)
    auto = "stream" if layout.nbytes >= threshold else "cached"  # pack and unpack both write layout.nbytes
    other = "cached" if auto == "stream" else "stream"
    med = {k: common.summarize(xs)["median_s"] for k, xs in samples.items()}
    s_over_c, s_ci = ratio_ci(samples, "stream", "cached")
    a_over_o, a_ci = ratio_ci(samples, auto, other)
    faster = "stream" if s_ci[1] < 1.0 else "cached" if s_ci[0] > 1.0 else "tie"
    return {
        "layout": layout.name,
        "dtype": str(layout.dtype).replace("torch.", ""),
        "tensors": len(layout.shapes),
        "bytes": layout.nbytes,
        "threads": threads,
        "median_s": med,
        "samples_s": samples,
        "stream/cached": s_over_c,
        "stream/cached_ci90": s_ci,
        "faster": faster,
        "auto": auto,
        "auto/other": a_over_o,
        "auto/other_ci90": a_ci,
        "verdict": verdict(a_ci),
    }


DDP_LAYERS, DDP_WIDTH, DDP_BATCH = 8, 1024, 32


def _ddp_rank(rank: int, world: int, store_path: str, steps: int, out_path: str) -> None:
    """One gloo rank: fastcoll.DDP steps of 8 layers of 1024x1024, alternating stream and cached stores step by step."""
    torch.manual_seed(0)
    common.set_malloc("keep")  # no page faults from the gradients freed each step (as the parent does)
    with common.rank_process_group(rank, world, store_path, threads=1):
        model = torch.nn.Sequential(*[torch.nn.Linear(DDP_WIDTH, DDP_WIDTH, bias=False) for _ in range(DDP_LAYERS)])
        ddp = fastcoll.DDP(model)
        x = torch.randn(DDP_BATCH, DDP_WIDTH)
        times: Dict[str, List[float]] = {k: [] for k in KINDS}
        for step in range(steps + 4):
            kind = KINDS[step % 2]  # both ranks alternate in the same order
            loader._C._set_cpu_stream_min_bytes(THRESHOLDS[kind])
            torch.distributed.barrier()
            t0 = time.perf_counter()
            ddp(x).square().mean().backward()
            for p in model.parameters():
                p.grad = None
            if step >= 4:
                times[kind].append(time.perf_counter() - t0)
        if rank == 0:
            Path(out_path).write_text(json.dumps(times))


def ddp_steps(steps: int) -> Dict[str, object]:
    """The DDP step comparison on 2 gloo ranks (rank 0's step times), with the automatic choice for its buckets."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.start_processes(_ddp_rank, args=(2, os.path.join(tmp, "store"), steps, out), nprocs=2, start_method="spawn")
        samples = json.loads(Path(out).read_text())
    ratio, ci = ratio_ci(samples, "stream", "cached")
    med = {k: common.summarize(xs)["median_s"] for k, xs in samples.items()}
    return {"median_s": med, "stream/cached": ratio, "stream/cached_ci90": ci, "steps": steps}


def print_rows(rows: List[Dict[str, object]], threshold: int) -> None:
    columns = ["layout", "thr", "tensors", "MiB", "stream", "cached", "stream/cached [90%]", "faster", "auto"]
    columns += ["auto/other", "<=1.05x"]
    table = []
    for r in rows:
        lo, hi = r["stream/cached_ci90"]
        alo, ahi = r["auto/other_ci90"]
        table.append(
            [
                r["layout"],
                str(r["threads"]),
                str(r["tensors"]),
                f"{r['bytes'] / MiB:.1f}",
                common.fmt_time(r["median_s"]["stream"]),
                common.fmt_time(r["median_s"]["cached"]),
                f"{r['stream/cached']:.3f} [{lo:.3f}, {hi:.3f}]",
                r["faster"],
                r["auto"],
                f"{r['auto/other']:.3f} [{alo:.3f}, {ahi:.3f}]",
                r["verdict"],
            ]
        )
    common.render_table(
        "streaming vs cached stores: pack x 1/8 + unpack, medians",
        columns,
        table,
        caption=(
            f"auto streams calls writing >= {threshold / MiB:g} MiB; faster: the 90% interval of stream/cached "
            "excludes 1 (else tie); <=1.05x: the interval of auto/other below 1.05 (met), above (MISSED), across (unresolved)"
        ),
    )


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # many short samples: on a shared machine a sample that a preemption hits is an outlier the median drops
    parser.add_argument("--reps", type=int, default=101, help="samples per kind (interleaved rounds)")
    parser.add_argument("--target-ms", type=float, default=1.0, help="length of one sample (one call at least)")
    parser.add_argument("--threads", default=None, help="1, N or all (default: 1 and all)")
    parser.add_argument("--only", default="", help="only layouts whose name contains this")
    parser.add_argument("--ddp", type=int, default=0, help="also N DDP steps per kind: 8 x 1024x1024 on 2 gloo ranks")
    parser.add_argument("--sweep", action="store_true", help="also 64-tensor float32 buckets of 1/8 to 1x the usable LLC")
    parser.add_argument("--json", default=None, help="where to write the JSON (default benchmarks/out/store_choice.json)")
    args = parser.parse_args(argv)
    if loader._C is None:
        raise SystemExit(f"store_choice: the compiled extension is not loaded ({loader.FALLBACK_REASON})")
    choice = stores.current()
    assert choice is not None
    common.set_malloc("keep")
    llc, llc_how = stores.usable_llc()
    machine = {"lscpu": lscpu(), "usable_llc_bytes": llc, "usable_llc": llc_how, **common.machine_info("cpu")}
    print(f"machine: {machine['lscpu'] or platform.processor()}")
    print(f"usable last-level cache: {llc_how}")
    print(f"automatic choice: {choice.rule}: {choice.reason}")
    layouts, _ = bench_ops.model_layouts(one_per_model=False)
    layouts += bench_ops.synthetic_layouts(counts=(1, 64, 448), total=25 * 2**18)
    if args.sweep:
        layouts += sweep_layouts(llc or stores.FALLBACK_MIN_BYTES * 2)
    layouts = [lay for lay in layouts if args.only in lay.name]
    rows = []
    start = time.perf_counter()
    for threads in common.thread_counts(args):
        for layout in layouts:
            rows.append(bench_bucket(layout, threads, choice.min_bytes, args.reps, args.target_ms / 1e3))
            r = rows[-1]
            print(
                f"  {r['layout']:<18} {threads} thr: stream/cached {r['stream/cached']:.3f} "
                f"[{r['stream/cached_ci90'][0]:.3f}, {r['stream/cached_ci90'][1]:.3f}], auto={r['auto']} {r['verdict']}",
                flush=True,
            )
    if rows:
        print_rows(rows, choice.min_bytes)
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("met", "MISSED", "unresolved")}
    print(f"verdicts: {counts} over {len(rows)} rows in {time.perf_counter() - start:.0f} s")
    ddp = None
    if args.ddp:
        ddp = ddp_steps(args.ddp)
        lo, hi = ddp["stream/cached_ci90"]
        print(
            f"DDP step, {DDP_LAYERS} x {DDP_WIDTH}x{DDP_WIDTH}, 2 gloo ranks, 1 thread each: stream "
            f"{common.fmt_time(ddp['median_s']['stream'])}, cached {common.fmt_time(ddp['median_s']['cached'])}, "
            f"stream/cached {ddp['stream/cached']:.3f} [{lo:.3f}, {hi:.3f}]"
        )
    path = Path(args.json) if args.json else common.repo_root() / "benchmarks" / "out" / "store_choice.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "machine": machine,
        "choice": {"min_bytes": choice.min_bytes, "rule": choice.rule, "reason": choice.reason},
        "reps": args.reps,
        "environment": {k: v for k, v in os.environ.items() if k.startswith(("FASTCOLL_", "OMP_"))},
        "rows": rows,
        "verdicts": counts,
        "ddp": ddp,
    }
    path.write_text(json.dumps(payload, indent=1, default=str))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
