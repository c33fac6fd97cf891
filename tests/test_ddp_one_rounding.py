"""16-bit values on the wire, one rounding: ``fastcoll.DDP(comm_dtype=..., comm_accum_dtype=torch.float32)``.

At 2, 3 and 4 gloo ranks:

* the all-reduce equals the float64 sum (rank order) of every rank's 16-bit
  wire values, times 1/world_size, rounded once to float32 and from there to
  16 bits, bit for bit (float32 and bfloat16 parameters, bfloat16 and float16 wires, gradients
  as bucket views or not, several buckets of lengths that do not divide by
  the world size);
* with ``ShardedOptimizer(grads="sharded")`` each rank's float32 range equals
  that float32 value itself (no rounding after it), bit for bit, with
  float32 main gradients of bfloat16 parameters and with float32 parameters
  (a bfloat16 range without main gradients: that value rounded once);
* each bucket issues one all-to-all and (all-reduce only) one all-gather;
* a small model's gradients are within one bfloat16 rounding of torch DDP's
  float32 all-reduce;
* bad arguments are refused at construction on every rank.

The oracle is computed in every rank process from every rank's inputs, in
float64 (exact for these inputs: see tests/test_ops_sum_chunks.py), rounded
once to float32, independently of fastcoll; a float32 accumulation differs
from it at 3 and 4 ranks (checked).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import pytest
import torch
from multiproc import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastcoll

pytestmark = pytest.mark.timeout(300)

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
SIZES = (37, 300, 5, 129, 64)  # several buckets at a 512-byte cap; none a multiple of 3 or 4 ranks' padding
WORLDS = [2, 3, 4]


class Linearly(nn.Module):
    """``loss = sum_i (w_i * x_i).sum()``: the gradient of ``w_i`` is ``x_i`` exactly."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.ws = nn.ParameterList([nn.Parameter(torch.zeros(n, dtype=dtype)) for n in SIZES])

    def forward(self, xs: List[torch.Tensor]) -> torch.Tensor:
        return sum((w * x).sum() for w, x in zip(self.ws, xs))


def rank_inputs(rank: int, dtype: torch.dtype, wire: torch.dtype) -> List[torch.Tensor]:
    """Rank ``rank``'s gradients: both signs over many binades (float16's range kept), so every rounding shows."""
    g = torch.Generator().manual_seed(1000 + rank)
    spread = 3 if wire == F16 else 12
    out = []
    for n in SIZES:
        mag = torch.exp2(torch.randint(-spread, spread + 1, (n,), generator=g).to(torch.float64))
        out.append((torch.randn(n, generator=g, dtype=torch.float64) * mag).to(dtype))
    return out


def oracle(world: int, dtype: torch.dtype, wire: torch.dtype, accum: torch.dtype = torch.float64) -> List[torch.Tensor]:
    """Per parameter: the sum over ranks, in rank order, of the wire values, times 1/world, rounded to float32.

    ``accum=torch.float32``: each add and the multiply (by float32(1/world)) rounded to float32 instead.
    """
    per_rank = [[x.to(wire).to(accum) for x in rank_inputs(r, dtype, wire)] for r in range(world)]
    out = []
    for i in range(len(SIZES)):
        acc = per_rank[0][i].clone()
        for r in range(1, world):
            acc = acc + per_rank[r][i]
        out.append((acc * torch.tensor(1.0 / world, dtype=accum)).to(F32))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    bad = (_bits(got) != _bits(want)).nonzero().flatten()
    assert bad.numel() == 0, f"{what}: {bad.numel()} of {got.numel()} differ, first at {bad[0].item()}"


def _collectives(ddp: fastcoll.DDP) -> List[str]:
    kinds: List[str] = []
    ddp.reducer.comm.add_listener(lambda c: kinds.append(c.kind))
    return kinds


# --------------------------------------------------------------------------- all-reduce: two roundings


def all_reduce_worker(rank: int, world: int, dtype: torch.dtype, wire: torch.dtype, as_view: bool) -> Dict:
    model = Linearly(dtype)
    ddp = fastcoll.DDP(model, bucket_cap_mb=0.0005, first_bucket_mb=0.0005, comm_dtype=wire,
                       comm_accum_dtype=F32, gradient_as_bucket_view=as_view)  # fmt: skip
    kinds = _collectives(ddp)
    for _ in range(2):  # a second iteration: the rebuilt layout, the pipeline restarted
        model.zero_grad(set_to_none=not as_view)
        ddp(rank_inputs(rank, dtype, wire)).backward()
    want = oracle(world, dtype, wire)
    for i, (w, v) in enumerate(zip(model.ws, want)):
        assert_bitwise(w.grad, v.to(wire).to(dtype), f"rank {rank} parameter {i}")
    nb = len(ddp.reducer.buckets)
    return {"kinds": kinds[-2 * nb :], "buckets": nb, "all_reduces": kinds.count("all_reduce")}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(
    "dtype,wire,as_view",
    [(F32, BF16, False), (F32, BF16, True), (BF16, BF16, False), (F32, F16, False)],
    ids=["fp32-bf16", "fp32-bf16-view", "bf16-bf16", "fp32-fp16"],
)
def test_all_reduce_is_the_sum_rounded_once(world, dtype, wire, as_view):
    for res in run_ranks(all_reduce_worker, world, dtype, wire, as_view, timeout=120):
        assert res["buckets"] > 1
        assert res["kinds"] == ["all_to_all"] * res["buckets"] + ["all_gather"] * res["buckets"] or sorted(
            res["kinds"]
        ) == sorted(["all_to_all", "all_gather"] * res["buckets"])
        assert res["all_reduces"] == 0


