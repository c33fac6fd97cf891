"""fastcoll.DDP against torch DDP in combination, bitwise, on 3 gloo ranks.

Every combination of gradient accumulation with ``no_sync()``,
``find_unused_parameters``, a 16-bit wire (``comm_dtype``, and the
one-rounding wires ``comm_accum_dtype=torch.float32`` with bfloat16 and float16;
torch gets a comm hook with the same arithmetic), ``join()`` with uneven inputs and a
checkpoint round trip half-way (model and optimizer state saved, loaded into
fresh wrappers) trains the same model under both wrappers with the plain
torch optimizer. The parameters must be bitwise equal after every step, on
every rank. ``gradient_as_bucket_view`` runs in every combination of the
others on the float32 wire (``test_bucket_views``). Single-feature tests
missed a silent ``no_sync`` x ``find_unused_parameters`` divergence that this
matrix catches.

With ``find_unused_parameters`` the model has what makes it matter: an
output the loss ignores (``aux``), and a branch (``side``) that only some
micro-batches use, on some ranks, in some steps. All combinations run in one
set of rank processes, each on fresh models.
"""

from __future__ import annotations

import contextlib
import io
import itertools

import pytest
import torch
import torch.distributed as dist
from multiproc import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastcoll

pytestmark = pytest.mark.timeout(400)

STEPS = 6
MICRO = 2  # micro-batches per step with accumulation: MICRO - 1 under no_sync, then a synchronized one


class Net(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)
        self.aux = nn.Linear(16, 4)
        self.side = nn.Linear(16, 4)

    def forward(self, x, side: bool = True):
        h = torch.tanh(self.body(x))
        main = self.head(h)
        if side:
            main = main + self.side(h)
        return {"main": main, "aux": self.aux(h)}


def _uses_side(rank: int, step: int, micro: int, find_unused: bool) -> bool:
    # Without find_unused every parameter must take part in every backward (torch DDP's rule).
    return not find_unused or (rank + step + micro) % 3 == 0


def _loss(out: dict, find_unused: bool) -> torch.Tensor:
    loss = out["main"].pow(2).mean()
    return loss if find_unused else loss + 0.1 * out["aux"].pow(2).mean()


#: The wires: (comm_dtype, comm_accum_dtype) per name.
WIRES = {
    "fp32": (None, None),
    "bf16": (torch.bfloat16, None),
    "bf16-accum": (torch.bfloat16, torch.float32),
    "fp16-accum": (torch.float16, torch.float32),
}


def _bf16_hook(state, bucket):
    """torch's side of comm_dtype=bfloat16: fastcoll's arithmetic (scale by 1/world size in fp32, one rounding, sum, upcast)."""
    ws = dist.get_world_size()
    wire = bucket.buffer().mul(1.0 / ws).to(torch.bfloat16)
    fut = dist.all_reduce(wire, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].to(bucket.buffer().dtype))


def _accum_hook(wire: torch.dtype):
    """torch's side of ``comm_dtype=wire, comm_accum_dtype=torch.float32``: fastcoll's arithmetic, element by element.

    Every rank's 16-bit values (unscaled) are gathered, summed in float64 in
    rank order, multiplied by 1/world size, rounded once to float32 and from
    there to ``wire`` (fastcoll's all-gather of its rounded ranges is exact: no
    second rounding shows). A rank that has joined runs this hook on zeros,
    as fastcoll's joined rank replays its all-to-all and all-gather.
    """

    def hook(state, bucket):
        ws = dist.get_world_size()
        mine = bucket.buffer().to(wire)
        parts = [torch.empty_like(mine) for _ in range(ws)]
        dist.all_gather(parts, mine)
        acc = parts[0].double()
        for part in parts[1:]:
            acc = acc + part.double()
        reduced = (acc * (1.0 / ws)).float().to(wire).to(bucket.buffer().dtype)
        fut = torch.futures.Future()
        fut.set_result(reduced)
        return fut

    return hook


def _wrap(cls, seed: int, combo: dict):
    model = Net(seed)
    comm_dtype, accum = WIRES[combo["wire"]]
    view = combo.get("view", False)
    if cls is TorchDDP:
        ddp = TorchDDP(model, find_unused_parameters=combo["find_unused"], gradient_as_bucket_view=view)
        if comm_dtype is not None:
            ddp.register_comm_hook(None, _bf16_hook if accum is None else _accum_hook(comm_dtype))
    else:
        ddp = fastcoll.DDP(
            model, find_unused_parameters=combo["find_unused"], comm_dtype=comm_dtype, comm_accum_dtype=accum,
            gradient_as_bucket_view=view,
        )  # fmt: skip
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    return ddp, opt


def _checkpoint(ddp, opt) -> bytes:
    buf = io.BytesIO()
    torch.save({"model": ddp.state_dict(), "opt": opt.state_dict()}, buf)
    return buf.getvalue()


