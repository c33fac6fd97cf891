"""Benchmark of fastcoll.DDP against torch DistributedDataParallel, side by side in one run.

    python -m fastcoll.bench ddp [--device cpu|cuda] [--quick] [--threads N|all] [--json PATH]
    python benchmarks/bench_ddp.py ...       (same)

The command spawns its own ranks: on CPU 2 gloo ranks over loopback (a
FileStore in a temporary directory), each with 1 intra-op thread (``--threads``
changes that); with ``--device cuda`` 1 rank on NCCL. Every rank builds the
same models from the same seeds and times, per model and per
``gradient_as_bucket_view`` setting, three ways of doing one training step:

* ``no_sync``: torch DDP inside ``no_sync()`` (a separate instance): the step
  without gradient synchronization, the compute-only floor;
* ``torch``: ``torch.nn.parallel.DistributedDataParallel``;
* ``fastcoll``: ``fastcoll.DDP`` with the same arguments.

A step is ``module.zero_grad(set_to_none=True)`` + forward + loss + backward
(no optimizer step: the same work for every method). Samples of the three are
taken round-robin (sample k of each before sample k+1), so drift of a shared
machine hits them alike; a sample is ``inner`` back-to-back steps and its time
is the slowest rank's. Reported per row: median step time, synchronization
overhead (step minus the no_sync step), peak memory (CPU: the growth of the
resident set from before the wrapper is built through its first steps, with
the high-water mark reset and free heap returned to the OS first; CUDA:
``torch.cuda.max_memory_allocated`` above what was allocated before), bytes
each rank sent per step (CPU: the rank's ``wchar`` from ``/proc/self/io``,
i.e. what gloo wrote to its sockets), bucket counts, and whether fastcoll's
gradients equal torch DDP's (checked once, after the warm-up steps).

Models: an MLP of 96 small layers (192 parameters, one bucket), a conv net with
BatchNorm (buffers broadcast every step), a 4-layer transformer encoder
(48 parameters, two buckets), and two synthetic models holding parameters of
ResNet-50's and GPT-2 small's shapes (``fastcoll/bench/model_shapes.json``) whose
forward is ``sum_i p_i.sum() * x_i``: one read of every parameter, so their
step is dominated by writing the gradients and synchronizing them.

Targets (issue 3), printed as PASS/MISS and never asserted: on CPU with 2 gloo
ranks, fastcoll's step at most 1.0x torch DDP's on every model and its sync
overhead no larger than torch DDP's; on a GPU (one rank, NCCL) at most 0.95x.

With one GPU (one rank) fastcoll.DDP issues no collective at all while torch
DDP still does, so ``--device cuda`` measures twice, each pass in its own
ranks, and labels both in the tables and the JSON (``row["collectives"]``,
``config["collective_passes"]``): ``plain`` (FASTCOLL_FORCE_COLLECTIVES=0: the
wrappers' local work, pack, unpack and hooks, against torch DDP with its
all-reduces) and ``forced`` (FASTCOLL_FORCE_COLLECTIVES=1: fastcoll issues its
all-reduces and broadcasts as at any world size, the like-for-like one-GPU
comparison with communication; labels end in " [comm forced]"). With the
variable set in the environment only that pass runs (``=1``: forced, ``=0``:
plain). A pass that fails is reported in ``config["passes"]`` and the other
still runs; the JSON is written after each pass. CPU runs (2 gloo ranks)
communicate anyway and have a single, unlabelled pass.

``--quick`` (about 1-2 minutes on 2 cores) takes 5 samples of 30 ms instead of
15 of 100 ms, times the GPT-2-shaped set without gradient_as_bucket_view only
(about 1 s a step on 2 CPU cores) and the comm_dtype section on the encoder and
the ResNet-50-shaped set only. ``--smoke`` (hidden; tests/test_bench_ddp.py)
runs shrunken models with 2 single-step samples: it checks the code, not the
numbers.

When ``fastcoll.DDP`` takes a ``comm_dtype`` argument (issue 5), a second
section times ``comm_dtype=torch.float16/bfloat16`` against torch DDP with
torch's ``fp16_compress_hook``/``bf16_compress_hook`` (the bf16 hook is called
through a wrapper: torch refuses it by name on CPU builds although it runs on
gloo), reporting step time and bytes sent per step.

``run(args)`` prints the tables and writes ``benchmarks/out/ddp_<device>.json``
and a PNG chart next to it; :func:`measure` returns the results as a dict.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import inspect
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import common
from .common import MiB

CPU_WORLD_SIZE = 2
CUDA_WORLD_SIZE = 1
CPU_TARGET = 1.0  # fastcoll step / torch DDP step, CPU with 2 gloo ranks; sync overhead also <= torch's
GPU_TARGET = 0.95  # fastcoll step / torch DDP step, one GPU rank on NCCL

METHODS = ("no_sync", "torch", "fastcoll")
METHOD_LABELS = {"no_sync": "no_sync", "torch": "torch DDP", "fastcoll": "fastcoll"}
METHOD_DESCRIPTIONS = {
    "no_sync": "torch DDP (a separate instance) inside no_sync(): the step without gradient synchronization",
    "torch": "torch.nn.parallel.DistributedDataParallel(module, gradient_as_bucket_view=...)",
    "fastcoll": "fastcoll.DDP(module, gradient_as_bucket_view=...)",
}
COMM_DTYPES = (("fp16", torch.float16), ("bf16", torch.bfloat16))
#: One-rank (CUDA) runs: the FASTCOLL_FORCE_COLLECTIVES passes, their label suffix and description.
COLLECTIVE_PASSES = ("plain", "forced")
PASS_SUFFIX = {"plain": "", "forced": " [comm forced]"}
PASS_DESCRIPTIONS = {
    "plain": "FASTCOLL_FORCE_COLLECTIVES=0: at world size 1 fastcoll.DDP issues no collective, torch DDP does "
    "(the wrappers' local work: pack, unpack, hooks)",
    "forced": "FASTCOLL_FORCE_COLLECTIVES=1: fastcoll.DDP issues its all-reduces and broadcasts as at any world size, "
    "as torch DDP does (the one-GPU comparison with communication)",
}
COMM_METHODS = ("no_sync", "torch fp16 hook", "fastcoll fp16", "torch bf16 hook", "fastcoll bf16")
COMM_DESCRIPTIONS = {
    "torch fp16 hook": "torch DDP + torch.distributed.algorithms.ddp_comm_hooks.default_hooks.fp16_compress_hook",
    "fastcoll fp16": "fastcoll.DDP(module, comm_dtype=torch.float16)",
    "torch bf16 hook": "torch DDP + default_hooks.bf16_compress_hook (through a wrapper: torch refuses it by name on CPU)",
    "fastcoll bf16": "fastcoll.DDP(module, comm_dtype=torch.bfloat16)",
}


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------


class ManyLayerMLP(nn.Module):
    """``depth`` Linear(width, width) layers with tanh in between."""

    def __init__(self, width: int = 32, depth: int = 96):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class ConvBNNet(nn.Module):
    """conv3x3-BatchNorm-ReLU blocks (stride 2 where the width doubles), global pooling, a linear head."""

    def __init__(self, channels: Sequence[int] = (16, 32, 32, 64, 64, 128), classes: int = 10):
        super().__init__()
        blocks = []
        cin = 3
        for c in channels:
            stride = 2 if c > cin and cin != 3 else 1
            blocks += [nn.Conv2d(cin, c, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()]
            cin = c
        self.features = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, x):
        return self.head(self.features(x).mean(dim=(2, 3)))


class Encoder(nn.Module):
    """``layers`` nn.TransformerEncoderLayer blocks (12 parameters each), no dropout."""

    def __init__(self, d_model: int = 128, heads: int = 4, ff: int = 512, layers: int = 4):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=ff, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, x):
        return self.encoder(x)


class ShapeModel(nn.Module):
    """Parameters of given shapes; ``forward(x) = sum_i p_i.sum() * x[i]`` (one read of each parameter).

    The gradient of parameter i is ``x[i]`` everywhere, so backward writes
    every gradient once; the rest of a step is the wrapper's synchronization.
    ``storage`` (tensors of the same shapes) makes the parameters share memory
    with another instance's, so several wrappers can be timed side by side
    without holding several copies of a large model's weights.
    """

    def __init__(self, shapes: Sequence[Sequence[int]], storage: Optional[Sequence[torch.Tensor]] = None, device="cpu"):
        super().__init__()
        if storage is None:
            storage = [torch.full(tuple(s), 0.01, device=device) for s in shapes]
        self.params = nn.ParameterList(nn.Parameter(t) for t in storage)

    def forward(self, x):
        return torch.stack([p.sum() for p in self.params]) @ x


@dataclasses.dataclass
class ModelSpec:
    """How to build one benchmarked model, its per-rank input and its loss."""

    name: str
    label: str
    kind: str  # "mlp", "convbn", "encoder" or "shapes"
    kwargs: Dict[str, Any]
    batch: int = 8
    note: str = ""

    @property
    def synthetic(self) -> bool:
        return self.kind == "shapes"


def load_shapes(model: str) -> Tuple[List[str], List[Tuple[int, ...]]]:
    """Parameter names and shapes of ``model`` (see :func:`common.model_shapes`), in registration order."""
    entries = common.model_shapes()[model]
    return [n for n, _ in entries], [s for _, s in entries]


def build_storage(spec: ModelSpec, device: str) -> List[torch.Tensor]:
    """Weights that every instance of ``spec``'s model built with them shares (parameters, then buffers).

    The timed wrappers of one model then compute on the same memory: besides
    not holding several copies of a large model, this keeps where each copy
    happened to be allocated out of the comparison (two identical wrappers on
    separately allocated small models differed by up to 15% on this box).
    """
    if spec.synthetic:
        _, shapes = _spec_shapes(spec)
        return [torch.full(s, 0.01, device=device) for s in shapes]
    model = build_model(spec, device)
    return [t.detach() for t in (*model.parameters(), *model.buffers())]


def _spec_shapes(spec: ModelSpec) -> Tuple[List[str], List[Tuple[int, ...]]]:
    names, shapes = load_shapes(spec.kwargs["model"])
    limit, div = spec.kwargs.get("limit"), spec.kwargs.get("divide", 1)
    if limit:
        names, shapes = names[:limit], shapes[:limit]
    if div > 1:
        shapes = [(max(1, math.prod(s) // div),) for s in shapes]
    return names, shapes


def build_model(spec: ModelSpec, device: str, storage: Optional[List[torch.Tensor]] = None) -> nn.Module:
    """The model of ``spec`` with seed-0 initialization (identical on every rank and for every method)."""
    torch.manual_seed(0)
    if spec.kind == "mlp":
        model = ManyLayerMLP(**spec.kwargs)
    elif spec.kind == "convbn":
        model = ConvBNNet(**spec.kwargs)
    elif spec.kind == "encoder":
        model = Encoder(**spec.kwargs)
    elif spec.kind == "shapes":
        return ShapeModel(_spec_shapes(spec)[1], storage, device)
    else:  # pragma: no cover
        raise ValueError(spec.kind)
    model = model.to(device)
    if storage is not None:
        for t, shared in zip((*model.parameters(), *model.buffers()), storage):
            t.data = shared
    return model


def make_input(spec: ModelSpec, rank: int, device: str) -> torch.Tensor:
    """This rank's input (a different one per rank, the same for every method)."""
    g = torch.Generator().manual_seed(1000 + rank)
    if spec.kind == "mlp":
        x = torch.randn(spec.batch, spec.kwargs.get("width", 32), generator=g)
    elif spec.kind == "convbn":
        x = torch.randn(spec.batch, 3, spec.kwargs.get("image", 16), spec.kwargs.get("image", 16), generator=g)
    elif spec.kind == "encoder":
        x = torch.randn(spec.batch, spec.kwargs.get("seq", 32), spec.kwargs.get("d_model", 128), generator=g)
    else:
        n = len(_spec_shapes(spec)[1])
        x = (rank + 1) * torch.arange(1, n + 1, dtype=torch.float32) / n
    return x.to(device)


