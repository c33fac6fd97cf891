"""Every fastcoll path on CUDA with NCCL, in one process (issue #14, GPU readiness).

One GPU is one rank, and at world size 1 fastcoll skips its collectives; with
``FASTCOLL_FORCE_COLLECTIVES=1`` (set before anything is constructed) it issues
them as at any size, so one GPU runs the NCCL paths. The ``pg`` fixture makes a
one-rank NCCL group over a FileStore in the test's tmp_path with that variable
set. References: torch DDP (which always communicates) with the same
arguments, a float64 or opmath reference for the ops. Each test also checks,
through the reducer's collective listener or by counting calls into
``torch.distributed``, that the collectives really ran.

Covered: fastcoll.DDP's default step, comm hooks (allreduce_hook,
fp16_compress_hook, PowerSGD with one bucket), comm_dtype fp16/bf16 (also with
gradient_as_bucket_view), sparse gradients, join(), the buffer broadcast,
gradient_as_bucket_view, parameters that are not dense, find_unused_parameters, static_graph,
compute_grad_norm / clip_grad_norm_ / check_nonfinite, set_gradient_divisor
with a CUDA tensor, the fastcoll.dist helpers; the ops under CUDA graph
capture (tables of 32/120/512 chunks, replays with new inputs, the 512/513
boundary), misaligned views for every dtype pair; and no host synchronization
inside a training step (``torch.cuda.set_sync_debug_mode("error")``).

All tests are marked ``cuda``: tests/conftest.py skips them without a GPU
(``make gpu-test`` runs them on the GPU machine). To check the test code itself
on a CPU-only machine, the tests that are not CUDA-specific also run on gloo
with CPU tensors:

    FASTCOLL_CUDA_PATHS_DEVICE=cpu PYTHONPATH=tests python -m pytest -p test_cuda_paths tests/test_cuda_paths.py

(``-p test_cuda_paths`` loads this module as a plugin too, so that its
``pytest_collection_modifyitems`` lifts conftest's skip; the CUDA-only tests
stay skipped.)
"""

from __future__ import annotations

import copy
import datetime
import os
from typing import Any, Callable, Dict, List, Sequence, Tuple

import ddp_models as M
import pytest
import torch
import torch.distributed as dist
from test_ops import capture_graph
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastcoll
from fastcoll import ops

DRY_RUN = os.environ.get("FASTCOLL_CUDA_PATHS_DEVICE", "cuda") == "cpu"
DEVICE = "cpu" if DRY_RUN else "cuda"
BACKEND = "gloo" if DRY_RUN else "nccl"

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]
CUDA_ONLY = pytest.mark.skipif(DRY_RUN, reason="CUDA-specific (graphs, kernels, sync debug mode): not in the CPU dry run")

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
DTYPES = (F32, F16, BF16, F64)
EXACT = {"rtol": 1e-5, "atol": 1e-6}
HALF = {"rtol": 2e-3, "atol": 2e-4}
CHUNK_BYTES = 64 * 1024  # csrc/cuda/copy_chunk.cuh kChunkBytes


@pytest.hookimpl(trylast=True)  # after conftest added its skip
def pytest_collection_modifyitems(config, items):
    """Plugin hook, active only with ``-p test_cuda_paths`` in a CPU dry run: lift conftest's skip of this module."""
    if not DRY_RUN:
        return
    for item in items:
        if item.module is not None and item.module.__name__.endswith(("test_cuda_paths", "test_cuda_sharded")):
            item.own_markers[:] = [
                m for m in item.own_markers if not (m.name == "skip" and "CUDA GPU" in str(m.kwargs.get("reason", "")))
            ]


# ---------------------------------------------------------------------------
# Fixtures and helpers
# ---------------------------------------------------------------------------


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


@pytest.fixture
def pg(tmp_path, monkeypatch):
    """A one-rank process group (NCCL; gloo in the dry run) over a FileStore, collectives forced at world size 1."""
    if not dist.is_available() or (BACKEND == "nccl" and not dist.is_nccl_available()):
        pytest.skip("torch.distributed with NCCL is not available in this torch build")
    monkeypatch.setenv("FASTCOLL_FORCE_COLLECTIVES", "1")  # before any wrapper or helper reads it
    if DEVICE == "cuda":
        torch.cuda.set_device(0)
        monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)  # same conv algorithms in both wrappers
        monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    if dist.is_initialized():  # a test before this one left its group behind
        dist.destroy_process_group()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(BACKEND, store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    try:
        yield dist.group.WORLD
    finally:
        _sync()
        dist.destroy_process_group()


@pytest.fixture
def calls(monkeypatch):
    """Names of the torch.distributed collectives called from now on (fastcoll calls them as ``dist.<name>``)."""
    seen: List[str] = []
    names = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single", "gather")
    for name in names:
        real = getattr(dist, name, None)
        if real is None:
            continue

        def wrapper(*args, _real=real, _name=name, **kwargs):
            seen.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(dist, name, wrapper)
    return seen


class Net(nn.Module):
    """Conv + BatchNorm (float buffers and an int64 one) + two Linear layers.

    Several parameters hold a number of elements that is not a multiple of 4
    (conv weight 135, fc2 weight 231): the bucket slots after them are not
    16-byte aligned, so the kernels' scalar path runs too.
    """

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3, padding=1)
        self.bn = nn.BatchNorm2d(5)
        self.fc1 = nn.Linear(5, 33)
        self.fc2 = nn.Linear(33, 7)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3))
        return self.fc2(torch.tanh(self.fc1(h)))


