"""fastcoll.DDP comm hooks (torch's contract) and fused low-precision communication (comm_dtype).

Every multi-rank check runs through ``multiproc.run_ranks`` (gloo, 1 thread
per rank, hard timeout); each spawned run performs a group of checks and the
assertion messages say which one failed.

References: torch DDP with the same hook (torch's hooks on fastcoll's bucket
must give torch DDP's gradients). Where torch DDP refuses a hook that works
(bf16 hooks on CPU are rejected by name at registration; functools.partial
objects and hooks whose second parameter is not literally ``bucket`` by its
signature check), torch DDP runs the very same torch hook through a plain
``def _(state, bucket)`` forwarding function, so the hook's arithmetic is
torch's own and only the registration check is sidestepped.
"""

from __future__ import annotations

import copy
import functools

import ddp_models as M
import pytest
import torch
import torch.distributed as dist
from multiproc import run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks as DBG
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as D
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as L
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastcoll

STEPS = 5
LR, MOMENTUM = 0.1, 0.9
EXACT = {"rtol": 1e-5, "atol": 1e-6}  # same arithmetic (summation order of gloo may differ only for 3+ ranks)
HALF = {"rtol": 2e-3, "atol": 2e-4}  # fp16 rounding differences (one rounding vs torch's two)
BF16 = {"rtol": 1.6e-2, "atol": 2e-3}


def _forward_to(hook):
    """torch DDP registration shim: the same torch hook behind a plain function torch accepts."""

    def reference_hook(state, bucket):
        return hook(state, bucket)

    return reference_hook


def _allreduce_times(factor, state, bucket):
    """A hook that takes an extra leading argument (registered through functools.partial)."""
    bucket.buffer().mul_(factor)
    return D.allreduce_hook(state, bucket)


def _renamed_second_param(state, grad_bucket):
    return D.allreduce_hook(state, grad_bucket)


def _psgd(start=2):
    return P.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=start)


_SUBGROUP = {}


def _local_subgroup():
    if "g" not in _SUBGROUP:
        _SUBGROUP["g"], _ = dist.new_subgroups(group_size=1)  # every rank alone: local SGD does not average
    return _SUBGROUP["g"]


def make_hook(kind: str, side: str):
    """(state, hook) for ``side`` in {"fast", "torch"}; a fresh state per call."""
    fast = side == "fast"
    if kind == "allreduce":
        return None, D.allreduce_hook
    if kind == "fp16":
        return None, D.fp16_compress_hook
    if kind == "bf16":
        return None, D.bf16_compress_hook if fast else _forward_to(D.bf16_compress_hook)
    if kind == "fp16_wrap_allreduce":
        return None, D.fp16_compress_wrapper(D.allreduce_hook)
    if kind == "bf16_wrap_allreduce":
        h = D.bf16_compress_wrapper(D.allreduce_hook)
        return None, h if fast else _forward_to(h)
    if kind == "powersgd":
        return _psgd(), P.powerSGD_hook
    if kind == "fp16_wrap_powersgd":
        return _psgd(), D.fp16_compress_wrapper(P.powerSGD_hook)
    if kind == "bf16_wrap_powersgd":
        h = D.bf16_compress_wrapper(P.powerSGD_hook)
        return _psgd(), h if fast else _forward_to(h)
    if kind == "post_localsgd_global":
        # subgroup=None: the intra-node group is created on first local step (needs CUDA); before
        # start_localSGD_iter the hook all-reduces globally.
        return L.PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=STEPS + 1), L.post_localSGD_hook
    if kind == "post_localsgd_local":
        return L.PostLocalSGDState(process_group=None, subgroup=_local_subgroup(), start_localSGD_iter=2), L.post_localSGD_hook
    if kind == "noop":
        return None, DBG.noop_hook
    if kind == "partial":
        return None, functools.partial(_allreduce_times, 2.0) if fast else _forward_to(functools.partial(_allreduce_times, 2.0))
    if kind == "renamed":
        return None, _renamed_second_param if fast else D.allreduce_hook
    raise KeyError(kind)


