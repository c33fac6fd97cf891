"""The fused flatten/unflatten ops against torch's ways of doing the same round trip (docs/benchmarks.md, "ops").

A round trip packs gradients into a flat bucket times 1/world_size and unpacks it into gradients of the same layout, by
each of :data:`METHOD_DESCRIPTIONS`, in rounds. Layouts: 25 MiB DDP buckets of ResNet-50, GPT-2 small and BERT-base and
synthetic tensor counts; then the 16 (gradient dtype, bucket dtype) pairs.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import ops
from . import models, report, runner, stats
from .models import BUCKET_CAP, MiB

WORLD_SIZE = 8
MODELS = ("resnet50", "gpt2_small", "bert_base")
SYNTH_COUNTS = (1, 2, 64, 128, 160, 448, 1024)
SYNTH_DTYPES = (torch.float32, torch.bfloat16)
SYNTH_TOTAL = BUCKET_CAP // 4  # elements: a 25 MiB float32 bucket
METHOD_LABELS = dict(floor="floor", fused="fused", per_param="per-param", torch_utils="utils.flatten", foreach="foreach_copy")
METHODS = tuple(METHOD_LABELS)
METHOD_DESCRIPTIONS = {
    "floor": "two plain copies of the same bytes: bucket.copy_(src_flat), dst_flat.copy_(bucket)",
    "fused": "fastcoll.ops.flatten_scale(grads, bucket, 1/ws) + fastcoll.ops.unflatten_scale(bucket, grads)",
    "per_param": "torch DDP reducer: torch.mul(grad, 1/ws, out=bucket_view), grad.copy_(bucket_view), per param",
    "torch_utils": "torch._utils._flatten_dense_tensors(grads).div_(ws), copy_ of each _unflatten_dense_tensors view",
    "foreach": "torch._foreach_copy_(bucket_views, grads) + bucket.mul_(1/ws), torch._foreach_copy_(grads, bucket_views)",
}
# ratios of median round trips: the ones every row reports (numerator, denominator), then the targets (+ op, threshold)
RATIOS = {"fused/floor": ("fused", "floor"), "floor/fused": ("floor", "fused"), "per-param/fused": ("per_param", "fused"),
          "torch_utils/fused": ("torch_utils", "fused"), "foreach/fused": ("foreach", "fused")}  # fmt: skip
CPU_TARGETS = {"fused/floor": ("fused", "floor", "le", 1.25), "per-param/fused": ("per_param", "fused", "ge", 1.5)}
GPU_TARGETS = {"floor/fused": ("floor", "fused", "ge", 0.90), "per-param/fused": ("per_param", "fused", "ge", 5.0)}
PAIR_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
PAIR_TARGET = 1.25  # fused/floor for every (gradient dtype, bucket dtype) pair, 1 thread
PAIR_THREADS = 1
#: The 16 ordered (gradient dtype, bucket dtype) pairs: the 4 same-dtype ones first.
PAIRS = [(d, d) for d in PAIR_DTYPES] + [(s, d) for s in PAIR_DTYPES for d in PAIR_DTYPES if s != d]
SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
# torch.testing.assert_close's default (rtol, atol); a pair is checked with its coarser dtype's
TOLERANCES = {torch.float64: (1e-7, 1e-7), torch.float32: (1.3e-6, 1e-5), torch.float16: (1e-3, 1e-5),
              torch.bfloat16: (1.6e-2, 1e-5)}  # fmt: skip
CONFIGS = {  # rounds: at least reps, at most max_reps (until every target of the row resolves)
    "smoke": dict(reps=3, max_reps=3, warmup=1, target_s=0.0005, synth_total=1 << 14, counts=(1, 64)),
    "default": dict(reps=5, max_reps=15, warmup=1, target_s=0.003, synth_total=SYNTH_TOTAL // 4, counts=(1, 64, 448)),
    "full": dict(reps=15, max_reps=30, warmup=3, target_s=0.02, synth_total=SYNTH_TOTAL, counts=SYNTH_COUNTS),
}


@dataclass
class Layout:
    """Tensor shapes packed into one bucket."""

    name: str
    kind: str  # "model" or "synthetic"
    shapes: List[Tuple[int, ...]]
    dtype: torch.dtype = torch.float32
    model: Optional[str] = None
    note: str = ""
    meta: Dict[str, object] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def model_layouts(one_per_model: bool, names: Sequence[str] = MODELS) -> Tuple[List[Layout], List[str]]:
    """The 25 MiB-cap buckets of the models, and a note on every one left out: the first (1 MiB cap), an embedding's far
    beyond the cap, repeats of an identical one and, ``one_per_model``, all but the full one with the most tensors."""
    layouts: List[Layout] = []
    skipped: List[str] = []
    for model in names:
        buckets = models.ddp_buckets(models.model_shapes()[model])
        n, eligible, seen = len(buckets), [], {}
        for b in buckets:
            desc = f"{model} b{b['index']}/{n}: {len(b['shapes'])} tensors, {b['bytes'] / MiB:.1f} MiB"
            if b["cap"] != BUCKET_CAP:
                skipped.append(f"{desc} (the first bucket, 1 MiB cap)")
            elif b["bytes"] > 2 * BUCKET_CAP:
                skipped.append(f"{desc} (an embedding far beyond the 25 MiB cap)")
            elif tuple(b["shapes"]) in seen:
                seen[tuple(b["shapes"])].append(b["index"])
            else:
                seen[tuple(b["shapes"])] = [b["index"]]
                eligible.append(b)
        if one_per_model and eligible:
            best = max([b for b in eligible if b["bytes"] >= BUCKET_CAP] or eligible, key=lambda b: len(b["shapes"]))
            skipped += [f"{model} b{b['index']}/{n} (one bucket per model)" for b in eligible if b is not best]
            eligible = [best]
        for b in eligible:
            same = seen[tuple(b["shapes"])]
            twins = f"; identical to b{', b'.join(map(str, same[1:]))}" if len(same) > 1 else ""
            note = f"bucket {b['index']} of {n}, {len(b['names'])} tensors, {b['bytes'] / MiB:.2f} MiB{twins}"
            meta = {"bucket_index": b["index"], "buckets": n, "params": b["names"], "identical_buckets": same}
            layouts.append(Layout(f"{model} b{b['index']}", "model", list(b["shapes"]), model=model, note=note, meta=meta))
    return layouts, skipped


def synthetic_layouts(counts: Sequence[int], total: int, dtypes: Sequence[torch.dtype] = SYNTH_DTYPES) -> List[Layout]:
    """``count`` equal 1-D tensors of ``total`` elements in all, per count and dtype."""
    return [Layout(f"synth {SHORT[d]} x{c}", "synthetic", equal_split(c, total), d,
                   note=f"{c} equal 1-D tensors, {total:,} elements")
            for d in dtypes for c in counts]  # fmt: skip


def equal_split(count: int, total: int) -> List[Tuple[int, ...]]:
    """``count`` 1-D shapes splitting ``total`` elements as evenly as possible."""
    base, extra = divmod(total, count)
    return [(base + (1 if i < extra else 0),) for i in range(count)]


# The methods
def make_methods(layout: Layout, device: str) -> Dict[str, Tuple[Callable[[], Any], Callable[[], Any]]]:
    """The (pack, unpack) halves of each method's round trip, checked to leave ``grads / ws`` in the destinations (tensors
    apart from the gradients, so every repetition sees the same values)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    gen = torch.Generator().manual_seed(0)
    # drawn in the layout's dtype, one after another: no freed temporaries scattering the gradients in memory
    grads = [torch.randn(s, generator=gen, dtype=layout.dtype).to(device) for s in layout.shapes]
    dests = [torch.empty_like(g) for g in grads]
    bucket = torch.empty(layout.numel, dtype=layout.dtype, device=device)
    views = ops.bucket_views(bucket, grads)
    src = torch.randn(layout.numel, generator=gen, dtype=layout.dtype).to(device)
    dst = torch.empty_like(src)
    s = 1.0 / WORLD_SIZE
    held: List[torch.Tensor] = []  # torch_utils' flat bucket, from its pack to its unpack

    def per_param_pack() -> None:
        for g, v in zip(grads, views):
            torch.mul(g, s, out=v)

    def copy_to_dests(pieces: Sequence[torch.Tensor] = views) -> None:
        for d, v in zip(dests, pieces):
            d.copy_(v)

    halves = {
        "floor": (lambda: bucket.copy_(src), lambda: dst.copy_(bucket)),
        "fused": (lambda: ops.flatten_scale(grads, bucket, s), lambda: ops.unflatten_scale(bucket, dests, 1.0)),
        "per_param": (per_param_pack, copy_to_dests),
        "torch_utils": (lambda: held.__setitem__(slice(None), [_flatten_dense_tensors(grads).div_(WORLD_SIZE)]),
                        lambda: copy_to_dests(_unflatten_dense_tensors(held[0], grads))),
        "foreach": (lambda: (torch._foreach_copy_(views, grads), bucket.mul_(s)), lambda: torch._foreach_copy_(dests, views)),
    }  # fmt: skip

    # the check: expected values first (with one tensor, _flatten_dense_tensors returns a view and div_ scales it in place)
    for name, (pack, unpack) in list(halves.items())[1:]:
        expected = [g * s for g in grads]
        for d in dests:
            d.fill_(float("nan"))
        pack()
        unpack()
        wrong = [i for i, (d, e) in enumerate(zip(dests, expected)) if not torch.equal(d, e)]
        if wrong:
            raise RuntimeError(f"benchmark method {name!r} produced a wrong result for tensor {wrong[0]}")
    return halves