def mlp() -> nn.Module:
    """Square layers PowerSGD can compress (no head)."""
    return M.MLP(width=16, depth=3, head=None)


class Branchy(M.Branchy):
    """``never`` is never used; ``sometimes`` on odd steps (the caller passes ``use``). The output is the logits tensor."""

    def forward(self, x, use: bool = False):
        return super().forward(x, use_sometimes=use).logits


class SparseNet(nn.Module):
    """An embedding with sparse gradients and a dense head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, 6, sparse=True)
        self.head = nn.Linear(6, 3)

    def forward(self, idx):
        return self.head(self.emb(idx).mean(dim=1))


def _batch(kind: str, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    if kind == "net":
        x = torch.randn(4, 3, 6, 6, generator=g)
    elif kind == "mlp":
        x = torch.randn(8, 16, generator=g)
    elif kind == "branchy":
        x = torch.randn(8, 8, generator=g)
    elif kind == "sparse":
        x = torch.randint(0, 40, (5, 4), generator=g)
    else:  # pragma: no cover
        raise ValueError(kind)
    return x.to(DEVICE)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _build(make: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return make().to(DEVICE)


def _ids() -> Any:
    return [0] if DEVICE == "cuda" else None


def _pair(model: nn.Module, fast_kwargs: Dict[str, Any] = None, torch_kwargs: Dict[str, Any] = None):
    """fastcoll.DDP and torch DDP on two copies of ``model``, with the listener attached; returns (fast, ref, seen)."""
    fast_kwargs = dict(fast_kwargs or {})
    torch_kwargs = dict(fast_kwargs if torch_kwargs is None else torch_kwargs)
    for k in ("first_bucket_mb", "comm_dtype", "comm_accum_dtype", "compute_grad_norm", "check_nonfinite"):
        torch_kwargs.pop(k, None)
    fast = fastcoll.DDP(copy.deepcopy(model), device_ids=_ids(), **fast_kwargs)
    ref = TorchDDP(copy.deepcopy(model), device_ids=_ids(), **torch_kwargs)
    seen: List[Any] = []
    fast.reducer.add_collective_listener(seen.append)
    return fast, ref, seen


def _grads(module: nn.Module) -> List[Tuple[str, Any]]:
    return [
        (n, None if p.grad is None else (p.grad.to_dense() if p.grad.is_sparse else p.grad)) for n, p in module.named_parameters()
    ]


def _assert_grads(fast: nn.Module, ref: nn.Module, what: str, tol: Dict[str, float] = EXACT) -> None:
    for (name, a), (_, b) in zip(_grads(fast.module), _grads(ref.module if hasattr(ref, "module") else ref)):
        if a is None or b is None:
            mine, theirs = ("None" if g is None else "set" for g in (a, b))
            assert a is None and b is None, f"{what}: '{name}': grad is {mine} in fastcoll, {theirs} in the reference"
            continue
        torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name: f"{what}: '{name}': {m}")


def _train(fast, ref, kind: str, steps: int, tol=EXACT, set_to_none: bool = True, forward=None, check: Callable = None):
    """``steps`` SGD steps of both wrappers on the same batches, gradients compared after each backward.

    Returns the number of buckets fastcoll reduced in each step (read after the forward, which may rebuild them).
    """
    forward = forward or (lambda mod, x, step: mod(x))
    of = torch.optim.SGD(fast.parameters(), lr=0.1, momentum=0.9)
    ot = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    buckets = []
    for step in range(steps):
        x = _batch(kind, step)
        for mod, opt in ((fast, of), (ref, ot)):
            opt.zero_grad(set_to_none=set_to_none)
            out = forward(mod, x, step)
            if mod is fast:
                buckets.append(len([b for b in fast.bucket_info() if b["numel"] or b["sparse"]]))
            _loss(out).backward()
        _assert_grads(fast, ref, f"step {step}", tol)
        if check is not None:
            check(step)
        of.step()
        ot.step()
    _sync()
    return buckets


def _bucket_reductions(seen: Sequence[Any]) -> List[Any]:
    return [c for c in seen if c.what.startswith("bucket")]


# ---------------------------------------------------------------------------
# fastcoll.DDP against torch DDP, collectives forced at world size 1
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("cap", [None, 0.0005], ids=["default_caps", "tiny_buckets"])
def test_default_step_matches_torch_ddp(pg, cap):
    kwargs = {} if cap is None else {"bucket_cap_mb": cap}
    fast, ref, seen = _pair(_build(Net), kwargs)
    buckets = _train(fast, ref, "net", 4)
    # The layout broadcast once (at the second forward), then one all-reduce per bucket and step.
    assert [c.what for c in seen if c.kind == "broadcast"] == ["layout"], seen
    reduced = _bucket_reductions(seen)
    assert len(reduced) == sum(buckets) and all(c.kind == "all_reduce" for c in reduced), (buckets, seen)
    assert fast.reducer.rebuilt and fast.reducer.stats()["iterations"] == 4
    for p, q in zip(fast.module.parameters(), ref.module.parameters()):
        torch.testing.assert_close(p, q, **EXACT)
    fast.close()


def _hook(kind: str):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as D
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P

    if kind == "allreduce":
        return None, D.allreduce_hook
    if kind == "fp16":
        return None, D.fp16_compress_hook
    state = P.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    return state, P.powerSGD_hook


@pytest.mark.parametrize("kind", ["allreduce", "fp16", "powersgd"])
def test_comm_hooks_match_torch_ddp(pg, kind):
    # One bucket (PowerSGD keys its state by bucket; the model is far below 1 MiB).
    fast, ref, seen = _pair(_build(mlp), {"bucket_cap_mb": 100})
    fast.register_comm_hook(*_hook(kind))
    ref.register_comm_hook(*_hook(kind))
    buckets = _train(fast, ref, "mlp", 5, tol=HALF if kind == "fp16" else EXACT)
    assert buckets == [1] * 5
    hooked = [c for c in seen if c.kind == "comm_hook"]
    assert len(hooked) == 5, seen
    fast.close()


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("view", [False, True], ids=["copy", "bucket_view"])
def test_comm_dtype_matches_torch_compress_hook(pg, dtype, view):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as D

    fast, ref, seen = _pair(_build(Net), {"comm_dtype": dtype, "bucket_cap_mb": 0.0005, "gradient_as_bucket_view": view})
    hook = D.fp16_compress_hook if dtype == F16 else D.bf16_compress_hook
    ref.register_comm_hook(None, lambda state, bucket: hook(state, bucket))  # torch refuses the bf16 hook by name on CPU
    buckets = _train(fast, ref, "net", 4, tol=HALF if dtype == F16 else {"rtol": 1.6e-2, "atol": 2e-3}, set_to_none=not view)
    reduced = _bucket_reductions(seen)
    assert len(reduced) == sum(buckets) and {c.dtype for c in reduced} == {dtype}, seen
    assert all(b["comm_dtype"] == dtype for b in fast.bucket_info())
    fast.close()


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("view", [False, True], ids=["copy", "bucket_view"])
def test_comm_accum_dtype_rounds_once(pg, dtype, view):
    """16-bit chunks through NCCL's all_to_all, summed by the fused sum_chunks kernel, then an all-gather.

    At one rank each value is rounded to 16 bits once, as torch's compress hook does, so the two agree within
    the same tolerance as plain ``comm_dtype``.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as D

    kwargs = {"comm_dtype": dtype, "comm_accum_dtype": F32, "bucket_cap_mb": 0.0005, "gradient_as_bucket_view": view}
    fast, ref, seen = _pair(_build(Net), kwargs)
    hook = D.fp16_compress_hook if dtype == F16 else D.bf16_compress_hook
    ref.register_comm_hook(None, lambda state, bucket: hook(state, bucket))
    buckets = _train(fast, ref, "net", 4, tol=HALF if dtype == F16 else {"rtol": 1.6e-2, "atol": 2e-3}, set_to_none=not view)
    reduced = _bucket_reductions(seen)
    kinds = {c.kind for c in reduced}
    assert kinds == {"all_to_all", "all_gather"}, seen  # the one-rounding reduction, not a 16-bit all-reduce
    assert len([c for c in reduced if c.kind == "all_to_all"]) == sum(buckets), seen
    assert {c.dtype for c in reduced} == {dtype}, seen
    fast.close()