def loss_of(spec: ModelSpec, out: torch.Tensor) -> torch.Tensor:
    return out if spec.synthetic else out.square().mean()


def model_specs(cfg: Dict[str, Any]) -> List[ModelSpec]:
    """The benchmarked models for a configuration (``smoke`` shrinks every one)."""
    if cfg["smoke"]:
        return [
            ModelSpec("mlp", "MLP 8 layers", "mlp", {"width": 8, "depth": 8}, batch=4),
            ModelSpec("convbn", "conv+BN", "convbn", {"channels": (4, 8)}, batch=2),
            ModelSpec("encoder", "encoder 1 layer", "encoder", {"d_model": 16, "heads": 2, "ff": 32, "layers": 1}, batch=2),
            ModelSpec(
                "resnet50",
                "ResNet-50 shapes (24, x1/256)",
                "shapes",
                {"model": "resnet50", "limit": 24, "divide": 256},
                note="synthetic",
            ),
        ]
    specs = [
        ModelSpec("mlp96", "MLP 96x(32x32)", "mlp", {"width": 32, "depth": 96}, batch=32),
        ModelSpec("convbn", "conv+BN 6 blocks", "convbn", {"channels": (16, 32, 32, 64, 64, 128)}, batch=8),
        ModelSpec("encoder", "encoder 4x d128", "encoder", {"d_model": 128, "heads": 4, "ff": 512, "layers": 4}, batch=8),
        ModelSpec("resnet50", "ResNet-50 shapes", "shapes", {"model": "resnet50"}, note="synthetic"),
        ModelSpec("gpt2_small", "GPT-2 small shapes", "shapes", {"model": "gpt2_small"}, note="synthetic"),
    ]
    return specs


