"""A tiny causal language model on a fixed synthetic next-token task, trained on 2+ ranks in 16 bits or 32.

The one definition of the quality check of float32 main gradients and master weights: ``tests/test_main_grads.py``
asserts on it and ``python -m fastcoll.bench zero`` reports it (:mod:`fastcoll.bench.zero_bf16`). Nothing is downloaded:
the model is built here (seed 0) and the data is generated (:func:`tokens`). :func:`train` runs one recipe: ``"fp32"``
(float32 under torch DDP, the reference), ``"torch_bf16"`` (the model in bfloat16 under torch DDP, a plain AdamW) or
``"fastcoll"`` (the model in bfloat16 under ``fastcoll.DDP(main_grad_dtype=torch.float32)`` with
``fastcoll.ShardedOptimizer(AdamW, master_dtype=torch.float32, grads=...)``).
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastcoll

from ..optim import checkpoint as ckpt

VOCAB = 32
SEQ = 16
BATCH = 4  # sequences per micro-batch and rank
RECIPES = ("fp32", "torch_bf16", "fastcoll")
BF16 = torch.bfloat16


class TinyCausalLM(nn.Module):
    """Token and position embeddings, ``layers`` pre-norm causal transformer blocks (4 heads, no dropout), a linear head."""

    def __init__(self, vocab: int = VOCAB, d: int = 32, layers: int = 2, seq: int = SEQ):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.out = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, ids):
        h = self.emb(ids) + self.pos[: ids.shape[1]]
        h = self.blocks(h, mask=self.mask.to(h.dtype), is_causal=True)
        return self.out(h)


def tokens(step: int, micro: int, rank: int) -> torch.Tensor:
    """A fixed synthetic next-token task: ``BATCH`` arithmetic sequences of ``SEQ + 1`` tokens modulo the vocabulary."""
    g = torch.Generator().manual_seed(step * 100 + micro * 10 + rank)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (BATCH, 1), generator=g)
    return (start + stride * torch.arange(SEQ + 1)) % VOCAB


def flat_weights(model: nn.Module) -> torch.Tensor:
    """Every parameter, as float32, in one vector (registration order)."""
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


def relative_distance(a: torch.Tensor, ref: torch.Tensor) -> float:
    """``||a - ref|| / ||ref||`` (float64)."""
    a, ref = a.double(), ref.double()
    return float((a - ref).norm() / ref.norm())


def train(
    rank: int, world: int, recipe: str, steps: int, *, grads: str = "sharded", lr: float = 1e-4, micro_batches: int = 4,
    masters: bool = False, ddp_kwargs: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:  # fmt: skip
    """Train :class:`TinyCausalLM` ``steps`` steps with ``recipe`` (one of :data:`RECIPES`) on this rank.

    Call it on every rank of an initialized process group. Each step: AdamW at ``lr`` after ``micro_batches``
    micro-batches of gradient accumulation (``no_sync`` on all but the last), each micro-batch's loss divided by their
    number. ``ddp_kwargs``: more arguments of ``fastcoll.DDP`` (the fastcoll recipe), e.g. ``comm_dtype``.

    Returns:
        ``weights``: the final parameters (float32 vector); ``loss``: the last step's loss (the mean over micro-batches,
        averaged over ranks); ``losses``: every step's; with ``masters`` and the fastcoll recipe, ``masters``: the
        float32 master weights (``opt.state_dict()``, in the parameters' order).
    """
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    model = TinyCausalLM()
    if recipe != "fp32":
        model.to(BF16)
    if recipe == "fastcoll":
        ddp: nn.Module = fastcoll.DDP(model, main_grad_dtype=torch.float32, **(ddp_kwargs or {}))
        opt: torch.optim.Optimizer = fastcoll.ShardedOptimizer(
            torch.optim.AdamW(model.parameters(), lr=lr), ddp, grads=grads, master_dtype=torch.float32
        )
    else:
        ddp = TorchDDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses: List[float] = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for micro in range(micro_batches):
            ids = tokens(step, micro, rank)
            with ddp.no_sync() if micro < micro_batches - 1 else contextlib.nullcontext():  # type: ignore[operator]
                logits = ddp(ids[:, :-1])
                loss = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
                (loss / micro_batches).backward()
            total += float(loss.detach()) / micro_batches
        opt.step()
        losses.append(total)
    out: Dict[str, Any] = {}
    if recipe == "fastcoll":
        opt.finish_param_sync()  # type: ignore[attr-defined]
        if masters:
            state = opt.state_dict()["state"]  # a collective: every rank
            out["masters"] = torch.cat([state[k][ckpt.MASTER].float().flatten() for k in sorted(state)])
    t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(t)
    per_step = (t / world).tolist()
    out.update(weights=flat_weights(model), loss=per_step[-1] if per_step else None, losses=per_step)
    return out


def train_runs(
    rank: int, world: int, steps: int, runs: Dict[str, Any], tick: Callable[[], None], init: Optional[torch.Tensor] = None
) -> Dict[str, Dict[str, Any]]:
    """:func:`train` each of ``runs`` (name -> its keyword arguments, ``recipe`` among them) for ``steps`` steps.

    Returns:
        Per run, its :func:`quality_metrics` (``init``: see there), ``losses`` and ``seconds``; ``tick()`` after each
        run.
    """
    out, seconds = {}, {}
    for name, kwargs in runs.items():
        t0 = time.perf_counter()
        out[name] = train(rank, world, steps=steps, **kwargs)
        seconds[name] = time.perf_counter() - t0
        gc.collect()
        tick()
    metrics = quality_metrics(out, init)
    return {n: {**metrics[n], "losses": out[n]["losses"], "seconds": seconds[n]} for n in out}


def quality_metrics(runs: Dict[str, Dict[str, Any]], init: Optional[torch.Tensor] = None) -> Dict[str, Dict[str, Any]]:
    """Per run, the relative L2 distance of its final weights (and masters) from ``runs["fp32"]``'s, and its loss gap.

    ``init``: the float32 initial weights; ``"fp32"``'s entry then has ``moved``, the distance its training moved them
    (the scale of the others').
    """
    ref = runs["fp32"]
    out: Dict[str, Dict[str, Any]] = {}
    for name, r in runs.items():
        m: Dict[str, Any] = {
            "final_loss": r["loss"],
            "loss_gap": (r["loss"] - ref["loss"]) / ref["loss"],
            "weight_distance": relative_distance(r["weights"], ref["weights"]),
        }
        if r.get("masters") is not None:
            m["master_distance"] = relative_distance(r["masters"], ref["weights"])
        if name == "fp32" and init is not None:
            m["moved"] = relative_distance(init, ref["weights"])
        out[name] = m
    return out
