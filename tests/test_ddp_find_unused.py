"""find_unused_parameters as torch's reducer decides it, case by case, against torch DDP (2 gloo ranks, bitwise).

torch's rules (c10d reducer.cpp): before backward, the autograd graph is
searched from every tensor the forward returned; parameters not reached are
ready at once (their ``.grad`` as it stands is reduced, zeros when None).
Parameters reached from the outputs but not from the loss get undefined
gradients through DDP's output sink and are ready too. A gradient marks its
parameter locally used, in synchronized and ``no_sync`` backwards alike,
until the next synchronized backward ends; the used maps are summed over
ranks, and a parameter unused on every rank keeps its ``.grad``.
"""

from __future__ import annotations

import pytest
import torch
from multiproc import RankError, run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.checkpoint import checkpoint

import fastcoll

pytestmark = pytest.mark.timeout(120)


class Heads(nn.Module):
    """A shared body, a main head, an auxiliary head whose output is returned, a branch some calls use."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(6, 8)
        self.main = nn.Linear(8, 3)
        self.aux = nn.Linear(8, 3)
        self.other = nn.Linear(8, 3)

    def forward(self, x, branch: str = "main"):
        h = torch.relu(self.body(x))
        main = self.other(h) if branch == "other" else self.main(h)
        return {"main": main, "aux": self.aux(h)}


def _grads(model: nn.Module) -> dict:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _run_both(rank: int, scenario) -> list:
    """Run ``scenario(ddp, rank, step)`` for 4 steps under each wrapper; returns the gradients after every step."""
    out = []
    for cls in (fastcoll.DDP, TorchDDP):
        model = Heads()
        ddp = cls(model, find_unused_parameters=True)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        torch.manual_seed(100 + rank)
        history = []
        for step in range(4):
            opt.zero_grad(set_to_none=step % 2 == 0)  # zeroed grads (not None) count as "has a grad" in torch's rules
            scenario(ddp, rank, step)
            history.append(_grads(model))
            opt.step()
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
        out.append(history)
        if isinstance(ddp, fastcoll.DDP):
            ddp.close()
    return out


def _compare(rank: int, scenario) -> None:
    ours, theirs = _run_both(rank, scenario)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        for name in a:
            x, y = a[name], b[name]
            assert (x is None) == (y is None), f"rank {rank} step {step} {name}: fastcoll {x} torch {y}"
            assert x is None or torch.equal(x, y), f"rank {rank} step {step} {name}: {(x - y).abs().max()}"


def _dict_unused_head(ddp, rank, step):
    ddp(torch.randn(4, 6))["main"].sum().backward()  # "aux" is returned but not in the loss


def _nosync_same_branch(ddp, rank, step):
    with ddp.no_sync():
        ddp(torch.randn(4, 6), "other")["main"].sum().backward()
    ddp(torch.randn(4, 6))["main"].sum().backward()


def _nosync_rank_branch(ddp, rank, step):
    with ddp.no_sync():
        ddp(torch.randn(4, 6), "other" if rank == 0 else "main")["main"].sum().backward()
    ddp(torch.randn(4, 6))["main"].sum().backward()


def _used_again_later(ddp, rank, step):
    # "other" is used by no rank in steps 0 and 2, by rank 1 only in step 1, by every rank in step 3.
    branch = "other" if (step == 1 and rank == 1) or step == 3 else "main"
    out = ddp(torch.randn(4, 6), branch)
    (out["main"].sum() + (out["aux"].sum() if step >= 2 else 0)).backward()


SCENARIOS = {
    "dict output, an unused head": _dict_unused_head,
    "no_sync micro-batch uses another branch, every rank": _nosync_same_branch,
    "no_sync micro-batch uses another branch on rank 0 only": _nosync_rank_branch,
    "a parameter unused, then used on one rank, then on all": _used_again_later,
}


def scenario_worker(rank, world_size, name):
    _compare(rank, SCENARIOS[name])


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_matches_torch_ddp(name):
    run_ranks(scenario_worker, 2, name, timeout=100)


def no_sync_worker(rank, world_size):
    """PyTorch's test_grads_same_across_ranks_with_no_sync, in short: after the synchronized backward every rank agrees."""
    model = Heads()
    ddp = fastcoll.DDP(model, find_unused_parameters=True)
    with ddp.no_sync():
        ddp(torch.full((2, 6), float(rank + 1)), "other")["main"].sum().backward()
    ddp(torch.ones(2, 6))["main"].sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_grads_agree_across_ranks_after_no_sync():
    g0, g1 = run_ranks(no_sync_worker, 2, timeout=60)
    assert set(g0) == set(g1) and "other.weight" in g0
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n


