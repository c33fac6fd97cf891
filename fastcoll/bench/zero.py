"""ZeRO-1: ``fastcoll.ShardedOptimizer`` against torch's ZeroRedundancyOptimizer and plain data parallelism.

    python -m fastcoll.bench zero [--device cpu|cuda] [--quick] [--threads N|all] [--json PATH]

On CPU, 2 gloo ranks over loopback, 1 intra-op thread each (``--threads``
changes that); with ``--device cuda`` one NCCL rank per GPU (at least 2).
Per bench model (:mod:`fastcoll.bench.ddp`'s MLP of 96 small layers and the
synthetic sets of ResNet-50's and GPT-2 small's parameter shapes), five ways
to train with AdamW (:data:`ADAMW`: ``fused=True`` where the device supports
it, the fastest torch AdamW on CPU; the same flags everywhere):

* ``torch``: ``torch.nn.parallel.DistributedDataParallel`` + ``AdamW``;
* ``zero``: torch DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer(optimizer_class=AdamW)``;
* ``fastcoll``: ``fastcoll.DDP`` + ``AdamW``;
* ``full``: ``fastcoll.DDP`` + ``fastcoll.ShardedOptimizer(AdamW(...), model, grads="full")``;
* ``sharded``: the same with ``grads="sharded"`` (reduce-scattered gradients).

The synthetic models here hold each parameter in a module of its own, called
in registration order (:class:`LayeredShapeModel`; forward = ``sum_i
p_i.sum() * x_i`` as in the ddp bench), so that ShardedOptimizer's forward
pre-hooks wait for each parameter's bucket as a real model's layers would.
Their forward is one read per parameter: it has almost no compute to hide the
parameters' all-gather behind.

Measured, in two phases:

1. **Memory, state, traffic and a check**, each (model, method) in a fresh
   process pair (forkserver), so no peak carries over: the growth of the
   resident set's high-water mark (``VmHWM``, reset after a warm-up on a tiny
   model and a ``malloc_trim``; CUDA: ``max_memory_allocated``) from before the
   model is built through its first steps; the optimizer-state bytes on each
   rank (the tensors in ``opt.state``: for ZeroRedundancyOptimizer its local
   optimizer's, for ShardedOptimizer this rank's pieces'); the bytes each rank
   sends in one iteration (``/proc/self/io`` wchar, the all-gathers
   included); and the parameters after the same steps, compared with torch
   DDP + AdamW's.
2. **Step time**, the methods of a model side by side in one process pair,
   on shared weights, samples round-robin in rotating order, a sample's time
   the slowest rank's. A step is ``opt.zero_grad(set_to_none=True)``, forward,
   loss, backward and ``opt.step()``; ShardedOptimizer's all-gathers run on
   into the next forward, which waits for them module by module, so a sample
   times steady-state iterations end to end: one untimed lead-in iteration,
   then ``inner`` timed ones (each waits for the previous one's all-gathers),
   then, untimed, the last all-gathers are drained and the gradients dropped.
   Sample counts come from a time budget (:func:`sample_count`). Where all
   five methods would hold more than :data:`GROUP_LIMIT_BYTES` per rank (the
   GPT-2 shapes: about 7 GiB), they are timed in two process pairs,
   :data:`SPLIT_GROUPS`, each holding the methods of its targets (ZeRO in both).

For ``full`` and ``sharded`` the parameters' all-gathers are traced per bucket
(:attr:`fastcoll.reducer.param_gather.ParamGather.record_times`): packing and
issuing in ``step()``, the collective's span (first issued to last
completed, from gloo's completion callbacks), the training thread's wait for
it in the next forward (exposed) and the write into the parameters; the
forward's length comes from ``model.sync_timeline()``.

Targets (printed with their 90% bootstrap intervals and MET / MISSED / not
resolved, never asserted): optimizer state per rank at most 1/N of DDP's
(+1%); step time at most 0.8x ZeroRedundancyOptimizer's with either grads
mode, and with ``grads="sharded"`` at most 1.0x torch DDP + AdamW's on the
ResNet-50 and GPT-2 shapes; peak memory per rank below torch DDP + AdamW's by
at least the optimizer state saved.

gloo has no reduce-scatter of its own: ``reduce_scatter_tensor`` sends what an
all-reduce sends (a true reduce-scatter sends half). fastcoll's communicator
does it with one send and one receive of a half each between 2 ranks
(:mod:`fastcoll.reducer.p2p`), and with an in-place all-reduce beyond: at 2 ranks
``grads="sharded"`` then moves what DDP moves (half an all-reduce for the
gradients, the other half for the parameters' all-gather), where ``grads="full"``
and ZeRO move 1.5x; on NCCL the two halves add up to one all-reduce at any size.
gloo's reduce-scatter and all-gather also work on temporaries as large as their
buffer, which are resident memory the sharded state does not save, and its
all-gather can take longer than the same exchange done as broadcasts
(ZeroRedundancyOptimizer's way). The bytes sent per iteration, and a probe of
one collective of each kind on a bucket-sized buffer (:func:`collective_costs`:
time, peak growth, bytes), show what this backend does.

Then the **bfloat16 section** (:mod:`fastcoll.bench.zero_bf16`): GPT-2 shapes
in bfloat16 under torch DDP, in float32 with ``autocast(bfloat16)``, and with
``fastcoll.DDP(main_grad_dtype=torch.float32)`` + ``ShardedOptimizer(master_dtype=
torch.float32)``: bytes per rank by kind, peak memory and step time; and the
quality of a tiny causal LM trained 300 AdamW steps each way. Its own JSON and
chart: ``benchmarks/out/zero_bf16_<device>.json`` / ``.png``.

``--quick`` (at most about 2.5 minutes on 2 cores, the bfloat16 section about
1 of them) leaves the GPT-2 shapes out here and takes 5 to 20 samples per
method; the full run 10 to 60 (GPT-2: 6 to 20), about 10-12 minutes with the
bfloat16 section (3.5). ``--smoke`` (hidden; tests) runs one tiny synthetic
model with 2 one-iteration samples. Output: tables on the terminal,
``benchmarks/out/zero_<device>.json`` and a PNG chart next to it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import common
from . import ddp as bench_ddp
from .common import MiB

CPU_WORLD_SIZE = 2
METHODS = ("torch", "zero", "fastcoll", "full", "sharded")
SHARDED = ("full", "sharded")
#: Short names in tables; "grads=..." are fastcoll.ShardedOptimizer's two modes.
METHOD_LABELS = {
    "torch": "torch DDP",
    "zero": "torch ZeRO",
    "fastcoll": "fastcoll.DDP",
    "full": "grads=full",
    "sharded": "grads=sharded",
}
METHOD_DESCRIPTIONS = {
    "torch": "torch.nn.parallel.DistributedDataParallel(module) + torch.optim.AdamW",
    "zero": "torch DDP + torch.distributed.optim.ZeroRedundancyOptimizer(params, optimizer_class=AdamW)",
    "fastcoll": "fastcoll.DDP(module) + torch.optim.AdamW",
    "full": 'fastcoll.DDP(module) + fastcoll.ShardedOptimizer(AdamW(...), model, grads="full")',
    "sharded": 'fastcoll.DDP(module) + fastcoll.ShardedOptimizer(AdamW(...), model, grads="sharded")',
}
#: AdamW's arguments for every method; ``fused=True`` is added where the device supports it (:func:`adamw_kwargs`).
ADAMW: Dict[str, Any] = {"lr": 1e-3, "weight_decay": 0.01}

STATE_TOLERANCE = 0.01  # state per rank <= (1 + this) x DDP's / N
STEP_VS_ZERO = 0.8  # full and sharded: step <= this x ZeroRedundancyOptimizer's
STEP_VS_TORCH = 1.0  # sharded: step <= this x torch DDP + AdamW's ...
STEP_VS_TORCH_MODELS = ("resnet50", "gpt2_small")  # ... on these models

#: Rough per-rank bytes a method adds in a timing process, in multiples of the parameters' bytes (bucket
#: buffers, optimizer state, reduced ranges); the parameters and one set of gradients are shared.
FOOTPRINT = {"torch": 3.0, "zero": 2.0, "fastcoll": 3.0, "full": 2.0, "sharded": 2.5}
#: Above this estimate per rank, a model's methods are timed in :data:`SPLIT_GROUPS` rather than together.
GROUP_LIMIT_BYTES = 3 << 30
#: Two process pairs covering every target: sharded vs ZeRO and torch DDP; full vs ZeRO (and fastcoll.DDP).
SPLIT_GROUPS: Tuple[Tuple[str, ...], ...] = (("torch", "zero", "sharded"), ("zero", "fastcoll", "full"))

MET, MISSED, UNRESOLVED = "MET", "MISSED", "not resolved"
#: The buffer of :func:`collective_costs` (a default DDP bucket).
COLLECTIVE_PROBE_BYTES = 25 * MiB
#: Seconds the rank processes may take to exit after rank 0 wrote its results (then they are killed).
EXIT_GRACE_S = 60.0
#: Imported once by the forkserver the rank processes are forked from.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.distributed.optim", "fastcoll", "fastcoll.bench.zero",
           "fastcoll.bench.zero_bf16")  # fmt: skip


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------


def _config(args: Any, device: str) -> Dict[str, Any]:
    smoke, quick = bool(getattr(args, "smoke", False)), bool(getattr(args, "quick", False))
    # reps..max_reps samples per method, as many as budget_s of a group's sampling allows (large: the GPT-2 shapes)
    if smoke:
        cfg: Dict[str, Any] = dict(reps=2, max_reps=2, budget_s=0.0, reps_large=2, max_reps_large=2, budget_large_s=0.0)
        cfg.update(setup_steps=2, target_s=0.0, max_inner=1)
    elif quick:
        cfg = dict(reps=5, max_reps=20, budget_s=15.0, reps_large=3, max_reps_large=6, budget_large_s=30.0)
        cfg.update(setup_steps=3, target_s=0.05, max_inner=20)
    else:
        cfg = dict(reps=10, max_reps=60, budget_s=60.0, reps_large=6, max_reps_large=20, budget_large_s=100.0)
        cfg.update(setup_steps=3, target_s=0.1, max_inner=50)
    cfg.update(smoke=smoke, quick=quick or smoke, device=device)
    if device == "cuda":
        cfg["world_size"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
        cfg["backend"] = "nccl"
    else:
        cfg["world_size"] = CPU_WORLD_SIZE
        cfg["backend"] = "gloo"
    cfg["threads"] = bench_ddp._threads_per_rank(args, max(cfg["world_size"], 1))
    cfg["group_limit_bytes"] = GROUP_LIMIT_BYTES
    return cfg


def model_specs(cfg: Dict[str, Any]) -> List[bench_ddp.ModelSpec]:
    """The models: the ddp bench's MLP and the ResNet-50 / GPT-2 shape sets (``--quick``: no GPT-2; smoke: tiny)."""
    ModelSpec = bench_ddp.ModelSpec
    if cfg["smoke"]:
        return [
            ModelSpec("resnet50", "ResNet-50 shapes (24, x1/256)", "shapes", {"model": "resnet50", "limit": 24, "divide": 256})
        ]
    specs = [
        ModelSpec("mlp96", "MLP 96x(32x32)", "mlp", {"width": 32, "depth": 96}, batch=32),
        ModelSpec("resnet50", "ResNet-50 shapes", "shapes", {"model": "resnet50"}, note="synthetic"),
        ModelSpec("gpt2_small", "GPT-2 small shapes", "shapes", {"model": "gpt2_small"}, note="synthetic"),
    ]
    return [s for s in specs if s.name != "gpt2_small"] if cfg["quick"] else specs