def test_sparse_gradients(pg):
    model = _build(SparseNet)
    fast = fastcoll.DDP(copy.deepcopy(model), device_ids=_ids())
    ref = copy.deepcopy(model)  # world size 1: the average over ranks is the local gradient
    seen: List[Any] = []
    fast.reducer.add_collective_listener(seen.append)
    sparse = [b for b in fast.bucket_info() if b["sparse"]]
    assert len(sparse) == 1 and sparse[0]["names"] == ["emb.weight"]
    _train(fast, ref, "sparse", 4)
    assert fast.module.emb.weight.grad.is_sparse
    gathers = [c.what for c in seen if c.kind == "all_gather"]  # per step: the row counts, then the rows
    assert gathers == ["bucket 1 (sparse) (row counts)", "bucket 1 (sparse) (rows)"] * 4, seen
    assert len([c for c in seen if c.kind == "all_reduce"]) == 4, seen  # the dense head's bucket
    fast.close()


@pytest.mark.parametrize("initial", [True, False], ids=["divide_by_initial", "divide_by_active"])
def test_join_with_even_inputs_runs_the_protocol(pg, calls, initial):
    fast, ref, seen = _pair(_build(Net))
    del calls[:]
    with fast.join(divide_by_initial_world_size=initial):
        buckets = _train(fast, ref, "net", 3)
    # Per iteration the join protocol all-reduces at least the "not joined" count and the requires-sync flag.
    assert calls.count("all_reduce") >= 2 * 3 + sum(buckets), calls
    assert len(_bucket_reductions(seen)) == sum(buckets), seen
    fast.close()