def count_cuda_kernels(fn: Callable[[], object]) -> int:
    """CUDA kernels one call of ``fn`` launches (memcpy/memset excluded)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    return sum(1 for e in prof.events() if e.device_type == cuda and not e.name.startswith(("Memcpy", "Memset")))


def bench_layout(layout: Layout, device: str, threads: Optional[int], cfg: Dict[str, Any], prog: Any) -> Dict[str, Any]:
    """Time every method on ``layout``, rounds until its targets resolve (or the cap); return the row."""
    halves = make_methods(layout, device)
    methods = {name: (lambda p=p, u=u: (p(), u())) for name, (p, u) in halves.items()}
    # the ratio targets of this row (CPU: ResNet-50 buckets; GPU: bandwidth on all models, speedup on ResNet-50)
    goals = dict(CPU_TARGETS if device == "cpu" else GPU_TARGETS) if layout.kind == "model" else {}
    goals = {k: v for k, v in goals.items() if layout.model == "resnet50" or (device == "cuda" and k == "floor/fused")}
    samples = _rounds(methods, device, cfg, goals.values(), prog)
    med = {m: statistics.median(xs) for m, xs in samples.items()}
    targets = {name: stats.ratio_target(samples, a, b, thr, op) for name, (a, b, op, thr) in goals.items()}
    kernels = None
    if device == "cuda":
        kernels = {m: {"pack": count_cuda_kernels(p), "unpack": count_cuda_kernels(u)} for m, (p, u) in halves.items()}
        fused = kernels["fused"]
        ok = fused["pack"] == 1 and fused["unpack"] == 1
        targets["launches"] = {"value": f"{fused['pack']}/{fused['unpack']}", "op": "eq", "threshold": "1/1", "pass": ok,
                               "verdict": stats.MET if ok else stats.MISSED, "ci90": None}  # fmt: skip
    return {
        "layout": layout.name, "kind": layout.kind, "model": layout.model, "note": layout.note, "dtype": str(layout.dtype)[6:],
        "tensors": len(layout.shapes), "numel": layout.numel, "bytes": layout.nbytes, "device": device, "threads": threads,
        "methods": {m: stats.summarize(xs) for m, xs in samples.items()},
        "ratios": {name: stats.ratio(med[a], med[b]) for name, (a, b) in RATIOS.items()},
        "bandwidth_gb_s": {m: 4 * layout.nbytes / t / 1e9 for m, t in med.items() if t},  # read + write, both ways
        "kernels_per_direction": kernels, "targets": targets, **({"bucket": layout.meta} if layout.meta else {}),
    }  # fmt: skip


def _rounds(fns: Dict[str, Callable[[], Any]], device: str, cfg: Dict[str, Any], goals: Any, prog: Any) -> stats.Samples:
    """Rounds of ``fns`` until the ``(a, b, op, threshold)`` ratio targets resolve; advances ``prog`` by every sample."""
    checks = [(stats.median_ratio(a, b), thr, op) for a, b, op, thr in goals]
    samples = runner.measure_interleaved(
        fns, device, cfg["warmup"], cfg["max_reps"], target_s=cfg["target_s"], on_sample=prog.advance,
        stop=lambda s, k: stats.enough_rounds(s, k, cfg["reps"], cfg["max_reps"], checks),
    )  # fmt: skip
    prog.advance(len(fns) * (cfg["max_reps"] - len(next(iter(samples.values())))))  # the rounds not taken
    return samples


# Dtype pairs: mixed-dtype round trips against a floor of plain copies
def bench_pair(layout: Layout, src: torch.dtype, dst: torch.dtype, cfg: Dict[str, Any], prog: Any) -> Dict[str, Any]:
    """The fused round trip from ``src`` gradients through a ``dst`` bucket, against a copy of the same bytes in each."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen, dtype=src) for s in layout.shapes]
    dests = [torch.empty_like(g) for g in grads]
    n = layout.numel
    bucket = torch.empty(n, dtype=dst)
    copies = [(torch.empty(n, dtype=d), torch.randn(n, generator=gen, dtype=d)) for d in (src, dst)]
    scale = 1.0 / WORLD_SIZE
    fns = {"floor": lambda: [a.copy_(b) for a, b in copies],
           "fused": lambda: (ops.flatten_scale(grads, bucket, scale), ops.unflatten_scale(bucket, dests, 1.0))}  # fmt: skip
    # check: the bucket holds (g * scale).to(dst) computed in float32 (float64 with a float64 side), the dests that
    # cast back, within the coarser dtype's tolerance (a kernel may round differently in the last bit)
    bucket.fill_(float("nan"))
    fns["fused"]()
    opmath = torch.float64 if torch.float64 in (src, dst) else torch.float32
    rtol, atol = max(TOLERANCES[src], TOLERANCES[dst])
    packed = torch.cat([(g.to(opmath) * scale).to(dst).reshape(-1) for g in grads])
    got_want = [(bucket, packed), (torch.cat([d.reshape(-1) for d in dests]), packed.to(src))]
    got_want = [(got.double(), want.double()) for got, want in got_want]  # exact in float64: compared there
    checks = {"ok": all(torch.allclose(got, want, rtol=rtol, atol=atol) for got, want in got_want),
              "exact": all(torch.equal(got, want) for got, want in got_want),
              "max_abs_err": max((got - want).abs().max().item() for got, want in got_want),
              "rtol": rtol, "atol": atol}  # fmt: skip
    if not checks["ok"]:
        raise RuntimeError(f"fused round trip {SHORT[src]} -> {SHORT[dst]} produced a wrong result: {checks}")
    samples = _rounds(fns, "cpu", cfg, [("fused", "floor", "le", PAIR_TARGET)], prog)
    t = stats.ratio_target(samples, "fused", "floor", PAIR_TARGET)
    moved = 2 * n * (src.itemsize + dst.itemsize)
    names = [str(d)[6:] for d in (src, dst)]  # "torch.float32" -> "float32"
    return {
        "layout": layout.name, "kind": layout.kind, "model": layout.model, "tensors": len(layout.shapes), "numel": n,
        "src": names[0], "dst": names[1], "pair": "->".join(names), "threads": PAIR_THREADS,
        "bytes_moved": moved, "methods": {m: stats.summarize(xs) for m, xs in samples.items()},
        "ratios": {"fused/floor": t["value"]}, "targets": {"fused/floor": t}, "checks": checks,
        "bandwidth_gb_s": {m: moved / statistics.median(xs) / 1e9 for m, xs in samples.items()},
    }  # fmt: skip


