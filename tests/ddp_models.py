"""Small models and data for the fastcoll.DDP tests (importable by spawned ranks).

Every model is built by ``build(name, seed)`` and trained through
``loss_of(name, model, x, y, chunk, step)``, where ``chunk`` is the index of
the per-rank slice of the global batch (the rank under DDP; the slice being
processed in the single-process reference). Models whose loss is not a mean
over samples (BatchNorm statistics, rank-dependent branches) are marked
``PER_CHUNK``: their single-process reference runs each slice separately and
averages the losses, which is what data parallelism computes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

LOCAL_BATCH = 4


class MLP(nn.Module):
    """Many small layers: ``depth`` square ones (tanh after each), then a head of ``head`` outputs (None: no head)."""

    def __init__(self, width: int = 8, depth: int = 12, head: Optional[int] = 3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = None if head is None else nn.Linear(width, head)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x if self.head is None else self.head(x)


class ConvBN(nn.Module):
    """Conv net with BatchNorm (buffers, including the int64 num_batches_tracked)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean(dim=(2, 3)))


class Encoder(nn.Module):
    """Small transformer encoder (no dropout, so runs are deterministic)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 16)
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)).mean(dim=1))


@dataclasses.dataclass
class BranchOut:
    logits: torch.Tensor
    extra: Dict[str, Any]


class Branchy(nn.Module):
    """``never`` is never used; ``sometimes`` only when the caller asks."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)
        self.sometimes = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x, use_sometimes: bool = False):
        h = torch.relu(self.trunk(x))
        if use_sometimes:
            h = h + self.sometimes(h)
        return BranchOut(self.head(h), {"hidden": (h,)})


class Mixed(nn.Module):
    """float32, float16 and bfloat16 parameters, a frozen layer and a zero-sized parameter."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.b = nn.Linear(8, 8).half()
        self.c = nn.Linear(8, 8).to(torch.bfloat16)
        self.d = nn.Linear(8, 3)
        self.empty = nn.Parameter(torch.zeros(0))

    def forward(self, x):
        x = torch.tanh(self.frozen(self.a(x)))
        x = torch.tanh(self.b(x.half())).float()
        x = torch.tanh(self.c(x.bfloat16())).float()
        return self.d(x) + self.empty.sum()


class Tied(nn.Module):
    """Embedding and output projection share one weight."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx):
        return self.out(torch.tanh(self.mid(self.emb(idx))))


class Reordered(nn.Module):
    """Registration order is the reverse of use order, so the ready order differs from the initial layout."""

    def __init__(self):
        super().__init__()
        self.c = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class SparseEmb(nn.Module):
    """Embeddings with sparse gradients (an Embedding and an EmbeddingBag) feeding a dense head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 6, sparse=True)
        self.bag = nn.EmbeddingBag(20, 6, mode="mean", sparse=True)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        return self.head(torch.cat([self.emb(x).mean(1), self.bag(x)], dim=1))


BUILDERS = {
    "mlp": MLP,
    "convbn": ConvBN,
    "convbn_cl": ConvBN,
    "encoder": Encoder,
    "branchy": Branchy,
    "mixed": Mixed,
    "tied": Tied,
    "reordered": Reordered,
    "sparse": SparseEmb,
}
PER_CHUNK = {"convbn", "convbn_cl", "branchy"}


def build(name: str, seed: int) -> nn.Module:
    """Model ``name`` initialized from ``seed``."""
    torch.manual_seed(seed)
    model = BUILDERS[name]()
    if name == "convbn_cl":
        model = model.to(memory_format=torch.channels_last)
    return model


def global_batch(name: str, world_size: int, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: ``world_size * LOCAL_BATCH`` samples."""
    g = torch.Generator().manual_seed(1000 + step)
    n = world_size * LOCAL_BATCH
    if name.startswith("convbn"):
        x = torch.randn(n, 3, 6, 6, generator=g)
        if name == "convbn_cl":
            x = x.contiguous(memory_format=torch.channels_last)
    elif name == "encoder":
        x = torch.randn(n, 5, 6, generator=g)
    elif name == "tied":
        x = torch.randint(0, 10, (n,), generator=g)
        return x, torch.randint(0, 10, (n,), generator=g)
    elif name == "sparse":
        x = torch.randint(0, 20, (n, 4), generator=g)  # rows differ across ranks, some repeat
    else:
        x = torch.randn(n, 8, generator=g)
    return x, torch.randint(0, 3, (n,), generator=g)


def chunk_of(t: torch.Tensor, chunk: int) -> torch.Tensor:
    return t[chunk * LOCAL_BATCH : (chunk + 1) * LOCAL_BATCH]


def uses_sometimes(chunk: int, step: int) -> bool:
    """Whether slice ``chunk`` uses Branchy.sometimes at ``step``: differs across ranks and steps; at step 2 no rank does."""
    return step != 2 and (chunk + step) % 2 == 0


def loss_of(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunk: int, step: int) -> torch.Tensor:
    """The training loss of ``model`` on a batch (``chunk`` matters only for Branchy)."""
    if name == "branchy":
        out = model(x, use_sometimes=uses_sometimes(chunk, step))
        return F.cross_entropy(out.logits, y)
    return F.cross_entropy(model(x).float(), y)


def backward_on_chunk(name: str, world_size: int, rank: int, step: int, pairs, set_to_none: bool = True) -> None:
    """For each (model, optimizer) of ``pairs``: zero the gradients, then the backward of the loss on slice
    ``rank`` of ``step``'s global batch (a rank's share of a data-parallel step)."""
    x, y = global_batch(name, world_size, step)
    xr, yr = chunk_of(x, rank), chunk_of(y, rank)
    for model, opt in pairs:
        opt.zero_grad(set_to_none=set_to_none)
        loss_of(name, model, xr, yr, rank, step).backward()


def reference_train(name: str, world_size: int, steps: int, lr: float, momentum: float, set_to_none: bool = True) -> nn.Module:
    """One process training on the global batches (seed 0, i.e. rank 0's initialization)."""
    model = build(name, 0)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for step in range(steps):
        x, y = global_batch(name, world_size, step)
        opt.zero_grad(set_to_none=set_to_none)
        if name in PER_CHUNK:
            loss = sum(loss_of(name, model, chunk_of(x, r), chunk_of(y, r), r, step) for r in range(world_size)) / world_size
        else:
            loss = loss_of(name, model, x, y, 0, step)
        loss.backward()
        opt.step()
    return model