# (name, model, fastcoll.DDP kwargs, how the reference is set up, tolerance)
# reference: ("hook", kind) = torch DDP with the same torch hook; ("builtin", T) = torch's builtin hook T.
HOOK_CONFIGS = [
    ("allreduce_hook", "mlp", {"hook": "allreduce"}, ("hook", "allreduce"), EXACT),
    (
        "allreduce_hook tiny buckets + view",
        "mlp",
        {"hook": "allreduce", "bucket_cap_mb": 1e-6, "gradient_as_bucket_view": True},
        ("hook", "allreduce"),
        EXACT,
    ),
    (
        "allreduce_hook find_unused",
        "branchy",
        {"hook": "allreduce", "find_unused_parameters": True},
        ("hook", "allreduce"),
        EXACT,
    ),
    ("fp16_compress_hook", "mlp", {"hook": "fp16"}, ("hook", "fp16"), EXACT),
    ("bf16_compress_hook", "mlp", {"hook": "bf16", "bucket_cap_mb": 0.001}, ("hook", "bf16"), EXACT),
    ("fp16_compress_wrapper(allreduce_hook)", "mlp", {"hook": "fp16_wrap_allreduce"}, ("hook", "fp16_wrap_allreduce"), EXACT),
    ("bf16_compress_wrapper(allreduce_hook)", "mlp", {"hook": "bf16_wrap_allreduce"}, ("hook", "bf16_wrap_allreduce"), EXACT),
    ("powerSGD_hook", "mlp", {"hook": "powersgd"}, ("hook", "powersgd"), EXACT),
    # One bucket: with several, PowerSGD issues collectives from future callbacks (gloo threads) while
    # the next bucket's hook issues its own, and the order differs across ranks (torch DDP itself then
    # fails on gloo with "Received data size doesn't match expected size").
    ("powerSGD_hook + view", "mlp", {"hook": "powersgd", "gradient_as_bucket_view": True}, ("hook", "powersgd"), EXACT),
    ("powerSGD_hook encoder", "encoder", {"hook": "powersgd"}, ("hook", "powersgd"), EXACT),
    ("fp16_compress_wrapper(powerSGD_hook)", "mlp", {"hook": "fp16_wrap_powersgd"}, ("hook", "fp16_wrap_powersgd"), EXACT),
    ("bf16_compress_wrapper(powerSGD_hook)", "mlp", {"hook": "bf16_wrap_powersgd"}, ("hook", "bf16_wrap_powersgd"), EXACT),
    ("post_localSGD_hook subgroup=None", "mlp", {"hook": "post_localsgd_global"}, ("hook", "post_localsgd_global"), EXACT),
    ("post_localSGD_hook local subgroup", "mlp", {"hook": "post_localsgd_local"}, ("hook", "post_localsgd_local"), EXACT),
    ("noop_hook", "mlp", {"hook": "noop"}, ("hook", "noop"), EXACT),
    ("functools.partial hook", "mlp", {"hook": "partial"}, ("hook", "partial"), EXACT),
    ("second parameter not named bucket", "mlp", {"hook": "renamed"}, ("hook", "renamed"), EXACT),
    ("builtin ALLREDUCE", "mlp", {"builtin": "ALLREDUCE"}, ("builtin", "ALLREDUCE"), EXACT),
    ("builtin FP16_COMPRESS", "mlp", {"builtin": "FP16_COMPRESS"}, ("builtin", "FP16_COMPRESS"), HALF),
    # fastcoll's own fused low-precision communication against torch's compress hooks.
    ("comm_dtype=float16", "mlp", {"comm_dtype": torch.float16}, ("hook", "fp16"), HALF),
    (
        "comm_dtype=float16 tiny buckets + view",
        "mlp",
        {"comm_dtype": torch.float16, "bucket_cap_mb": 1e-6, "gradient_as_bucket_view": True},
        ("hook", "fp16"),
        HALF,
    ),
    ("comm_dtype=float16 convbn", "convbn", {"comm_dtype": torch.float16, "bucket_cap_mb": 0.001}, ("hook", "fp16"), HALF),
    (
        "comm_dtype=float16 find_unused",
        "branchy",
        {"comm_dtype": torch.float16, "find_unused_parameters": True},
        ("hook", "fp16"),
        HALF,
    ),
    ("comm_dtype=bfloat16", "mlp", {"comm_dtype": torch.bfloat16}, ("hook", "bf16"), BF16),
    (
        "comm_dtype=bfloat16 + view",
        "encoder",
        {"comm_dtype": torch.bfloat16, "gradient_as_bucket_view": True, "bucket_cap_mb": 0.002},
        ("hook", "bf16"),
        BF16,
    ),
]