def _restore(cls, rank: int, combo: dict, blob: bytes):
    ddp, opt = _wrap(cls, 1000 + rank, combo)  # other weights: everything must come from the checkpoint
    sd = torch.load(io.BytesIO(blob), weights_only=True)
    ddp.load_state_dict(sd["model"])
    opt.load_state_dict(sd["opt"])
    return ddp, opt


def _steps(ddp, opt, rank: int, combo: dict, steps: range, gen: torch.Generator, history: list) -> None:
    with ddp.join() if combo["join"] else contextlib.nullcontext():
        for step in steps:
            opt.zero_grad()
            micros = MICRO if combo["no_sync"] else 1
            for micro in range(micros):
                x = torch.randn(5, 8, generator=gen)
                side = _uses_side(rank, step, micro, combo["find_unused"])
                with ddp.no_sync() if micro < micros - 1 else contextlib.nullcontext():
                    _loss(ddp(x, side), combo["find_unused"]).backward()
            opt.step()
            history.append([p.detach().clone() for p in ddp.module.parameters()])
    # Under join, a rank that ran out early shadowed the others' last steps and got the final model.
    history.append([p.detach().clone() for p in ddp.module.parameters()])


def _train(cls, rank: int, combo: dict) -> list:
    """This rank's parameters after each of its steps (and after each join)."""
    ddp, opt = _wrap(cls, rank, combo)  # rank-dependent init: the construction-time broadcast makes it rank 0's
    last = STEPS - rank if combo["join"] else STEPS  # uneven inputs under join (every rank has at least 3 steps)
    gen = torch.Generator().manual_seed(7 + rank)
    history: list = []
    if combo["checkpoint"]:
        _steps(ddp, opt, rank, combo, range(0, 3), gen, history)
        blob = _checkpoint(ddp, opt)
        if isinstance(ddp, fastcoll.DDP):
            ddp.close()
        ddp, opt = _restore(cls, rank, combo, blob)
        _steps(ddp, opt, rank, combo, range(3, last), gen, history)
    else:
        _steps(ddp, opt, rank, combo, range(0, last), gen, history)
    if isinstance(ddp, fastcoll.DDP):
        ddp.close()
    return history


COMBOS = [
    dict(no_sync=a, find_unused=b, wire=c, join=d, checkpoint=e)
    for a, b, c, d, e in itertools.product((False, True), (False, True), tuple(WIRES), (False, True), (False, True))
]

#: The same with gradients as bucket views (float32 wire): the gradients move into new buckets when the layout is
#: rebuilt, and a checkpoint is loaded into wrappers whose buckets hold them.
VIEW_COMBOS = [dict(c, view=True) for c in COMBOS if c["wire"] == "fp32"]


def matrix_worker(rank: int, world_size: int, combos: list, tolerance: dict) -> list:
    """Train every combination under both wrappers; returns the largest difference seen per combination.

    ``tolerance`` per wire (absent: bitwise): with 3 ranks, gloo adds the
    three contributions in an order that depends on where an element sits in
    the buffer, so bucket layouts that differ from torch's change the last bits.
    The one-rounding wires sum in rank order on both sides: bitwise at any N
    (a float64 sum of three 16-bit values is exact unless their exponents lie
    very far apart, so the order itself does not show; the scaling and the
    rounding do: scaling before the sum, as the plain 16-bit wire does, fails).
    """
    names = [n for n, _ in Net(0).named_parameters()]
    worst = []
    for combo in combos:
        ours = _train(fastcoll.DDP, rank, combo)
        theirs = _train(TorchDDP, rank, combo)
        assert len(ours) == len(theirs), (combo, len(ours), len(theirs))
        tol = tolerance.get(combo["wire"])
        most = 0.0
        for step, (a, b) in enumerate(zip(ours, theirs)):
            for name, pa, pb in zip(names, a, b):
                diff = (pa - pb).abs().max().item()
                most = max(most, diff)
                bad = not torch.equal(pa, pb) if tol is None else diff > tol * (1 + pb.abs().max().item())
                if bad:
                    raise AssertionError(f"{combo}: rank {rank} step {step} {name} differs from torch DDP by {diff:.3g}")
        worst.append(most)
    return worst


@pytest.mark.parametrize("part", range(2))
def test_two_ranks_bitwise(part):
    combos = COMBOS[part::2]
    run_ranks(matrix_worker, 2, combos, {}, timeout=380)


@pytest.mark.parametrize("part", range(4))
def test_three_ranks(part):
    """Within the last bits of gloo's summation order: 1e-6 relative on a float32 wire, bfloat16's resolution on
    its wire; bitwise on the one-rounding wires (rank order on both sides)."""
    combos = COMBOS[part::4]
    run_ranks(matrix_worker, 3, combos, {"fp32": 1e-6, "bf16": 2e-3}, timeout=380)


@pytest.mark.parametrize("world", [2, 3])
def test_bucket_views(world):
    """gradient_as_bucket_view in every combination of the rest (float32 wire): bitwise at 2 ranks, within gloo's
    summation order at 3."""
    run_ranks(matrix_worker, world, VIEW_COMBOS, {} if world == 2 else {"fp32": 1e-6}, timeout=380)
