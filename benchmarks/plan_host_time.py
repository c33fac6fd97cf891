"""Host time per call of a bucket's pack + unpack of many tiny tensors, with and without a BucketPlan.

    python benchmarks/plan_host_time.py [--tensors 1000] [--elements N] [--reps 21] [--device cpu|cuda] [--json PATH]

A bucket of ``--tensors`` float32 tensors of 1 to 64 elements (a few KiB in
all: the copy itself is negligible, what is left is the host's work per
tensor; ``--elements N``: N elements each instead, e.g. 448 x 14628 for a
25 MiB bucket on a GPU), packed into a float32 buffer by 0.5 (``ops.flatten_scale``) and
written back by 2 (``ops.unflatten_scale``), timed side by side, round-robin
(round k of every method before round k + 1):

* unplanned: the calls as a bucket made them before plans existed;
* planned:   the same calls with the bucket's ``ops.BucketPlan`` (built once, before timing);
* planned, no copy: planned calls on as many zero-element tensors: the host work a planned call does per
  tensor besides its copy (checking the call against the plan), which on CUDA is all of it (the chunk
  table is resident; the copies run on the device).

Each sample is the host time per pack + unpack over back-to-back calls (on
CUDA the launches are not waited for: host time, the bound the issue is
about), by default the calling thread's CPU time (``--clock cpu``,
time.thread_time: on a shared machine wall time mostly measures the other
processes; ``--clock wall`` for perf_counter). Reported: median and quartiles per method, per tensor and direction
(time / (2 x tensors)), and the planned / unplanned ratio of medians with a
90 % paired bootstrap interval. One thread (OMP_NUM_THREADS=1 is advised).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a clean clone

import torch  # noqa: E402

from fastcoll import ops  # noqa: E402
from fastcoll.bench.report import cpu_model  # noqa: E402
from fastcoll.bench.runner import synchronize  # noqa: E402
from fastcoll.bench.stats import bootstrap_ci, rotated, summarize  # noqa: E402

CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}


def host_time(fn: Callable[[], object], inner: int, device: str, clock: Callable[[], float]) -> float:
    """Host seconds per call over ``inner`` back-to-back calls (the device drained before, not after)."""
    synchronize(device)
    t0 = clock()
    for _ in range(inner):
        fn()
    return (clock() - t0) / inner


def bucket(n: int, elements: int, device: str) -> Dict[str, object]:
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(elements or 1 + (7 * k) % 64, generator=g).to(device) for k in range(n)]
    flat = torch.empty(sum(t.numel() for t in grads), device=device)
    return {"grads": grads, "flat": flat, "plan": ops.BucketPlan()}


def device_time(args: argparse.Namespace) -> Dict[str, object]:
    """CUDA: device time of a planned pack + unpack against the copy floor, side by side.

    The floor is two plain device copies of the bucket's bytes (into the flat buffer and back) between
    contiguous buffers. Several bucket sets, each with its own plan, rotate past the L2 cache; CUDA events
    around ``--inner`` calls; round-robin samples; median and 90 % paired bootstrap interval of the ratio.
    """
    numel = sum(1 + (7 * k) % 64 for k in range(args.tensors)) if not args.elements else args.elements * args.tensors
    sets = max(2, -(-240 * 2**20 // (8 * numel)))
    buckets = [bucket(args.tensors, args.elements, "cuda") for _ in range(sets)]
    contig = [(torch.randn(numel, device="cuda"), torch.empty(numel, device="cuda")) for _ in range(sets)]
    state = {"i": 0}

    def planned() -> None:
        b = buckets[state["i"] % sets]
        state["i"] += 1
        ops.flatten_scale(b["grads"], b["flat"], 0.5, plan=b["plan"])
        ops.unflatten_scale(b["flat"], b["grads"], 2.0, plan=b["plan"])

    def floor() -> None:
        src, flat = contig[state["i"] % sets]
        state["i"] += 1
        flat.copy_(src)
        src.copy_(flat)

    fns = {"planned": planned, "floor": floor}
    for fn in fns.values():
        for _ in range(2 * sets):
            fn()
    samples: Dict[str, List[float]] = {name: [] for name in fns}
    for k in range(args.reps):
        for name in rotated(list(fns), k):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.inner):
                fns[name]()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) * 1e-3 / args.inner)
    b = buckets[0]
    back = [g.clone() for g in b["grads"]]
    b["flat"].fill_(float("nan"))
    ops.flatten_scale(b["grads"], b["flat"], 0.5, plan=b["plan"])
    correct = torch.equal(b["flat"], torch.cat(back) * 0.5)

    def ratio(s: Dict[str, List[float]]) -> float:
        return summarize(s["planned"])["median_s"] / summarize(s["floor"])["median_s"]

    ci = bootstrap_ci(ratio, samples, paired=True)
    return {
        "sets": sets,
        "bytes": 4 * numel,
        "correct": correct,
        "planned_us": summarize(samples["planned"])["median_s"] * 1e6,
        "floor_us": summarize(samples["floor"])["median_s"] * 1e6,
        "planned_over_floor": ratio(samples),
        "planned_over_floor_ci90": list(ci) if ci else None,
    }


def run(args: argparse.Namespace) -> Dict[str, object]:
    b = bucket(args.tensors, args.elements, args.device)
    grads, flat, plan = b["grads"], b["flat"], b["plan"]

    def unplanned() -> None:
        ops.flatten_scale(grads, flat, 0.5)
        ops.unflatten_scale(flat, grads, 2.0)

    def planned() -> None:
        ops.flatten_scale(grads, flat, 0.5, plan=plan)
        ops.unflatten_scale(flat, grads, 2.0, plan=plan)

    empty = [torch.empty(0, device=args.device) for _ in grads]
    empty_flat, empty_plan = torch.empty(0, device=args.device), ops.BucketPlan()

    def planned_no_copy() -> None:
        ops.flatten_scale(empty, empty_flat, 0.5, plan=empty_plan)
        ops.unflatten_scale(empty_flat, empty, 2.0, plan=empty_plan)

    fns = {"unplanned": unplanned, "planned": planned, "planned, no copy": planned_no_copy}
    for fn in fns.values():
        for _ in range(20):
            fn()
    before = plan.stats()
    inner = args.inner
    samples: Dict[str, List[float]] = {name: [] for name in fns}
    for k in range(args.reps):
        for name in rotated(list(fns), k):
            samples[name].append(host_time(fns[name], inner, args.device, CLOCKS[args.clock]))
    synchronize(args.device)
    after = plan.stats()
    per = 2 * args.tensors

    def ratio(s: Dict[str, List[float]]) -> float:
        return summarize(s["planned"])["median_s"] / summarize(s["unplanned"])["median_s"]

    rows = {}
    for name, xs in samples.items():
        s = summarize(xs)
        rows[name] = {
            "per_call_us": s["median_s"] * 1e6,
            "per_call_q1_us": s["q1_s"] * 1e6,
            "per_call_q3_us": s["q3_s"] * 1e6,
            "per_tensor_direction_ns": s["median_s"] / per * 1e9,
            "per_tensor_direction_q1_ns": s["q1_s"] / per * 1e9,
            "per_tensor_direction_q3_ns": s["q3_s"] / per * 1e9,
        }
    ci = bootstrap_ci(ratio, samples, paired=True)
    return {
        "device": args.device,
        "cpu": cpu_model(),
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "implementation": ops.implementation(),
        "plan_active": plan.active,
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "tensors": args.tensors,
        "elements": sum(t.numel() for t in grads),
        "reps": args.reps,
        "inner": inner,
        "methods": rows,
        "planned_over_unplanned": ratio(samples),
        "planned_over_unplanned_ci90": list(ci) if ci else None,
        # the timed planned calls rebuilt nothing: every one reused the plan
        "plan_builds_while_timed": after["builds"] - before["builds"],
        "plan_reuses_while_timed": after["reuses"] - before["reuses"],
        "samples_s": samples,
        "device_time": device_time(args) if args.device == "cuda" else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--elements", type=int, default=0, help="elements per tensor (default: 1 to 64)")
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--inner", type=int, default=200, help="calls per sample")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--clock", default="cpu", choices=sorted(CLOCKS), help="thread CPU time or wall time")
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args()
    result = run(args)
    m = result["methods"]
    print(
        f"{args.tensors} float32 tensors ({result['elements']} elements), pack + unpack, {args.device} "
        f"({result['gpu'] or result['cpu']}), {result['threads']} thread(s), {args.reps} samples x {args.inner} calls, "
        f"{args.clock} time"
    )
    print(f"{'method':<17} {'per call (us)':>24} {'per tensor and direction (ns)':>34}")
    for name, r in m.items():
        call = f"{r['per_call_us']:.1f} [{r['per_call_q1_us']:.1f}, {r['per_call_q3_us']:.1f}]"
        q1, q3 = r["per_tensor_direction_q1_ns"], r["per_tensor_direction_q3_ns"]
        each = f"{r['per_tensor_direction_ns']:.1f} [{q1:.1f}, {q3:.1f}]"
        print(f"{name:<17} {call:>24} {each:>34}")
    ci = result["planned_over_unplanned_ci90"]
    ci_text = f" (90% CI {ci[0]:.3f}-{ci[1]:.3f})" if ci else ""
    print(
        f"planned / unplanned: {result['planned_over_unplanned']:.3f}x{ci_text}; medians [quartiles]; "
        f"plan rebuilds while timed: {result['plan_builds_while_timed']}, reuses: {result['plan_reuses_while_timed']}"
    )
    d = result["device_time"]
    if d:
        ci = d["planned_over_floor_ci90"]
        ci_text = f" (90% CI {ci[0]:.3f}-{ci[1]:.3f})" if ci else ""
        print(
            f"device time, planned pack + unpack {d['planned_us']:.1f} us vs copy floor {d['floor_us']:.1f} us "
            f"({d['bytes'] / 2**20:.1f} MiB, {d['sets']} sets rotated): {d['planned_over_floor']:.3f}x{ci_text}"
            f"{'' if d['correct'] else '  WRONG RESULT'}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