def comm_model_names(cfg: Dict[str, Any]) -> Tuple[str, ...]:
    if cfg["smoke"]:
        return ("encoder",)
    if cfg["quick"]:
        return ("encoder", "resnet50")
    return ("mlp96", "encoder", "resnet50", "gpt2_small")


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------


def _config(args: Any, device: str) -> Dict[str, Any]:
    if getattr(args, "smoke", False):
        cfg = dict(reps=2, setup_steps=3, target_s=0.0, max_inner=1, smoke=True, quick=True)
    elif getattr(args, "quick", False):
        cfg = dict(reps=5, setup_steps=3, target_s=0.03, max_inner=50, smoke=False, quick=True)
    else:
        cfg = dict(reps=15, setup_steps=3, target_s=0.1, max_inner=200, smoke=False, quick=False)
    cfg["device"] = device
    cfg["world_size"] = CUDA_WORLD_SIZE if device == "cuda" else CPU_WORLD_SIZE
    cfg["backend"] = "nccl" if device == "cuda" else "gloo"
    cfg["threads"] = _threads_per_rank(args, cfg["world_size"])
    return cfg


def collective_passes(cfg: Dict[str, Any]) -> List[Optional[str]]:
    """The FASTCOLL_FORCE_COLLECTIVES passes to run: ``[None]`` (one unlabelled pass) unless the world has one rank.

    At world size 1: both ("plain", "forced") when FASTCOLL_FORCE_COLLECTIVES is
    unset, else only the one it names (a value other than "" or "0" forces).
    """
    if cfg["world_size"] > 1:
        return [None]
    value = os.environ.get("FASTCOLL_FORCE_COLLECTIVES")
    if value is None:
        return list(COLLECTIVE_PASSES)
    return ["plain" if value.strip() in ("", "0") else "forced"]