def test_buffer_broadcast(pg, calls):
    fast, ref, seen = _pair(_build(Net))
    del calls[:]
    _train(fast, ref, "net", 3)
    for (name, a), b in zip(fast.module.named_buffers(), ref.module.buffers()):
        torch.testing.assert_close(a, b, **EXACT, msg=lambda m, name=name: f"buffer '{name}': {m}")
    layout = len([c for c in seen if c.what == "layout"])
    assert calls.count("broadcast") == 3 + layout, calls  # one coalesced message per forward (+ the layout)
    # The message the source sends holds every buffer, packed by the fused op into its dtype's section
    # (checked right after a broadcast: the forward that follows one updates the BatchNorm statistics).
    fast._sync_buffers(0)
    _sync()
    for m in fast._buffer_sync.broadcast.messages:
        for section, tensors in m.fused:
            assert torch.equal(section, torch.cat([t.reshape(-1) for t in tensors])), [t.dtype for t in tensors]
        for section, t in m.copied:
            assert torch.equal(section, t)
    fast.close()


def test_gradient_as_bucket_view(pg):
    fast, ref, seen = _pair(_build(Net), {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.0005})

    def views(step):
        for b in fast.reducer.buckets:
            lo = b.flat.data_ptr()
            hi = lo + b.flat.numel() * b.flat.element_size()
            for p in b.params:
                assert p.grad is not None and lo <= p.grad.data_ptr() < hi, f"step {step}: a gradient is not a view of its bucket"

    buckets = _train(fast, ref, "net", 4, set_to_none=False, check=views)
    assert len(_bucket_reductions(seen)) == sum(buckets)
    fast.close()


@pytest.mark.parametrize("view", [False, True], ids=["copies", "bucket-view"])
def test_non_dense_parameters(pg, view):
    """Strided slices as parameters (contiguous gradients and bucket views, as torch DDP's): same gradients."""
    from test_ddp_strides import Sliced, _batch

    kwargs = {"gradient_as_bucket_view": view, "bucket_cap_mb": 1e-4, "device_ids": _ids()}
    fast = fastcoll.DDP(Sliced(seed=0, device=DEVICE), **kwargs)
    ref = TorchDDP(Sliced(seed=0, device=DEVICE), **kwargs)
    assert not fast.module.w1.is_contiguous() and not fast.module.w2.is_contiguous()
    seen: List[Any] = []
    fast.reducer.add_collective_listener(seen.append)
    of = torch.optim.SGD(fast.parameters(), lr=0.1, momentum=0.9)
    ot = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        for mod, opt in ((fast, of), (ref, ot)):
            opt.zero_grad(set_to_none=step % 2 == 0)
            _loss(mod(_batch(0, step).to(DEVICE))).backward()
        _assert_grads(fast, ref, f"step {step}")
        of.step()
        ot.step()
    _sync()
    assert len(_bucket_reductions(seen)) >= 4, "the buckets were not reduced through the process group"
    fast.close()


