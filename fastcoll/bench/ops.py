"""Benchmark of the fused ops against what DDP implementations do today.

One "round trip" is the per-byte work around an all-reduce: pack the gradients
into a flat bucket multiplied by 1/world_size, then unpack the (here: not
reduced) bucket into the gradients. Methods, timed side by side in one run:

* ``fused``: ``fastcoll.ops.flatten_scale`` + ``fastcoll.ops.unflatten_scale``.
* ``per_param``: torch DDP's reducer: ``torch.mul(grad, 1/ws, out=bucket_view)``
  per parameter, then ``grad.copy_(bucket_view)`` per parameter.
* ``torch_utils``: ``torch._utils._flatten_dense_tensors`` (a cat into a new
  buffer) + ``div_(ws)``, then ``copy_`` of each ``_unflatten_dense_tensors`` view.
* ``foreach``: ``torch._foreach_copy_`` into the bucket views + ``bucket.mul_``,
  then ``torch._foreach_copy_`` back.
* ``floor``: two plain copies of the same bytes (``bucket.copy_(src_flat)`` and
  ``dst_flat.copy_(bucket)``): what any pack+unpack costs at best.

The gradients the round trip unpacks into are separate tensors with the same
layout as the ones it packs from, so every repetition sees the same values
(unpacking into the sources would shrink them by 1/world_size per repetition
into denormals, which are slow on CPUs). Every method is checked to produce
the same result before it is timed.

Layouts: the 25 MiB DDP buckets of ResNet-50, GPT-2 small and BERT-base
(``fastcoll/bench/model_shapes.json``; buckets formed in reverse parameter order,
the first with a 1 MiB cap and the rest with 25 MiB caps, each closing once its
size reaches its cap, as torch DDP does when it rebuilds buckets in backward
order), plus synthetic sweeps over the tensor count at a fixed total size, in
float32 and bfloat16.

Dtype pairs (CPU, 1 intra-op thread; issue 11's target: every pair within
1.25x of the floor): for each of the 16 ordered (gradient dtype, bucket dtype)
pairs of float32, bfloat16, float16 and float64, the ``fused`` round trip
packs gradients of the first dtype into a bucket of the second and unpacks
into gradients of the first; its ``floor`` is a plain copy of n elements in
each dtype (the same bytes read and written). Layouts: ResNet-50's bucket
``resnet50 b2`` and 64 equal tensors of as many elements (``--quick``: the
bucket only). Each pair's result is checked against torch
(``(g.to(opmath) * scale).to(dst)``, and that cast back) within the coarser
dtype's tolerance before it is timed; the JSON's ``dtype_pairs`` has a row per
pair and layout, with its ``checks``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import common
from .common import MiB

WORLD_SIZE = 8
FIRST_BUCKET_CAP = 1 * MiB
BUCKET_CAP = 25 * MiB
MODELS = ("resnet50", "gpt2_small", "bert_base")
SYNTH_COUNTS = (1, 2, 64, 128, 160, 448, 1024)
SYNTH_DTYPES = (torch.float32, torch.bfloat16)
SYNTH_TOTAL = BUCKET_CAP // 4  # elements: a 25 MiB float32 bucket (12.5 MiB in bfloat16)

METHODS = ("floor", "fused", "per_param", "torch_utils", "foreach")
METHOD_LABELS = {
    "floor": "floor",
    "fused": "fused",
    "per_param": "per-param",
    "torch_utils": "utils.flatten",
    "foreach": "foreach_copy",
}
METHOD_DESCRIPTIONS = {
    "floor": "two plain copies of the same bytes: bucket.copy_(src_flat), dst_flat.copy_(bucket)",
    "fused": "fastcoll.ops.flatten_scale(grads, bucket, 1/ws) + fastcoll.ops.unflatten_scale(bucket, grads)",
    "per_param": "torch DDP reducer: torch.mul(grad, 1/ws, out=bucket_view) per param, grad.copy_(bucket_view) per param",
    "torch_utils": "torch._utils._flatten_dense_tensors(grads).div_(ws), copy_ of each _unflatten_dense_tensors view",
    "foreach": "torch._foreach_copy_(bucket_views, grads) + bucket.mul_(1/ws), torch._foreach_copy_(grads, bucket_views)",
}

# The targets, as (ratio, threshold); "le" means ratio <= threshold passes.
CPU_TARGETS = {"fused/floor": ("le", 1.25), "per-param/fused": ("ge", 1.5)}  # ResNet-50 buckets
GPU_TARGETS = {"floor/fused": ("ge", 0.90), "per-param/fused": ("ge", 5.0)}  # BW: all models; speedup: ResNet-50

# Dtype pairs (issue 11): every (gradient dtype, bucket dtype) pair within 1.25x of the floor at 1 thread.
PAIR_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
PAIR_MODEL_BUCKET = ("resnet50", 2)  # the main table's "resnet50 b2"
PAIR_SYNTH_COUNT = 64
PAIR_THREADS = 1
PAIR_TARGET = ("le", 1.25)
PAIR_METHOD_DESCRIPTIONS = {
    "floor": "src_a.copy_(src_b) + dst_a.copy_(dst_b): the round trip's bytes in plain same-dtype copies",
    "fused": "fastcoll.ops.flatten_scale(grads_src, bucket_dst, 1/ws) + fastcoll.ops.unflatten_scale(bucket_dst, dests_src, 1.0)",
}
# torch.testing.assert_close's default (rtol, atol) per dtype; a pair is checked with its coarser dtype's
PAIR_TOLERANCES = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1.3e-6, 1e-5),
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
}


# ---------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------


@dataclass
class Layout:
    name: str
    kind: str  # "model" or "synthetic"
    shapes: List[Tuple[int, ...]]
    dtype: torch.dtype
    model: Optional[str] = None
    note: str = ""
    meta: Dict[str, object] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def load_model_shapes() -> Dict[str, List[Tuple[str, Tuple[int, ...]]]]:
    """See :func:`common.model_shapes`."""
    return common.model_shapes()


def ddp_buckets(
    params: Sequence[Tuple[str, Tuple[int, ...]]],
    element_size: int = 4,
    first_cap: int = FIRST_BUCKET_CAP,
    cap: int = BUCKET_CAP,
) -> List[Dict[str, object]]:
    """DDP's bucket assignment: reverse parameter order; a bucket closes once its size reaches its cap.

    The first bucket's cap is ``first_cap``, every later one's ``cap``; a
    parameter larger than the cap gets a bucket of its own. Returns, in
    reduction order, dicts with the bucket's index, cap, parameter names and
    shapes, and size in bytes.
    """
    buckets: List[Dict[str, object]] = []
    names: List[str] = []
    shapes: List[Tuple[int, ...]] = []
    size = 0

    def close():
        nonlocal names, shapes, size
        limit = first_cap if not buckets else cap
        buckets.append({"index": len(buckets), "cap": limit, "names": names, "shapes": shapes, "bytes": size})
        names, shapes, size = [], [], 0

    for name, shape in reversed(list(params)):
        names.append(name)
        shapes.append(tuple(shape))
        size += math.prod(shape) * element_size
        if size >= (first_cap if not buckets else cap):
            close()
    if names:
        close()
    return buckets


def model_layouts(quick: bool, models: Sequence[str] = MODELS) -> Tuple[List[Layout], List[str]]:
    """The 25 MiB-cap buckets to benchmark, and a note on every bucket left out.

    A "25 MiB bucket" is one formed under the 25 MiB cap (not the first, 1 MiB
    bucket) that is not dominated by a tensor far beyond the cap (GPT-2's and
    BERT's embedding buckets: 168 and 91 MiB). Identical buckets (the
    transformer blocks) are benchmarked once. ``quick`` keeps one per model:
    the one with the most tensors.
    """
    all_params = load_model_shapes()
    layouts: List[Layout] = []
    skipped: List[str] = []
    for model in models:
        buckets = ddp_buckets(all_params[model])
        n = len(buckets)
        eligible, seen = [], {}
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
        if quick and eligible:
            full = [b for b in eligible if b["bytes"] >= BUCKET_CAP] or eligible
            best = max(full, key=lambda b: len(b["shapes"]))
            for b in eligible:
                if b is not best:
                    skipped.append(f"{model} b{b['index']}/{n} (--quick keeps one bucket per model)")
            eligible = [best]
        for b in eligible:
            same = seen[tuple(b["shapes"])]
            twins = f"; identical to b{', b'.join(map(str, same[1:]))}" if len(same) > 1 else ""
            names = b["names"]
            layouts.append(
                Layout(
                    name=f"{model} b{b['index']}",
                    kind="model",
                    shapes=list(b["shapes"]),
                    dtype=torch.float32,
                    model=model,
                    note=(
                        f"bucket {b['index']} of {n} in reduction order, {len(names)} tensors, "
                        f"{b['bytes'] / MiB:.2f} MiB: {names[0]} .. {names[-1]}{twins}"
                    ),
                    meta={"bucket_index": b["index"], "buckets": n, "params": names, "identical_buckets": same},
                )
            )
    return layouts, skipped


def synthetic_shapes(count: int, total: int) -> List[Tuple[int, ...]]:
    """``count`` 1-D tensors splitting ``total`` elements as evenly as possible."""
    base, extra = divmod(total, count)
    return [(base + (1 if i < extra else 0),) for i in range(count)]


def synthetic_layouts(counts=SYNTH_COUNTS, dtypes=SYNTH_DTYPES, total: int = SYNTH_TOTAL) -> List[Layout]:
    out = []
    for dtype in dtypes:
        short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
        for count in counts:
            out.append(
                Layout(
                    name=f"synth {short} x{count}",
                    kind="synthetic",
                    shapes=synthetic_shapes(count, total),
                    dtype=dtype,
                    note=f"{count} equal 1-D tensors, {total:,} elements in total",
                )
            )
    return out


# ---------------------------------------------------------------------------
# The methods
# ---------------------------------------------------------------------------


@dataclass
class Case:
    grads: List[torch.Tensor]  # packed from
    dests: List[torch.Tensor]  # unpacked into (same shapes/strides as grads)
    bucket: torch.Tensor
    views: List[torch.Tensor]
    src_flat: torch.Tensor  # the floor's source and destination
    dst_flat: torch.Tensor
    scale: float


def make_case(layout: Layout, device: str, seed: int = 0) -> Case:
    from .. import ops

    gen = torch.Generator().manual_seed(seed)
    # Drawn in the layout's dtype: a float32 draw cast afterwards would leave a freed temporary between
    # consecutive gradients and scatter them in memory (16-bit layouts of many tensors then look slower).
    grads = [torch.randn(s, generator=gen, dtype=layout.dtype).to(device) for s in layout.shapes]
    dests = [torch.empty_like(g) for g in grads]
    n = layout.numel
    bucket = torch.empty(n, dtype=layout.dtype, device=device)
    views = ops.bucket_views(bucket, grads)
    src_flat = torch.randn(n, generator=gen, dtype=layout.dtype).to(device)
    dst_flat = torch.empty_like(src_flat)
    return Case(grads, dests, bucket, views, src_flat, dst_flat, 1.0 / WORLD_SIZE)


def make_methods(case: Case) -> Dict[str, Tuple[Callable[[], None], Callable[[], None]]]:
    """(pack, unpack) callables per method."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    from .. import ops

    c = case
    s = c.scale
    holder: List[torch.Tensor] = []

    def floor_pack():
        c.bucket.copy_(c.src_flat)

    def floor_unpack():
        c.dst_flat.copy_(c.bucket)

    def fused_pack():
        ops.flatten_scale(c.grads, c.bucket, s)

    def fused_unpack():
        ops.unflatten_scale(c.bucket, c.dests, 1.0)

    def per_param_pack():
        for g, v in zip(c.grads, c.views):
            torch.mul(g, s, out=v)

    def per_param_unpack():
        for d, v in zip(c.dests, c.views):
            d.copy_(v)

    def utils_pack():
        flat = _flatten_dense_tensors(c.grads)
        flat.div_(WORLD_SIZE)
        holder[:] = [flat]

    def utils_unpack():
        for d, u in zip(c.dests, _unflatten_dense_tensors(holder[0], c.grads)):
            d.copy_(u)

    def foreach_pack():
        torch._foreach_copy_(c.views, c.grads)
        c.bucket.mul_(s)

    def foreach_unpack():
        torch._foreach_copy_(c.dests, c.views)

    return {
        "floor": (floor_pack, floor_unpack),
        "fused": (fused_pack, fused_unpack),
        "per_param": (per_param_pack, per_param_unpack),
        "torch_utils": (utils_pack, utils_unpack),
        "foreach": (foreach_pack, foreach_unpack),
    }


