"""fastcoll.DDP.join(): training with uneven inputs, against torch DDP's join.

Each rank gets its own number of batches; fastcoll.DDP and torch DDP train the
same model, one after the other, inside their own ``join()``; per-step
gradients on every rank, the final parameters and buffers (after the
last joiner's broadcast) must match. Every run goes through
``multiproc.run_ranks`` with a hard timeout, so a collective mismatch between
joined and training ranks (a hang) fails the test instead of stalling.
"""

from __future__ import annotations

import copy

import ddp_models as M
import pytest
import torch
import torch.distributed as dist
from multiproc import run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as D
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastcoll

LR, MOMENTUM = 0.1, 0.9
EXACT = {"rtol": 1e-5, "atol": 1e-6}
HALF = {"rtol": 2e-3, "atol": 2e-4}


# --------------------------------------------------------------------------- divisor semantics


def _uneven_grads(m, rank, divide):
    """Rank r trains on r + 1 inputs of ones inside a join; returns the weight's gradient after each step."""
    grads = []
    with m.join(divide_by_initial_world_size=divide):
        for _ in range(rank + 1):
            m.zero_grad()
            m(torch.ones(1)).sum().backward()
            grads.append(m.module.weight.grad.item())
    return grads


def semantics_worker(rank, world_size):
    # rank 0: one input, rank 1: two; local gradient 1.0 (torch DDP measured: rank 1 sees
    # 1.0 then 0.5 by default, 1.0 then 1.0 with divide_by_initial_world_size=False).
    expected = {True: [[1.0], [1.0, 0.5]], False: [[1.0], [1.0, 1.0]]}
    for divide in (True, False):
        for cls in (fastcoll.DDP, TorchDDP):
            for view in (False, True):
                m = cls(nn.Linear(1, 1, bias=False), gradient_as_bucket_view=view)
                grads = _uneven_grads(m, rank, divide)
                assert grads == expected[divide][rank], f"{cls.__name__} divide={divide} view={view} rank {rank}: {grads}"
                if isinstance(m, fastcoll.DDP):
                    m.close()
    # comm_dtype uses the run-time divisor too.
    for divide in (True, False):
        m = fastcoll.DDP(nn.Linear(1, 1, bias=False), comm_dtype=torch.float16)
        grads = _uneven_grads(m, rank, divide)
        assert grads == expected[divide][rank], f"comm_dtype divide={divide} rank {rank}: {grads}"
        # After the join, with every rank training again, the divisor is the world size.
        m.zero_grad()
        m(torch.ones(1)).sum().backward()
        assert m.module.weight.grad.item() == 1.0
        m.close()
    # Joinable interface.
    m = fastcoll.DDP(nn.Linear(2, 2))
    assert isinstance(m, torch.distributed.algorithms.join.Joinable)
    assert m.join_device == torch.device("cpu") and m.join_process_group is m.process_group
    hook = m.join_hook(divide_by_initial_world_size=False)
    assert isinstance(hook, torch.distributed.algorithms.join.JoinHook) and m._divide_by_initial_world_size is False
    # enable=False: no join collectives; even inputs train as without join.
    with m.join(enable=False):
        m(torch.ones(2)).sum().backward()
    g = m.module.weight.grad.clone()
    m.zero_grad()
    m(torch.ones(2)).sum().backward()
    assert torch.equal(g, m.module.weight.grad)
    m.close()


def test_divisor_semantics():
    run_ranks(semantics_worker, 2, timeout=60)


# --------------------------------------------------------------------------- parity with torch DDP + join