def test_gradient_as_bucket_view_holds_no_more_than_torch_ddp(pg):
    """gradient_as_bucket_view with zero_grad(set_to_none=True): backward writes each gradient into a tensor of its
    own; a large one is copied into its bucket view and released as soon as it is final, as torch DDP does, instead
    of staying alive until its whole bucket is packed. A steady-state iteration holds no more bytes than torch's."""
    from fastcoll.bench.runner import MemoryProbe

    model = _build(lambda: nn.Sequential(*(nn.Linear(256, 256) for _ in range(4))))
    fast, ref, seen = _pair(model, {"gradient_as_bucket_view": True})
    early = [n for b in fast.bucket_info() for n in b["packed_early"]]
    assert early == [f"{i}.weight" for i in (3, 2, 1, 0)], early
    x = torch.randn(8, 256, device=DEVICE)
    peaks: Dict[str, List[int]] = {"fastcoll": [], "torch": []}
    for _ in range(4):
        for name, mod in (("fastcoll", fast), ("torch", ref)):
            probe = MemoryProbe(DEVICE, tensors=True)
            probe.start()
            mod.module.zero_grad(set_to_none=True)
            _loss(mod(x)).backward()
            peaks[name].append(probe.tensor_peak())
    _assert_grads(fast, ref, "after 4 iterations")
    assert _bucket_reductions(seen), "no collective ran"
    for step in (2, 3):  # after both wrappers rebuilt their buckets
        assert peaks["fastcoll"][step] <= peaks["torch"][step] + 64 * 1024, (step, peaks)
    fast.close()


def test_find_unused_parameters(pg):
    fast, ref, seen = _pair(_build(Branchy), {"find_unused_parameters": True})
    _train(fast, ref, "branchy", 4, forward=lambda mod, x, step: mod(x, use=step % 2 == 1))
    assert len([c for c in seen if c.what == "used parameters"]) == 4, seen
    assert fast.reducer.stats()["host_reads"] == 4
    assert fast.module.never.weight.grad is None
    fast.close()


def test_static_graph(pg):
    fast, ref, seen = _pair(_build(Net), {"static_graph": True, "bucket_cap_mb": 0.0005})
    buckets = _train(fast, ref, "net", 4)
    # The learning iteration reduces everything at its end and sums the use map once; later ones never do.
    assert len([c for c in seen if c.what == "used parameters"]) == 1, seen
    assert len(_bucket_reductions(seen)) == sum(buckets)
    fast.close()


def test_grad_norm_and_clipping(pg):
    fast, ref, seen = _pair(_build(Net), {"compute_grad_norm": True, "bucket_cap_mb": 0.0005})
    for step in range(3):
        x = _batch("net", step)
        for mod in (fast, ref):
            mod.module.zero_grad(set_to_none=True)
            _loss(mod(x)).backward()
        want = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in ref.module.parameters()]))
        norm = fast.grad_norm()
        assert norm.device.type == DEVICE and norm.dtype == F32
        torch.testing.assert_close(norm.double(), want, rtol=1e-6, atol=0)
        got = fast.clip_grad_norm_(0.5 * float(want))
        expected = torch.nn.utils.clip_grad_norm_(ref.module.parameters(), 0.5 * float(want))
        torch.testing.assert_close(got, expected.to(got.dtype), rtol=1e-6, atol=0)
        _assert_grads(fast, ref, f"clipped, step {step}")
    assert len(_bucket_reductions(seen)) > 0
    fast.close()


def test_check_nonfinite(pg):
    fast = fastcoll.DDP(_build(Net), device_ids=_ids(), check_nonfinite=True, bucket_cap_mb=0.0005)
    _loss(fast(_batch("net", 0))).backward()  # finite: no error
    handle = fast.module.fc2.weight.register_hook(lambda g: g.index_fill(0, torch.tensor([1], device=g.device), float("nan")))
    with pytest.raises(fastcoll.NonFiniteGradError) as err:
        _loss(fast(_batch("net", 1))).backward()
    assert "rank 0: 'fc2.weight'" in str(err.value), str(err.value)
    handle.remove()
    fast.zero_grad()
    _loss(fast(_batch("net", 2))).backward()  # the caller skips the step and goes on
    assert all(torch.isfinite(p.grad).all() for p in fast.module.parameters())
    fast.close()


@pytest.mark.parametrize("comm_dtype", [None, BF16], ids=["fp32", "bf16_wire"])
def test_gradient_divisor_on_the_device(pg, comm_dtype):
    kwargs = {"bucket_cap_mb": 0.0005}
    if comm_dtype is not None:
        kwargs["comm_dtype"] = comm_dtype
    fast, ref, seen = _pair(_build(Net), kwargs, {"bucket_cap_mb": 0.0005})
    d = 3.0
    divisor = torch.tensor(d, device=DEVICE)
    fast.set_gradient_divisor(divisor)
    tol = EXACT if comm_dtype is None else {"rtol": 1.6e-2, "atol": 2e-3}
    for step in range(3):
        x = _batch("net", step)
        for mod in (fast, ref):
            mod.module.zero_grad(set_to_none=True)
            _loss(mod(x)).backward()
        for (name, p), q in zip(fast.module.named_parameters(), ref.module.parameters()):
            torch.testing.assert_close(p.grad, q.grad / d, **tol, msg=lambda m, name=name: f"step {step} '{name}': {m}")
        d = 2.0 + step
        divisor.fill_(d)  # read on the device at the start of the next backward
    assert len(_bucket_reductions(seen)) > 0
    fast.close()


