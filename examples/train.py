#!/usr/bin/env python
"""Data-parallel training with fastcoll.DDP on synthetic data, from a laptop to several nodes.

The same script, unchanged:

    python examples/train.py                                    # one process
    torchrun --nproc_per_node=8 examples/train.py               # one node, 8 GPUs (or 8 CPU processes)
    # two nodes: run on each, with NODE_RANK 0 and 1 and the first node's address
    torchrun --nnodes=2 --node_rank=$NODE_RANK --nproc_per_node=8 \\
             --master_addr=$HOST0 --master_port=29500 examples/train.py
    srun --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 python examples/train.py --launcher slurm

What it shows: the process group set up with ``fastcoll.init_dist`` (torchrun,
SLURM or MPI environments; a one-process group when there is no launcher, so
fastcoll.DDP runs everywhere), the model wrapped with ``fastcoll.DDP`` exactly
as with torch's DistributedDataParallel, gradient accumulation with
``no_sync()``, logging of rank-averaged metrics with ``fastcoll.all_reduce_dict``
on rank 0 only (``fastcoll.rank_zero_only``), and an evaluation whose
per-sample results are gathered in dataset order with ``fastcoll.collect_results``.
NCCL is used on GPUs, gloo on CPUs.

``--out DIR`` writes, per rank, the final weights (``rank{R}.pt``) and a summary
with their SHA-256 (``rank{R}.json``): every rank must end with the same hash.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import fastcoll

# --------------------------------------------------------------------------- #
# Launch
# --------------------------------------------------------------------------- #


def detect_launcher() -> str:
    """'pytorch' under torchrun, 'slurm' under srun with several tasks, 'mpi' under mpirun, else 'none'."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return "pytorch"
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        return "slurm"
    if int(env.get("OMPI_COMM_WORLD_SIZE", env.get("PMI_SIZE", "1"))) > 1:
        return "mpi"
    return "none"


def setup(launcher: str, backend: str, timeout_s: float) -> None:
    """Create the default process group (a one-process group when there is no launcher)."""
    if launcher == "none":
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        fastcoll.init_dist(launcher, backend, timeout=timeout_s)


# --------------------------------------------------------------------------- #
# Models and data
# --------------------------------------------------------------------------- #


class ConvNet(nn.Module):
    """A small CNN with BatchNorm (its running statistics are broadcast from rank 0 by DDP)."""

    def __init__(self, num_classes: int, width: int = 32):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(inplace=True),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class TinyTransformer(nn.Module):
    """A small pre-norm transformer encoder classifying token sequences."""

    def __init__(self, num_classes: int, vocab: int, seq_len: int, dim: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq_len, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(tokens) + self.pos)
        return self.head(self.norm(h.mean(dim=1)))