def _threads_per_rank(args: Any, world_size: int) -> int:
    spec = getattr(args, "threads", None)
    if spec is None:
        return 1
    if str(spec) == "all":
        return max(1, common.available_cpus() // world_size)
    return max(1, int(spec))


def comm_dtype_supported() -> bool:
    """Whether this checkout's fastcoll.DDP takes the ``comm_dtype`` argument (issue 5)."""
    import fastcoll

    try:
        return "comm_dtype" in inspect.signature(fastcoll.DDP).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


@dataclasses.dataclass
class Case:
    """One row: a model, a gradient_as_bucket_view setting and the methods timed side by side."""

    section: str  # "fp32" or "comm_dtype"
    spec: ModelSpec
    gabv: bool
    methods: Tuple[str, ...]

    @property
    def title(self) -> str:
        return f"{self.spec.label}" + (", bucket view" if self.gabv else "") + (" (comm)" if self.section != "fp32" else "")


def build_cases(cfg: Dict[str, Any], with_comm: bool) -> List[Case]:
    specs = model_specs(cfg)
    cases = [Case("fp32", s, gabv, METHODS) for s in specs for gabv in (False, True)]
    if cfg["smoke"]:  # the encoder is covered by the comm_dtype section when there is one
        cases = [c for c in cases if (not c.gabv or c.spec.kind == "mlp") and (c.spec.kind != "encoder" or not with_comm)]
    elif cfg["quick"]:  # the longest case (about 1 s a step on 2 CPU cores): --quick times it once
        cases = [c for c in cases if not (c.gabv and c.spec.name == "gpt2_small")]
    if with_comm:
        names = comm_model_names(cfg)
        cases += [Case("comm_dtype", s, False, COMM_METHODS) for s in specs if s.name in names]
    return cases


def progress_units(cases: Sequence[Case], cfg: Dict[str, Any]) -> int:
    return sum(len(c.methods) * (cfg["reps"] + 1) for c in cases)


# ---------------------------------------------------------------------------
# Measuring memory and bytes on the wire
# ---------------------------------------------------------------------------


def _proc_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:  # pragma: no cover (not Linux)
        pass
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:  # pragma: no cover
        return False


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # pragma: no cover (not glibc)
        pass


def bytes_written() -> Optional[int]:
    """Bytes this process wrote through write()/writev()/send() so far (gloo's sockets included)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:  # pragma: no cover
        pass
    return None


class MemoryProbe:
    """Peak memory growth of a block: RSS high-water mark on CPU, allocator peak on CUDA."""

    def __init__(self, device: str):
        self.device = device
        self.base = 0
        self.ok = True

    def start(self) -> None:
        gc.collect()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        _malloc_trim()  # free heap goes back to the OS, so reusing it shows up in the RSS again
        self.ok = _reset_peak_rss()
        self.base = (_proc_kib("VmRSS") or 0) * 1024

    def peak(self) -> Optional[int]:
        if self.device == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        hwm = _proc_kib("VmHWM")
        if not self.ok or hwm is None:
            return None
        return max(0, hwm * 1024 - self.base)


# ---------------------------------------------------------------------------
# The wrappers and their steps
# ---------------------------------------------------------------------------


def _torch_hook(dtype: torch.dtype) -> Callable:
    """torch's fp16/bf16_compress_hook behind a differently named function (torch refuses bf16 by name on CPU)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    fn = default_hooks.fp16_compress_hook if dtype == torch.float16 else default_hooks.bf16_compress_hook

    def compress_hook(state, bucket):
        return fn(state, bucket)

    return compress_hook


def make_wrapper(method: str, module: nn.Module, gabv: bool, device: str) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import fastcoll

    kw: Dict[str, Any] = {"gradient_as_bucket_view": gabv}
    if device == "cuda":
        kw["device_ids"] = [torch.cuda.current_device()]
    if method in ("no_sync", "torch"):
        return TorchDDP(module, **kw)
    if method == "fastcoll":
        return fastcoll.DDP(module, **kw)
    kind, dtype_name = method.split()[:2]
    dtype = dict(COMM_DTYPES)[dtype_name]
    if kind == "torch":
        wrapper = TorchDDP(module, **kw)
        wrapper.register_comm_hook(None, _torch_hook(dtype))
        return wrapper
    return fastcoll.DDP(module, comm_dtype=dtype, **kw)


def make_step(method: str, wrapper: nn.Module, spec: ModelSpec, x: torch.Tensor) -> Callable[[], None]:
    module = wrapper.module
    if method == "no_sync":

        def step() -> None:
            module.zero_grad(set_to_none=True)
            with wrapper.no_sync():
                loss_of(spec, wrapper(x)).backward()

    else:

        def step() -> None:
            module.zero_grad(set_to_none=True)
            loss_of(spec, wrapper(x)).backward()

    return step


def count_buckets(method: str, wrapper: nn.Module) -> Optional[int]:
    """Buckets of the wrapper's current layout (torch DDP: from its logging data, after the rebuild)."""
    if method.startswith("fastcoll"):
        return len(wrapper.bucket_info())
    try:
        data = wrapper._get_ddp_logging_data()  # private torch API: informative only
        sizes = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or "")
        return len([s for s in sizes.split(",") if s.strip()]) or None
    except Exception:
        return None


def compare_grads(a: nn.Module, b: nn.Module, rtol: float) -> Dict[str, Any]:
    """Compare the ``.grad`` of two modules' parameters (same architecture).

    ``close``: the largest absolute difference is at most ``rtol`` times the
    largest gradient magnitude of ``b`` (half-precision communication rounds
    small gradients to a grid set by the large ones, so a per-element or
    per-parameter relative test would flag correct results).
    """
    equal = shapes_ok = True
    max_abs = scale = 0.0
    with torch.no_grad():
        for pa, pb in zip(a.parameters(), b.parameters()):
            ga, gb = pa.grad, pb.grad
            if ga is None or gb is None or ga.shape != gb.shape:
                if ga is not None or gb is not None:
                    equal = shapes_ok = False
                continue
            if ga.numel() == 0:
                continue
            scale = max(scale, float(gb.abs().max()))
            if not torch.equal(ga, gb):
                equal = False
                max_abs = max(max_abs, float((ga - gb).abs().max()))
    close = equal or (shapes_ok and max_abs <= rtol * scale)
    return {"equal": equal, "close": close, "max_abs_diff": max_abs, "max_abs_grad": scale}


# ---------------------------------------------------------------------------
# The ranks
# ---------------------------------------------------------------------------


def _all_max(values: List[float], device: str) -> List[float]:
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _synced_time(step: Callable[[], None], device: str) -> float:
    common.synchronize(device)
    t0 = time.perf_counter()
    step()
    common.synchronize(device)
    return time.perf_counter() - t0


