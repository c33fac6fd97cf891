"""What a module does to its tensors after it was wrapped.

Buffers a module replaces (``self.mean = 0.9 * self.mean + ...`` in a forward, or
``ddp.double()``) are broadcast as the module holds them now, as torch DDP reads
them again before every broadcast. Parameters cast, moved or replaced after
wrapping are refused, naming them (fastcoll.ddp.module_changes); torch DDP then
stops averaging them without a word.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from multiproc import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastcoll


class Reassigning(nn.Module):
    """A linear layer with buffers its forward replaces instead of updating in place, and a BatchNorm."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mean = 0.9 * self.mean + 0.1 * x.detach().mean(0)  # a new tensor every forward
        self.seen = self.seen + x.shape[0]
        return self.bn(self.lin(x - self.mean))


def _batch(rank: int, step: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * step + rank)).to(dtype)


def _buffers(model: nn.Module) -> dict:
    return {n: b.clone() for n, b in model.named_buffers()}


def _train_reassigning(wrap, rank: int, steps: int, join: bool = False):
    """``steps`` SGD steps of :class:`Reassigning` under ``wrap`` (inside ``join()`` if ``join``); (model, wrapper)."""
    torch.manual_seed(0)
    model = Reassigning()
    ddp = wrap(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with ddp.join() if join else contextlib.nullcontext():
        for step in range(steps):
            opt.zero_grad()
            ddp(_batch(rank, step)).square().mean().backward()
            opt.step()
    return model, ddp


def buffers_worker(rank: int, world_size: int) -> None:
    """Per rank, the buffers after training, after ``ddp.double()`` and forwards without gradients: torch DDP's."""
    results = []
    for wrap in (TorchDDP, fastcoll.DDP):
        model, ddp = _train_reassigning(wrap, rank, 3)
        trained = _buffers(model)
        current = [id(b) for b in ddp.modules_buffers] == [id(b) for _, b in model.named_buffers()]
        ddp.double()  # buffers become new tensors; parameters too (refused for training, not for inference)
        with torch.no_grad():
            for step in range(3, 5):
                ddp(_batch(rank, step, torch.float64))
        results.append((trained, _buffers(model), current))
    (torch_trained, torch_cast, _), (fast_trained, fast_cast, fast_current) = results
    for stage, ref, got in (("training", torch_trained, fast_trained), ("after double()", torch_cast, fast_cast)):
        for name in ref:
            assert torch.equal(got[name], ref[name]), f"rank {rank}, {stage}: buffer {name} {got[name]} vs torch DDP {ref[name]}"
    assert fast_current, "modules_buffers is not the buffers the module holds"


def test_replaced_buffers_are_broadcast_as_torch_ddp_does():
    run_ranks(buffers_worker, 2, timeout=120)


def join_buffers_worker(rank: int, world_size: int) -> None:
    """Uneven inputs under join(): the replaced buffers are broadcast from the rank still training, and the final
    state from the last one to finish, as torch DDP's."""
    results = []
    for wrap in (TorchDDP, fastcoll.DDP):
        model, _ = _train_reassigning(wrap, rank, 3 + rank, join=True)
        results.append((_buffers(model), [p.detach().clone() for p in model.parameters()]))
    (tb, tp), (fb, fp) = results
    for name in tb:
        assert torch.equal(fb[name], tb[name]), f"rank {rank}: buffer {name} {fb[name]} vs torch DDP {tb[name]}"
    for k, (a, b) in enumerate(zip(fp, tp)):
        torch.testing.assert_close(a, b, msg=lambda m: f"rank {rank}: parameter {k}: {m}")


def test_replaced_buffers_under_join_as_torch_ddp():
    run_ranks(join_buffers_worker, 2, timeout=120)


CONVERSIONS = {
    "ddp.double()": lambda ddp, model: ddp.double(),
    "module.double()": lambda ddp, model: model.double(),
    "module.head.half()": lambda ddp, model: model[2].half(),
}


def conversion_worker(rank: int, world_size: int, how: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
    ddp = fastcoll.DDP(model)
    ddp(_batch(rank, 0)).sum().backward()
    CONVERSIONS[how](ddp, model)
    dtype = model[0].weight.dtype
    with torch.no_grad():
        if how != "module.head.half()":  # (a float16 head on the CPU after float32 layers: no forward to run)
            ddp(_batch(rank, 1, dtype))  # inference still runs
    with pytest.raises(
        RuntimeError, match=r"cast or moved after the model was wrapped: '2\.bias' \(float(64|16) on cpu, was float32"
    ):
        ddp(_batch(rank, 2, dtype))
    ddp.float()  # back to the buckets' dtype: trains again
    ddp(_batch(rank, 3)).sum().backward()
    ddp.close()


@pytest.mark.parametrize("how", list(CONVERSIONS))
def test_parameters_cast_after_wrapping_are_refused_at_the_next_training_forward(how):
    run_ranks(conversion_worker, 2, how, timeout=120)


def same_conversion_worker(rank: int, world_size: int) -> None:
    ddp = fastcoll.DDP(nn.Linear(4, 3))
    ddp.float().to("cpu").share_memory()
    ddp(_batch(rank, 0)).sum().backward()
    ddp.close()


def test_a_conversion_to_the_same_dtype_and_device_is_not_refused():
    run_ranks(same_conversion_worker, 2, timeout=60)


class WithSpare(nn.Module):
    """Two linear layers and one the forward never uses."""

    def __init__(self):
        super().__init__()
        self.hidden, self.out, self.spare = nn.Linear(4, 4), nn.Linear(4, 3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)))