def make_data(args: argparse.Namespace, n: int, seed: int) -> TensorDataset:
    """A learnable synthetic task, identical on every rank: noisy samples around one fixed pattern per class."""
    g = torch.Generator().manual_seed(seed)
    patterns_g = torch.Generator().manual_seed(args.seed)  # the same class patterns for train and eval
    y = torch.randint(0, args.num_classes, (n,), generator=g)
    if args.model == "conv":
        patterns = torch.randn(args.num_classes, 3, args.image_size, args.image_size, generator=patterns_g)
        x = torch.randn(n, 3, args.image_size, args.image_size, generator=g) + 0.5 * patterns[y]
    else:
        # each class prefers its own tokens: half of a sequence comes from the class's slice of the vocabulary
        per_class = max(args.vocab // args.num_classes, 1)
        preferred = torch.randperm(args.vocab, generator=patterns_g)[: per_class * args.num_classes]
        preferred = preferred.view(args.num_classes, per_class)
        random_tokens = torch.randint(0, args.vocab, (n, args.seq_len), generator=g)
        pick = torch.randint(0, preferred.shape[1], (n, args.seq_len), generator=g)
        from_class = preferred[y][torch.arange(n)[:, None], pick]
        x = torch.where(torch.rand(n, args.seq_len, generator=g) < 0.5, from_class, random_tokens)
    return TensorDataset(x, y)


def build_model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(args.seed)  # fastcoll.DDP broadcasts rank 0's weights anyway
    if args.model == "conv":
        return ConvNet(args.num_classes)
    return TinyTransformer(args.num_classes, args.vocab, args.seq_len)


# --------------------------------------------------------------------------- #
# Training and evaluation
# --------------------------------------------------------------------------- #


@fastcoll.rank_zero_only
def log(msg: str) -> None:
    print(msg, flush=True)


def evaluate(model: nn.Module, data: TensorDataset, args: argparse.Namespace, device: torch.device) -> float:
    """Accuracy on ``data``: each rank scores its share, rank 0 gets every result in dataset order."""
    # Without shuffling, DistributedSampler deals sample i to rank i % world_size
    # (padding the last round), which is the order collect_results undoes.
    sampler = DistributedSampler(data, shuffle=False, drop_last=False)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    results: List[bool] = []
    model.eval()
    with torch.no_grad():
        for x, y in loader:
            pred = model(x.to(device)).argmax(dim=1).cpu()
            results.extend((pred == y).tolist())
    model.train()
    # 'gpu' exchanges through tensors on the backend's device (CPU tensors on
    # gloo): no shared filesystem needed across nodes.
    gathered = fastcoll.collect_results(results, len(data), device="gpu")
    if gathered is None:  # ranks other than 0
        return float("nan")
    return sum(gathered) / len(gathered)


def state_hash(state: Dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k, v in state.items():
        h.update(k.encode())
        h.update(v.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train(args: argparse.Namespace) -> Dict[str, object]:
    rank, world = fastcoll.get_rank(), fastcoll.get_world_size()
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())

    model = build_model(args).to(device)
    if device.type == "cuda" and args.channels_last and args.model == "conv":
        model = model.to(memory_format=torch.channels_last)
    # The one line that differs from torch DDP: fastcoll.DDP instead of
    # torch.nn.parallel.DistributedDataParallel (same arguments).
    ddp = fastcoll.DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=args.bucket_cap_mb,
        gradient_as_bucket_view=args.gradient_as_bucket_view,
    )
    if args.optimizer == "sgd":
        opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)

    train_set = make_data(args, args.train_samples, args.seed + 1)
    eval_set = make_data(args, args.eval_samples, args.seed + 2)
    sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    updates_per_epoch = len(loader) // args.grad_accum
    total = updates_per_epoch * args.epochs if args.max_steps <= 0 else args.max_steps
    log(
        f"fastcoll {fastcoll.__version__}: {world} process(es), backend {dist.get_backend()}, device {device.type}, "
        f"model {args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters), "
        f"global batch {args.batch_size * args.grad_accum * world}, {total} updates"
    )

    step, t0, last = 0, time.perf_counter(), {}
    epoch = 0
    while step < total:
        sampler.set_epoch(epoch)
        batches = iter(loader)
        while step < total:
            micro: List[Tuple[torch.Tensor, torch.Tensor]] = []
            for _ in range(args.grad_accum):
                try:
                    micro.append(next(batches))
                except StopIteration:
                    break
            if len(micro) < args.grad_accum:
                break  # end of epoch
            correct = torch.zeros((), device=device)
            for i, (x, y) in enumerate(micro):
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                last_micro = i == len(micro) - 1
                # All but the last micro-batch accumulate locally; the last
                # backward averages the summed gradients across ranks.
                with ddp.no_sync() if not last_micro else nullcontext():
                    out = ddp(x)
                    loss = F.cross_entropy(out, y) / args.grad_accum
                    loss.backward()
                correct += (out.argmax(dim=1) == y).float().mean().detach() / args.grad_accum
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % args.log_every == 0 or step == total:
                # Averaged over ranks in one fused all-reduce; every rank must call it.
                last = fastcoll.all_reduce_dict({"loss": loss.detach() * args.grad_accum, "acc": correct}, op="mean")
                rate = step / (time.perf_counter() - t0)
                loss_acc = f"loss {last['loss'].item():.4f}  train acc {last['acc'].item():.3f}"
                log(f"step {step:5d}/{total}  {loss_acc}  {rate:.1f} it/s")
        epoch += 1

    acc = evaluate(ddp, eval_set, args, device)
    log(f"eval accuracy {acc:.3f} on {len(eval_set)} samples")
    state = {k: v.detach().cpu().clone() for k, v in ddp.module.state_dict().items()}
    summary = dict(
        rank=rank,
        world_size=world,
        steps=step,
        model=args.model,
        final_loss=float(last["loss"]) if last else float("nan"),
        eval_accuracy=None if math.isnan(acc) else acc,
        sha256=state_hash(state),
        seconds=time.perf_counter() - t0,
    )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        torch.save(state, os.path.join(args.out, f"rank{rank}.pt"))
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(summary, f, indent=1)
    if args.checkpoint:
        save_checkpoint(ddp, opt, step, args.checkpoint)
    fastcoll.synchronize()
    return summary


@fastcoll.rank_zero_only
def save_checkpoint(ddp: fastcoll.DDP, opt: torch.optim.Optimizer, step: int, path: str) -> None:
    # ddp.state_dict() has torch DDP's "module." keys; ddp.module.state_dict() the bare model's.
    torch.save({"model": ddp.module.state_dict(), "optimizer": opt.state_dict(), "step": step}, path)
    print(f"saved {path}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("conv", "transformer"), default="conv")
    p.add_argument("--launcher", choices=("auto", "none", "pytorch", "slurm", "mpi"), default="auto")
    p.add_argument("--backend", default=None, help="process-group backend (default: nccl on GPUs, gloo on CPUs)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many updates (0: run --epochs)")
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per update (no_sync on all but the last)")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default=None, help="default: sgd for conv, adamw for transformer")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--bucket-cap-mb", type=float, default=None)
    p.add_argument("--gradient-as-bucket-view", action="store_true")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--train-samples", type=int, default=2048)
    p.add_argument("--eval-samples", type=int, default=500)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--image-size", type=int, default=16)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout, seconds")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per process (0: torch's default)")
    p.add_argument("--out", default=None, help="directory for per-rank final weights and summaries")
    p.add_argument("--checkpoint", default=None, help="save model/optimizer here (rank 0)")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.backend is None:
        args.backend = "nccl" if args.device == "cuda" else "gloo"
    if args.optimizer is None:
        args.optimizer = "sgd" if args.model == "conv" else "adamw"
    if args.lr is None:
        args.lr = 0.05 if args.optimizer == "sgd" else 1e-3
    if args.grad_accum < 1:
        p.error("--grad-accum must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    launcher = detect_launcher() if args.launcher == "auto" else args.launcher
    setup(launcher, args.backend, args.timeout)
    try:
        train(args)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