def _warm_up_code_paths(device: str) -> None:
    """Run each wrapper once on a tiny model, so that no measured case pays one-time costs."""
    import torch.distributed as dist

    spec = ModelSpec("warmup", "", "mlp", {"width": 4, "depth": 2}, batch=2)

    for method in ("no_sync", "torch", "fastcoll"):
        w = make_wrapper(method, build_model(spec, device), False, device)
        step = make_step(method, w, spec, make_input(spec, dist.get_rank(), device))
        for _ in range(3):
            step()
        del w, step


def bench_case(case: Case, rank: int, cfg: Dict[str, Any], tick: Callable[[int], None]) -> Dict[str, Any]:
    device = cfg["device"]
    spec = case.spec
    storage = build_storage(spec, device)
    x = make_input(spec, rank, device)
    wrappers: Dict[str, nn.Module] = {}
    steps: Dict[str, Callable[[], None]] = {}
    info: Dict[str, Dict[str, Any]] = {}
    probe = MemoryProbe(device)
    for method in case.methods:
        module = build_model(spec, device, storage)
        probe.start()
        wrapper = make_wrapper(method, module, case.gabv, device)
        step = make_step(method, wrapper, spec, x)
        for _ in range(cfg["setup_steps"] - 1):  # bucket rebuilds happen here
            step()
        w0 = bytes_written()
        one = _synced_time(step, device)
        w1 = bytes_written()
        info[method] = {
            "peak_mem_bytes": probe.peak(),
            "sent_bytes_per_step": (w1 - w0) if device == "cpu" and w0 is not None and w1 is not None else None,
            "buckets": count_buckets(method, wrapper),
            "setup_step_s": one,
        }
        wrappers[method], steps[method] = wrapper, step
        tick(1)

    # Gradient check: every instance ran the same steps from the same state on the same inputs.
    checks: Dict[str, Dict[str, Any]] = {}
    pairs = [("fastcoll", "torch")] if case.section == "fp32" else [(f"fastcoll {d}", f"torch {d} hook") for d, _ in COMM_DTYPES]
    for mine, theirs in pairs:
        half = case.section != "fp32"
        checks[mine] = compare_grads(wrappers[mine].module, wrappers[theirs].module, rtol=1e-2 if half else 1e-5)

    # Calibrate from the last setup step: one sample = inner steps, the same count on every rank and method.
    per_step = _all_max([max(i["setup_step_s"] for i in info.values())], device)[0]
    inner = 1 if cfg["target_s"] <= 0 else max(1, min(cfg["max_inner"], int(math.ceil(cfg["target_s"] / max(per_step, 1e-6)))))
    samples = common.measure_interleaved(steps, device, warmup=0, reps=cfg["reps"], inner=inner, on_sample=lambda: tick(1))
    samples = {m: _all_max(s, device) for m, s in samples.items()}
    peaks = _all_max([float(info[m]["peak_mem_bytes"] or 0) for m in case.methods], device)
    sent = _all_max([float(info[m]["sent_bytes_per_step"] or 0) for m in case.methods], device)
    for m, p, s in zip(case.methods, peaks, sent):
        if info[m]["peak_mem_bytes"] is not None:
            info[m]["peak_mem_bytes"] = int(p)
        if info[m]["sent_bytes_per_step"] is not None:
            info[m]["sent_bytes_per_step"] = int(s)
    params = [p for p in wrappers[case.methods[-1]].module.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    del wrappers, steps, storage
    gc.collect()
    return _row(case, cfg, samples, info, checks, inner, len(params), numel)


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def _row(case, cfg, samples, info, checks, inner, nparams, numel) -> Dict[str, Any]:
    stats = {m: common.summarize(s) for m, s in samples.items()}
    floor = stats["no_sync"]["median_s"]
    methods = {}
    for m, st in stats.items():
        methods[m] = {**st, **info[m], "sync_overhead_s": None if m == "no_sync" else st["median_s"] - floor}
    row: Dict[str, Any] = {
        "section": case.section,
        "model": case.spec.name,
        "label": case.spec.label,
        "synthetic": case.spec.synthetic,
        "gradient_as_bucket_view": case.gabv,
        "params": nparams,
        "numel": numel,
        "inner": inner,
        "methods": methods,
        "grads": checks,
    }
    if case.section == "fp32":
        t, f = methods["torch"], methods["fastcoll"]
        ratio = _ratio(f["median_s"], t["median_s"])
        sync_ratio = (
            _ratio(f["sync_overhead_s"], t["sync_overhead_s"]) if t["sync_overhead_s"] and t["sync_overhead_s"] > 0 else None
        )
        row["ratios"] = {
            "fastcoll/torch": ratio,
            "sync fastcoll/torch": sync_ratio,
            "no_sync/torch": _ratio(floor, t["median_s"]),
        }
        if cfg["device"] == "cuda":
            row["targets"] = {
                "step": {"op": "le", "threshold": GPU_TARGET, "value": ratio, "pass": ratio is not None and ratio <= GPU_TARGET}
            }
        else:
            row["targets"] = {
                "step": {"op": "le", "threshold": CPU_TARGET, "value": ratio, "pass": ratio is not None and ratio <= CPU_TARGET},
                "sync": {
                    "op": "le",
                    "threshold": "torch DDP's",
                    "value": f["sync_overhead_s"],
                    "pass": f["sync_overhead_s"] <= t["sync_overhead_s"],
                },
            }
    else:
        row["ratios"] = {
            f"fastcoll {d}/torch {d} hook": _ratio(methods[f"fastcoll {d}"]["median_s"], methods[f"torch {d} hook"]["median_s"])
            for d, _ in COMM_DTYPES
        }
    return row


def _worker(rank: int, ws: int, store_path: str, cfg: Dict[str, Any], cases: List[Case], out_path: str, progress_q: Any) -> None:
    device = cfg["device"]
    if cfg.get("collectives") is not None:  # before any wrapper or helper reads it
        os.environ["FASTCOLL_FORCE_COLLECTIVES"] = "1" if cfg["collectives"] == "forced" else "0"
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())

    tick = common.rank_ticker(rank, progress_q)

    with common.rank_process_group(rank, ws, store_path, cfg["threads"], cfg["backend"]):
        if not cfg["smoke"]:
            _warm_up_code_paths(device)
        gc.collect()
        gc.freeze()  # later collections skip the (many) long-lived objects of torch: ms instead of 0.3 s
        rows = []
        for case in cases:
            if rank == 0 and progress_q is not None:
                progress_q.put(("describe", f"ddp: {case.title}"))
            rows.append(bench_case(case, rank, cfg, tick))
        common.save_rank_rows(rank, out_path, rows)