def _wrap(side, name, model, kwargs):
    kw = {k: v for k, v in kwargs.items() if k not in ("hook", "builtin")}
    if side == "torch":
        kw.pop("comm_dtype", None)
        ddp = TorchDDP(copy.deepcopy(model), **kw)
    else:
        ddp = fastcoll.DDP(copy.deepcopy(model), **kw)
    return ddp


def _register(ddp, side, spec):
    how, what = spec
    if how == "hook":
        state, hook = make_hook(what, side)
        ddp.register_comm_hook(state, hook)
    elif how == "builtin":
        ddp._register_builtin_comm_hook(getattr(dist.BuiltinCommHookType, what))


def _grads(mod):
    return [None if p.grad is None else p.grad.detach().clone() for p in mod.module.parameters()]


def _record_wire(fast):
    """Record (gradient dtype, wire dtype) of every bucket all-reduce the reducer issues."""
    seen = []
    dtype_of = {f"bucket {b['index']}": b["dtype"] for b in fast.bucket_info()}

    def listen(c):
        if c.kind == "all_reduce" and c.what in dtype_of:
            seen.append((dtype_of[c.what], c.dtype))

    fast.reducer.add_collective_listener(listen)
    return seen


def hook_parity_worker(rank, world_size, configs):
    for label, name, kwargs, ref_spec, tol in configs:
        what = f"{label} (rank {rank}/{world_size})"
        model = M.build(name, seed=rank)
        fast = _wrap("fast", name, model, kwargs)
        ref = _wrap("torch", name, model, kwargs)
        if "hook" in kwargs:
            _register(fast, "fast", ("hook", kwargs["hook"]))
        if "builtin" in kwargs:
            _register(fast, "fast", ("builtin", kwargs["builtin"]))
        _register(ref, "torch", ref_spec)
        wire = _record_wire(fast)
        of = torch.optim.SGD(fast.parameters(), lr=LR, momentum=MOMENTUM)
        ot = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
        for step in range(STEPS):
            M.backward_on_chunk(name, world_size, rank, step, ((fast, of), (ref, ot)))
            gf, gt = _grads(fast), _grads(ref)
            for (n, _), a, b in zip(fast.module.named_parameters(), gf, gt):
                assert (a is None) == (b is None), f"{what} step {step}: {n}.grad None mismatch"
                if a is not None:
                    torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{what} step {step}: grad of {n}: {m}")
            if kwargs.get("hook") == "noop":
                # The noop hook leaves local gradients: the ranks must differ.
                g = fast.module.head.weight.grad
                others = [torch.empty_like(g) for _ in range(world_size)]
                dist.all_gather(others, g)
                assert not torch.equal(others[0], others[1]), f"{what}: noop hook synchronized gradients"
            of.step()
            ot.step()
        for (n, p), (_, q) in zip(fast.module.named_parameters(), ref.module.named_parameters()):
            torch.testing.assert_close(p, q, **tol, msg=lambda m: f"{what}: parameter {n} after training: {m}")
        comm_dtype = kwargs.get("comm_dtype") or (torch.float16 if kwargs.get("builtin") == "FP16_COMPRESS" else None)
        info = fast.bucket_info()
        if comm_dtype is not None:
            assert wire, f"{what}: no bucket all-reduce was issued"
            for grad_dtype, dtype in wire:
                want = comm_dtype if grad_dtype == torch.float32 else grad_dtype  # 16-bit buckets travel as they are
                assert dtype == want, f"{what}: a {grad_dtype} bucket travelled as {dtype}, not {want}"
            for b in info:
                want = comm_dtype if b["dtype"] == torch.float32 else b["dtype"]
                assert b["comm_dtype"] == want and b["comm_bytes"] == b["numel"] * want.itemsize, f"{what}: {b}"
                assert b["bytes"] == b["numel"] * b["dtype"].itemsize, f"{what}: {b}"
        elif "hook" in kwargs:
            assert not wire, f"{what}: the reducer issued its own all-reduce next to the comm hook"
        if kwargs.get("gradient_as_bucket_view"):
            for b in fast.reducer.buckets:
                for p, v in zip(b.params, b.views):
                    if p.grad is not None:
                        assert p.grad.data_ptr() == v.data_ptr(), f"{what}: grad is not its bucket view"
        fast.close()