def verify(case: Case, methods) -> None:
    """Every method's round trip leaves grads * scale in dests (scale is a power of two: exact).

    The expected values come from the grads as they were before the pack:
    with a single tensor, ``_flatten_dense_tensors`` returns a view of that
    tensor rather than a copy, so the torch_utils path's ``div_`` scales the
    gradient itself in place (which is also why the benchmark flushes
    denormals: repeated in-place scaling would otherwise reach them).
    """
    for name, (pack, unpack) in methods.items():
        if name == "floor":
            continue
        expected = [g * case.scale for g in case.grads]
        for d in case.dests:
            d.fill_(float("nan"))
        pack()
        unpack()
        for i, (d, e) in enumerate(zip(case.dests, expected)):
            if not torch.equal(d, e):
                raise RuntimeError(f"benchmark method {name!r} produced a wrong result for tensor {i}")


# ---------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------


@dataclass
class Config:
    reps: int
    warmup: int
    target_s: float
    quick: bool = False
    smoke: bool = False
    synth_total: int = SYNTH_TOTAL


def config_for(args, device: str) -> Config:
    if getattr(args, "smoke", False):
        return Config(reps=3, warmup=1, target_s=0.0005, quick=True, smoke=True)
    if getattr(args, "quick", False):
        # a quarter of the synthetic size on CPU (6.25 MiB in float32) keeps `make bench-quick` short
        total = SYNTH_TOTAL // 4 if device == "cpu" else SYNTH_TOTAL
        return Config(reps=5, warmup=1, target_s=0.003 if device == "cpu" else 0.002, quick=True, synth_total=total)
    return Config(reps=15, warmup=3, target_s=0.02 if device == "cpu" else 0.005)


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a and b else None