def _large(spec: bench_ddp.ModelSpec) -> bool:
    return spec.name == "gpt2_small"


def param_count(spec: bench_ddp.ModelSpec) -> int:
    """The number of parameter elements of ``spec``'s model (without building the synthetic ones)."""
    if spec.synthetic:
        return sum(math.prod(s) for s in bench_ddp._spec_shapes(spec)[1])
    return sum(p.numel() for p in bench_ddp.build_model(spec, "cpu").parameters())


def timing_groups(param_bytes: int, limit_bytes: int) -> List[Tuple[str, ...]]:
    """The methods timed together in one process pair: all of them, or :data:`SPLIT_GROUPS` above ``limit_bytes``."""
    estimate = param_bytes * (2.0 + sum(FOOTPRINT[m] for m in METHODS))
    return [METHODS] if estimate <= limit_bytes else [tuple(g) for g in SPLIT_GROUPS]


def sample_count(cfg: Dict[str, Any], large: bool, round_s: float) -> int:
    """Samples per method: as many rounds (``round_s`` each) as the budget allows, within the configured bounds."""
    lo, hi, budget = (
        (cfg["reps_large"], cfg["max_reps_large"], cfg["budget_large_s"])
        if large
        else (cfg["reps"], cfg["max_reps"], cfg["budget_s"])
    )
    fit = int(budget / max(round_s, 1e-6))
    return max(lo, min(hi, fit))


# ---------------------------------------------------------------------------
# Models, methods, steps
# ---------------------------------------------------------------------------