# --------------------------------------------------------------------------- Hugging Face BERT pre-training head


def bert_worker(rank, world_size):
    from transformers import BertConfig, BertForPreTraining

    cfg = BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    out = []
    for cls in (fastcoll.DDP, TorchDDP):
        torch.manual_seed(0)
        model = BertForPreTraining(cfg)
        ddp = cls(model, find_unused_parameters=True)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(3):
            opt.zero_grad()
            ids = torch.randint(0, 64, (2, 8), generator=gen)
            res = ddp(input_ids=ids)
            # The masked-LM loss alone: the next-sentence head (cls.seq_relationship) is returned, never used.
            loss = nn.functional.cross_entropy(res.prediction_logits.reshape(-1, 64), ids.reshape(-1))
            loss.backward()
            opt.step()
        nsp = model.cls.seq_relationship.weight
        assert nsp.grad is None, f"{cls.__name__}: the unused head got a gradient"
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
        if isinstance(ddp, fastcoll.DDP):
            ddp.close()
    ours, theirs = out
    for n in ours:
        assert torch.equal(ours[n], theirs[n]), n


def test_bert_for_pretraining_with_the_mlm_loss_only():
    pytest.importorskip("transformers")
    run_ranks(bert_worker, 2, timeout=110)


# --------------------------------------------------------------------------- reentrant activation checkpointing


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(checkpoint(self.inner, x.requires_grad_(), use_reentrant=True))


def reentrant_worker(rank, world_size, cls_name, static_graph):
    cls = fastcoll.DDP if cls_name == "fastcoll" else TorchDDP
    ddp = cls(Checkpointed(), find_unused_parameters=not static_graph, static_graph=static_graph)
    for _ in range(3):
        ddp(torch.randn(2, 4)).sum().backward()
    return [p.grad.clone() for p in ddp.module.parameters()]


@pytest.mark.parametrize("cls_name", ["fastcoll", "torch"])
def test_reentrant_checkpoint_with_find_unused_fails_and_says_why(cls_name):
    with pytest.raises(RankError) as info:
        run_ranks(reentrant_worker, 2, cls_name, False, timeout=60)
    text = str(info.value)
    if cls_name == "torch":
        assert "marked as ready twice" in text or "mark a variable ready only once" in text
    else:
        assert "parameter 'inner." in text and "use_reentrant=True" in text and "use_reentrant=False" in text
        assert "return every tensor the loss depends on" not in text


def test_reentrant_checkpoint_with_static_graph_trains_like_torch():
    ours = run_ranks(reentrant_worker, 2, "fastcoll", True, timeout=60)
    theirs = run_ranks(reentrant_worker, 2, "torch", True, timeout=60)
    for a, b in zip(ours, theirs):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


# --------------------------------------------------------------------------- parameters and buffers to ignore


class TopLevel(nn.Module):
    def __init__(self, rank: int):
        super().__init__()
        torch.manual_seed(rank)  # different on every rank: shows what the construction-time broadcast covers
        self.scale = nn.Parameter(torch.randn(3))
        self.fc = nn.Linear(3, 3)
        self.register_buffer("offset", torch.full((3,), float(rank)))

    def forward(self, x):
        return self.fc(x * self.scale) + self.offset


def ignore_worker(rank: int, world: int, names: list) -> list:
    out = []
    for cls in (fastcoll.DDP, TorchDDP):
        model = TopLevel(rank)
        cls._set_params_and_buffers_to_ignore_for_model(model, names)
        ddp = cls(model)
        after_init = {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
        torch.manual_seed(100 + rank)
        ddp(torch.randn(4, 3)).pow(2).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        out.append((after_init, grads))
        if isinstance(ddp, fastcoll.DDP):
            ddp.close()
    (ours_init, ours_grads), (theirs_init, theirs_grads) = out
    for n in theirs_init:
        assert torch.equal(ours_init[n], theirs_init[n]), f"after construction, {n}"
    for n in theirs_grads:
        assert torch.equal(ours_grads[n], theirs_grads[n]), f"gradient of {n}"
    return [ours_init["scale"], ours_grads["scale"]]


def test_ignored_names_as_torch_honours_them():
    """A root-level parameter in the list is left out of the construction-time broadcast but still averaged (torch's
    reducer tests '.scale'); a nested one is left out of both; a buffer is not broadcast."""
    (init0, g0), (init1, g1) = run_ranks(ignore_worker, 2, ["scale", "fc.bias", "offset"], timeout=60)
    assert not torch.equal(init0, init1)  # not broadcast: each rank kept its own
    assert torch.equal(g0, g1)  # averaged anyway, as under torch DDP