def _targets(layout: Layout, device: str, ratios: Dict[str, Optional[float]], kernels) -> Dict[str, Dict[str, object]]:
    """The issue's targets that apply to this row: {name: {value, threshold, op, pass}}."""
    out: Dict[str, Dict[str, object]] = {}

    def add(name, op, threshold, value):
        ok = None if value is None else (value <= threshold if op == "le" else value >= threshold)
        out[name] = {"value": value, "op": op, "threshold": threshold, "pass": ok}

    if layout.kind != "model":
        return out
    if device == "cpu" and layout.model == "resnet50":
        for name, (op, thr) in CPU_TARGETS.items():
            add(name, op, thr, ratios[name])
    if device == "cuda":
        op, thr = GPU_TARGETS["floor/fused"]
        add("floor/fused", op, thr, ratios["floor/fused"])
        if layout.model == "resnet50":
            op, thr = GPU_TARGETS["per-param/fused"]
            add("per-param/fused", op, thr, ratios["per-param/fused"])
    if device == "cuda" and kernels:
        fused = kernels.get("fused", {})
        ok = fused.get("pack") == 1 and fused.get("unpack") == 1
        out["launches"] = {"value": f"{fused.get('pack')}/{fused.get('unpack')}", "op": "eq", "threshold": "1/1", "pass": ok}
    return out