# ---------------------------------------------------------------------------
# fastcoll.dist over NCCL, collectives forced at world size 1
# ---------------------------------------------------------------------------


def test_dist_helpers(pg, calls):
    import fastcoll.dist as fd

    t = torch.randn(3, 5, device=DEVICE)
    out = fd.reduce_mean(t)
    assert torch.equal(out, t) and out.data_ptr() != t.data_ptr()
    assert "all_reduce" in calls, calls

    del calls[:]
    values = {"loss": torch.tensor(2.5, device=DEVICE), "acc": torch.randn(4, device=DEVICE).to(BF16), "n": 7,
              "count": torch.tensor([3, 4], device=DEVICE)}  # fmt: skip
    mean = fd.all_reduce_dict(values, op="mean", to_float=False)
    assert list(mean) == list(values)
    assert torch.equal(mean["loss"], values["loss"]) and torch.equal(mean["acc"], values["acc"])
    assert mean["n"].item() == 7 and mean["count"].tolist() == [3.0, 4.0]
    assert "all_gather" in calls or "all_gather_into_tensor" in calls or "all_gather_single" in calls, calls  # the key check
    assert calls.count("all_reduce") >= 2, calls  # the float groups and the exact integer sum

    del calls[:]
    params = [nn.Parameter(torch.randn(n, device=DEVICE)) for n in (3, 1000, 7, 70000)]
    half = nn.Parameter(torch.randn(33, device=DEVICE).half())
    emb = nn.Embedding(20, 4, sparse=True).to(DEVICE)
    emb(torch.tensor([[1, 3, 3]], device=DEVICE)).sum().backward()
    for p in params + [half]:
        p.grad = torch.randn_like(p)
    before = [p.grad.clone() for p in params + [half]] + [emb.weight.grad.to_dense()]
    fd.allreduce_grads(params + [half, emb.weight], bucket_size_mb=0.001)
    for i, (p, b) in enumerate(zip(params + [half, emb.weight], before)):
        g = p.grad.to_dense() if p.grad.is_sparse else p.grad
        torch.testing.assert_close(g, b, **EXACT, msg=lambda m, i=i: f"allreduce_grads gradient {i}: {m}")
    assert calls.count("all_reduce") >= 4, calls  # several fp32 buckets and the fp16 one
    assert len([c for c in calls if c.startswith("all_gather")]) >= 3, calls  # the digest and the sparse exchange

    del calls[:]
    assert fd.broadcast({"x": [1, 2]}) == {"x": [1, 2]}
    assert "broadcast" in calls, calls
    del calls[:]
    assert fd.all_gather_object_gpu({"r": 0}, rank_zero_return_only=False) == [{"r": 0}]
    assert fd.all_gather_object_gpu([1, None]) == [[1, None]]
    assert len(calls) >= 2, calls
    assert fd.collect_results(list(range(7)) + [None], size=6, device="gpu") == list(range(6))


def test_collect_results_gpu_communicates_when_forced(pg, calls):
    import fastcoll.dist as fd

    assert fd.collect_results([1, 2, 3], size=3, device="gpu") == [1, 2, 3]
    assert calls, "collect_results(device='gpu') issued no collective with FASTCOLL_FORCE_COLLECTIVES=1"


# ---------------------------------------------------------------------------
# No host synchronization inside a training step
# ---------------------------------------------------------------------------


@CUDA_ONLY
@pytest.mark.parametrize("kwargs", [{}, {"compute_grad_norm": True}], ids=["default", "compute_grad_norm"])
def test_training_step_has_no_host_sync(pg, kwargs):
    fast = fastcoll.DDP(_build(Net), device_ids=[0], **kwargs)
    seen: List[Any] = []
    fast.reducer.add_collective_listener(seen.append)
    xs = [_batch("net", s) for s in range(4)]

    def step(x):
        fast.module.zero_grad(set_to_none=True)
        _loss(fast(x)).backward()
        if kwargs.get("compute_grad_norm"):
            fast.grad_norm()
            fast.clip_grad_norm_(0.1)

    # Warm-up outside the check: iteration 1 records the gradient-ready order and the forward of
    # iteration 2 rebuilds the buckets from it (a broadcast and a .tolist(), once).
    step(xs[0])
    step(xs[1])
    torch.cuda.synchronize()
    assert fast.reducer.rebuilt
    before = len(seen)
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(xs[2])
        step(xs[3])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert len(_bucket_reductions(seen[before:])) >= 2, seen  # the all-reduces really ran inside the check
    if kwargs.get("compute_grad_norm"):
        assert torch.isfinite(fast.grad_norm())
    fast.close()