def test_the_oracle_is_not_a_16_bit_ring():
    """The inputs make a per-hop-rounded (ring) sum differ from the oracle: the bitwise tests can fail."""
    world, differ = 4, 0
    want = oracle(world, F32, BF16)
    for i in range(len(SIZES)):
        ring = rank_inputs(0, F32, BF16)[i].to(BF16)
        for r in range(1, world):
            ring = (ring.float() + rank_inputs(r, F32, BF16)[i].to(BF16).float()).to(BF16)
        differ += int(((ring.float() / world).to(BF16) != want[i].to(BF16)).sum())
    assert differ > 0


@pytest.mark.parametrize("world", [3, 4])
def test_the_oracle_is_not_a_float32_accumulation(world):
    """The inputs make a sum rounded to float32 at every add differ from the oracle: the sum is exact, not float32's."""
    exact, f32 = oracle(world, F32, BF16), oracle(world, F32, BF16, accum=F32)
    assert sum(int((a != b).sum()) for a, b in zip(exact, f32)) > 0


class PartlyUsed(Linearly):
    """The last parameter gets no gradient on any rank (found unused each iteration)."""

    def forward(self, xs: List[torch.Tensor]) -> torch.Tensor:
        return sum((w * x).sum() for w, x in list(zip(self.ws, xs))[:-1])


def find_unused_worker(rank: int, world: int) -> None:
    model = PartlyUsed(F32)
    ddp = fastcoll.DDP(model, bucket_cap_mb=0.0005, first_bucket_mb=0.0005, comm_dtype=BF16, comm_accum_dtype=F32,
                       find_unused_parameters=True)  # fmt: skip
    want = oracle(world, F32, BF16)
    for _ in range(2):
        model.zero_grad()
        ddp(rank_inputs(rank, F32, BF16)).backward()
        for i, w in enumerate(model.ws[:-1]):
            assert_bitwise(w.grad, want[i].to(BF16).float(), f"rank {rank} parameter {i}")
        assert model.ws[-1].grad is None


def test_find_unused_parameters():
    run_ranks(find_unused_worker, 3, timeout=120)


# --------------------------------------------------------------------------- reduce-scatter: one rounding


def _ranges(ddp: fastcoll.DDP, opt: fastcoll.ShardedOptimizer, model: Linearly) -> List[tuple]:
    """``(parameter index in model.ws, lo, hi, kept range)`` for each of this rank's pieces."""
    by_model = {id(w): i for i, w in enumerate(model.ws)}
    return [
        (by_model[id(ddp.reducer.params[pc.param])], pc.lo, pc.hi, opt.reducer.kept.source(pos, pc)) for pos, pc in opt._pieces
    ]


def sharded_worker(rank: int, world: int, dtype: torch.dtype, main: Optional[torch.dtype]) -> int:
    """One backward: the ranges hold the one-rounding sum. A second without zero_grad: float32 ranges add it."""
    model = Linearly(dtype)
    ddp = fastcoll.DDP(model, bucket_cap_mb=0.0005, first_bucket_mb=0.0005, comm_dtype=BF16,
                       comm_accum_dtype=F32, main_grad_dtype=main)  # fmt: skip
    opt = fastcoll.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), ddp, grads="sharded",
                                    master_dtype=F32 if dtype == BF16 else None)  # fmt: skip
    kinds = _collectives(ddp)
    ddp(rank_inputs(rank, dtype, BF16)).backward()
    assert "all_gather" not in kinds and "reduce_scatter" not in kinds and "all_to_all" in kinds, kinds
    want = oracle(world, dtype, BF16)
    checked = 0
    for i, lo, hi, got in _ranges(ddp, opt, model):
        # float32 ranges: the float32 sum itself; bfloat16 ranges (no main gradients): rounded once.
        assert_bitwise(got, want[i][lo:hi].to(got.dtype), f"rank {rank} parameter {i} [{lo}:{hi}]")
        checked += got.numel()
    ddp(rank_inputs(rank, dtype, BF16)).backward()  # gradients accumulate until zero_grad, as .grad does
    for i, lo, hi, got in _ranges(ddp, opt, model):
        if got.dtype == F32:
            assert_bitwise(got, 2 * want[i][lo:hi], f"rank {rank} parameter {i} [{lo}:{hi}], second backward")
    opt.step()
    opt.zero_grad()
    return checked


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype,main", [(BF16, F32), (F32, None), (BF16, None)], ids=["bf16-main-fp32", "fp32", "bf16"])
def test_reduce_scatter_keeps_the_sum_rounded_to_float32(world, dtype, main):
    checked = run_ranks(sharded_worker, world, dtype, main, timeout=120)
    assert sum(checked) == sum(SIZES)