def _train(cls, name, kwargs, counts, rank, world_size, opts):
    """Train under join; returns (per-step gradients, final state_dict)."""
    model = M.build(name, seed=rank)  # rank-dependent init: init_sync makes it rank 0's
    kw = {k: v for k, v in kwargs.items() if not (cls is TorchDDP and k in ("comm_dtype", "first_bucket_mb"))}
    ddp = cls(copy.deepcopy(model), **kw)
    hook = opts.get("hook")
    if hook is not None:
        state = P.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2) if hook == "powersgd" else None
        fn = {"allreduce": D.allreduce_hook, "fp16": D.fp16_compress_hook, "powersgd": P.powerSGD_hook}[hook]
        ddp.register_comm_hook(state, fn)
    if cls is TorchDDP and kwargs.get("comm_dtype") is not None:
        ddp.register_comm_hook(None, {torch.float16: D.fp16_compress_hook}[kwargs["comm_dtype"]])
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=opts.get("momentum", MOMENTUM))
    grads = []
    step = 0
    for epoch_counts in counts:
        with ddp.join(**opts.get("join", {})):
            for _ in range(epoch_counts[rank]):
                opt.zero_grad(set_to_none=not kwargs.get("gradient_as_bucket_view"))
                x, y = M.global_batch(name, world_size, step)
                xr, yr = M.chunk_of(x, rank), M.chunk_of(y, rank)
                if opts.get("accumulate"):
                    with ddp.no_sync():
                        M.loss_of(name, ddp, xr, yr, rank, step).backward()
                    if opts.get("eval_forward") and cls is fastcoll.DDP:
                        # torch DDP tells its joined ranks a synchronized backward follows a
                        # no_grad forward (a collective mismatch); fastcoll tells them none does.
                        with torch.no_grad():
                            ddp(xr) if name != "branchy" else ddp(xr, use_sometimes=False)
                M.loss_of(name, ddp, xr, yr, rank, step).backward()
                grads.append([None if p.grad is None else p.grad.detach().clone() for p in ddp.module.parameters()])
                opt.step()
                step += 1
    state = {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}
    if isinstance(ddp, fastcoll.DDP):
        ddp.close()
    return grads, state


# (label, model, DDP kwargs, per-epoch per-rank batch counts (indexed by world size), options, tolerance)
JOIN_CONFIGS = [
    ("default", "mlp", {}, {2: [[3, 5]], 3: [[2, 4, 3]]}, {}, EXACT),
    (
        "divide_by_initial_world_size=False",
        "mlp",
        {},
        {2: [[3, 5]], 3: [[4, 2, 3]]},
        {"join": {"divide_by_initial_world_size": False}},
        EXACT,
    ),
    # BatchNorm buffers: synced from the highest rank still training, and in the final broadcast.
    ("convbn buffers", "convbn", {"bucket_cap_mb": 0.001}, {2: [[2, 4]], 3: [[3, 1, 2]]}, {}, EXACT),
    # A rank joining before any iteration, another after one (the one-time layout rebuild is pending).
    (
        "tiny buckets, joins before the rebuild",
        "reordered",
        {"bucket_cap_mb": 1e-6},
        {2: [[0, 3], [1, 3]], 3: [[1, 0, 3]]},
        {},
        EXACT,
    ),
    # A joined fastcoll rank reports no parameter used; torch's joined rank all-reduces the stale
    # *reduced* map of its last iteration instead, so parameters unused by every training rank get
    # zero gradients there and keep None here. Without momentum both leave such parameters alone.
    (
        "find_unused_parameters",
        "branchy",
        {"find_unused_parameters": True, "bucket_cap_mb": 1e-6},
        {2: [[2, 5]], 3: [[3, 5, 2]]},
        {"momentum": 0.0, "none_is_zero": True},
        EXACT,
    ),
    (
        "gradient_as_bucket_view + no_sync accumulation + no_grad forward",
        "mlp",
        {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.001},
        {2: [[4, 2]], 3: [[2, 3, 1]]},
        {"accumulate": True, "eval_forward": True},
        EXACT,
    ),
    ("allreduce_hook", "mlp", {"bucket_cap_mb": 0.001}, {2: [[2, 4]], 3: [[4, 3, 1]]}, {"hook": "allreduce"}, EXACT),
    ("powerSGD_hook", "mlp", {}, {2: [[2, 5]]}, {"hook": "powersgd"}, EXACT),
    (
        "comm_dtype=float16 vs fp16_compress_hook",
        "mlp",
        {"comm_dtype": torch.float16, "bucket_cap_mb": 0.001},
        {2: [[3, 5]], 3: [[2, 4, 3]]},
        {},
        HALF,
    ),
    ("two epochs, each its own join", "convbn", {}, {2: [[2, 3], [3, 1]], 3: [[1, 2, 2], [2, 2, 1]]}, {}, EXACT),
]


