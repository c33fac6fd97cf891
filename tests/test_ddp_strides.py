"""Parameters that are not dense: strided slices of larger tensors, as torch DDP accepts them.

A parameter such as ``nn.Parameter(w[:, ::2])`` gets a contiguous gradient from autograd, and torch DDP's
bucket views are contiguous for it. fastcoll.DDP does the same: every mode trains as it does on a dense copy of
the model, and as torch DDP does. ``ShardedOptimizer`` updates a range of each parameter's memory, which such a
parameter does not have in one block: it refuses it, on every rank, naming it, before anything is written.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from multiproc import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastcoll

STEPS = 4


class Sliced(nn.Module):
    """Two linear layers and a scale whose weights are non-dense views (``dense=True``: contiguous copies)."""

    def __init__(self, seed: int, dense: bool = False, device: str = "cpu"):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        # Sliced on the device: Module.to() would make them contiguous.
        w1 = (0.3 * torch.randn(16, 20, generator=g)).to(device)[:, ::2]  # every other column: strides (20, 2)
        w2 = (0.3 * torch.randn(3, 24, generator=g)).to(device)[:, 4:20]  # a block of columns: strides (24, 1)
        scale = (torch.randn(3, 8, generator=g) / 3).to(device)[:, ::4]  # used in some iterations only
        if dense:
            w1, w2, scale = w1.contiguous(), w2.contiguous(), scale.contiguous()
        self.w1, self.w2, self.scale = nn.Parameter(w1), nn.Parameter(w2), nn.Parameter(scale)
        self.b1 = nn.Parameter(torch.randn(16, generator=g).to(device))

    def forward(self, x: torch.Tensor, use_scale: bool = True) -> torch.Tensor:
        # .contiguous(): the same matmuls (and roundings) as the dense copy's; the gradients reach the slices as they are
        h = torch.tanh(x @ self.w1.contiguous().t() + self.b1) @ self.w2.contiguous().t()
        return h * self.scale.sum() if use_scale else h


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 10, generator=torch.Generator().manual_seed(100 * step + rank))


def _loss(model: nn.Module, x: torch.Tensor, use_scale: bool = True) -> torch.Tensor:
    return model(x, use_scale).pow(2).mean()


def torch_parity_worker(rank: int, world_size: int, view: bool) -> None:
    """fastcoll.DDP against torch DDP on the sliced model: same gradients (and their strides), same weights; every
    parameter keeps its storage and strides; against one process on the global batch too."""
    what = f"gradient_as_bucket_view={view} (rank {rank}/{world_size})"
    fast_model, torch_model = Sliced(seed=rank), Sliced(seed=rank)  # init_sync makes them rank 0's
    layout = [(p.data_ptr(), p.stride()) for p in fast_model.parameters()]
    fast = fastcoll.DDP(fast_model, gradient_as_bucket_view=view, bucket_cap_mb=1e-4)
    ref = TorchDDP(torch_model, gradient_as_bucket_view=view, bucket_cap_mb=1e-4)
    of = torch.optim.SGD(fast.parameters(), lr=0.1, momentum=0.9)
    ot = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        for model, opt in ((fast, of), (ref, ot)):
            opt.zero_grad(set_to_none=step % 2 == 0)
            _loss(model, _batch(rank, step)).backward()
        for (n, p), q in zip(fast_model.named_parameters(), torch_model.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{what} step {step}: grad of {n}: {m}")
            assert p.grad.stride() == q.grad.stride(), f"{what}: {n}.grad strides {p.grad.stride()} vs torch {q.grad.stride()}"
        of.step()
        ot.step()
    assert [(p.data_ptr(), p.stride()) for p in fast_model.parameters()] == layout, f"{what}: a parameter was moved"
    for (n, p), q in zip(fast_model.named_parameters(), torch_model.parameters()):
        torch.testing.assert_close(p, q, msg=lambda m: f"{what}: {n} after training: {m}")
    if rank == 0:
        single = Sliced(seed=0)
        opt = torch.optim.SGD(single.parameters(), lr=0.1, momentum=0.9)
        for step in range(STEPS):
            opt.zero_grad(set_to_none=step % 2 == 0)
            x = torch.cat([_batch(r, step) for r in range(world_size)])
            _loss(single, x).backward()
            opt.step()
        for (n, p), q in zip(fast_model.named_parameters(), single.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}: {n} vs one process: {m}")
    fast.close()


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("view", [False, True], ids=["copies", "bucket-view"])
def test_non_dense_parameters_train_as_with_torch_ddp(world_size, view):
    run_ranks(torch_parity_worker, world_size, view, timeout=150)


# (fastcoll.DDP keyword arguments, loop): each mode on the sliced model against the same on its dense copy.
MODES = [
    ({}, "plain"),
    ({"gradient_as_bucket_view": True}, "no_sync"),
    ({"find_unused_parameters": True}, "unused"),
    ({"find_unused_parameters": True, "gradient_as_bucket_view": True}, "unused"),
    ({"static_graph": True}, "plain"),
    ({"comm_dtype": torch.bfloat16}, "plain"),
    ({"comm_dtype": torch.bfloat16, "comm_accum_dtype": torch.float32}, "plain"),
    ({"compute_grad_norm": True, "check_nonfinite": True}, "clip"),
    ({"verify_replicas_every": 1}, "no_sync"),
    ({}, "join"),
    ({"bucket_cap_mb": 25}, "hook"),  # one bucket: with several, PowerSGD on gloo races (test_ddp_hooks.py)
]


def _train(rank: int, dense: bool, kwargs: dict, loop: str) -> list:
    model = Sliced(seed=rank, dense=dense)
    ddp = fastcoll.DDP(model, **{"bucket_cap_mb": 1e-4, **kwargs})
    if loop == "hook":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    norms = []
    steps = STEPS - rank if loop == "join" else STEPS  # uneven inputs: join() shadows the missing iterations
    with ddp.join() if loop == "join" else contextlib.nullcontext():
        for step in range(steps):
            opt.zero_grad(set_to_none=step % 2 == 0)
            if loop == "no_sync" and step % 2 == 0:
                with ddp.no_sync():
                    _loss(ddp, _batch(rank, 10 + step)).backward()
            _loss(ddp, _batch(rank, step), use_scale=loop != "unused" or step % 2 == 1).backward()
            if loop == "clip":
                norms.append(float(ddp.clip_grad_norm_(0.05)))
            opt.step()
    ddp.close()
    return [p.detach().clone() for p in model.parameters()] + [torch.tensor(norms)]


def modes_worker(rank: int, world_size: int) -> None:
    for kwargs, loop in MODES:
        sliced, dense = _train(rank, False, kwargs, loop), _train(rank, True, kwargs, loop)
        for k, (a, b) in enumerate(zip(sliced, dense)):
            assert torch.equal(a, b), f"{kwargs} {loop} (rank {rank}): tensor {k} differs from the dense model's: {a} vs {b}"


def test_non_dense_parameters_in_every_mode_train_as_their_dense_copies():
    """Bitwise: the reduction sees the same gradients in the same bucket order, only the parameters' strides differ."""
    run_ranks(modes_worker, 2, timeout=240)


def sharded_refusal_worker(rank: int, world_size: int) -> None:
    for grads in ("full", "sharded"):
        model = Sliced(seed=0)
        ddp = fastcoll.DDP(model, bucket_cap_mb=1e-4)
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(
            ValueError, match=r"ShardedOptimizer: parameter 'w1' \(shape \(16, 10\), strides \(20, 2\)\) is not dense"
        ):
            fastcoll.ShardedOptimizer(torch.optim.AdamW(ddp.parameters(), lr=0.1), ddp, grads=grads)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)), f"{grads}: a parameter changed"
        for p in model.parameters():  # what the message says to do
            p.data = p.data.contiguous()
        opt = fastcoll.ShardedOptimizer(torch.optim.AdamW(ddp.parameters(), lr=0.1), ddp, grads=grads)
        _loss(ddp, _batch(rank, 0)).backward()
        opt.step()
        ddp.close()


def test_sharded_optimizer_refuses_a_non_dense_parameter_on_every_rank():
    run_ranks(sharded_refusal_worker, 2, timeout=120)
