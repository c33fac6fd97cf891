"""fastcoll.ShardedOptimizer on CUDA with NCCL, in one process (issue #22 on a GPU).

One GPU is one rank; the ``pg`` fixture of test_cuda_paths makes a one-rank NCCL group with
``FASTCOLL_FORCE_COLLECTIVES=1``, so the gradient reduction and the parameters' all-gather run through
NCCL as at any size (the reducer's collective listener checks that they ran). References: torch DDP +
the plain torch AdamW on a copy of the model; for a bfloat16 model with float32 main gradients and
master weights, the same mathematics spelled out (float32 masters stepped from the bfloat16 gradients,
then rounded). Models: ``Reordered`` of test_sharded_optimizer in its three layouts (every parameter
in a flat buffer, mixed, and buckets without a buffer), several buckets each.

Marked ``cuda``: tests/conftest.py skips them without a GPU (``make gpu-test`` runs them). The CPU dry run
of test_cuda_paths' docstring (gloo, CPU tensors) runs them too, with ``tests/test_cuda_sharded.py``.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from test_cuda_paths import DEVICE, _ids, _sync, pg  # noqa: F401  (pg: the fixture)
from test_sharded_optimizer import Reordered
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastcoll

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]

LAYOUTS = {"aligned": {"aligned": True}, "mixed": {}, "wide": {"wide": True}}
STEPS = 4
CAP_MB = 0.002  # a few KiB: several buckets


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(16, 7, generator=g).to(DEVICE)


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def _kinds(seen) -> set:
    return {c.kind for c in seen}


@pytest.mark.parametrize("grads", ["full", "sharded"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_torch_ddp_and_adamw(pg, layout, grads):  # noqa: F811
    base = Reordered(seed=3, **LAYOUTS[layout]).to(DEVICE)
    fast = fastcoll.DDP(copy.deepcopy(base), device_ids=_ids(), bucket_cap_mb=CAP_MB)
    ref = TorchDDP(copy.deepcopy(base), device_ids=_ids(), bucket_cap_mb=CAP_MB)
    seen = []
    fast.reducer.add_collective_listener(seen.append)
    opt = fastcoll.ShardedOptimizer(_adamw(fast.parameters()), fast, grads=grads)
    ref_opt = _adamw(ref.parameters())
    if layout == "aligned":
        assert opt.staged_parameters() == []
    for step in range(STEPS):
        x = _batch(step)
        for model, o in ((fast, opt), (ref, ref_opt)):
            o.zero_grad()
            model(x).square().mean().backward()
            o.step()
    opt.finish_param_sync()
    _sync()
    for (name, p), q in zip(fast.module.named_parameters(), ref.module.parameters()):
        assert p.device.type == DEVICE, name
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{layout}/{grads} '{name}': {m}")
    kinds = _kinds(seen)
    assert "all_gather" in kinds and ("reduce_scatter" if grads == "sharded" else "all_reduce") in kinds, kinds
    fast.close()


@pytest.mark.parametrize("grads", ["full", "sharded"])
def test_bf16_model_with_float32_main_grads_and_masters(pg, grads):  # noqa: F811
    base = Reordered(seed=4, aligned=True).to(DEVICE)
    fast = fastcoll.DDP(
        copy.deepcopy(base).to(torch.bfloat16), device_ids=_ids(), bucket_cap_mb=CAP_MB, main_grad_dtype=torch.float32
    )
    opt = fastcoll.ShardedOptimizer(_adamw(fast.parameters()), fast, grads=grads, master_dtype=torch.float32)
    # Reference: the bfloat16 model computes the gradients, float32 masters take the step, then rounded back.
    model16 = copy.deepcopy(base).to(torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_(p.requires_grad) for p in model16.parameters()]
    ref_opt = _adamw([m for m in masters if m.requires_grad])
    for step in range(STEPS):
        x = _batch(step).to(torch.bfloat16)
        opt.zero_grad()
        fast(x).float().square().mean().backward()
        opt.step()
        ref_opt.zero_grad()
        model16.zero_grad()
        model16(x).float().square().mean().backward()
        for p, m in zip(model16.parameters(), masters):
            if p.grad is not None:
                m.grad = p.grad.float()
        ref_opt.step()
        with torch.no_grad():
            for p, m in zip(model16.parameters(), masters):
                p.copy_(m)
    opt.finish_param_sync()
    _sync()
    for (name, p), q in zip(fast.module.named_parameters(), model16.parameters()):
        assert p.dtype == torch.bfloat16 and p.device.type == DEVICE, name
        # One bfloat16 rounding apart at most (cuBLAS may pick other kernels for other addresses).
        torch.testing.assert_close(p.float(), q.float(), rtol=8e-3, atol=1e-4, msg=lambda m, name=name: f"{grads} '{name}': {m}")
    fast.close()


@pytest.mark.parametrize("accumulate", ["reduce_scatter", "full"])
@pytest.mark.parametrize("layout", ["mixed", "wide"])
def test_grad_buffer_pool_equals_persistent_buffers(pg, layout, accumulate):  # noqa: F811
    """ZeRO-2 on the device: pool buffers on CUDA, NCCL reduce-scatters, two micro-batches per step."""
    base = Reordered(seed=5, **LAYOUTS[layout]).to(DEVICE)
    final = {}
    for mode in ("persistent", "pool"):
        fast = fastcoll.DDP(copy.deepcopy(base), device_ids=_ids(), bucket_cap_mb=CAP_MB)
        seen = []
        fast.reducer.add_collective_listener(seen.append)
        kw = {"grad_buffers": "pool", "accumulate": accumulate, "pool_buffers": 1} if mode == "pool" else {}
        opt = fastcoll.ShardedOptimizer(_adamw(fast.parameters()), fast, grads="sharded", **kw)
        for step in range(STEPS):
            opt.zero_grad()
            for micro in range(2):
                with fast.no_sync() if micro == 0 else contextlib.nullcontext():
                    fast(_batch(10 * step + micro)).square().mean().backward()
            opt.step()
        opt.finish_param_sync()
        _sync()
        if mode == "pool":
            pool = opt.grad_pool
            assert pool.peak == pool.bound == 1 and pool.live == 0, (pool.peak, pool.bound, pool.live)
            assert all(b.device.type == DEVICE for b in fast.module.parameters())
        assert "reduce_scatter" in _kinds(seen) and "all_gather" in _kinds(seen), _kinds(seen)
        final[mode] = [p.detach().clone() for p in fast.module.parameters()]
        fast.close()
    for i, (a, b) in enumerate(zip(final["persistent"], final["pool"])):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=lambda m, i=i: f"{layout}/{accumulate} parameter {i}: {m}")


@pytest.mark.parametrize("grads", ["full", "sharded"])
def test_complex_parameters_through_nccl(pg, grads):  # noqa: F811
    """Complex buckets through NCCL: its all-reduce, reduce-scatter and all-gather (fastcoll hands them real views)."""
    from test_ddp_complex import Spectral, _x

    base = Spectral().to(DEVICE)
    fast = fastcoll.DDP(copy.deepcopy(base), device_ids=_ids(), bucket_cap_mb=0.0004, first_bucket_mb=0.0002)
    ref = TorchDDP(copy.deepcopy(base), device_ids=_ids())
    seen = []
    fast.reducer.add_collective_listener(seen.append)
    opt = fastcoll.ShardedOptimizer(_adamw(fast.parameters()), fast, grads=grads)
    ref_opt = _adamw(ref.parameters())
    for step in range(STEPS):
        x = _x(step, 0).to(DEVICE)
        for model, o in ((fast, opt), (ref, ref_opt)):
            o.zero_grad()
            model(x).backward()
            o.step()
    opt.finish_param_sync()
    _sync()
    for (name, p), q in zip(fast.module.named_parameters(), ref.module.parameters()):
        assert p.dtype == q.dtype, name
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{grads} '{name}': {m}")
    complex_kinds = {c.kind for c in seen if c.dtype.is_complex}
    assert "all_gather" in complex_kinds and ("reduce_scatter" if grads == "sharded" else "all_reduce") in complex_kinds, seen
    fast.close()