def bench_layout(layout: Layout, device: str, threads: Optional[int], cfg: Config, bar) -> Dict[str, object]:
    case = make_case(layout, device)
    methods = make_methods(case)
    verify(case, methods)
    round_trips = {name: (lambda p=p, u=u: (p(), u())) for name, (p, u) in methods.items()}
    samples = common.measure_interleaved(
        round_trips, device, warmup=cfg.warmup, reps=cfg.reps, target_s=cfg.target_s, on_sample=bar.advance
    )
    stats = {name: common.summarize(xs) for name, xs in samples.items()}
    med = {name: st["median_s"] for name, st in stats.items()}
    ratios = {
        "fused/floor": _ratio(med["fused"], med["floor"]),
        "floor/fused": _ratio(med["floor"], med["fused"]),
        "per-param/fused": _ratio(med["per_param"], med["fused"]),
        "torch_utils/fused": _ratio(med["torch_utils"], med["fused"]),
        "foreach/fused": _ratio(med["foreach"], med["fused"]),
    }
    moved = 4 * layout.nbytes  # read + write, in both directions
    bandwidth = {name: moved / t / 1e9 for name, t in med.items() if t}
    kernels = None
    if device == "cuda":
        kernels = {
            name: {"pack": len(common.count_cuda_kernels(p)), "unpack": len(common.count_cuda_kernels(u))}
            for name, (p, u) in methods.items()
        }
    del case, methods, round_trips
    return {
        "layout": layout.name,
        "kind": layout.kind,
        "model": layout.model,
        "note": layout.note,
        "dtype": str(layout.dtype).replace("torch.", ""),
        "tensors": len(layout.shapes),
        "numel": layout.numel,
        "bytes": layout.nbytes,
        "device": device,
        "threads": threads,
        "methods": stats,
        "ratios": ratios,
        "bandwidth_gb_s": bandwidth,
        "kernels_per_direction": kernels,
        "targets": _targets(layout, device, ratios, kernels),
        **({"bucket": layout.meta} if layout.meta else {}),
    }