# Output and entry
def print_rows(label: str, rows: List[Dict[str, Any]], device: str) -> None:
    """The table of one setting's layouts."""
    goals, cuda = CPU_TARGETS if device == "cpu" else GPU_TARGETS, device == "cuda"
    columns = ["layout", "tensors", "MiB", *(METHOD_LABELS[m] for m in METHODS), "fused/floor", "per-param/fused", "fused GB/s",
               *(f"{k} ({'≤' if g[2] == 'le' else '≥'}{g[3]})" for k, g in goals.items()),
               *(["launches fused (per-param)"] if cuda else [])]  # fmt: skip
    body = []
    for r in rows:
        times = [report.fmt_time(r["methods"][m]["median_s"]) for m in METHODS]
        line = [r["layout"], r["tensors"], f"{r['bytes'] / MiB:.1f}", *times, report.fmt_ratio(r["ratios"]["fused/floor"]),
                report.fmt_ratio(r["ratios"]["per-param/fused"]), f"{r['bandwidth_gb_s'].get('fused', float('nan')):.1f}",
                *(report.target_cell(r["targets"].get(k)) if k in r["targets"] else "" for k in goals)]  # fmt: skip
        if cuda:
            k = r["kernels_per_direction"]
            line.append(f"{k['fused']['pack']}/{k['fused']['unpack']} ({k['per_param']['pack']}/{k['per_param']['unpack']})")
        body.append(line)
    caption = f"median round trip (pack x 1/{WORLD_SIZE}, unpack); ratios with 90% paired bootstrap intervals; "
    caption += "GB/s counts 4 x bucket bytes\n" + "\n".join(f"{METHOD_LABELS[m]}: {METHOD_DESCRIPTIONS[m]}" for m in METHODS)
    report.table(f"fastcoll ops: {label}", columns, body, caption)