# ---------------------------------------------------------------------------
# The ops: CUDA graph capture and misaligned tensors
# ---------------------------------------------------------------------------


def _chunks(tensors: Sequence[torch.Tensor], flat_dtype: torch.dtype) -> int:
    """Chunks of one call (copy_chunk.cuh): each tensor cut into pieces of 64 KiB of the wider dtype."""
    n = 0
    for t in tensors:
        if t.numel():
            per = max(1, CHUNK_BYTES // max(t.element_size(), flat_dtype.itemsize))
            n += -(-t.numel() // per)
    return n


def _tensors_for_chunks(total: int, seed: int) -> List[torch.Tensor]:
    """float32 tensors on CUDA that make ``total`` chunks: tiny ones (1 chunk each) and one of several chunks."""
    g = torch.Generator().manual_seed(seed)
    big = max(1, total // 5)
    tiny = total - big
    ts = [torch.randn(1 + k % 7, generator=g) for k in range(tiny)]
    ts.insert(tiny // 2, torch.randn(big * (CHUNK_BYTES // 4) - 3, generator=g))
    return [t.cuda() for t in ts]


def _inline_limit_or_skip(err: BaseException) -> None:
    """Skip when the error says the driver allows only the 120-chunk table (CUDA older than 12.1)."""
    if "for more than 120 chunks" in str(err):
        pytest.skip(f"the CUDA driver or toolkit predates 12.1: kernel-argument tables stop at 120 chunks ({err})")


@CUDA_ONLY
@pytest.mark.parametrize("nchunks", [20, 110, 300, 512], ids=lambda n: f"{n}_chunks")
@pytest.mark.parametrize("wire", [F32, BF16], ids=["fp32", "bf16"])
def test_graph_capture_and_replay(nchunks, wire):
    if not fastcoll.build_info()["cuda_kernels"]:
        pytest.skip("the CUDA kernels are not built")
    src = _tensors_for_chunks(nchunks, seed=nchunks)
    assert _chunks(src, wire) == nchunks
    n = sum(t.numel() for t in src)
    flat = torch.full((n,), float("nan"), device="cuda", dtype=wire)
    back = [torch.full_like(t, float("nan")) for t in src]
    ops.flatten_scale(src, flat, 0.5)  # warm-up outside capture
    try:
        graph = capture_graph(lambda: (ops.flatten_scale(src, flat, 0.5), ops.unflatten_scale(flat, back, 4.0)))
    except RuntimeError as err:
        _inline_limit_or_skip(err)
        raise
    g = torch.Generator().manual_seed(1)
    for replay in range(3):  # each replay reads the inputs' current values
        for t in src:
            t.copy_(torch.randn(t.shape, generator=g).cuda())
        flat.fill_(float("nan"))
        for b in back:
            b.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = torch.cat([(t * 0.5).to(wire) for t in src])
        assert torch.equal(flat, want), f"replay {replay}: packed bucket differs"
        at = 0
        for i, (b, t) in enumerate(zip(back, src)):
            assert torch.equal(b, want[at : at + t.numel()].float() * 4.0), f"replay {replay}: tensor {i} unpacked wrong"
            at += t.numel()


@CUDA_ONLY
def test_graph_capture_refused_past_512_chunks():
    if not fastcoll.build_info()["cuda_kernels"]:
        pytest.skip("the CUDA kernels are not built")
    src = _tensors_for_chunks(512, seed=3) + [torch.randn(2, device="cuda")]
    assert _chunks(src, F32) == 513
    n = sum(t.numel() for t in src)
    flat = torch.full((n,), 7.0, device="cuda")
    back = [torch.full_like(t, 7.0) for t in src]
    errors: List[str] = []
    small = [torch.randn(5, device="cuda")]
    small_flat = torch.empty(5, device="cuda")

    def refused():
        ops.flatten_scale(small, small_flat, 2.0)  # one call that is recorded: the graph is not empty
        for call in (lambda: ops.flatten_scale(src, flat, 0.5), lambda: ops.unflatten_scale(flat, back, 2.0)):
            try:
                call()
            except RuntimeError as err:
                errors.append(str(err))

    graph = capture_graph(refused)
    assert len(errors) == 2, f"a 513-chunk call was not refused under capture: {errors}"
    for msg in errors:
        _inline_limit_or_skip(RuntimeError(msg))
        assert "CUDA graph capture" in msg and "more than 512 chunks" in msg and "this call has 513" in msg, msg
    small[0].copy_(torch.arange(5.0, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(small_flat, torch.arange(5.0, device="cuda") * 2.0)
    assert torch.equal(flat, torch.full_like(flat, 7.0)), "a refused call wrote into the bucket"
    assert all(torch.equal(b, torch.full_like(b, 7.0)) for b in back), "a refused call wrote into a tensor"
    ops.flatten_scale(src, flat, 0.5)  # outside capture the pinned-table path runs
    torch.testing.assert_close(flat, torch.cat(src) * 0.5, rtol=0, atol=0)


PAIRS = [(s, d) for s in DTYPES for d in DTYPES]
SIZES = (1, 3, 7, 33, 1000, 40000)  # 40000: several chunks whatever the dtypes
# Against float64: one rounding to the output dtype (float64 outputs of float32 math carry float32's).
TOL = {
    F16: {"rtol": 1e-3, "atol": 1e-5},
    BF16: {"rtol": 8e-3, "atol": 1e-5},
    F32: {"rtol": 1.3e-6, "atol": 1e-7},
    F64: {"rtol": 1e-6, "atol": 1e-7},
}


def _opmath(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return F64 if F64 in (a, b) else F32


def _expected(x: torch.Tensor, scale: float, dst: torch.dtype) -> torch.Tensor:
    """The kernels' arithmetic on the CPU: x in opmath times opmath(scale), one rounding to ``dst``."""
    m = _opmath(x.dtype, dst)
    return (x.cpu().to(m) * torch.tensor(scale, dtype=m)).to(dst)


def _views(base_numel_pad: int, offset: int, sizes: Sequence[int], dtype: torch.dtype, fill: float = None, seed: int = 0):
    """Tensors that are views at element offsets ``offset``, ``offset + size + 3``, ... of one larger buffer."""
    total = offset + sum(s + 3 for s in sizes) + base_numel_pad
    if fill is None:
        base = torch.randn(total, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)
    else:
        base = torch.full((total,), fill, dtype=dtype, device=DEVICE)
    views, at = [], offset
    for s in sizes:
        views.append(base[at : at + s])
        at += s + 3  # a gap of 3 elements: every view starts at another alignment
    return base, views


@CUDA_ONLY
@pytest.mark.parametrize("pair", PAIRS, ids=[f"{str(a)[6:]}-{str(b)[6:]}" for a, b in PAIRS])
def test_misaligned_views_every_dtype_pair(pair):
    src_dtype, dst_dtype = pair
    scale = 1 / 3
    n = sum(SIZES)
    for offset in range(1, 8):
        # flatten_scale: sources at odd offsets into one buffer, the bucket at an offset into a poisoned one.
        _, sources = _views(5, offset, SIZES, src_dtype, seed=offset)
        out_base = torch.full((n + 2 * offset,), float("nan"), dtype=dst_dtype, device=DEVICE)
        out = out_base[offset : offset + n]
        ops.flatten_scale(sources, out, scale)
        _sync()
        want = torch.cat([_expected(s, scale, dst_dtype) for s in sources])
        what = f"flatten_scale {src_dtype}->{dst_dtype} offset {offset}"
        assert torch.equal(out.cpu(), want), f"{what}: differs from the opmath reference"
        ref64 = torch.cat([s.cpu().double() * scale for s in sources])
        torch.testing.assert_close(out.cpu().double(), ref64, **TOL[dst_dtype], msg=lambda m: f"{what}: vs float64: {m}")
        assert out_base[:offset].isnan().all() and out_base[offset + n :].isnan().all(), f"{what}: wrote outside the bucket"

        # unflatten_scale: the bucket at an offset, destinations at odd offsets into a poisoned buffer.
        flat_base = torch.randn(n + 2 * offset, generator=torch.Generator().manual_seed(50 + offset)).to(src_dtype).to(DEVICE)
        flat = flat_base[offset : offset + n]
        dst_base, dests = _views(5, offset, SIZES, dst_dtype, fill=float("nan"))
        ops.unflatten_scale(flat, dests, scale)
        _sync()
        what = f"unflatten_scale {src_dtype}->{dst_dtype} offset {offset}"
        at = 0
        for i, d in enumerate(dests):
            piece = flat[at : at + d.numel()]
            at += d.numel()
            assert torch.equal(d.cpu(), _expected(piece, scale, dst_dtype)), (
                f"{what}: tensor {i} differs from the opmath reference"
            )
            torch.testing.assert_close(
                d.cpu().double(), piece.cpu().double() * scale, **TOL[dst_dtype], msg=lambda m: f"{what}: tensor {i}: {m}"
            )
        written = torch.zeros(dst_base.numel(), dtype=torch.bool)
        for d in dests:
            start = d.storage_offset()
            written[start : start + d.numel()] = True
        assert dst_base.cpu()[~written].isnan().all(), f"{what}: wrote outside the destinations"