def replaced_worker(rank: int, world_size: int, find_unused: bool) -> None:
    """``module.weight = nn.Parameter(...)`` after wrapping: refused, naming it. With find_unused_parameters at the
    end of the forward that uses it, before its backward (the spare layer, unused and not replaced, is not refused);
    else at the next forward, instead of an unfinished reduction naming the old parameter."""
    torch.manual_seed(0)
    model = WithSpare() if find_unused else nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
    ddp = fastcoll.DDP(model, find_unused_parameters=find_unused)
    for step in range(2):
        ddp(_batch(rank, step)).sum().backward()
    if find_unused:
        model.out.weight = nn.Parameter(torch.ones(3, 4))
        with pytest.raises(RuntimeError, match=r"replaced by other tensors after the model was wrapped: 'out\.weight'\."):
            ddp(_batch(rank, 2))
        assert model.out.weight.grad is None
    else:
        model[2].weight = nn.Parameter(torch.ones(3, 4))
        ddp(_batch(rank, 2)).sum().backward()  # the old weight's gradient never comes
        with pytest.raises(RuntimeError, match=r"replaced by other tensors after the model was wrapped: '2\.weight'\."):
            ddp(_batch(rank, 3))
    ddp.close()


@pytest.mark.parametrize("find_unused", [True, False], ids=["find_unused", "all_used"])
def test_replaced_parameters_are_refused(find_unused):
    run_ranks(replaced_worker, 2, find_unused, timeout=120)


def frozen_worker(rank: int, world_size: int) -> None:
    """A parameter frozen after wrapping (without find_unused_parameters): the next forward names it as frozen."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
    ddp = fastcoll.DDP(model)
    ddp(_batch(rank, 0)).sum().backward()
    model[0].weight.requires_grad_(False)
    ddp(_batch(rank, 1)).sum().backward()
    with pytest.raises(RuntimeError, match=r"stopped requiring gradients after the model was wrapped: '0\.weight'\."):
        ddp(_batch(rank, 2))
    ddp.close()


def test_parameters_frozen_after_wrapping_are_named():
    run_ranks(frozen_worker, 2, timeout=60)


def unfrozen_worker(rank: int, world_size: int) -> None:
    """A layer frozen at wrapping and unfrozen later: refused at the next training forward, naming it (torch DDP leaves
    its gradients each rank's own). Wrapped trainable with find_unused_parameters, it can be frozen and unfrozen: the
    gradients are averaged (equal on every rank)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
    model[0].requires_grad_(False)
    ddp = fastcoll.DDP(model)
    ddp(_batch(rank, 0)).sum().backward()
    model[0].requires_grad_(True)
    with pytest.raises(
        RuntimeError, match=r"require gradients now that did not when the model was wrapped: '0\.weight', '0\.bias'\."
    ):
        ddp(_batch(rank, 1))
    with torch.no_grad():
        ddp(_batch(rank, 1))  # inference still runs
    ddp.close()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
    ddp = fastcoll.DDP(model, find_unused_parameters=True)
    model[0].requires_grad_(False)
    ddp(_batch(rank, 0)).sum().backward()
    model[0].requires_grad_(True)
    ddp.zero_grad()
    ddp(_batch(rank, 1)).sum().backward()
    everyone = [torch.empty_like(model[0].weight.grad) for _ in range(world_size)]
    torch.distributed.all_gather(everyone, model[0].weight.grad)
    assert all(torch.equal(g, everyone[0]) for g in everyone), "the unfrozen layer's gradients differ across ranks"
    ddp.close()


def test_parameters_unfrozen_after_wrapping_are_refused():
    run_ranks(unfrozen_worker, 2, timeout=60)