# ---------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------


def _run_pass(cfg: Dict[str, Any], cases: List[Case], bar: Any) -> Dict[str, Any]:
    """Spawn the ranks of one pass and wait for them; returns rank 0's ``{"rows", "implementation"}``."""
    import torch.multiprocessing as tmp

    ws = cfg["world_size"]
    with tempfile.TemporaryDirectory(prefix="fastcoll_bench_ddp_") as tmpdir:
        out_path = os.path.join(tmpdir, "result.json")
        mpctx = tmp.get_context("spawn")
        progress_q = mpctx.Queue()
        ctx = tmp.spawn(
            _worker,
            args=(ws, os.path.join(tmpdir, "store"), cfg, cases, out_path, progress_q),
            nprocs=ws,
            join=False,
        )
        common.follow_ranks(ctx, progress_q, bar)
        with open(out_path) as f:
            return json.load(f)


def measure(args: Any = None, on_pass: Optional[Callable[[Dict[str, Any]], None]] = None) -> Dict[str, Any]:
    """Spawn the ranks, run the benchmark and return its results.

    Args:
        args: An argparse namespace (or None) with optional ``device``,
            ``quick``, ``smoke`` and ``threads`` attributes, as the CLI gives.
        on_pass: Called with the results so far after each pass (see
            :func:`collective_passes`), e.g. to write them before the next starts.

    Returns:
        ``{"benchmark": "ddp", "config": {...}, "implementation": ...,
        "comm_dtype": {...}, "results": [row, ...]}``; each row has the model,
        the gradient_as_bucket_view setting, per method the timing summary
        (seconds), ``sync_overhead_s``, ``peak_mem_bytes``,
        ``sent_bytes_per_step`` and ``buckets``, plus ``ratios``, ``targets``
        (fp32 rows) and the gradient check ``grads``. One-rank runs also
        have ``config["collective_passes"]`` (the passes asked for),
        ``config["passes"]`` (``{pass: {"ok": bool, "error": str}}``) and, per
        row, ``collectives`` ("plain" or "forced").
    """
    device = getattr(args, "device", "cpu") or "cpu"
    cfg = _config(args, device)
    with_comm = comm_dtype_supported()
    cases = build_cases(cfg, with_comm)
    ws = cfg["world_size"]
    passes = collective_passes(cfg)
    rows: List[Dict[str, Any]] = []
    implementation: Optional[str] = None
    status: Dict[str, Dict[str, Any]] = {}
    payload: Dict[str, Any] = {}
    units = progress_units(cases, cfg) * len(passes)
    with common.progress(units, f"ddp: starting {ws} rank{'s' if ws > 1 else ''}") as bar:
        for p in passes:
            try:
                result = _run_pass({**cfg, "collectives": p}, cases, bar)
            except Exception as exc:
                if p is None:
                    raise
                error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"  # one line (spawn's errors hold a traceback)
                status[p] = {"ok": False, "error": error}
                common.say(f"[red]fastcoll.bench ddp: the '{p}' pass ({PASS_DESCRIPTIONS[p]}) failed: {error}[/red]")
            else:
                implementation = result["implementation"]
                for r in result["rows"]:
                    if p is not None:
                        r["collectives"] = p
                        r["label"] += PASS_SUFFIX[p]
                rows += result["rows"]
                if p is not None:
                    status[p] = {"ok": True}
            payload = _payload(cfg, cases, with_comm, implementation, rows, passes, status)
            if on_pass is not None:
                on_pass(payload)
    return payload


def _payload(cfg, cases, with_comm, implementation, rows, passes, status) -> Dict[str, Any]:
    config: Dict[str, Any] = {
        **cfg,
        "models": [dataclasses.asdict(c.spec) for c in cases if c.section == "fp32" and not c.gabv],
        "methods": {**METHOD_DESCRIPTIONS, **(COMM_DESCRIPTIONS if with_comm else {})},
        "step": "module.zero_grad(set_to_none=True); loss(wrapper(x)).backward()  (no optimizer step)",
        "synthetic_models": "parameters of the model's shapes, forward = sum_i p_i.sum() * x_i: the step is "
        "dominated by writing and synchronizing the gradients",
        "targets": {
            "cpu": f"step <= {CPU_TARGET}x torch DDP and sync overhead <= torch DDP's",
            "cuda": f"step <= {GPU_TARGET}x torch DDP",
        },
    }
    if passes != [None]:
        config["collective_passes"] = list(passes)
        config["passes"] = dict(status)
        config["pass_descriptions"] = {p: PASS_DESCRIPTIONS[p] for p in passes}
    return {
        "benchmark": "ddp",
        "config": config,
        "implementation": implementation,
        "comm_dtype": {"supported": with_comm, "measured": with_comm},
        "results": list(rows),
    }


def _mib(nbytes: Optional[float]) -> str:
    if nbytes is None:
        return "-"
    return f"{nbytes / MiB:.1f}" if abs(nbytes) >= 10 * MiB or nbytes == 0 else f"{nbytes / MiB:.2f}"


