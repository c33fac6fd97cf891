"""ShardedOptimizer checkpoints: the standard format and per-rank shards, reloaded at other world sizes.

Training is the same mathematics at every world size (each rank takes its
chunk of one global batch, losses are means), so a run interrupted at 3
ranks and continued at 2 or 1 (or with a plain torch optimizer in one
process) must end where an uninterrupted run ends, up to float32 rounding.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from multiproc import run_ranks
from test_sharded_optimizer import Reordered, _batch
from torch import nn

import fastcoll
from fastcoll.optim import checkpoint as ckpt

pytestmark = pytest.mark.timeout(300)

STEPS, CUT = 6, 3


def _setup(grads: str):
    model = Reordered()
    ddp = fastcoll.DDP(model, bucket_cap_mb=0.0004, first_bucket_mb=0.0002)
    opt = fastcoll.ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1), ddp, grads=grads)
    return model, ddp, opt


def _train(ddp, opt, rank: int, world: int, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        ddp(_batch(step, rank, world)).pow(2).mean().backward()
        opt.step()
    opt.finish_param_sync()


def _params(model: nn.Module) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def uninterrupted(rank: int, world: int, grads: str) -> dict:
    model, ddp, opt = _setup(grads)
    _train(ddp, opt, rank, world, range(STEPS))
    return _params(model)


def first_half(rank: int, world: int, grads: str, directory: str) -> None:
    """Train the first steps, then write both formats: the per-rank shards and the standard state dict."""
    model, ddp, opt = _setup(grads)
    _train(ddp, opt, rank, world, range(CUT))
    os.makedirs(directory, exist_ok=True)
    ckpt.save_sharded(opt, directory)
    assert os.path.exists(os.path.join(directory, f"optim-rank{rank:05d}-of-{world:05d}.pt"))
    full = opt.state_dict()  # a collective: every rank calls it, every rank gets the whole state
    if rank == 0:
        torch.save(full, os.path.join(directory, "optim-full.pt"))
        torch.save(model.state_dict(), os.path.join(directory, "model.pt"))


def second_half(rank: int, world: int, grads: str, directory: str, kind: str) -> dict:
    model, ddp, opt = _setup(grads)
    model.load_state_dict(torch.load(os.path.join(directory, "model.pt"), weights_only=True))
    if kind == "sharded":
        ckpt.load_sharded(opt, directory)
    else:
        opt.load_state_dict(torch.load(os.path.join(directory, "optim-full.pt"), weights_only=True))
    _train(ddp, opt, rank, world, range(CUT, STEPS))
    return _params(model)


def plain_resume(directory: str, kind: str) -> dict:
    """One process, no DDP, a plain torch AdamW on the global batch, from the checkpoint."""
    model = Reordered()
    model.load_state_dict(torch.load(os.path.join(directory, "model.pt"), weights_only=True))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    if kind == "sharded":
        sd = ckpt.full_from_directory(directory)
    else:
        sd = torch.load(os.path.join(directory, "optim-full.pt"), weights_only=True)
    opt.load_state_dict(sd)
    for step in range(CUT, STEPS):
        opt.zero_grad()
        model(_batch(step, 0, 1)).pow(2).mean().backward()
        opt.step()
    return _params(model)


def _close(a: dict, b: dict, what: str) -> None:
    for n in b:
        assert torch.allclose(a[n], b[n], rtol=1e-5, atol=1e-6), f"{what}: {n} differs by {(a[n] - b[n]).abs().max()}"


@pytest.mark.parametrize("grads", ["full", "sharded"])
def test_resume_at_other_world_sizes(tmp_path, grads):
    """Saved at 3 ranks: resumed at 2 and 1 (both formats), and with a plain torch AdamW; saved at 2: resumed at 3."""
    reference = run_ranks(uninterrupted, 3, grads, timeout=120)[0]
    at3 = str(tmp_path / "at3")
    run_ranks(first_half, 3, grads, at3, timeout=120)
    for world, kind in ((2, "sharded"), (1, "sharded"), (2, "full")):
        for rank, end in enumerate(run_ranks(second_half, world, grads, at3, kind, timeout=120)):
            _close(end, reference, f"{kind} saved at 3, resumed at {world} (rank {rank}, grads={grads})")
    for kind in ("sharded", "full"):
        _close(plain_resume(at3, kind), reference, f"{kind} checkpoint into torch.optim.AdamW")
    at2 = str(tmp_path / "at2")
    run_ranks(first_half, 2, grads, at2, timeout=120)
    for rank, end in enumerate(run_ranks(second_half, 3, grads, at2, "sharded", timeout=120)):
        _close(end, reference, f"saved at 2, resumed at 3 (rank {rank}, grads={grads})")


def segment(rank: int, world: int, grads: str, load_from, save_to: str, steps: range) -> dict:
    """Resume from ``load_from`` (None: from scratch), train ``steps``, save the per-rank shards and the model."""
    model, ddp, opt = _setup(grads)
    if load_from is not None:
        model.load_state_dict(torch.load(os.path.join(load_from, "model.pt"), weights_only=True))
        ckpt.load_sharded(opt, load_from)
    _train(ddp, opt, rank, world, steps)
    os.makedirs(save_to, exist_ok=True)
    ckpt.save_sharded(opt, save_to)
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(save_to, "model.pt"))
    return _params(model)


@pytest.mark.parametrize("worlds", [(3, 2, 1), (1, 2, 3)])
@pytest.mark.parametrize("grads", ["full", "sharded"])
def test_reshard_again_after_a_reshard(tmp_path, grads, worlds):
    """Two steps at each world size in turn, each segment saving what the next loads: ends where 6 steps end."""
    reference = run_ranks(uninterrupted, 3, grads, timeout=120)[0]
    previous = None
    for k, world in enumerate(worlds):
        here = str(tmp_path / f"seg{k}-at{world}")
        steps = range(2 * k, 2 * k + 2)
        ends = run_ranks(segment, world, grads, previous, here, steps, timeout=120)
        assert len(os.listdir(here)) == world + 1  # one file per rank, and the model
        previous = here
    for rank, end in enumerate(ends):
        _close(end, reference, f"chain {worlds} (rank {rank}, grads={grads})")


def layout_worker(rank: int, world: int) -> dict:
    model, ddp, opt = _setup("sharded")
    _train(ddp, opt, rank, world, range(2))
    sd = opt.sharded_state_dict()
    # Nothing of another rank in this rank's dict: its pieces are exactly this rank's ranges.
    mine = {(p.param, p.lo, p.hi) for _, p in opt._pieces}
    number = {i: k for k, i in enumerate(opt._order_index) if i is not None}
    assert {(number[i], lo, hi) for i, lo, hi in mine} == {(pc["param"], pc["lo"], pc["hi"]) for pc in sd["pieces"]}
    assert sd["rank"] == rank and sd["world_size"] == world
    return sd


def test_sharded_state_dicts_hold_only_their_rank_and_cover_every_element():
    sds = run_ranks(layout_worker, 3, timeout=120)
    params = sds[0]["params"]
    for k, spec in enumerate(params):
        numel = int(torch.tensor(spec["shape"]).prod()) if spec["shape"] else 1
        covered = sorted((pc["lo"], pc["hi"]) for sd in sds for pc in sd["pieces"] if pc["param"] == k)
        if not covered:  # the frozen parameter: no state
            continue
        assert covered[0][0] == 0 and covered[-1][1] == numel, (k, covered)
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), (k, covered)  # no gap, no overlap
    with pytest.raises(ValueError, match=r"3-rank run are needed, got ranks \[0, 1\]"):
        ckpt.full_from_sharded(sds[:2])


class HalfAndFloat(nn.Module):
    """A bfloat16 layer, then a LayerNorm kept in float32 (as mixed-precision recipes keep norms)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8).to(torch.bfloat16)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x.to(torch.bfloat16)).float()).pow(2).sum()


def mixed_dtypes_worker(rank: int, world: int) -> list:
    """No master weights: each parameter's optimizer state keeps its dtype in opt.state_dict(), as torch's does."""
    from torch.nn.parallel import DistributedDataParallel

    model = HalfAndFloat()
    ref = copy.deepcopy(model)
    ddp, tdp = fastcoll.DDP(model), DistributedDataParallel(ref)
    opt = fastcoll.ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), ddp)
    plain = torch.optim.AdamW(ref.parameters(), lr=0.01)
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        for m, o in ((ddp, opt), (tdp, plain)):
            o.zero_grad()
            m(x).backward()
            o.step()
    got, want = opt.state_dict()["state"], plain.state_dict()["state"]
    return [f"{k} {key}: {got[k][key].dtype} vs {v.dtype}" for k, st in want.items() for key, v in st.items()
            if got[k][key].dtype != v.dtype or not torch.equal(got[k][key], v)]  # fmt: skip


def test_state_dict_keeps_each_parameters_state_dtype():
    for r, diffs in enumerate(run_ranks(mixed_dtypes_worker, 2)):
        assert diffs == [], f"rank {r}: {diffs}"