def run(args: Any) -> int:
    """``python -m fastcoll.bench ops``: tables, ``benchmarks/out/ops_<device>.json`` and a chart."""
    device, level = args.device, args.level
    cfg, smoke = CONFIGS[level], level == "smoke"
    if ops.implementation() != "extension":
        report.say("[yellow]fastcoll.bench ops: the C++ extension is not loaded; 'fused' is the pure-PyTorch reference[/yellow]")
    layouts, skipped = model_layouts(level != "full", ("resnet50",) if smoke else MODELS)
    bucket = next(lay for lay in model_layouts(False, ("resnet50",))[0] if lay.meta["bucket_index"] == 2)  # "resnet50 b2"
    if smoke:  # every tensor 64 times smaller
        *layouts, bucket = [replace(lay, name=lay.name + " (x1/64)", shapes=[(max(1, math.prod(s) // 64),) for s in lay.shapes])
                            for lay in [*layouts, bucket]]  # fmt: skip
    layouts += synthetic_layouts(cfg["counts"], cfg["synth_total"])
    settings: List[Optional[int]] = [None] if device == "cuda" else runner.thread_counts(args)[: 1 if smoke else None]
    gpu = f" ({torch.cuda.get_device_name()})" if device == "cuda" and torch.cuda.is_available() else ""
    setting = {t: f"CUDA{gpu}" if device == "cuda" else f"CPU, {t} thread{'s' if t != 1 else ''}" for t in settings}
    synth = Layout("synth x64", "synthetic", equal_split(64, bucket.numel), note=f"64 tensors, as many elements as {bucket.name}")
    pair_layouts = ([bucket] if level != "full" else [bucket, synth]) if device == "cpu" else []
    report.table("DDP buckets benchmarked (reverse parameter order; first cap 1 MiB, then 25 MiB)",
                 ["layout", "tensors", "MiB", "which bucket"],
                 [[lay.name, len(lay.shapes), f"{lay.nbytes / MiB:.2f}", lay.note] for lay in layouts if lay.kind == "model"],
                 "not benchmarked: " + "; ".join(skipped))  # fmt: skip
    results: List[Dict[str, Any]] = []
    pairs: List[Dict[str, Any]] = []
    flush = torch.set_flush_denormal(True)  # the one-tensor torch_utils path scales its source in place
    total = (len(layouts) * len(settings) * len(METHODS) + len(pair_layouts) * 16 * 2) * cfg["max_reps"]
    with report.progress("ops", total) as prog:
        for threads in settings:
            with runner.num_threads(threads or torch.get_num_threads()):
                for layout in layouts:
                    prog.describe(f"ops, {setting[threads]}: {layout.name}")
                    results.append(bench_layout(layout, device, threads, cfg, prog))
            prog.row(setting[threads], len(settings) + bool(pair_layouts))
            print_rows(setting[threads], results[-len(layouts) :], device)
        with runner.num_threads(PAIR_THREADS):
            for src, dst in PAIRS if pair_layouts else []:
                for layout in pair_layouts:
                    prog.describe(f"ops, dtype pairs: {SHORT[src]} → {SHORT[dst]}, {layout.name}")
                    pairs.append(bench_pair(layout, src, dst, cfg, prog))
        if pairs:
            prog.row("dtype pairs", len(settings) + 1)
    torch.set_flush_denormal(False) if flush else None
    if pairs:  # their table: a row per pair, three columns per layout
        by_pair: Dict[str, List[str]] = {}
        for r in pairs:
            line = by_pair.setdefault(r["pair"], [" → ".join(SHORT[getattr(torch, r[k])] for k in ("src", "dst"))])
            line += [report.fmt_time(r["methods"][m]["median_s"]) for m in ("floor", "fused")]
            line.append(report.target_cell(r["targets"]["fused/floor"]))
        columns = [f"{lay.kind} {c}" for lay in pair_layouts for c in ("floor", "fused", f"fused/floor (≤{PAIR_TARGET}x)")]
        caption = (f"median round trip at {PAIR_THREADS} thread: fused = flatten_scale into a bucket of the second dtype + "
                   "unflatten_scale back; floor = a plain copy of the same elements in each dtype")  # fmt: skip
        caption += "".join(f"\n{lay.kind}: {lay.name}, {len(lay.shapes)} tensors, {lay.numel:,} elements" for lay in pair_layouts)
        report.table(f"fastcoll ops: dtype pairs, CPU, {PAIR_THREADS} thread", ["grads → bucket", *columns],
                     list(by_pair.values()), caption)  # fmt: skip
    targets = [(f"{setting[r['threads']]}, {r['layout']}: {k}", t) for r in results for k, t in r["targets"].items()]
    targets += [(f"dtype pair {r['pair']}, {r['layout']}", r["targets"]["fused/floor"]) for r in pairs]
    config = {
        "device": device, "threads": settings, "level": level, "quick": level != "full", "smoke": smoke, **cfg,
        "world_size": WORLD_SIZE, "first_bucket_cap": models.FIRST_BUCKET_CAP, "bucket_cap": BUCKET_CAP,
        "synthetic_total_elements": cfg["synth_total"], "methods": METHOD_DESCRIPTIONS, "not_benchmarked": skipped,
        "dtype_pairs": {"dtypes": [str(d)[6:] for d in PAIR_DTYPES], "threads": PAIR_THREADS,
                        "layouts": {lay.name: lay.note for lay in pair_layouts}, "target": {"fused/floor": ["le", PAIR_TARGET]}},
    }  # fmt: skip
    payload = {"benchmark": "ops", "config": config, "results": results, "dtype_pairs": pairs}
    report.conclude("ops", report.json_path(args, f"ops_{device}"), payload, targets)
    return 0