def _setting_label(device: str, threads: Optional[int]) -> str:
    if device == "cuda":
        return "CUDA" + (f" ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else "")
    return f"CPU, {threads} thread{'s' if threads != 1 else ''}"


def print_results(label: str, rows: List[Dict[str, object]], device: str) -> None:
    columns = ["layout", "tensors", "MiB"] + [METHOD_LABELS[m] for m in METHODS]
    columns += ["fused/floor", "per-param/fused", "fused GB/s"]
    if device == "cpu":
        columns += ["≤1.25x floor", "≥1.5x per-param"]
    else:
        columns += ["launches", "≥90% copy BW", "≥5x per-param"]
    table = []
    for r in rows:
        st, ra, tg = r["methods"], r["ratios"], r["targets"]
        line = [r["layout"], str(r["tensors"]), f"{r['bytes'] / MiB:.1f}"]
        line += [common.fmt_time(st[m]["median_s"]) for m in METHODS]
        line += [common.fmt_ratio(ra["fused/floor"]), common.fmt_ratio(ra["per-param/fused"])]
        line += [f"{r['bandwidth_gb_s'].get('fused', float('nan')):.1f}"]
        if device == "cpu":
            line += [common.pass_miss(tg.get(k, {}).get("pass")) for k in ("fused/floor", "per-param/fused")]
        else:
            k = r["kernels_per_direction"] or {}
            launches = f"{k.get('fused', {}).get('pack')}/{k.get('fused', {}).get('unpack')}"
            pp = k.get("per_param", {})
            launches += f" (per-param {pp.get('pack')}/{pp.get('unpack')})"
            line += [launches] + [common.pass_miss(tg.get(k2, {}).get("pass")) for k2 in ("floor/fused", "per-param/fused")]
        table.append(line)
    caption = (
        f"median time of one round trip (pack x 1/{WORLD_SIZE} into the bucket, unpack); per-param/fused > 1: "
        "fused is faster; GB/s counts 4 x bucket bytes (read+write, both directions)\n"
        + "\n".join(f"{METHOD_LABELS[m]}: {METHOD_DESCRIPTIONS[m]}" for m in METHODS)
    )
    common.render_table(f"fastcoll ops: {label}", columns, table, caption=caption)


def print_layouts(layouts: List[Layout], skipped: List[str]) -> None:
    rows = [[lay.name, str(len(lay.shapes)), f"{lay.nbytes / MiB:.2f}", lay.note] for lay in layouts if lay.kind == "model"]
    if rows:
        common.render_table(
            "DDP buckets benchmarked (reverse parameter order; first cap 1 MiB, then 25 MiB)",
            ["layout", "tensors", "MiB", "which bucket"],
            rows,
            caption="not benchmarked: " + "; ".join(skipped) if skipped else "",
        )


def chart(path: Path, results: List[Dict[str, object]]) -> Optional[Path]:
    panels: Dict[str, Dict[str, Dict[str, float]]] = {}
    for r in results:
        label = _setting_label(r["device"], r["threads"])
        floor = r["methods"]["floor"]["median_s"]
        panels.setdefault(label, {})[r["layout"]] = {
            METHOD_LABELS[m]: r["methods"][m]["median_s"] / floor for m in METHODS if m != "floor"
        }
    return common.bar_chart(
        path,
        "fastcoll ops: round-trip time relative to the two-copy floor (dashed; lower is better)",
        panels,
        "time / floor",
        reference_line=1.0,
    )


# ---------------------------------------------------------------------------
# Dtype pairs (issue 11): mixed-dtype round trips against a floor of plain copies
# ---------------------------------------------------------------------------


@dataclass
class PairCase:
    src: torch.dtype  # the gradients' dtype
    dst: torch.dtype  # the bucket's (wire) dtype
    grads: List[torch.Tensor]
    dests: List[torch.Tensor]
    bucket: torch.Tensor
    floor_src: Tuple[torch.Tensor, torch.Tensor]  # (destination, source) of the floor's copy in src
    floor_dst: Tuple[torch.Tensor, torch.Tensor]  # and in dst


def pair_layouts(cfg: Config) -> List[Layout]:
    """ResNet-50's bucket 2 (the main table's ``resnet50 b2``) and 64 equal tensors of as many elements.

    ``--quick`` and ``--smoke`` keep the model bucket only; ``--smoke`` shrinks it 64-fold.
    """
    model, index = PAIR_MODEL_BUCKET
    layouts, _ = model_layouts(quick=False, models=(model,))
    bucket = next(lay for lay in layouts if lay.meta["bucket_index"] == index)
    if cfg.smoke:
        bucket = _shrunk(bucket)
    if cfg.quick:
        return [bucket]
    synth = Layout(
        name=f"synth x{PAIR_SYNTH_COUNT}",
        kind="synthetic",
        shapes=synthetic_shapes(PAIR_SYNTH_COUNT, bucket.numel),
        dtype=bucket.dtype,
        note=f"{PAIR_SYNTH_COUNT} equal 1-D tensors, {bucket.numel:,} elements in total (as many as {bucket.name})",
    )
    return [bucket, synth]


def make_pair_case(shapes: Sequence[Tuple[int, ...]], src: torch.dtype, dst: torch.dtype, seed: int = 0) -> PairCase:
    gen = torch.Generator().manual_seed(seed)
    # drawn in their own dtype, one after another: no freed temporaries between them (see make_case)
    grads = [torch.randn(s, generator=gen, dtype=src) for s in shapes]
    dests = [torch.empty_like(g) for g in grads]
    n = sum(g.numel() for g in grads)
    bucket = torch.empty(n, dtype=dst)
    floor_src = (torch.empty(n, dtype=src), torch.randn(n, generator=gen, dtype=src))
    floor_dst = (torch.empty(n, dtype=dst), torch.randn(n, generator=gen, dtype=dst))
    return PairCase(src, dst, grads, dests, bucket, floor_src, floor_dst)


def make_pair_methods(case: PairCase) -> Dict[str, Callable[[], None]]:
    """One round trip per method: ``floor`` (a plain copy in each dtype) and ``fused``."""
    from .. import ops

    c = case
    scale = 1.0 / WORLD_SIZE

    def floor():
        c.floor_src[0].copy_(c.floor_src[1])
        c.floor_dst[0].copy_(c.floor_dst[1])

    def fused():
        ops.flatten_scale(c.grads, c.bucket, scale)
        ops.unflatten_scale(c.bucket, c.dests, 1.0)

    return {"floor": floor, "fused": fused}


def verify_pair(case: PairCase, fused: Callable[[], None]) -> Dict[str, object]:
    """The bucket holds ``(g * scale).to(dst)`` and the dests that cast back to ``src``, within the coarser dtype's tolerance.

    The torch reference multiplies in float32 (float64 when either dtype is
    float64), as the ops do. Rounding may differ in the last bit (a kernel
    may narrow float64 to a 16-bit dtype through float32), so ``exact`` is
    recorded but only the tolerance (``torch.testing``'s default for the
    coarser dtype) decides ``ok``; a miss raises, as :func:`verify` does.
    """
    c = case
    c.bucket.fill_(float("nan"))
    for d in c.dests:
        d.fill_(float("nan"))
    fused()
    opmath = torch.float64 if torch.float64 in (c.src, c.dst) else torch.float32
    rtol, atol = max(PAIR_TOLERANCES[c.src], PAIR_TOLERANCES[c.dst])
    ok, exact, err = True, True, 0.0
    views = [v.reshape(g.shape) for v, g in zip(c.bucket.split([g.numel() for g in c.grads]), c.grads)]
    for g, v, d in zip(c.grads, views, c.dests):
        packed = (g.to(opmath) * (1.0 / WORLD_SIZE)).to(c.dst)
        for got, want in ((v, packed), (d, packed.to(c.src))):
            exact = exact and torch.equal(got, want)
            ok = ok and torch.allclose(got.double(), want.double(), rtol=rtol, atol=atol)
            err = max(err, (got.double() - want.double()).abs().max().item())
    checks = {"ok": ok, "exact": exact, "max_abs_err": err, "rtol": rtol, "atol": atol}
    if not ok:
        raise RuntimeError(f"fused round trip {_pair_name(c.src, c.dst)} produced a wrong result: {checks}")
    return checks


def bench_pair(layout: Layout, src: torch.dtype, dst: torch.dtype, cfg: Config, bar) -> Dict[str, object]:
    case = make_pair_case(layout.shapes, src, dst)
    methods = make_pair_methods(case)
    checks = verify_pair(case, methods["fused"])
    samples = common.measure_interleaved(
        methods, "cpu", warmup=cfg.warmup, reps=cfg.reps, target_s=cfg.target_s, on_sample=bar.advance
    )
    del case, methods
    stats = {name: common.summarize(xs) for name, xs in samples.items()}
    ratio = _ratio(stats["fused"]["median_s"], stats["floor"]["median_s"])
    op, thr = PAIR_TARGET
    moved = 2 * layout.numel * (_element_size(src) + _element_size(dst))  # each dtype read and written once
    return {
        "layout": layout.name,
        "kind": layout.kind,
        "model": layout.model,
        "tensors": len(layout.shapes),
        "numel": layout.numel,
        "src": _dtype_name(src),
        "dst": _dtype_name(dst),
        "pair": f"{_dtype_name(src)}->{_dtype_name(dst)}",
        "threads": PAIR_THREADS,
        "bytes_moved": moved,
        "methods": stats,
        "ratios": {"fused/floor": ratio},
        "bandwidth_gb_s": {name: moved / st["median_s"] / 1e9 for name, st in stats.items() if st["median_s"]},
        "targets": {"fused/floor": {"value": ratio, "op": op, "threshold": thr, "pass": None if ratio is None else ratio <= thr}},
        "checks": checks,
    }


def run_dtype_pairs(layouts: List[Layout], cfg: Config, bar) -> List[Dict[str, object]]:
    """Every (gradient dtype, bucket dtype) pair on every layout, at :data:`PAIR_THREADS` intra-op thread."""
    rows = []
    with common.num_threads(PAIR_THREADS):
        for src, dst in dtype_pairs():
            for layout in layouts:
                bar.describe(f"dtype pairs: {_pair_name(src, dst)}, {layout.name}")
                rows.append(bench_pair(layout, src, dst, cfg, bar))
    return rows


def dtype_pairs() -> List[Tuple[torch.dtype, torch.dtype]]:
    """The 16 ordered (src, dst) pairs: the 4 same-dtype ones first, then the 12 mixed ones."""
    same = [(d, d) for d in PAIR_DTYPES]
    return same + [(s, d) for s in PAIR_DTYPES for d in PAIR_DTYPES if s != d]


def print_dtype_pairs(rows: List[Dict[str, object]], layouts: List[Layout]) -> None:
    op, thr = PAIR_TARGET
    tags = {lay.name: ("model" if lay.kind == "model" else "synth") for lay in layouts}
    columns = ["grads → bucket"]
    for lay in layouts:
        tag = tags[lay.name]
        columns += [f"{tag} floor", f"{tag} fused", f"{tag} fused/floor", f"{tag} ≤{thr}x"]
    by_pair: Dict[str, List[str]] = {}
    for r in rows:
        line = by_pair.setdefault(r["pair"], [_pair_name(getattr(torch, r["src"]), getattr(torch, r["dst"]))])
        line += [common.fmt_time(r["methods"][m]["median_s"]) for m in ("floor", "fused")]
        line += [common.fmt_ratio(r["ratios"]["fused/floor"]), common.pass_miss(r["targets"]["fused/floor"]["pass"])]
    caption = (
        f"median time of one round trip at {PAIR_THREADS} thread: fused = flatten_scale(grads, bucket, 1/{WORLD_SIZE}) "
        "+ unflatten_scale(bucket, dests, 1.0), grads and dests in the first dtype, the bucket in the second; "
        "floor = src_a.copy_(src_b) + dst_a.copy_(dst_b), the same bytes in plain same-dtype copies\n"
        + "\n".join(f"{tags[lay.name]}: {lay.name}, {len(lay.shapes)} tensors, {lay.numel:,} elements" for lay in layouts)
    )
    common.render_table(
        f"fastcoll ops: dtype pairs, CPU, {PAIR_THREADS} thread", columns, list(by_pair.values()), caption=caption
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _pair_name(src: torch.dtype, dst: torch.dtype) -> str:
    short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
    return f"{short[src]} → {short[dst]}"


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _shrunk(layout: Layout) -> Layout:
    """``--smoke``: the layout with every tensor 64 times smaller (1-D)."""
    return replace(layout, name=layout.name + " (x1/64)", shapes=[(max(1, math.prod(s) // 64),) for s in layout.shapes])


def main_layouts(cfg: Config) -> Tuple[List[Layout], List[str]]:
    """The main table's layouts and the buckets left out of it."""
    if cfg.smoke:
        layouts, skipped = model_layouts(quick=True, models=("resnet50",))
        return [_shrunk(lay) for lay in layouts] + synthetic_layouts(counts=(1, 64), total=1 << 14), skipped
    layouts, skipped = model_layouts(quick=cfg.quick)
    return layouts + synthetic_layouts(total=cfg.synth_total), skipped


def run(args) -> int:
    device = getattr(args, "device", "cpu") or "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        common.say("[red]fastcoll.bench ops: --device cuda but torch.cuda.is_available() is False[/red]")
        return 2
    cfg = config_for(args, device)
    from .. import ops

    if ops.implementation() != "extension":
        common.say(
            "[yellow]fastcoll.bench ops: the C++ extension is not loaded; 'fused' is the pure-PyTorch "
            "reference (one op per tensor), not the fused kernels[/yellow]"
        )

    layouts, skipped = main_layouts(cfg)
    settings = [None] if device == "cuda" else common.thread_counts(args)
    if cfg.smoke:
        settings = settings[:1]
    pair_lays = pair_layouts(cfg) if device == "cpu" else []  # the dtype-pair target is a CPU one

    print_layouts(layouts, skipped)
    results: List[Dict[str, object]] = []
    pairs: List[Dict[str, object]] = []
    flush_denormal = torch.set_flush_denormal(True)  # see verify(); no effect on the other methods' values
    total = (len(layouts) * len(settings) * len(METHODS) + len(pair_lays) * len(dtype_pairs()) * 2) * cfg.reps
    with common.progress(total, "ops") as bar:
        for threads in settings:
            label = _setting_label(device, threads)
            rows = []
            ctx = common.num_threads(threads) if threads else _null()
            with ctx:
                for layout in layouts:
                    bar.describe(f"{label}: {layout.name}")
                    rows.append(bench_layout(layout, device, threads, cfg, bar))
            results += rows
            print_results(label, rows, device)
        if pair_lays:
            pairs = run_dtype_pairs(pair_lays, cfg, bar)
            print_dtype_pairs(pairs, pair_lays)
    if flush_denormal:
        torch.set_flush_denormal(False)

    _summary(results)
    _pairs_summary(pairs)
    path = common.resolve_json_path(args, f"ops_{device}")
    payload = {
        "benchmark": "ops",
        "config": {
            "device": device,
            "threads": settings,
            "quick": cfg.quick,
            "smoke": cfg.smoke,
            "reps": cfg.reps,
            "warmup": cfg.warmup,
            "sample_target_s": cfg.target_s,
            "world_size": WORLD_SIZE,
            "first_bucket_cap": FIRST_BUCKET_CAP,
            "bucket_cap": BUCKET_CAP,
            "synthetic_total_elements": cfg.synth_total,
            "methods": METHOD_DESCRIPTIONS,
            "not_benchmarked": skipped,
            "dtype_pairs": {
                "dtypes": [_dtype_name(d) for d in PAIR_DTYPES],
                "threads": PAIR_THREADS,
                "layouts": {lay.name: lay.note for lay in pair_lays},
                "methods": PAIR_METHOD_DESCRIPTIONS,
                "target": {"fused/floor": list(PAIR_TARGET)},
            },
        },
        "results": results,
        "dtype_pairs": pairs,
    }
    common.write_json(path, payload, device)
    png = chart(path.with_suffix(".png"), results)
    common.say(f"wrote {path}" + (f" and {png}" if png else " (matplotlib missing: no chart)"))
    return 0


def _summary(results: List[Dict[str, object]]) -> None:
    lines = []
    for r in results:
        for name, t in r["targets"].items():
            if t["pass"] is None:
                continue
            value = t["value"] if isinstance(t["value"], str) else f"{t['value']:.2f}x"
            op = {"le": "<=", "ge": ">=", "eq": "=="}[t["op"]]
            thr = t["threshold"] if isinstance(t["threshold"], str) else f"{t['threshold']}x"
            lines.append(
                f"  {_setting_label(r['device'], r['threads'])}, {r['layout']}: {name} {value} (target {op} {thr}) "
                f"{common.pass_miss(t['pass'])}"
            )
    if lines:
        common.say("[bold]targets (issue 2; informational, never asserted):[/bold]")
        for line in lines:
            common.say(line)


def _pairs_summary(rows: List[Dict[str, object]]) -> None:
    ratios = [(r["ratios"]["fused/floor"], r) for r in rows if r["ratios"]["fused/floor"] is not None]
    if not ratios:
        return
    passed = sum(1 for _, r in ratios if r["targets"]["fused/floor"]["pass"])
    worst, r = max(ratios, key=lambda x: x[0])
    common.say(
        f"[bold]dtype pairs (issue 11; informational, never asserted):[/bold] {passed}/{len(ratios)} "
        f"within {PAIR_TARGET[1]}x of the floor at {PAIR_THREADS} thread; worst {r['pair']} on {r['layout']}: "
        f"{worst:.2f}x {common.pass_miss(passed == len(ratios))}"
    )


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