# --------------------------------------------------------------------------- uneven inputs: join()


def join_worker(rank: int, world: int, initial: bool) -> int:
    """Rank r trains r + 1 batches; the joined ranks replay the same all-to-alls and all-gathers.

    A joined rank still sums its range of the result (the training ranks' values, its zeros) with the
    training ranks' divisor: the world size, or (``initial`` False) the number of ranks still training.
    (join() refuses a sharded optimizer, so only the all-reduce has a replay.)
    """
    model = Linearly(F32)
    ddp = fastcoll.DDP(model, bucket_cap_mb=0.0005, first_bucket_mb=0.0005, comm_dtype=BF16, comm_accum_dtype=F32)
    steps = 0
    with ddp.join(divide_by_initial_world_size=initial):
        for _ in range(rank + 1):
            model.zero_grad()
            ddp(rank_inputs(rank, F32, BF16)).backward()
            steps += 1
    if rank == world - 1:  # its last step: only its own contribution, divided by the divisor
        scale = 1.0 / world if initial else 1.0
        for i, (w, x) in enumerate(zip(model.ws, rank_inputs(rank, F32, BF16))):
            want = (x.to(BF16).double() * scale).float().to(BF16).float()
            assert_bitwise(w.grad, want, f"parameter {i} after the others joined")
    return steps


@pytest.mark.parametrize("initial", [True, False], ids=["initial-world", "active-ranks"])
def test_join_replays_the_same_collectives(initial):
    assert run_ranks(join_worker, 3, initial, timeout=120) == [1, 2, 3]


# --------------------------------------------------------------------------- a model vs torch DDP in float32


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 33), nn.Tanh(), nn.Linear(33, 4))

    def forward(self, x):
        return self.net(x)


def model_worker(rank: int, world: int) -> None:
    torch.manual_seed(100 + rank)
    x = torch.randn(8, 16)
    ref, ours = MLP(), MLP()
    torch_ddp = TorchDDP(ref)
    ddp = fastcoll.DDP(ours, bucket_cap_mb=0.002, comm_dtype=BF16, comm_accum_dtype=F32)
    torch_ddp(x).square().sum().backward()
    ddp(x).square().sum().backward()
    local = MLP()
    local(x).square().sum().backward()
    locals_ = [torch.zeros(world, *p.shape) for p in local.parameters()]
    for buf, p in zip(locals_, local.parameters()):
        gathered = [torch.empty_like(p.grad) for _ in range(world)]
        torch.distributed.all_gather(gathered, p.grad)
        buf.copy_(torch.stack(gathered))
    differ = 0
    for (name, a), b, per_rank in zip(ref.named_parameters(), ours.parameters(), locals_):
        # One bfloat16 rounding of each rank's gradient on the wire and one of the result.
        bound = 2.0**-8 * (per_rank.abs().mean(0) + a.grad.abs())
        err = (b.grad - a.grad).abs()
        assert bool((err <= bound).all()), f"rank {rank} {name}: error {err.max().item()} beyond one bf16 rounding"
        differ += int((err > 0).sum())
    assert differ > 0  # bf16 on the wire, not float32


@pytest.mark.parametrize("world", WORLDS)
def test_model_gradients_within_one_bf16_rounding_of_torch_ddp(world):
    run_ranks(model_worker, world, timeout=120)


# --------------------------------------------------------------------------- refusals


def refusal_worker(rank: int, world: int) -> None:
    cases = [
        (dict(comm_accum_dtype=F32), "needs comm_dtype=torch.bfloat16 or torch.float16, got comm_dtype=None"),
        (dict(comm_dtype=BF16, comm_accum_dtype=torch.float64), "comm_accum_dtype must be None or torch.float32"),
        (dict(comm_dtype=BF16, comm_accum_dtype=BF16), "comm_accum_dtype must be None or torch.float32"),
        (dict(comm_dtype=BF16, comm_accum_dtype="float32"), "comm_accum_dtype must be None or torch.float32"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
            fastcoll.DDP(MLP(), **kwargs)
    ddp = fastcoll.DDP(MLP(), comm_dtype=F16, comm_accum_dtype=F32)
    with pytest.raises(ValueError, match="needs comm_dtype"):
        ddp.reducer.set_comm_dtype(None)
    ddp.reducer.set_comm_dtype(BF16)  # another 16-bit wire is fine
    ddp(torch.randn(2, 16)).sum().backward()  # and still reduces


def test_refusals():
    run_ranks(refusal_worker, 2, timeout=120)
