"""FastCollTrainer (fastcoll.integrations.transformers) against the plain transformers Trainer, on 2 gloo ranks.

Both Trainers train a tiny GPT-2 (built here, no download, no dropout) for a
few steps with gradient accumulation, ``max_grad_norm`` at a norm that clips,
a cosine schedule with warmup and AdamW; the plain Trainer's accelerate wraps
the model in torch DDP, FastCollTrainer's in fastcoll.DDP. Weights must be
equal after the run: bitwise with fastcoll.DDP (same buckets, same order of
reductions), to float32 rounding with the sharded optimizer (its clipping norm
sums in float64 over ranges). Checkpoints: a run resumed from its step-2
checkpoint ends bitwise where the uninterrupted run ends.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hf_helpers import compare_states, tiny_gpt2, torchrun_env
from multiproc import run_ranks

for _pkg in ("accelerate", "transformers", "safetensors"):
    if importlib.util.find_spec(_pkg) is None:
        pytest.skip(f"{_pkg} is not installed (`make test` installs the pinned HF_EXTRAS)", allow_module_level=True)

pytestmark = pytest.mark.timeout(300)

WORLD = 2
STEPS = 3


class _Tokens(torch.utils.data.Dataset):
    """``n`` fixed random sequences (language modelling: the labels are the inputs)."""

    def __init__(self, n: int, seed: int = 0):
        self.ids = torch.randint(0, 64, (n, 8), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _WithUnusedHead(torch.nn.Module):
    """A GPT-2 and a head that no forward uses (a multi-task model trained on one task)."""

    def __init__(self):
        super().__init__()
        self.lm = tiny_gpt2()
        self.unused = torch.nn.Linear(16, 4)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict:
        return {"loss": self.lm(input_ids=input_ids, labels=labels).loss}


def _trainer(kind: str, out: str, model=None, fastcoll=None, **overrides):
    """A plain Trainer (``kind="torch"``) or a FastCollTrainer over the tiny GPT-2 and 32 sequences."""
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    from fastcoll.integrations.transformers import FastCollTrainer

    AcceleratorState._reset_state()  # each Trainer sets up its own accelerator state (the process group stays)
    settings = dict(output_dir=out, per_device_train_batch_size=2, per_device_eval_batch_size=2,
                    gradient_accumulation_steps=2, max_grad_norm=0.05, learning_rate=1e-2, weight_decay=0.01,
                    lr_scheduler_type="cosine", warmup_steps=1, max_steps=STEPS, optim="adamw_torch", use_cpu=True,
                    ddp_backend="gloo", ddp_find_unused_parameters=False, report_to=[], save_strategy="no",
                    logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0)  # fmt: skip
    settings.update(overrides)
    args = TrainingArguments(**settings)
    extra = {} if kind == "torch" else {"fastcoll": fastcoll}
    cls = Trainer if kind == "torch" else FastCollTrainer
    return cls(model=model if model is not None else tiny_gpt2(), args=args, train_dataset=_Tokens(32),
               eval_dataset=_Tokens(8, seed=1), **extra)  # fmt: skip


def _weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _check_resume(kind: str, tmp: str, fastcoll=None) -> "object":
    """Train with a checkpoint at step 2, resume a fresh Trainer from it: bitwise the uninterrupted weights."""
    import os

    full = _trainer(kind, os.path.join(tmp, kind), fastcoll=fastcoll, save_strategy="steps", save_steps=2)
    full.train()
    resumed = _trainer(kind, os.path.join(tmp, kind + "_resumed"), model=tiny_gpt2(seed=7), fastcoll=fastcoll)
    resumed.train(resume_from_checkpoint=os.path.join(tmp, kind, "checkpoint-2"))
    compare_states(_weights(resumed.model), _weights(full.model), f"{kind}: resumed from checkpoint-2", exact=True)
    return full


def _ddp_worker(rank: int, world_size: int, tmp: str) -> None:
    import os

    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    from transformers import GPT2LMHeadModel

    import fastcoll
    from fastcoll.integrations.accelerate import FastCollAccelerator

    torchrun_env(rank, world_size)
    runs = {}
    for kind in ("torch", "fastcoll"):
        trainer = _trainer(kind, os.path.join(tmp, "run_" + kind))
        trainer.train()
        wrapper = type(trainer.model_wrapped)
        assert wrapper is (TorchDDP if kind == "torch" else fastcoll.DDP), (kind, wrapper)
        runs[kind] = (trainer, _weights(trainer.model), trainer.evaluate())
    assert isinstance(runs["fastcoll"][0].accelerator, FastCollAccelerator)
    compare_states(runs["fastcoll"][1], runs["torch"][1], f"weights after {STEPS} steps", exact=True)
    assert runs["fastcoll"][2]["eval_loss"] == runs["torch"][2]["eval_loss"], (runs["fastcoll"][2], runs["torch"][2])

    # save_model + from_pretrained
    trainer = runs["fastcoll"][0]
    trainer.save_model(os.path.join(tmp, "saved"))
    trainer.accelerator.wait_for_everyone()
    loaded = GPT2LMHeadModel.from_pretrained(os.path.join(tmp, "saved"))
    compare_states(_weights(loaded), runs["fastcoll"][1], "from_pretrained(save_model)", exact=True)

    _check_resume("fastcoll", tmp)


def test_trainer_fastcoll_ddp_matches_torch_ddp(tmp_path):
    """Trainer on fastcoll.DDP: accumulation, max_grad_norm, cosine: bitwise torch DDP; evaluate, save_model, resume."""
    run_ranks(_ddp_worker, WORLD, str(tmp_path), timeout=270, pg_timeout=60)


def _sharded_worker(rank: int, world_size: int, tmp: str, grads: str) -> None:
    import os

    import fastcoll
    from fastcoll.integrations.accelerate import FastCollKwargs

    torchrun_env(rank, world_size)
    pool = grads.endswith("-pool")  # ZeRO-2: gradient buffers from a pool
    grads = grads.removesuffix("-pool")
    options = FastCollKwargs(sharded_optimizer=True, grads=grads, grad_buffers="pool" if pool else "persistent")
    torch_run = _check_resume("torch", tmp)
    fast_run = _check_resume("fastcoll", tmp, fastcoll=options)
    assert isinstance(fast_run.optimizer.optimizer, fastcoll.ShardedOptimizer), type(fast_run.optimizer.optimizer)
    assert (fast_run.optimizer.optimizer.grad_pool is not None) == pool
    compare_states(
        _weights(fast_run.model), _weights(torch_run.model), f"grads={grads}: weights after {STEPS} steps", exact=False
    )
    # The checkpoint's optimizer.pt is the plain AdamW state dict, as the torch DDP run's.
    got = torch.load(os.path.join(tmp, "fastcoll", "checkpoint-2", "optimizer.pt"), weights_only=True)
    want = torch.load(os.path.join(tmp, "torch", "checkpoint-2", "optimizer.pt"), weights_only=True)
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"])
    for i, st in want["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(got["state"][i][k], v, rtol=2e-5, atol=1e-7, msg=lambda m: f"state {i} {k}: {m}")


@pytest.mark.parametrize("grads", ["full", "sharded", "sharded-pool"])
def test_trainer_sharded_optimizer_matches_torch_ddp(tmp_path, grads):
    """FastCollTrainer with the sharded optimizer vs the plain Trainer; its checkpoint is the plain optimizer's."""
    run_ranks(_sharded_worker, WORLD, str(tmp_path), grads, timeout=270, pg_timeout=60)