def join_parity_worker(rank, world_size, configs):
    for label, name, kwargs, counts, opts, tol in configs:
        if world_size not in counts:
            continue
        what = f"{label} (rank {rank}/{world_size})"
        c = counts[world_size]
        gf, sf = _train(fastcoll.DDP, name, kwargs, c, rank, world_size, opts)
        gt, st = _train(TorchDDP, name, kwargs, c, rank, world_size, opts)
        assert len(gf) == len(gt) == sum(e[rank] for e in c), what
        names = [n for n, _ in M.build(name, 0).named_parameters()]
        for step, (a, b) in enumerate(zip(gf, gt)):
            for n, ga, gb in zip(names, a, b):
                if opts.get("none_is_zero") and (ga is None) != (gb is None):
                    assert ga is None and not gb.any(), f"{what} step {step}: {n}.grad: fastcoll {ga}, torch {gb}"
                    continue
                assert (ga is None) == (gb is None), f"{what} step {step}: {n}.grad None mismatch"
                if ga is not None:
                    torch.testing.assert_close(ga, gb, **tol, msg=lambda m: f"{what} step {step}: grad of {n}: {m}")
        assert list(sf) == list(st)
        for k in sf:
            kw = tol if sf[k].is_floating_point() else {}
            torch.testing.assert_close(sf[k], st[k], **kw, msg=lambda m: f"{what}: final {k}: {m}")
        # Every rank ends with the same model (the last joiner's).
        for k, v in sf.items():
            if v.is_floating_point():
                ref = v.clone()
                dist.broadcast(ref, 0)
                assert torch.equal(ref, v), f"{what}: final {k} differs across ranks"


@pytest.mark.parametrize("world_size", [2, 3])
def test_join_parity_with_torch_ddp(world_size):
    run_ranks(join_parity_worker, world_size, JOIN_CONFIGS, timeout=170)


# --------------------------------------------------------------------------- early termination, ZeRO


def throw_worker(rank, world_size):
    messages = []
    for cls in (fastcoll.DDP, TorchDDP):
        m = cls(M.build("mlp", 0))
        x, y = M.global_batch("mlp", world_size, 0)
        with pytest.raises(RuntimeError) as err:
            with m.join(throw_on_early_termination=True):
                for _ in range(2 + rank):  # rank 0 runs out first
                    M.loss_of("mlp", m, M.chunk_of(x, rank), M.chunk_of(y, rank), rank, 0).backward()
        messages.append(str(err.value))
        if isinstance(m, fastcoll.DDP):
            m.close()
    # Same exception on every rank as with torch DDP ("Rank 0 exhausted all inputs" / "Detected ...").
    assert messages[0] == messages[1], messages
    assert ("exhausted all inputs" if rank == 0 else "Detected at least one rank that exhausted inputs") in messages[0]
    # The ranks are still in step.
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world_size
    return messages[0]


def test_throw_on_early_termination_raises_on_every_rank():
    msgs = run_ranks(throw_worker, 2, timeout=60, pg_timeout=20)
    assert len(msgs) == 2


def zero_worker(rank, world_size, divide):
    counts = [3, 5, 4][:world_size]
    states = []
    for cls in (fastcoll.DDP, TorchDDP):
        model = M.build("convbn", seed=0)
        ddp = cls(copy.deepcopy(model), bucket_cap_mb=0.001)
        zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, lr=LR, momentum=MOMENTUM)
        with Join([ddp, zero], divide_by_initial_world_size=divide):
            for step in range(counts[rank]):
                x, y = M.global_batch("convbn", world_size, step)
                zero.zero_grad()
                M.loss_of("convbn", ddp, M.chunk_of(x, rank), M.chunk_of(y, rank), rank, step).backward()
                zero.step()
        states.append({k: v.detach().clone() for k, v in ddp.module.state_dict().items()})
        if isinstance(ddp, fastcoll.DDP):
            ddp.close()
    for k in states[0]:
        torch.testing.assert_close(states[0][k], states[1][k], **EXACT, msg=lambda m: f"ZeRO + Join (divide={divide}): {k}: {m}")
        if states[0][k].is_floating_point():
            ref = states[0][k].clone()
            dist.broadcast(ref, 0)
            assert torch.equal(ref, states[0][k]), f"ZeRO + Join: {k} differs across ranks"


@pytest.mark.parametrize("world_size,divide", [(2, True), (3, False)])
def test_join_shared_with_zero_redundancy_optimizer(world_size, divide):
    run_ranks(zero_worker, world_size, divide, timeout=90)
