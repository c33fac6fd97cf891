"""Memory per rank of a bf16 fine-tuning run in the transformers Trainer: fastcoll against accelerate's own DDP.

    python benchmarks/hf_trainer_memory.py [--layers 12] [--embd 768] [--seq 128] [--steps 3] [--json FILE]
                                           [--methods accelerate,fastcoll]

Two fresh pairs of gloo ranks on CPU, one per method, each training a GPT-2
built from its config (GPT-2 small's shapes by default: 12 layers, 768 wide,
50257 tokens; no download) on random tokens for ``--steps`` optimizer steps
(batch 1 per rank, AdamW, ``max_grad_norm=1``):

* ``accelerate``: the plain ``Trainer(bf16=True)``: float32 weights, bf16
  autocast, accelerate's torch DDP, AdamW over all the weights on every rank.
* ``fastcoll``: ``FastCollTrainer`` on bf16 weights with
  ``FastCollKwargs(sharded_optimizer=True, grads="sharded",
  main_grad_dtype=torch.float32, master_dtype=torch.float32)``: float32 main
  gradients in the buckets (each rank keeps its range after the
  reduce-scatter), float32 master weights and AdamW state for 1/2 of the
  elements per rank.

Per rank (rank 0's row is printed; ``--json`` writes both ranks): the
high-water mark of the resident set (VmHWM) above the level before the model
is built, the resident set at the end, and what the tensors the run keeps
account for: the model's parameters, the optimizer state this rank holds and
(fastcoll) its float32 master pieces. The resident set includes what the
allocator keeps and the activations; the tensor columns are exact.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from typing import Any, Dict, List, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a clean clone

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

WORLD_SIZE = 2
METHODS = ("accelerate", "fastcoll")


def _proc_mib(key: str) -> float:
    """A ``/proc/self/status`` memory field (VmRSS, VmHWM) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def _tensor_mib(tensors: Any) -> float:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total / 2**20


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int):
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _rank(rank: int, method: str, opts: Dict[str, Any], port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD_SIZE))  # fmt: skip
    torch.set_num_threads(1)
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from fastcoll.integrations.accelerate import FastCollKwargs
    from fastcoll.integrations.transformers import FastCollTrainer

    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    base = _proc_mib("VmRSS")
    cfg = GPT2Config(n_layer=opts["layers"], n_embd=opts["embd"], n_head=max(1, opts["embd"] // 64),
                     n_positions=opts["seq"], vocab_size=opts["vocab"])  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    args = dict(output_dir=os.path.join(out_dir, method), per_device_train_batch_size=1, max_steps=opts["steps"],
                learning_rate=1e-4, max_grad_norm=1.0, optim="adamw_torch", use_cpu=True, ddp_backend="gloo",
                ddp_find_unused_parameters=False, report_to=[], save_strategy="no", logging_strategy="no",
                disable_tqdm=True, dataloader_num_workers=0, seed=0)  # fmt: skip
    data = _Tokens(opts["steps"] * WORLD_SIZE, opts["seq"], opts["vocab"])
    if method == "accelerate":
        trainer = Trainer(model=model, args=TrainingArguments(bf16=True, **args), train_dataset=data)
    else:
        options = FastCollKwargs(sharded_optimizer=True, grads="sharded", main_grad_dtype=torch.float32,
                                 master_dtype=torch.float32)  # fmt: skip
        trainer = FastCollTrainer(model=model.to(torch.bfloat16), args=TrainingArguments(**args), train_dataset=data,
                                  fastcoll=options)  # fmt: skip
    out = trainer.train()
    opt = trainer.optimizer.optimizer  # under accelerate's AcceleratedOptimizer
    inner = getattr(opt, "_local", opt)  # a ShardedOptimizer steps its pieces with a private optimizer of the class
    state = [t for st in inner.state.values() for t in st.values()]
    row = {
        "method": method,
        "rank": rank,
        "peak_rss_mib": _proc_mib("VmHWM") - base,
        "end_rss_mib": _proc_mib("VmRSS") - base,
        "params_mib": _tensor_mib(trainer.model.parameters()),
        "optimizer_state_mib": _tensor_mib(state),
        "master_pieces_mib": _tensor_mib(p for g in inner.param_groups for p in g["params"]) if inner is not opt else 0.0,
        "train_loss": out.training_loss,
        "param_count": sum(p.numel() for p in trainer.model.parameters()),
    }
    with open(os.path.join(out_dir, f"{method}-{rank}.json"), "w") as f:
        json.dump(row, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(opts: Dict[str, Any], methods: Sequence[str] = METHODS) -> List[Dict[str, Any]]:
    """One fresh pair of ranks per method; every rank's row."""
    rows = []
    with tempfile.TemporaryDirectory() as out_dir:
        for method in methods:
            mp.start_processes(_rank, args=(method, opts, _free_port(), out_dir), nprocs=WORLD_SIZE, start_method="spawn")
            for rank in range(WORLD_SIZE):
                with open(os.path.join(out_dir, f"{method}-{rank}.json")) as f:
                    rows.append(json.load(f))
    return rows


def main(argv: Any = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--embd", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", help="write every rank's row to this file")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated, of: " + ", ".join(METHODS))
    a = p.parse_args(argv)
    methods = a.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        p.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    opts = {k: getattr(a, k) for k in ("layers", "embd", "vocab", "seq", "steps")}
    rows = measure(opts, methods)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"options": opts, "rows": rows}, f, indent=1)
    cols = ("peak_rss_mib", "end_rss_mib", "params_mib", "optimizer_state_mib", "master_pieces_mib")
    print(f"GPT-2 {opts['layers']}x{opts['embd']} ({rows[0]['param_count'] / 1e6:.1f}M parameters), seq {opts['seq']}, "
          f"{opts['steps']} steps, {WORLD_SIZE} gloo ranks; rank 0, MiB")  # fmt: skip
    print("| method | " + " | ".join(cols) + " | train loss |")
    print("|---" * (len(cols) + 2) + "|")
    for r in rows:
        if r["rank"] == 0:
            print(f"| {r['method']} | " + " | ".join(f"{r[c]:.0f}" for c in cols) + f" | {r['train_loss']:.4f} |")


if __name__ == "__main__":
    main()