class ParamHolder(nn.Module):
    """One parameter in a module of its own; ``forward()`` returns its sum (one read of it)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight)

    def forward(self) -> torch.Tensor:
        return self.weight.sum()


class LayeredShapeModel(nn.Module):
    """:class:`fastcoll.bench.ddp.ShapeModel` with every parameter in its own module, called in registration order.

    ``forward(x) = sum_i p_i.sum() * x[i]``, as ShapeModel's, but each
    ``p_i.sum()`` is a module call, so forward pre-hooks (ShardedOptimizer's
    waits for the parameters' all-gathers) run before each parameter is read.
    """

    def __init__(self, shapes: Sequence[Sequence[int]], storage: Optional[Sequence[torch.Tensor]] = None, device: Any = "cpu"):
        super().__init__()
        if storage is None:
            storage = [torch.full(tuple(s), 0.01, device=device) for s in shapes]
        self.layers = nn.ModuleList(ParamHolder(t) for t in storage)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([m() for m in self.layers]) @ x


def build_model(spec: bench_ddp.ModelSpec, device: str, storage: Optional[List[torch.Tensor]] = None) -> nn.Module:
    """``spec``'s model, seed-0 weights (``storage``: share these tensors, see :func:`fastcoll.bench.ddp.build_storage`)."""
    if spec.synthetic:
        return LayeredShapeModel(bench_ddp._spec_shapes(spec)[1], storage, device)
    return bench_ddp.build_model(spec, device, storage)


_FUSED: Dict[str, bool] = {}


def adamw_kwargs(device: str) -> Dict[str, Any]:
    """:data:`ADAMW`, plus ``fused=True`` when torch's fused AdamW runs on ``device``."""
    if device not in _FUSED:
        try:
            p = torch.zeros(2, device=device, requires_grad=True)
            p.grad = torch.ones_like(p)
            torch.optim.AdamW([p], fused=True).step()
            _FUSED[device] = True
        except (RuntimeError, ValueError, TypeError):
            _FUSED[device] = False
    return {**ADAMW, **({"fused": True} if _FUSED[device] else {})}


def make_method(method: str, module: nn.Module, device: str) -> Tuple[nn.Module, torch.optim.Optimizer]:
    """The wrapper and the optimizer of ``method`` (one of :data:`METHODS`) around ``module``."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import fastcoll

    kw: Dict[str, Any] = {}
    if device == "cuda":
        kw["device_ids"] = [torch.cuda.current_device()]
    adamw = adamw_kwargs(device)
    if method in ("torch", "zero"):
        wrapper: nn.Module = TorchDDP(module, **kw)
    else:
        wrapper = fastcoll.DDP(module, **kw)
    if method == "zero":
        opt: torch.optim.Optimizer = ZeroRedundancyOptimizer(wrapper.parameters(), optimizer_class=torch.optim.AdamW, **adamw)
    elif method in SHARDED:
        opt = fastcoll.ShardedOptimizer(torch.optim.AdamW(wrapper.parameters(), **adamw), wrapper, grads=method)
    else:
        opt = torch.optim.AdamW(wrapper.parameters(), **adamw)
    return wrapper, opt


def make_step(spec: bench_ddp.ModelSpec, wrapper: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> Callable[[], None]:
    """One training iteration: zero_grad(set_to_none=True), forward, loss, backward, step."""
    loss_of = bench_ddp.loss_of

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_of(spec, wrapper(x)).backward()
        opt.step()

    return step


def settle(opt: torch.optim.Optimizer) -> None:
    """Wait for a ShardedOptimizer's pending all-gathers (the parameters are whole after it); no-op otherwise."""
    finish = getattr(opt, "finish_param_sync", None)
    if finish is not None:
        finish()


def state_bytes(method: str, opt: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer-state tensors this rank holds (ZeRO: its local optimizer's; ShardedOptimizer: its pieces')."""
    state = opt.optim.state if method == "zero" else opt.state  # type: ignore[attr-defined]
    return sum(v.numel() * v.element_size() for s in state.values() for v in s.values() if torch.is_tensor(v))


def param_digest(module: nn.Module) -> List[float]:
    """Sum and sum of squares of every parameter, in float64 (compared across methods after the same steps)."""
    total = squares = 0.0
    with torch.no_grad():
        for p in module.parameters():  # one float64 copy at a time
            d = p.detach().double()
            total += float(d.sum())
            squares += float(torch.dot(d.view(-1), d.view(-1)))
    return [total, squares]


def _set_device(device: str, rank: int) -> None:
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())


def _gather(obj: Any) -> List[Any]:
    import torch.distributed as dist

    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _warm_up(method: str, device: str, rank: int) -> None:
    """A few iterations of ``method`` on a tiny model, so the measured model pays no one-time costs."""
    spec = bench_ddp.ModelSpec("warmup", "", "mlp", {"width": 4, "depth": 2}, batch=2)
    wrapper, opt = make_method(method, build_model(spec, device), device)
    step = make_step(spec, wrapper, opt, bench_ddp.make_input(spec, rank, device))
    for _ in range(3):
        step()
    settle(opt)
    del wrapper, opt, step
    gc.collect()


# ---------------------------------------------------------------------------
# Phase 1: memory, state, traffic (a fresh process pair per model and method)
# ---------------------------------------------------------------------------


class LiveBytes:
    """Bytes the C heap has handed out and not taken back (glibc ``mallinfo2``: every arena, mmapped blocks included).

    Unlike the resident set it leaves out freed memory the allocator keeps
    (fragments, per-thread arenas), so sampled between the phases of an
    iteration it tells what is really alive then. :attr:`available` is False
    off glibc (or before glibc 2.33); then every reading is None.
    """

    class _Info(ctypes.Structure):
        _fields_ = [
            (n, ctypes.c_size_t)
            for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
        ]

    def __init__(self) -> None:
        self._fn: Any = None
        try:
            fn = ctypes.CDLL("libc.so.6").mallinfo2
            fn.restype = LiveBytes._Info
            self._fn = fn
        except (OSError, AttributeError):  # pragma: no cover (not glibc, or glibc < 2.33)
            pass
        self.base = self.read() or 0
        self.peak = 0

    @property
    def available(self) -> bool:
        return self._fn is not None

    def read(self) -> Optional[int]:
        if self._fn is None:
            return None
        info = self._fn()
        return int(info.uordblks + info.hblkhd)

    def sample(self) -> None:
        """Note the bytes alive now (above the construction-time base) if they are the most so far."""
        now = self.read()
        if now is not None:
            self.peak = max(self.peak, now - self.base)


def measure_memory(spec: Any, method: str, rank: int, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """This rank's peak growth, optimizer-state bytes, bytes sent per iteration and parameter digest for ``method``.

    Besides the resident set's high-water mark (:class:`fastcoll.bench.ddp.MemoryProbe`),
    on CPU the heap's live bytes are sampled after each phase of every
    iteration (:class:`LiveBytes`: zero_grad, forward, backward, step, and the
    all-gathers' drain): their maximum leaves out what the allocator kept of
    freed memory, so the two together tell retention from live data.
    Everything built here is released when it returns (a torch DDP reducer
    released after its process group is destroyed can deadlock in gloo's
    destructor).
    """
    device = cfg["device"]
    probe = bench_ddp.MemoryProbe(device)
    probe.start()
    live = LiveBytes() if device == "cpu" else None
    module = build_model(spec, device)
    x = bench_ddp.make_input(spec, rank, device)
    wrapper, opt = make_method(method, module, device)
    sample = live.sample if live is not None else (lambda: None)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        sample()
        loss = bench_ddp.loss_of(spec, wrapper(x))
        sample()
        loss.backward()
        sample()
        opt.step()
        sample()

    for _ in range(cfg["setup_steps"]):
        step()
    settle(opt)
    sample()
    common.synchronize(device)
    w0 = bench_ddp.bytes_written()
    step()
    settle(opt)
    sample()
    common.synchronize(device)
    w1 = bench_ddp.bytes_written()
    return {
        "rank": rank,
        "peak_bytes": probe.peak(),
        "live_peak_bytes": live.peak if live is not None and live.available else None,
        "state_bytes": state_bytes(method, opt),
        "sent_bytes": (w1 - w0) if device == "cpu" and w0 is not None and w1 is not None else None,
        "digest": param_digest(module),
        "buckets": len(wrapper.bucket_info()) if hasattr(wrapper, "bucket_info") else None,
        "iterations": cfg["setup_steps"] + 1,
    }


def collective_costs(nbytes: int, device: str, reps: int = 3) -> Dict[str, Dict[str, Optional[float]]]:
    """Peak memory growth, bytes sent and time of one collective of each kind on an ``nbytes`` buffer.

    The kinds: ``all_reduce``; ``reduce_scatter`` and ``all_gather`` (torch's
    ``_tensor`` forms, what ShardedOptimizer's communicator issues on NCCL);
    ``reduce_scatter (fastcoll, gloo)``, the communicator's own on gloo (one send
    and one receive between 2 ranks, an in-place all-reduce beyond); and
    ``all_gather as broadcasts``, the same all-gather done as one in-place
    broadcast per rank of its own range (how ZeroRedundancyOptimizer moves
    parameters, and the communicator on gloo). gloo's own reduce-scatter and
    all-gather work on temporaries as large as their buffer (its all-reduce and
    broadcast work in place), and its reduce-scatter sends what an all-reduce
    sends: this measures that on the machine at hand (CPU: VmHWM growth, ``/proc/self/io`` wchar; time: the
    median of ``reps`` calls, the slowest rank's).
    """
    import torch.distributed as dist

    from ..reducer.comm import _ALL_GATHER, _REDUCE_SCATTER, Communicator  # torch's current names for them

    ws, rank = dist.get_world_size(), dist.get_rank()
    shard = nbytes // 4 // ws
    n = shard * ws
    buf = torch.ones(n, device=device)
    part = torch.ones(shard, device=device)

    def as_broadcasts() -> None:
        works = [dist.broadcast(buf[r * shard : (r + 1) * shard], src=r, async_op=True) for r in range(ws)]
        for w in works:
            w.wait()

    comm = Communicator(None, ws)

    def communicator_reduce_scatter() -> None:
        comm.wait(comm.reduce_scatter(part, buf, "probe"))

    calls = {
        "all_reduce": lambda: dist.all_reduce(buf),
        "reduce_scatter": lambda: _REDUCE_SCATTER(part, buf),
        "reduce_scatter (fastcoll, gloo)": communicator_reduce_scatter,
        "all_gather": lambda: _ALL_GATHER(buf, buf[rank * shard : (rank + 1) * shard]),
        "all_gather as broadcasts": as_broadcasts,
    }
    out: Dict[str, Dict[str, Optional[float]]] = {}
    for name, call in calls.items():
        call()
        dist.barrier()
        probe = bench_ddp.MemoryProbe(device)
        probe.start()
        w0 = bench_ddp.bytes_written()
        call()
        common.synchronize(device)
        w1 = bench_ddp.bytes_written()
        peak = probe.peak()
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            call()
            common.synchronize(device)
            times.append(time.perf_counter() - t0)
        sent = (w1 - w0) if device == "cpu" and w0 is not None and w1 is not None else None
        out[name] = {
            "buffer_bytes": 4 * n,
            "peak_growth_bytes": peak,
            "sent_bytes": sent,
            "time_s": bench_ddp._all_max([statistics.median(times)], device)[0],
        }
    return out


def _memory_worker(
    rank: int,
    ws: int,
    store_path: str,
    out_path: str,
    progress_q: Any,
    cfg: Dict[str, Any],
    spec: Any,
    method: str,
    probe_collectives: bool = False,
) -> None:
    device = cfg["device"]
    _set_device(device, rank)
    with common.rank_process_group(rank, ws, store_path, cfg["threads"], cfg["backend"]):
        _warm_up(method, device, rank)
        info = measure_memory(spec, method, rank, cfg)
        gc.collect()  # the wrappers go while their process group is alive
        if probe_collectives:
            info["collectives"] = collective_costs(COLLECTIVE_PROBE_BYTES // (64 if cfg["smoke"] else 1), device)
        infos = _gather(info)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"ranks": infos}, f)
            if progress_q is not None:
                progress_q.put(("advance", 1))


# ---------------------------------------------------------------------------
# Phase 2: step time (a model's methods side by side in one process pair)
# ---------------------------------------------------------------------------


def gather_metrics(times: Dict[int, Dict[str, int]]) -> Optional[Dict[str, float]]:
    """One step's parameter all-gathers from :attr:`ParamGather.times` (None if some bucket was never waited for).

    Returns (seconds): ``issue_s``, packing and issuing in ``step()`` (summed
    over buckets; the inner optimizer steps each bucket's pieces in between:
    ``step_s``, summed too); ``gather_s``, the collectives' span (first issued to
    last completed); ``exposed_s``, the training thread's waits for them;
    ``hidden_s`` = ``gather_s - exposed_s``, the span the training thread
    spent on other work (packing later buckets, the rest of the step, the
    forward up to each wait); ``write_s``, writing the gathered values into
    the parameters; ``buckets``.
    """
    evs = list(times.values())
    if not evs or any("waited" not in e or "issued" not in e for e in evs):
        return None
    first_issue = min(e["issued"] for e in evs)
    gather = max(e.get("completed", e["waited"]) for e in evs) - first_issue
    exposed = sum(e["waited"] - e["wait"] for e in evs)
    return {
        "issue_s": sum(e["issued"] - e["pack"] for e in evs) / 1e9,
        "step_s": sum(e["pack"] - e.get("step", e["pack"]) for e in evs) / 1e9,
        "gather_s": gather / 1e9,
        "exposed_s": exposed / 1e9,
        "hidden_s": max(0, gather - exposed) / 1e9,
        "write_s": sum(e.get("written", e["waited"]) - e["waited"] for e in evs) / 1e9,
        "buckets": float(len(evs)),
    }


def bucket_metrics(times: Dict[int, Dict[str, int]]) -> Dict[int, Dict[str, float]]:
    """Per bucket position of one step's all-gathers: ``comm_s`` (issued to completed), ``exposed_s`` and ``wait_rank``.

    ``wait_rank`` is the order in which the next forward waited for the buckets
    (0: first); the all-gathers are issued last bucket first (the forward's order).
    """
    waited = sorted((e["wait"], pos) for pos, e in times.items() if "wait" in e)
    order = {pos: k for k, (_, pos) in enumerate(waited)}
    return {
        pos: {
            "comm_s": (e.get("completed", e.get("waited", e["issued"])) - e["issued"]) / 1e9,
            "exposed_s": (e["waited"] - e["wait"]) / 1e9 if "waited" in e else 0.0,
            "wait_rank": float(order.get(pos, -1)),
        }
        for pos, e in times.items()
        if "issued" in e
    }


def _median_metrics(rows: Sequence[Dict[str, float]]) -> Optional[Dict[str, float]]:
    if not rows:
        return None
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]} | {"steps": float(len(rows))}


def _median_buckets(rows: Sequence[Dict[int, Dict[str, float]]]) -> Dict[str, Dict[str, float]]:
    """Per bucket position (a string: JSON keys), the median of each of :func:`bucket_metrics`' values."""
    out: Dict[str, Dict[str, float]] = {}
    for pos in sorted({p for r in rows for p in r}):
        per = [r[pos] for r in rows if pos in r]
        out[str(pos)] = {k: statistics.median(x[k] for x in per) for k in per[0]}
    return out


def forward_seconds(iterations: Sequence[Dict[str, Any]]) -> Optional[float]:
    """Median forward time (forward start to the first gradient hook) over ``model.sync_timeline()``'s iterations."""
    fw = [
        (it["backward_start_us"] - it["forward_start_us"]) / 1e6
        for it in iterations
        if it.get("forward_start_us") is not None and it.get("backward_start_us") is not None
    ]
    return statistics.median(fw) if fw else None


def time_group(spec: Any, methods: Sequence[str], rank: int, cfg: Dict[str, Any], tick: Callable[[int], None]) -> Dict[str, Any]:
    """Time ``methods`` on ``spec``'s model side by side (this rank's part; samples are the slowest rank's)."""
    device = cfg["device"]
    storage = bench_ddp.build_storage(spec, device)
    x = bench_ddp.make_input(spec, rank, device)
    runs: Dict[str, Tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]] = {}
    setup_s: Dict[str, float] = {}
    for m in methods:
        wrapper, opt = make_method(m, build_model(spec, device, storage), device)
        step = make_step(spec, wrapper, opt, x)
        for _ in range(cfg["setup_steps"] - 1):  # bucket rebuilds, optimizer state allocation
            step()
        settle(opt)
        common.synchronize(device)
        t0 = time.perf_counter()
        step()
        settle(opt)
        common.synchronize(device)
        setup_s[m] = time.perf_counter() - t0
        opt.zero_grad(set_to_none=True)
        if m in SHARDED:
            opt._gather.record_times = True  # type: ignore[attr-defined]
        runs[m] = (wrapper, opt, step)
        tick(1)
    per_step = bench_ddp._all_max([max(setup_s.values())], device)[0]
    inner = 1 if cfg["target_s"] <= 0 else max(1, min(cfg["max_inner"], math.ceil(cfg["target_s"] / max(per_step, 1e-6))))
    reps = sample_count(cfg, _large(spec), len(methods) * (inner + 1) * per_step)
    samples: Dict[str, List[float]] = {m: [] for m in methods}
    gathers: Dict[str, List[Dict[str, float]]] = {m: [] for m in methods if m in SHARDED}
    buckets: Dict[str, List[Dict[int, Dict[str, float]]]] = {m: [] for m in gathers}
    for k in range(reps):
        for m in common.rotated(methods, k):
            _wrapper, opt, step = runs[m]
            sync = getattr(opt, "_gather", None) if m in SHARDED else None
            step()  # lead-in: its all-gathers are pending when the timing starts, as in steady state
            common.synchronize(device)
            traced = [sync.times] if sync is not None else []
            t0 = time.perf_counter()
            for _ in range(inner):
                step()
                if sync is not None:
                    traced.append(sync.times)
            common.synchronize(device)
            samples[m].append((time.perf_counter() - t0) / inner)
            settle(opt)  # the last step's all-gathers, outside the timing (the next sample starts with none pending)
            opt.zero_grad(set_to_none=True)
            if sync is not None:  # the all-gathers the timed forwards waited for (not the last, drained above)
                gathers[m] += [g for g in map(gather_metrics, traced[:-1]) if g is not None]
                buckets[m] += [bucket_metrics(t) for t in traced[:-1]]
            tick(1)
    max_reps = cfg["max_reps_large"] if _large(spec) else cfg["max_reps"]
    tick((max_reps - reps) * len(methods))
    samples = {m: bench_ddp._all_max(s, device) for m, s in samples.items()}
    forward = {m: forward_seconds(runs[m][0].sync_timeline()) for m in methods if hasattr(runs[m][0], "sync_timeline")}
    per_rank = _gather(
        {
            "gather": {m: _median_metrics(g) for m, g in gathers.items()},
            "buckets": {m: _median_buckets(b) for m, b in buckets.items()},
            "forward": forward,
        }
    )
    runs.clear()
    storage = None  # noqa: F841
    gc.collect()
    return {
        "methods": list(methods),
        "inner": inner,
        "reps": reps,
        "setup_step_s": per_step,
        "samples": samples,
        "gather_per_rank": [r["gather"] for r in per_rank],
        "buckets_per_rank": [r["buckets"] for r in per_rank],
        "forward_per_rank": [r["forward"] for r in per_rank],
    }


def _timing_worker(
    rank: int, ws: int, store_path: str, out_path: str, progress_q: Any, cfg: Dict[str, Any], spec: Any, methods: Sequence[str]
) -> None:
    timing_rank(rank, ws, store_path, out_path, progress_q, cfg, lambda tick: time_group(spec, methods, rank, cfg, tick))


def timing_rank(rank: int, ws: int, store_path: str, out_path: str, progress_q: Any, cfg: Dict[str, Any],
                time_fn: Callable[[Any], Dict[str, Any]]) -> None:  # fmt: skip
    """One rank of a timing pair: device, allocator settings, process group, ``time_fn(tick)``; rank 0 writes the result."""
    device = cfg["device"]
    _set_device(device, rank)
    malloc = common.keep_freed_memory() if device == "cpu" else None
    tick = common.rank_ticker(rank, progress_q)
    with common.rank_process_group(rank, ws, store_path, cfg["threads"], cfg["backend"]):
        gc.collect()
        gc.freeze()
        result = time_fn(tick)
        gc.collect()  # the wrappers go while their process group is alive
        if rank == 0:
            from .. import ops

            with open(out_path, "w") as f:
                json.dump({**result, "malloc": malloc, "implementation": ops.implementation()}, f)


# ---------------------------------------------------------------------------
# Process pairs
# ---------------------------------------------------------------------------


def _context() -> Any:
    """The forkserver context of the rank processes, with what they import preloaded (a start costs a fork).

    torch.optim's optimizers import torch._dynamo on construction, and
    torch.distributed.optim takes seconds more: in every fresh process pair
    that was 10-20 s of a loaded 2-core machine.
    """
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _run_ranks(fn: Callable[..., None], args: Tuple[Any, ...], ws: int, progress_q: Any, bar: Any) -> Dict[str, Any]:
    """Start ``ws`` rank processes of ``fn(rank, ws, store, out, progress_q, *args)``, wait, return rank 0's JSON."""
    import torch.multiprocessing as tmp

    _context()
    with tempfile.TemporaryDirectory(prefix="fastcoll_bench_zero_") as tmpdir:
        out_path = os.path.join(tmpdir, "result.json")
        ctx = tmp.start_processes(
            fn,
            args=(ws, os.path.join(tmpdir, "store"), out_path, progress_q, *args),
            nprocs=ws,
            join=False,
            start_method="forkserver",
        )
        _follow(ctx, progress_q, bar, out_path)
        with open(out_path) as f:
            return json.load(f)


def _follow(ctx: Any, progress_q: Any, bar: Any, out_path: str, grace_s: float = EXIT_GRACE_S) -> None:
    """:func:`common.follow_ranks`, but ranks still alive ``grace_s`` after rank 0 wrote its results are terminated.

    Their work is done by then; a process stuck in its exit (a gloo process
    group's destructor once deadlocked there) must not hang the benchmark.
    """

    written_at: Optional[float] = None
    while not ctx.join(timeout=0.2):
        common.drain_progress(progress_q, bar)
        if written_at is None and os.path.exists(out_path):
            written_at = time.perf_counter()
        if written_at is not None and time.perf_counter() - written_at > grace_s:
            stuck = [p.pid for p in ctx.processes if p.is_alive()]
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            common.say(f"[yellow]fastcoll.bench zero: rank processes {stuck} had not exited {grace_s:.0f} s after "
                       "their results were written; killed them[/yellow]")  # fmt: skip
            return


# ---------------------------------------------------------------------------
# Analysis
# ---------------------------------------------------------------------------


def verdict(value: Optional[float], threshold: float, ci: Optional[Sequence[float]] = None, op: str = "le") -> str:
    """MET / MISSED from the interval ``ci`` (or the exact ``value``); "not resolved" when ``ci`` spans ``threshold``."""
    if value is None:
        return "not measured"
    lo, hi = (value, value) if ci is None else (ci[0], ci[1])
    if op == "le":
        return MET if hi <= threshold else MISSED if lo > threshold else UNRESOLVED
    return MET if lo >= threshold else MISSED if hi < threshold else UNRESOLVED


def _target(value: Optional[float], threshold: float, ci: Optional[Sequence[float]], op: str, what: str) -> Dict[str, Any]:
    return {
        "op": op,
        "threshold": threshold,
        "value": value,
        "ci90": list(ci) if ci is not None else None,
        "interval": what,
        "verdict": verdict(value, threshold, ci, op),
    }


def _median_ratio(a: str, b: str) -> Callable[[Dict[str, List[float]]], Optional[float]]:
    def stat(s: Dict[str, List[float]]) -> Optional[float]:
        den = statistics.median(s[b])
        return statistics.median(s[a]) / den if den > 0 else None

    return stat


def step_ratio(groups: Sequence[Dict[str, Any]], a: str, b: str) -> Tuple[Optional[float], Optional[Tuple[float, float]]]:
    """Median step of ``a`` over ``b``'s, from the first group timing both, with its 90% paired bootstrap interval."""
    for g in groups:
        s = g["samples"]
        if a in s and b in s:
            sub = {a: s[a], b: s[b]}
            value = _median_ratio(a, b)(sub)
            ci = common.bootstrap_ci(_median_ratio(a, b), sub, paired=True) if len(s[a]) > 1 else None
            return value, ci
    return None, None


def gather_buckets(group: Dict[str, Any], method: str) -> Optional[Dict[str, Dict[str, float]]]:
    """Rank 0's per-bucket medians of ``method``'s all-gathers in a timing group (None if not traced)."""
    per_rank = group.get("buckets_per_rank") or []
    return per_rank[0].get(method) if per_rank else None


def first_waited(buckets: Optional[Dict[str, Dict[str, float]]]) -> Optional[Dict[str, Any]]:
    """The bucket the next forward waits for first: its position, how many buckets there are, its share of the waits."""
    if not buckets:
        return None
    pos, first = min(buckets.items(), key=lambda kv: kv[1]["wait_rank"] if kv[1]["wait_rank"] >= 0 else math.inf)
    total = sum(b["exposed_s"] for b in buckets.values())
    return {"bucket": int(pos), "of": len(buckets), "exposed_share": first["exposed_s"] / total if total > 0 else None}


def analyze(row: Dict[str, Any]) -> Dict[str, Any]:
    """Add per-method summaries, the all-gather breakdown, checks and the targets to a model's row (in place)."""
    groups = row["groups"]
    mem = row["memory"]
    ws = row["world_size"]
    methods: Dict[str, Dict[str, Any]] = {}
    for m in METHODS:
        g = next((i for i, grp in enumerate(groups) if m in grp["samples"]), None)
        entry: Dict[str, Any] = {"group": g}
        if g is not None:
            entry.update(common.summarize(groups[g]["samples"][m]))
        ranks = mem.get(m, {}).get("ranks") or []
        if ranks:
            entry["state_bytes"] = [r["state_bytes"] for r in ranks]
            entry["peak_bytes"] = [r["peak_bytes"] for r in ranks]
            entry["live_peak_bytes"] = [r.get("live_peak_bytes") for r in ranks]
            entry["sent_bytes"] = [r["sent_bytes"] for r in ranks]
            entry["buckets"] = ranks[0].get("buckets")
        methods[m] = entry
    row["methods"] = methods

    # The all-gathers (slowest rank's medians) and the forward that hides them.
    gather: Dict[str, Any] = {}
    for m in SHARDED:
        g = methods[m]["group"]
        if g is None:
            continue
        per_rank = [r.get(m) for r in groups[g]["gather_per_rank"] if r.get(m)]
        fw = [r.get(m) for r in groups[g]["forward_per_rank"] if r.get(m) is not None]
        fwd_fc = [r.get("fastcoll") for grp in groups for r in grp["forward_per_rank"] if r.get("fastcoll") is not None]
        if not per_rank:
            continue
        worst = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
        step = methods[m]["median_s"]
        gather[m] = {
            **worst,
            "per_rank": per_rank,
            "per_bucket": [r.get(m) for r in groups[g].get("buckets_per_rank", [])],
            "hidden_share": worst["hidden_s"] / worst["gather_s"] if worst["gather_s"] > 0 else None,
            "gather_share_of_step": worst["gather_s"] / step if step else None,
            "exposed_share_of_step": worst["exposed_s"] / step if step else None,
            "first_waited": first_waited(gather_buckets(groups[g], m)),
            "forward_s": max(fw) if fw else None,
            "forward_fastcoll_s": max(fwd_fc) if fwd_fc else None,
        }
    row["gather"] = gather

    # The parameters after the same iterations, against torch DDP + AdamW's.
    checks: Dict[str, Any] = {}
    ref = (mem.get("torch", {}).get("ranks") or [{}])[0].get("digest")
    for m in METHODS:
        ranks = mem.get(m, {}).get("ranks") or []
        if not ranks or ref is None:
            continue
        rel = max(abs(a - b) / max(abs(b), 1e-30) for r in ranks for a, b in zip(r["digest"], ref))
        checks[m] = {"max_rel_diff": rel, "ok": rel <= 1e-5}
    row["checks"] = checks

    targets: Dict[str, Any] = {}
    torch_state = methods["torch"].get("state_bytes")
    torch_peak = methods["torch"].get("peak_bytes")
    for m in SHARDED:
        st = methods[m].get("state_bytes")
        if torch_state and st:
            value = max(st) / (max(torch_state) / ws)
            targets[f"state {m}"] = _target(value, 1 + STATE_TOLERANCE, None, "le", "exact (bytes)")
        value, ci = step_ratio(groups, m, "zero")
        if value is not None:
            targets[f"step {m}/zero"] = _target(value, STEP_VS_ZERO, ci, "le", "90% bootstrap (rounds)")
        pk = methods[m].get("peak_bytes")
        if torch_state and st and torch_peak and pk and None not in torch_peak and None not in pk:
            margins = [(tp - p) - (ts - s) for tp, p, ts, s in zip(torch_peak, pk, torch_state, st)]
            value = min(margins)
            targets[f"memory {m}"] = _target(value, 0.0, (min(margins), max(margins)), "ge", "range over ranks")
    if row["model"] in STEP_VS_TORCH_MODELS:
        value, ci = step_ratio(groups, "sharded", "torch")
        if value is not None:
            targets["step sharded/torch"] = _target(value, STEP_VS_TORCH, ci, "le", "90% bootstrap (rounds)")
    row["targets"] = targets
    # The same margin from the live heap bytes (no target: tells allocator retention from live data).
    torch_live = methods["torch"].get("live_peak_bytes")
    row["live_margins"] = {}
    for m in METHODS[1:]:
        lv, st = methods[m].get("live_peak_bytes"), methods[m].get("state_bytes")
        if torch_live and lv and torch_state and st and None not in torch_live and None not in lv:
            row["live_margins"][m] = min((a - b) - (c - d) for a, b, c, d in zip(torch_live, lv, torch_state, st))
    # Informational ratios (no target): every method against torch DDP + AdamW, ZeRO's state share.
    row["ratios"] = {f"{m}/torch": step_ratio(groups, m, "torch")[0] for m in METHODS if m != "torch"}
    zs = methods["zero"].get("state_bytes")
    if torch_state and zs:
        row["ratios"]["zero state/(torch/N)"] = max(zs) / (max(torch_state) / ws)
    return row


# ---------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------


def measure(args: Any = None) -> Dict[str, Any]:
    """Run both phases for every model; return the results.

    Returns:
        ``{"benchmark": "zero", "config": {...}, "implementation": ..., "results": [row, ...]}``;
        each row has per method the step-time summary (seconds), the
        per-rank state, peak and sent bytes; the all-gather breakdown
        (``gather``), the parameter ``checks``, ``ratios`` and ``targets``, and
        the raw samples of each timing group (``groups``).
    """
    device = getattr(args, "device", "cpu") or "cpu"
    cfg = _config(args, device)
    ws = cfg["world_size"]
    specs = model_specs(cfg)
    plans = []
    for spec in specs:
        numel = param_count(spec)
        plans.append((spec, numel, timing_groups(4 * numel, cfg["group_limit_bytes"])))
    units = 0
    for spec, _, groups in plans:
        per = cfg["max_reps_large"] if _large(spec) else cfg["max_reps"]
        units += len(METHODS) + sum(len(g) * (per + 1) for g in groups)
    progress_q = _context().Queue()
    results: List[Dict[str, Any]] = []
    implementation, malloc = None, None
    collectives: Optional[List[Dict[str, Any]]] = None
    started = time.perf_counter()
    with common.progress(units, f"zero: {ws} ranks") as bar:
        for spec, numel, groups in plans:
            t0 = time.perf_counter()
            memory: Dict[str, Any] = {}
            for m in METHODS:
                bar.describe(f"zero: {spec.label}, memory of {METHOD_LABELS[m]}")
                probe = collectives is None and m == "torch"
                memory[m] = _run_ranks(_memory_worker, (cfg, spec, m, probe), ws, progress_q, bar)
                if probe:
                    collectives = [r.pop("collectives") for r in memory[m]["ranks"]]
            timed = []
            for g in groups:
                bar.describe(f"zero: {spec.label}, timing {', '.join(METHOD_LABELS[m] for m in g)}")
                out = _run_ranks(_timing_worker, (cfg, spec, g), ws, progress_q, bar)
                implementation, malloc = out.pop("implementation"), out.pop("malloc")
                timed.append(out)
            row = {
                "model": spec.name,
                "label": spec.label,
                "synthetic": spec.synthetic,
                "world_size": ws,
                "numel": numel,
                "param_bytes": 4 * numel,
                "memory": memory,
                "groups": timed,
                "elapsed_s": time.perf_counter() - t0,
            }
            results.append(analyze(row))
    return {
        "benchmark": "zero",
        "config": {
            **cfg,
            "models": [dataclasses.asdict(s) for s in specs],
            "methods": METHOD_DESCRIPTIONS,
            "adamw": adamw_kwargs(device),
            "step": "opt.zero_grad(set_to_none=True); loss(wrapper(x)).backward(); opt.step()  (steady state: "
            "an untimed lead-in iteration, timed iterations each waiting for the previous one's all-gathers, the "
            "last all-gathers drained untimed)",
            "synthetic_models": "LayeredShapeModel: one module per parameter of the model's shapes, forward = "
            "sum_i p_i.sum() * x_i (one read of each parameter)",
            "memory": "growth of VmHWM over VmRSS before the model is built (fresh process pair per model and method, "
            "after a warm-up on a tiny model and malloc_trim)"
            if device == "cpu"
            else "max_memory_allocated growth",
            "malloc_timing": malloc or "unchanged",
            "targets": {
                "state": f"optimizer state per rank <= (1 + {STATE_TOLERANCE}) x torch DDP + AdamW's / N (full, sharded)",
                "step vs zero": f"step <= {STEP_VS_ZERO}x ZeroRedundancyOptimizer's (full, sharded)",
                "step vs torch": f"sharded step <= {STEP_VS_TORCH}x torch DDP + AdamW's ({', '.join(STEP_VS_TORCH_MODELS)})",
                "memory": "peak per rank below torch DDP + AdamW's by at least the state saved (full, sharded)",
            },
            "elapsed_s": time.perf_counter() - started,
        },
        "implementation": implementation,
        "collectives": collectives,
        "results": results,
    }


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def _mib(nbytes: Optional[float]) -> str:
    if nbytes is None:
        return "-"
    return f"{nbytes / MiB:.1f}" if abs(nbytes) >= 10 * MiB or nbytes == 0 else f"{nbytes / MiB:.2f}"


def _per_rank_mib(values: Optional[Sequence[Optional[float]]]) -> str:
    if not values or any(v is None for v in values):
        return "-"
    return " / ".join(_mib(v) for v in values)


def print_collectives(payload: Dict[str, Any]) -> None:
    """One collective of each kind on a bucket-sized buffer: peak memory growth and bytes sent (worst rank)."""
    ranks = payload.get("collectives") or []
    if not ranks:
        return
    table = []
    for name in ranks[0]:
        rows = [r[name] for r in ranks if name in r]
        peaks = [r["peak_growth_bytes"] for r in rows if r["peak_growth_bytes"] is not None]
        sent = [r["sent_bytes"] for r in rows if r["sent_bytes"] is not None]
        when = [r["time_s"] for r in rows if r.get("time_s") is not None]
        table.append(
            [
                name,
                _mib(rows[0]["buffer_bytes"]),
                common.fmt_time(max(when) if when else None),
                _mib(max(peaks) if peaks else None),
                _mib(max(sent) if sent else None),
            ]
        )
    cfg = payload["config"]
    common.render_table(
        f"fastcoll zero: one collective on a bucket-sized buffer, {cfg['world_size']} {cfg['backend']} ranks ({cfg['device']})",
        ["collective", "buffer MiB", "time", "peak growth MiB", "sent MiB"],
        table,
        caption="What the sharded paths pay per bucket on this backend (worst rank; time: median of 3). "
        "ShardedOptimizer all-gathers each bucket's parameters after each step (grads='sharded' also reduce-scatters "
        "each bucket in backward): on NCCL with all_gather_into_tensor and reduce_scatter_tensor; on gloo with one "
        "in-place broadcast per rank and the communicator's own reduce-scatter (one send of a half between 2 ranks, "
        "an in-place all-reduce beyond). ZeroRedundancyOptimizer broadcasts each parameter from its owner. gloo's "
        "own reduce-scatter and all-gather work on temporaries as large as the buffer, and its reduce-scatter sends "
        "what an all-reduce sends. NCCL's collectives work in the caller's buffers, its reduce-scatter sends half "
        "an all-reduce.",
    )


def _first_waited_cell(f: Optional[Dict[str, Any]]) -> str:
    if not f:
        return "-"
    share = "" if f["exposed_share"] is None else f" {f['exposed_share']:.0%}"
    issued = f["of"] - f["bucket"]  # issued last bucket first
    return f"b{f['bucket']} ({issued}/{f['of']}){share}"


def _verdict_cell(t: Optional[Dict[str, Any]]) -> str:
    if t is None:
        return ""
    v = t["verdict"]
    colour = {MET: "green", MISSED: "red"}.get(v, "yellow")
    return f"[{colour}]{v}[/{colour}]"


def print_results(payload: Dict[str, Any]) -> None:
    """The step-time table, the memory table and the all-gather table."""
    cfg = payload["config"]
    device = cfg["device"]
    rows = payload["results"]
    where = (
        f"{cfg['world_size']} gloo ranks on loopback, {cfg['threads']} intra-op thread(s) each"
        if device == "cpu"
        else f"{cfg['world_size']} NCCL ranks"
    )
    columns = ["model", *(METHOD_LABELS[m] for m in METHODS), "fastcoll.DDP/torch", "n x inner"]
    table = []
    for r in rows:
        m = r["methods"]
        cells = [r["label"] + (" *" if r["synthetic"] else "")]
        cells += [common.fmt_time(m[k].get("median_s")) for k in METHODS]
        cells.append(common.fmt_ratio(r["ratios"].get("fastcoll/torch")))
        cells.append(" | ".join(f"{g['reps']} x {g['inner']}" for g in r["groups"]))
        table.append(cells)
    split = [r["label"] for r in rows if len(r["groups"]) > 1]
    pairs = " | ".join(", ".join(METHOD_LABELS[m] for m in g) for g in SPLIT_GROUPS)
    caption = (
        f"{where}; ops: {payload['implementation']}; AdamW({', '.join(f'{k}={v}' for k, v in cfg['adamw'].items())}). "
        "Median step (slowest rank) = zero_grad + forward + backward + step, steady state: each forward waits for "
        "the previous step's all-gathers. Samples interleaved, order rotated each round; n samples of `inner` "
        "iterations (the IQRs are in the JSON)."
        + (
            f"\n{', '.join(split)}: timed in two process pairs ({pairs}) "
            "to bound memory; n per pair; each ratio from the pair timing both, ZeRO from the first."
            if split
            else ""
        )
        + "\n* synthetic: one module per parameter of the model's shapes, forward = sum_i p_i.sum() * x_i."
    )
    common.render_table(f"fastcoll zero: step time with AdamW ({device})", columns, table, caption=caption)

    table = []
    for r in rows:
        for i, (name, t) in enumerate(r["targets"].items()):
            value, interval = _target_value_cells(name, t)
            table.append([r["label"] if i == 0 else "", target_label(name), value, interval,
                          _threshold_cell(name, t), _verdict_cell(t)])  # fmt: skip
    common.render_table(
        f"fastcoll zero: targets ({device})",
        ["model", "target", "value", "interval", "target", "verdict"],
        table,
        caption="step: ratio of median steps, 90% bootstrap interval (rounds resampled, paired); state: exact bytes, "
        "the worst rank's share of DDP's state / N; memory: (torch DDP + AdamW's peak - this peak) - (state saved), "
        "the range over ranks. MET / MISSED when the interval lies on one side of the target, else not resolved. "
        "Informational, never asserted.",
    )

    columns = ["model", "method", "state MiB", "state/(DDP/N)", "peak MiB", "saved", "margin", "target"]
    columns += ["live MiB", "live margin", "sent MiB", "params"]
    table = []
    for r in rows:
        m = r["methods"]
        tstate, tpeak = m["torch"].get("state_bytes"), m["torch"].get("peak_bytes")
        for k in METHODS:
            st, pk = m[k].get("state_bytes"), m[k].get("peak_bytes")
            saved = margin = None
            if k != "torch" and st and pk and tstate and tpeak and None not in pk and None not in tpeak:
                saved = max(a - b for a, b in zip(tstate, st))
                margin = min((a - b) - (c - d) for a, b, c, d in zip(tpeak, pk, tstate, st))
            share = max(st) / (max(tstate) / r["world_size"]) if st and tstate else None
            state_t = r["targets"].get(f"state {k}")
            check = r["checks"].get(k)
            table.append(
                [
                    r["label"] if k == METHODS[0] else "",
                    METHOD_LABELS[k],
                    _per_rank_mib(st),
                    (f"{share:.3f}" if share is not None else "-") + (f" {_verdict_cell(state_t)}" if state_t else ""),
                    _per_rank_mib(pk),
                    _mib(saved),
                    _mib(margin),
                    _verdict_cell(r["targets"].get(f"memory {k}")),
                    _per_rank_mib(m[k].get("live_peak_bytes")),
                    _mib(r.get("live_margins", {}).get(k)),
                    _per_rank_mib(m[k].get("sent_bytes")),
                    "-"
                    if check is None
                    else (
                        "[green]equal[/green]"
                        if check["max_rel_diff"] == 0
                        else f"{'[green]close[/green]' if check['ok'] else '[red]DIFFER[/red]'} ({check['max_rel_diff']:.0e})"
                    ),
                ]
            )
    caption = (
        "Per rank (rank 0 / rank 1). state: bytes of the optimizer-state tensors (ZeRO: its local optimizer's, "
        f"ShardedOptimizer: this rank's pieces'); target <= {1 + STATE_TOLERANCE:.2f} x DDP's / N.\n"
        "peak: growth of the resident set's high-water mark from before the model is built through its first "
        "iterations, each method in a fresh process pair; saved = torch DDP + AdamW's state - this state; margin = "
        "(torch DDP + AdamW's peak - this peak) - saved, worst rank; target >= 0.\n"
        "live: the most heap bytes alive (glibc mallinfo2, every arena) sampled between the phases of every "
        "iteration (zero_grad, forward, backward, step), above the same baseline, and the margin from those (no "
        "target). It misses what lives only within a phase; a peak well above it is mostly memory the allocator "
        "kept (freed gradients, gloo's per-collective temporaries, allocated on gloo's threads, in their arenas).\n"
        "sent: bytes a rank wrote to its sockets in one iteration (all-gathers included). gloo's own reduce-scatter "
        "sends what an all-reduce sends; fastcoll's at 2 ranks is one send of a half, so grads='sharded' moves DDP's "
        "bytes (half for the gradients, half for the all-gather) where grads='full' and ZeRO move 1.5x; at 3+ ranks "
        "on gloo it is an all-reduce (1.5x), and on NCCL sharded moves what DDP moves.\nparams: float64 sum and "
        "sum of squares of the parameters after the same iterations, against torch DDP + AdamW's."
    )
    common.render_table(
        f"fastcoll zero: optimizer state, peak memory and traffic per rank ({device})", columns, table, caption=caption
    )
    print_collectives(payload)

    columns = ["model", "method", "step", "forward (fc.DDP)", "pack+issue", "span", "exposed", "hidden"]
    columns += ["write", "span/step", "exposed/step", "first waited"]
    table = []
    for r in rows:
        for k in SHARDED:
            g = r["gather"].get(k)
            if g is None:
                continue
            hidden = g["hidden_share"]
            table.append(
                [
                    r["label"],
                    k,
                    common.fmt_time(r["methods"][k]["median_s"]),
                    f"{common.fmt_time(g['forward_s'])} ({common.fmt_time(g['forward_fastcoll_s'])})",
                    common.fmt_time(g["issue_s"]),
                    common.fmt_time(g["gather_s"]),
                    common.fmt_time(g["exposed_s"]),
                    f"{common.fmt_time(g['hidden_s'])} ({'-' if hidden is None else f'{hidden:.0%}'})",
                    common.fmt_time(g["write_s"]),
                    "-" if g["gather_share_of_step"] is None else f"{g['gather_share_of_step']:.0%}",
                    "-" if g["exposed_share_of_step"] is None else f"{g['exposed_share_of_step']:.0%}",
                    _first_waited_cell(g.get("first_waited")),
                ]
            )
    if table:
        common.render_table(
            f"fastcoll zero: the parameters' all-gather after each step and how much of it the next forward hides ({device})",
            columns,
            table,
            caption="Per step, median over the timed steps of the slowest rank (ParamGather.record_times): pack+issue = "
            "packing and issuing the all-gathers in step(), summed over buckets (the inner optimizer steps each "
            "bucket's pieces in between; nothing to pack where the parameters live in a flat buffer); span = first "
            "all-gather issued to last completed (gloo's completion callbacks); exposed = the training thread's waits "
            "for them in the next forward's module pre-hooks; hidden = span - exposed (the training thread packing, "
            "finishing the step and running the forward meanwhile), share of the span; write = unpacking into the "
            "parameters (staged buckets only). forward: forward start to first gradient (model.sync_timeline()), in "
            "brackets fastcoll.DDP + AdamW's. first waited: the bucket the forward's first module waits for, (k-th "
            "issued / n) (the all-gathers go out last bucket first, the forward's order), and its share of the "
            "exposed wait.",
        )


def target_label(name: str) -> str:
    """A target's key (``"step sharded/zero"``, ``"state full"``, ``"memory sharded"``) in words."""
    kind, what = name.split(" ", 1)
    if kind == "step":
        mine, base = what.split("/")
        return f"step, {METHOD_LABELS[mine]} / {METHOD_LABELS[base]}'s"
    if kind == "state":
        return f"state per rank, grads={what} / (DDP's / N)"
    return f"peak below torch DDP's - state saved, grads={what}"


def _target_value_cells(name: str, t: Dict[str, Any]) -> Tuple[str, str]:
    ci = t["ci90"]
    if name.startswith("memory"):
        return f"{_mib(t['value'])} MiB", f"ranks {_mib(ci[0])} to {_mib(ci[1])} MiB"
    if name.startswith("state"):
        return f"{t['value']:.4f}", "exact"
    return f"{t['value']:.2f}x", f"{ci[0]:.2f}-{ci[1]:.2f}" if ci else "-"


def _threshold_cell(name: str, t: Dict[str, Any]) -> str:
    if name.startswith("memory"):
        return ">= 0"
    return f"<= {t['threshold']:.2f}" + ("" if name.startswith("state") else "x")


def _summary(payload: Dict[str, Any]) -> None:
    counts = {MET: 0, MISSED: 0, UNRESOLVED: 0}
    for r in payload["results"]:
        for t in r["targets"].values():
            counts[t["verdict"]] = counts.get(t["verdict"], 0) + 1
    if any(counts.values()):
        common.say(
            f"[bold]targets (informational, never asserted):[/bold] {counts[MET]} met, {counts[MISSED]} missed, "
            f"{counts[UNRESOLVED]} not resolved"
        )
    for r in payload["results"]:
        for m, c in r["checks"].items():
            if not c["ok"]:
                common.say(f"[red]warning: {r['label']}: {METHOD_LABELS[m]}'s parameters differ from torch DDP + AdamW's[/red]")


def chart(path: Path, payload: Dict[str, Any]) -> Optional[Path]:
    """Four panels: step time / ZeRO's (intervals), state and peak memory / torch DDP's, the all-gathers per step."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = payload["results"]
    if not rows:
        return None
    names = [r["label"] for r in rows]
    xs = list(range(len(rows)))
    w = 0.8 / len(METHODS)
    fig, axes = plt.subplots(2, 2, figsize=(max(11, 3.2 * len(rows) + 4), 8.5))
    (ax_step, ax_state), (ax_peak, ax_gather) = axes

    def worst(values: Optional[Sequence[Optional[float]]]) -> Optional[float]:
        return max(values) if values and None not in values else None

    for k, m in enumerate(METHODS):
        off = [x + (k - (len(METHODS) - 1) / 2) * w for x in xs]
        ys, err_lo, err_hi = [], [], []
        for r in rows:  # against ZeRO: every timing group has it, so every ratio is paired
            value, ci = (1.0, None) if m == "zero" else step_ratio(r["groups"], m, "zero")
            ys.append(value if value is not None else float("nan"))
            err_lo.append(max(0.0, value - ci[0]) if value is not None and ci else 0.0)
            err_hi.append(max(0.0, ci[1] - value) if value is not None and ci else 0.0)
        ax_step.bar(off, ys, w, yerr=[err_lo, err_hi], capsize=2, label=METHOD_LABELS[m])
        shares, peaks, lives, levels = [], [], [], []
        for r in rows:
            me, base = r["methods"][m], r["methods"]["torch"]
            st, tst = worst(me.get("state_bytes")), worst(base.get("state_bytes"))
            pk, tpk = worst(me.get("peak_bytes")), worst(base.get("peak_bytes"))
            lv, tlv = worst(me.get("live_peak_bytes")), worst(base.get("live_peak_bytes"))
            shares.append(st / tst if st is not None and tst else float("nan"))
            peaks.append(pk / tpk if pk is not None and tpk else float("nan"))
            lives.append(lv / tlv if lv is not None and tlv else float("nan"))
            # the target: this peak <= torch's peak - the state saved
            ok = m in SHARDED and st is not None and tst and tpk
            levels.append((tpk - (tst - st)) / tpk if ok else float("nan"))
        ax_state.bar(off, shares, w, label=METHOD_LABELS[m])
        ax_peak.bar(off, peaks, w)
        ax_peak.scatter(off, lives, marker="x", color="black", s=14, zorder=3, label="live heap peak" if k == 0 else None)
        ax_peak.scatter(off, levels, marker="_", color="red", s=160, zorder=3, label="target level" if k == 3 else None)
    ax_step.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax_step.axhline(STEP_VS_ZERO, color="red", linewidth=0.8, linestyle=":")
    ax_step.set_title(
        f"step time / torch ZeRO's (90% intervals; red: the {STEP_VS_ZERO}x target of grads=full/sharded)", fontsize=9
    )
    ax_state.axhline(1 / max(1, payload["config"]["world_size"]), color="red", linewidth=0.8, linestyle=":")
    ax_state.set_title("optimizer state per rank / torch DDP + AdamW's (worst rank; red: 1/N)", fontsize=9)
    ax_peak.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax_peak.set_title("peak RSS growth / torch DDP + AdamW's (worst rank); x: live heap bytes; red: the target level", fontsize=9)
    ax_peak.legend(fontsize=7, loc="lower right")
    gw = 0.2
    parts = [("gather_s", "all-gather span"), ("exposed_s", "exposed wait"), ("issue_s", "pack+issue"), ("write_s", "write")]
    for j, m in enumerate(SHARDED):
        for i, (key, label) in enumerate(parts):
            off = [x + (j - 0.5) * 0.42 + (i - 1.5) * gw / 2 for x in xs]
            ys = [1e3 * (r["gather"].get(m) or {}).get(key, float("nan")) for r in rows]
            ax_gather.bar(off, ys, gw / 2, label=f"{METHOD_LABELS[m]}: {label}", color=f"C{i}", alpha=1.0 if j == 0 else 0.55)
    ax_gather.set_title("parameters' all-gather per step, ms (left: grads=full, right: sharded; log scale)", fontsize=9)
    ax_gather.set_yscale("log")
    lo, hi = ax_gather.get_ylim()
    ax_gather.set_ylim(lo, hi * 100)  # room for the legend above the bars
    ax_gather.legend(fontsize=6, ncol=2, loc="upper left")
    for ax in (ax_step, ax_state, ax_peak, ax_gather):
        ax.set_xticks(xs)
        ax.set_xticklabels(names, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    ax_step.legend(fontsize=7)
    cfg = payload["config"]
    fig.suptitle(
        f"fastcoll zero ({cfg['device']}, {cfg['world_size']} ranks): ShardedOptimizer vs ZeroRedundancyOptimizer vs DDP, AdamW"
    )
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    return common.save_figure(fig, path)


def supported() -> bool:
    """Whether this checkout has ``fastcoll.ShardedOptimizer`` (and torch its ZeroRedundancyOptimizer)."""
    import fastcoll

    try:
        from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: F401
    except ImportError:  # pragma: no cover
        return False
    return hasattr(fastcoll, "ShardedOptimizer")


def run(args: Any = None) -> int:
    """CLI entry (``python -m fastcoll.bench zero``): measure, print the tables, write JSON and a chart.

    Then the bfloat16 section (:func:`fastcoll.bench.zero_bf16.run_section`).

    Returns:
        0 on success (also when this checkout has no ShardedOptimizer, or
        fewer than 2 GPUs with ``--device cuda``: skipped with a message), 1 if
        a method's parameters differ from torch DDP + AdamW's, 2 if ``--device
        cuda`` is asked for without a GPU.
    """
    device = getattr(args, "device", "cpu") or "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        common.say("[red]fastcoll.bench zero: --device cuda but torch.cuda.is_available() is False[/red]")
        return 2
    if device == "cuda" and torch.cuda.device_count() < 2:
        common.say("[yellow]fastcoll.bench zero: sharding needs at least 2 ranks, and there is 1 GPU; skipping[/yellow]")
        return 0
    if not supported():
        common.say("[yellow]fastcoll.bench zero: this checkout has no fastcoll.ShardedOptimizer; skipping[/yellow]")
        return 0
    common.say(
        "[dim]ResNet-50 and GPT-2 rows (*) are synthetic: parameters of those shapes, one module each, with a forward "
        "of one read per parameter (little compute for the all-gathers to hide behind).[/dim]"
    )
    payload = measure(args)
    print_results(payload)
    _summary(payload)
    path = common.resolve_json_path(args, f"zero_{device}")
    common.write_json(path, payload, device)
    png = chart(path.with_suffix(".png"), payload)
    common.say(f"wrote {path}" + (f" and {png}" if png else " (matplotlib missing: no chart)"))
    ok = all(c["ok"] for r in payload["results"] for c in r["checks"].values())
    from . import zero_bf16

    rc = zero_bf16.run_section(args)
    return rc if ok else 1


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m fastcoll.bench.zero [--device cpu|cuda] [--quick] [--threads N|all] [--json PATH]``."""
    from .__main__ import main as cli

    return cli(["zero", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