def _grads_cell(check: Dict[str, Any]) -> str:
    if check["equal"]:
        return "[green]equal[/green]"
    if check["close"]:
        return f"[green]close[/green] ({check['max_abs_diff']:.1e})"
    return f"[red]DIFFER[/red] ({check['max_abs_diff']:.1e})"


def _signed_time(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    return ("-" if seconds < 0 else "") + common.fmt_time(abs(seconds))


def print_results(payload: Dict[str, Any]) -> None:
    """Print the timing table, the memory/traffic table and (when measured) the comm_dtype table, per pass."""
    passes = payload["config"].get("collective_passes") or [None]
    for p in passes:
        results = [r for r in payload["results"] if r.get("collectives") == p]
        if p is not None and not results:
            error = payload["config"].get("passes", {}).get(p, {}).get("error", "no rows")
            common.say(f"[red]fastcoll ddp: no results for the '{p}' pass ({PASS_DESCRIPTIONS[p]}): {error}[/red]")
            continue
        _print_tables(payload, results, p)


def _print_tables(payload: Dict[str, Any], results: List[Dict[str, Any]], collectives: Optional[str]) -> None:
    cfg = payload["config"]
    device = cfg["device"]
    cpu = device == "cpu"
    rows = [r for r in results if r["section"] == "fp32"]
    title_pass = "" if collectives is None else f", {'collectives forced' if collectives == 'forced' else 'no collectives'}"
    columns = ["model", "view", "no_sync", "torch DDP", "fastcoll", "fastcoll/torch", "sync torch", "sync fastcoll", "grads"]
    columns += [f"step ≤{CPU_TARGET}x", "sync ≤ torch"] if cpu else [f"step ≤{GPU_TARGET}x"]
    table = []
    for r in rows:
        m = r["methods"]
        t, f = m["torch"], m["fastcoll"]
        line = [
            r["label"] + (" *" if r["synthetic"] else ""),
            "yes" if r["gradient_as_bucket_view"] else "no",
            common.fmt_time(m["no_sync"]["median_s"]),
            common.fmt_time(t["median_s"]),
            common.fmt_time(f["median_s"]),
            common.fmt_ratio(r["ratios"]["fastcoll/torch"]),
            _signed_time(t["sync_overhead_s"]),
            _signed_time(f["sync_overhead_s"]),
            _grads_cell(r["grads"]["fastcoll"]),
            common.pass_miss(r["targets"]["step"]["pass"]),
        ]
        if cpu:
            line.append(common.pass_miss(r["targets"]["sync"]["pass"]))
        table.append(line)
    where = (
        f"{cfg['world_size']} gloo ranks on loopback, {cfg['threads']} intra-op thread(s) each"
        if cpu
        else f"{cfg['world_size']} rank on NCCL"
        + (f" ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else "")
        + (
            " (with one rank fastcoll.DDP issues no all-reduce; torch DDP does)"
            if collectives != "forced"
            else " with FASTCOLL_FORCE_COLLECTIVES=1 (fastcoll.DDP issues its all-reduces and broadcasts, as torch DDP does)"
        )
    )
    caption = (
        f"{where}; ops: {payload['implementation']}. Median step (slowest rank) = zero_grad + forward + backward, "
        "no optimizer; samples interleaved across methods.\n"
        "no_sync: torch DDP inside no_sync(), the compute-only floor; sync = step - no_sync step; view = "
        "gradient_as_bucket_view; grads: fastcoll's vs torch DDP's after the same steps.\n"
        "* synthetic: parameters of the model's shapes, forward = sum_i p_i.sum() * x_i, so the step is dominated "
        "by gradient synchronization. Targets are informational, never asserted."
    )
    common.render_table(
        f"fastcoll ddp: fastcoll.DDP vs torch DDP, step time ({device}{title_pass})", columns, table, caption=caption
    )

    columns = ["model", "view", "params", "grad MiB", "buckets torch", "buckets fastcoll", "peak MiB torch", "peak MiB fastcoll"]
    columns += ["sent MiB torch", "sent MiB fastcoll"] if cpu else []
    table = []
    for r in rows:
        m = r["methods"]
        t, f = m["torch"], m["fastcoll"]
        line = [
            r["label"] + (" *" if r["synthetic"] else ""),
            "yes" if r["gradient_as_bucket_view"] else "no",
            str(r["params"]),
            _mib(4 * r["numel"]),
            str(t["buckets"] or "-"),
            str(f["buckets"] or "-"),
            _mib(t["peak_mem_bytes"]),
            _mib(f["peak_mem_bytes"]),
        ]
        if cpu:
            line += [_mib(t["sent_bytes_per_step"]), _mib(f["sent_bytes_per_step"])]
        table.append(line)
    caption = (
        "peak: "
        + (
            "growth of the resident set (high-water mark reset, free heap returned first)"
            if cpu
            else "torch.cuda.max_memory_allocated above the allocation before"
        )
        + " while the wrapper is built and runs its first steps (max over ranks)"
        + ("; sent: bytes a rank wrote to its sockets in one step (/proc/self/io wchar)" if cpu else "")
        + "; buckets after the rebuild of the first iteration."
    )
    common.render_table(f"fastcoll ddp: memory and traffic ({device}{title_pass})", columns, table, caption=caption)

    comm = [r for r in results if r["section"] == "comm_dtype"]
    if not payload["comm_dtype"]["supported"]:
        common.say("[yellow]comm_dtype rows skipped: this checkout's fastcoll.DDP has no comm_dtype argument (issue 5)[/yellow]")
        return
    if not comm:
        return
    columns = ["model", "no_sync"]
    for d, _ in COMM_DTYPES:
        columns += [f"torch {d} hook", f"fastcoll {d}", "ratio", "sent MiB t/f", "grads"]
    table = []
    for r in comm:
        m = r["methods"]
        line = [r["label"] + (" *" if r["synthetic"] else ""), common.fmt_time(m["no_sync"]["median_s"])]
        for d, _ in COMM_DTYPES:
            t, f = m[f"torch {d} hook"], m[f"fastcoll {d}"]
            line += [
                common.fmt_time(t["median_s"]),
                common.fmt_time(f["median_s"]),
                common.fmt_ratio(r["ratios"][f"fastcoll {d}/torch {d} hook"]),
                f"{_mib(t['sent_bytes_per_step'])}/{_mib(f['sent_bytes_per_step'])}",
                _grads_cell(r["grads"][f"fastcoll {d}"]),
            ]
        table.append(line)
    common.render_table(
        f"fastcoll ddp: comm_dtype vs torch DDP + compress hooks ({device}{title_pass})",
        columns,
        table,
        caption="ratio = fastcoll comm_dtype step / torch DDP + the same-dtype compress hook step (<1: fastcoll faster); "
        "sent: MiB each rank wrote per step (torch/fastcoll); grads compared with a half-precision tolerance.",
    )


def _summary(payload: Dict[str, Any]) -> None:
    rows = [r for r in payload["results"] if r["section"] == "fp32"]
    misses = [
        f"{r['label']}{' (bucket view)' if r['gradient_as_bucket_view'] else ''}: {name}"
        for r in rows
        for name, t in r["targets"].items()
        if not t["pass"]
    ]
    total = sum(len(r["targets"]) for r in rows)
    if total:
        common.say(f"[bold]targets (issue 3; informational, never asserted):[/bold] {total - len(misses)}/{total} PASS")
        for m in misses:
            common.say(f"  [red]MISS[/red] {m}")
    bad = [r for r in payload["results"] for k, c in r["grads"].items() if not c["close"]]
    for r in bad:
        common.say(f"[red]warning: {r['label']}: fastcoll's gradients differ from torch DDP's (see the grads column)[/red]")


def chart(path: Path, payload: Dict[str, Any]) -> Optional[Path]:
    """Step times relative to torch DDP's (the comm_dtype panel: to torch DDP + the same-dtype hook)."""
    panels: Dict[str, Dict[str, Dict[str, float]]] = {"fp32: step time / torch DDP step": {}}
    comm_title = "comm_dtype: step time / torch DDP + same-dtype compress hook step"
    for r in payload["results"]:
        m = r["methods"]
        floor = m["no_sync"]["median_s"]
        if r["section"] == "fp32":
            name = r["label"] + (" +view" if r["gradient_as_bucket_view"] else "")
            base = m["torch"]["median_s"]
            panels["fp32: step time / torch DDP step"][name] = {
                "no_sync": floor / base,
                "fastcoll": m["fastcoll"]["median_s"] / base,
            }
        else:
            for d, _ in COMM_DTYPES:
                base = m[f"torch {d} hook"]["median_s"]
                panels.setdefault(comm_title, {})[f"{r['label']} {d}"] = {
                    "no_sync": floor / base,
                    "fastcoll": m[f"fastcoll {d}"]["median_s"] / base,
                }
    return common.bar_chart(
        path,
        f"fastcoll ddp ({payload['config']['device']}): step time relative to torch DDP "
        "(dashed = 1, lower is better; no_sync = compute-only floor)",
        panels,
        "time / torch DDP",
        reference_line=1.0,
    )


def run(args: Any = None) -> int:
    """CLI entry (``python -m fastcoll.bench ddp``): measure, print the tables, write JSON and a chart.

    Returns:
        0 on success, 1 if fastcoll's gradients differ from torch DDP's or a
        pass failed, 2 if ``--device cuda`` is asked for without a GPU.
    """
    device = getattr(args, "device", "cpu") or "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        common.say("[red]fastcoll.bench ddp: --device cuda but torch.cuda.is_available() is False[/red]")
        return 2
    from .. import ops

    if ops.implementation() != "extension":
        common.say(
            "[yellow]fastcoll.bench ddp: the C++ extension is not loaded; fastcoll.DDP packs with the "
            "pure-PyTorch reference ops, not the fused kernels[/yellow]"
        )
    if not comm_dtype_supported():
        common.say(
            "[yellow]fastcoll.bench ddp: fastcoll.DDP has no comm_dtype argument; the comm_dtype rows are skipped[/yellow]"
        )
    common.say(
        "[dim]ResNet-50 and GPT-2 rows (*) are synthetic: parameters of those shapes with a forward of one "
        "read per parameter, so their step is dominated by gradient synchronization.[/dim]"
    )
    path = common.resolve_json_path(args, f"ddp_{device}")
    # Written after every pass too, so that a later pass that hangs or dies leaves the earlier results.
    payload = measure(args, on_pass=lambda partial: common.write_json(path, partial, device))
    print_results(payload)
    _summary(payload)
    common.write_json(path, payload, device)
    png = chart(path.with_suffix(".png"), payload) if payload["results"] else None
    why = "matplotlib missing" if payload["results"] else "no results"
    common.say(f"wrote {path}" + (f" and {png}" if png else f" ({why}: no chart)"))
    ok = all(c["close"] for r in payload["results"] for c in r["grads"].values())
    passes_ok = all(st["ok"] for st in payload["config"].get("passes", {}).values())
    return 0 if ok and passes_ok else 1


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m fastcoll.bench.ddp [--device cpu|cuda] [--quick] [--threads N|all] [--json PATH]``."""
    from .__main__ import main as cli

    return cli(["ddp", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