def test_hook_parity_with_torch_ddp():
    run_ranks(hook_parity_worker, 2, HOOK_CONFIGS, timeout=180)


MIXED_CONFIGS = [
    # fp16/bf16 buckets travel as they are; float32 ones narrow (torch's hook casts every bucket).
    (
        "comm_dtype=float16 mixed dtypes",
        "mixed",
        {"comm_dtype": torch.float16, "bucket_cap_mb": 1e-4},
        ("hook", "fp16"),
        {"rtol": 2e-2, "atol": 2e-2},
    ),
]


def three_rank_worker(rank, world_size):
    hook_parity_worker(
        rank,
        world_size,
        [c for c in HOOK_CONFIGS if c[0] in ("powerSGD_hook", "comm_dtype=float16", "allreduce_hook")] + MIXED_CONFIGS,
    )
    _check_overflow(rank, world_size)


def test_three_ranks_and_mixed_dtypes():
    run_ranks(three_rank_worker, 3, timeout=150)


# --------------------------------------------------------------------------- comm_dtype overflow


class Scaled(nn.Module):
    """loss = sum(w * big): the gradient of every weight element is ``big`` on every rank."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(64))

    def forward(self, big):
        return (self.w * big).sum()


def _check_overflow(rank, world_size):
    big = 6.0e4  # < float16 max (65504); world_size * big is not
    # The naive scheme (sum in float16, divide afterwards) overflows:
    naive = torch.full((4,), big, dtype=torch.float16)
    dist.all_reduce(naive)
    assert torch.isinf(naive).all(), f"expected the naive float16 sum to overflow, got {naive}"
    for view in (False, True):
        fast = fastcoll.DDP(Scaled(), comm_dtype=torch.float16, gradient_as_bucket_view=view)
        fast(torch.tensor(big)).backward()
        g = fast.module.w.grad
        assert torch.isfinite(g).all(), f"comm_dtype=float16 (view={view}): gradient overflowed: {g[:4]}"
        torch.testing.assert_close(
            g, torch.full_like(g, big), rtol=1e-3, atol=0, msg=lambda m: f"comm_dtype=float16 (view={view}): {m}"
        )
        # Rank-dependent large gradients: the mean, not the sum, must come back.
        fast.zero_grad()
        scale = big * (rank + 1) / world_size
        fast(torch.tensor(scale)).backward()
        want = big * (world_size + 1) / 2 / world_size
        torch.testing.assert_close(fast.module.w.grad, torch.full_like(g, want), rtol=1e-3, atol=0)
        fast.close()


def test_overflow_two_ranks():
    run_ranks(_overflow_worker, 2, timeout=60)


def _overflow_worker(rank, world_size):
    _check_overflow(rank, world_size)


# --------------------------------------------------------------------------- the bucket object


def _probe_hook(log, bucket):
    """Checks the GradBucket contract from inside a hook, then all-reduces through set_buffer."""
    buf = bucket.buffer()
    params = bucket.parameters()
    grads = bucket.gradients()
    assert buf.dim() == 1 and buf.is_contiguous() and buf.storage_offset() == 0
    assert buf.untyped_storage().nbytes() == buf.numel() * buf.element_size(), "buffer() does not own its storage"
    assert len(grads) == len(params) and buf.numel() == sum(p.numel() for p in params)
    for g, p in zip(grads, params):
        assert g.shape == p.shape and g.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        # Packed without division: the bucket holds this rank's own gradients.
        assert torch.equal(g, p.grad), "bucket gradients differ from the parameters' local gradients"
    log.append((bucket.index(), bucket.is_last(), buf.numel()))
    # Writing through gradients() writes the buffer (PowerSGD does this).
    before = buf.clone()
    grads[0].add_(1.0)
    assert torch.equal(buf[: grads[0].numel()], before[: grads[0].numel()] + 1.0), "gradients() are not views of buffer()"
    grads[0].sub_(1.0)
    # set_buffer: the accessors follow the new buffer.
    new = buf.to(torch.float64)
    bucket.set_buffer(new)
    assert bucket.buffer() is new
    assert all(
        g.dtype == torch.float64 and g.untyped_storage().data_ptr() == new.untyped_storage().data_ptr()
        for g in bucket.gradients()
    )
    new.div_(dist.get_world_size())
    return dist.all_reduce(new, async_op=True).get_future()  # value: a list with one float64 tensor


def bucket_object_worker(rank, world_size):
    for view in (False, True):
        what = f"bucket object (gradient_as_bucket_view={view})"
        model = M.build("mlp", 0)
        fast = fastcoll.DDP(copy.deepcopy(model), bucket_cap_mb=0.001, gradient_as_bucket_view=view)
        ref = TorchDDP(copy.deepcopy(model), bucket_cap_mb=0.001)
        log = []
        fast.register_comm_hook(log, _probe_hook)
        for step in range(3):
            x, y = M.global_batch("mlp", world_size, step)
            log.clear()
            for mod in (fast, ref):
                mod.zero_grad()
                M.loss_of("mlp", mod, M.chunk_of(x, rank), M.chunk_of(y, rank), rank, step).backward()
            n = len(fast.bucket_info())
            assert [i for i, _, _ in log] == list(range(n)), f"{what} step {step}: hook order {log}"
            assert [last for _, last, _ in log] == [False] * (n - 1) + [True], f"{what}: is_last {log}"
            assert [numel for _, _, numel in log] == [b["numel"] for b in fast.bucket_info()]
            for (name, p), q in zip(fast.module.named_parameters(), ref.module.parameters()):
                torch.testing.assert_close(p.grad, q.grad, **EXACT, msg=lambda m: f"{what} step {step}: {name}: {m}")
        assert n >= 3, f"{what}: expected several buckets, got {n}"
        fast.close()


def test_bucket_object_contract():
    run_ranks(bucket_object_worker, 2, timeout=60)


# --------------------------------------------------------------------------- registration rules


def _returns_tensor(state, bucket):
    return bucket.buffer()


def _returns_none(state, bucket):
    return None


def _wrong_numel(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer()[:-1])
    return fut


def _bad_bucket_annotation(state, bucket: int):
    return D.allreduce_hook(state, bucket)


def _bad_return_annotation(state, bucket) -> int:
    return D.allreduce_hook(state, bucket)


def _future_of_int(state, bucket) -> torch.futures.Future[int]:
    return D.allreduce_hook(state, bucket)


def _one_param(bucket):
    return D.allreduce_hook(None, bucket)


def _string_annotations(state: "object", bucket: "dist.GradBucket") -> "torch.futures.Future[torch.Tensor]":
    return D.allreduce_hook(state, bucket)


def _fastcoll_bucket_annotation(state, bucket: fastcoll.GradBucket) -> torch.futures.Future[list[torch.Tensor]]:
    return dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True).get_future()


def _expect(exc, match, fn):
    with pytest.raises(exc, match=match):
        fn()


def _backward(ddp, rank):
    x, y = M.global_batch("mlp", 2, 0)
    M.loss_of("mlp", ddp, M.chunk_of(x, rank), M.chunk_of(y, rank), rank, 0).backward()


def registration_worker(rank, world_size):
    mk = lambda **kw: fastcoll.DDP(M.build("mlp", 0), **kw)  # noqa: E731
    d = mk()
    _expect(TypeError, "callable", lambda: d.register_comm_hook(None, 42))
    _expect(TypeError, "hook\\(state, bucket\\)", lambda: d.register_comm_hook(None, _one_param))
    _expect(ValueError, "bucket parameter 'bucket' is annotated", lambda: d.register_comm_hook(None, _bad_bucket_annotation))
    _expect(ValueError, "return annotation", lambda: d.register_comm_hook(None, _bad_return_annotation))
    _expect(ValueError, "return annotation", lambda: d.register_comm_hook(None, _future_of_int))
    d.register_comm_hook(None, _string_annotations)
    _expect(RuntimeError, "already registered", lambda: d.register_comm_hook(None, D.allreduce_hook))
    _expect(RuntimeError, "already registered", lambda: d._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE))
    _backward(d, rank)
    d.close()
    d = mk()
    d.register_comm_hook(None, _fastcoll_bucket_annotation)  # a list-valued future, fastcoll's Bucket annotation
    ref = TorchDDP(M.build("mlp", 0))
    for mod in (d, ref):
        _backward(mod, rank)
    for p, q in zip(d.module.parameters(), ref.module.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **EXACT)
    d.close()
    d = mk()
    d._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    assert d.comm_dtype == torch.float16 and all(b["comm_dtype"] == torch.float16 for b in d.bucket_info())
    _expect(RuntimeError, "already registered", lambda: d.register_comm_hook(None, D.allreduce_hook))
    _expect(TypeError, "BuiltinCommHookType", lambda: mk()._register_builtin_comm_hook("ALLREDUCE"))
    d.close()
    d = mk(comm_dtype=torch.bfloat16)
    _expect(RuntimeError, "already registered.*comm_dtype", lambda: d.register_comm_hook(None, D.allreduce_hook))
    d.close()
    # Bad comm_dtype: every rank raises at construction (the check is shared across ranks).
    for bad in (torch.float32, "float16"):
        _expect(ValueError, "comm_dtype", lambda: mk(comm_dtype=bad))
    # Bad on one rank only: every rank raises the same error, naming that rank.
    _expect(ValueError, "rank 1: comm_dtype must be", lambda: mk(comm_dtype=torch.float64 if rank == 1 else None))
    # A hook that returns something else than a future: a clear error naming what it returned.
    for hook, needle in ((_returns_tensor, "returned a Tensor"), (_returns_none, "returned None")):
        d = mk()
        d.register_comm_hook(None, hook)
        _expect(TypeError, needle + ".*torch.futures.Future", lambda: _backward(d, rank))
        d.close()
    d = mk()
    d.register_comm_hook(None, _wrong_numel)
    n = d.bucket_info()[0]["numel"]
    _expect(TypeError, f"{n - 1},.*expected one floating-point tensor of {n} elements", lambda: _backward(d, rank))
    d.close()
    # The ranks are still in step afterwards.
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world_size


def test_registration_rules():
    run_ranks(registration_worker, 2, timeout=60)


# --------------------------------------------------------------------------- layout with comm_dtype


def rebuild_worker(rank, world_size):
    # The rebuilt layout keeps comm_dtype, and bucket_info() reports it.
    fast = fastcoll.DDP(M.build("reordered", 0), bucket_cap_mb=1e-6, comm_dtype=torch.float16)
    ref = TorchDDP(M.build("reordered", 0), bucket_cap_mb=1e-6)
    ref.register_comm_hook(None, D.fp16_compress_hook)
    before = [b["names"] for b in fast.bucket_info()]
    for step in range(3):
        x, y = M.global_batch("reordered", world_size, step)
        for mod in (fast, ref):
            mod.zero_grad()
            M.loss_of("reordered", mod, M.chunk_of(x, rank), M.chunk_of(y, rank), rank, step).backward()
        for p, q in zip(fast.module.parameters(), ref.module.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **HALF)
    after = fast.bucket_info()
    assert [b["names"] for b in after] != before and after[0]["names"][0].startswith("c."), after
    assert all(b["comm_dtype"] == torch.float16 for b in after)
    fast.close()
    assert fast.bucket_info() == []


def test_rebuilt_layout_keeps_comm_dtype():
    run_ranks(rebuild_worker, 2, timeout=60)