def _unused_worker(rank: int, world_size: int, tmp: str) -> None:
    import os

    torchrun_env(rank, world_size)
    weights = {}
    for kind in ("torch", "fastcoll"):
        trainer = _trainer(kind, os.path.join(tmp, kind), model=_WithUnusedHead(), ddp_find_unused_parameters=True)
        assert trainer.accelerator.ddp_handler.find_unused_parameters
        before = trainer.model.unused.weight.detach().clone()
        trainer.train()
        assert trainer.model_wrapped.find_unused_parameters
        assert torch.equal(trainer.model.unused.weight, before), f"{kind}: the unused head changed"
        weights[kind] = _weights(trainer.model)
    compare_states(weights["fastcoll"], weights["torch"], "unused head: weights", exact=True)

    # FSDP asked of the Trainer: refused (on CPU accelerate would ignore it; on GPUs fastcoll would be bypassed).
    with pytest.raises(ValueError, match="TrainingArguments.fsdp.* is configured"):
        _trainer("fastcoll", os.path.join(tmp, "fsdp"), fsdp="full_shard")
    os.environ.pop("ACCELERATE_USE_FSDP", None)


def test_trainer_unused_head_find_unused_parameters(tmp_path):
    """ddp_find_unused_parameters=True with a head no forward uses: fastcoll.DDP as torch DDP, bitwise."""
    run_ranks(_unused_worker, WORLD, str(tmp_path), timeout=270, pg_timeout=60)
