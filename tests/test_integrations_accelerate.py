"""FastCollAccelerator (fastcoll.integrations.accelerate) against accelerate's own torch DDP, on 2 gloo ranks.

Each run is a hand-written accelerate loop over a tiny GPT-2 (built here, no
download, no dropout): ``accumulate()`` over 2 micro-batches, ``backward``,
``clip_grad_norm_`` at a norm that clips, AdamW and a cosine schedule built
before ``prepare()`` (accelerate's documented order). The same loop runs with
``accelerate.Accelerator`` (torch DDP, plain AdamW) and with
``FastCollAccelerator``; the weights after the run must be equal: bitwise with
fastcoll.DDP (same buckets, same reduction order), to float32 rounding with the
sharded optimizer (its clipping norm sums in float64 over ranges).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hf_helpers import compare_states, tiny_gpt2, torchrun_env
from multiproc import run_ranks

for _pkg in ("accelerate", "transformers"):
    if importlib.util.find_spec(_pkg) is None:
        pytest.skip(f"{_pkg} is not installed (`make test` installs the pinned HF_EXTRAS)", allow_module_level=True)

pytestmark = pytest.mark.timeout(300)

WORLD = 2
ACCUM = 2
STEPS = 3
MAX_NORM = 0.05  # below the tiny GPT-2's gradient norm: every step clips


def _batch(rank: int, micro: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1000 * micro + rank))


def _setup(acc, model, schedule_on: str = "torch"):
    """AdamW and a cosine schedule over ``model``, prepared.

    ``schedule_on``: ``"torch"``: the schedule is built on the torch optimizer before prepare()
    (accelerate's documented order); ``"prepared"``: on the prepared optimizer (the Trainer's order).
    """
    from transformers import get_cosine_schedule_with_warmup

    def schedule(opt):
        return get_cosine_schedule_with_warmup(opt, num_warmup_steps=1, num_training_steps=2 * STEPS * WORLD)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    if schedule_on == "prepared":
        model, opt = acc.prepare(model, opt)
        return model, opt, acc.prepare(schedule(opt))
    return acc.prepare(model, opt, schedule(opt))


def _train(acc, model, opt, sched, rank: int, steps: int, first: int = 0) -> list:
    """``steps`` optimizer steps of ACCUM micro-batches each; returns the clipping norms and mean losses seen."""
    seen = []
    for micro in range(first * ACCUM, (first + steps) * ACCUM):
        with acc.accumulate(model):
            loss = model(input_ids=_batch(rank, micro), labels=_batch(rank, micro)).loss
            acc.backward(loss)
            if acc.sync_gradients:
                norm = acc.clip_grad_norm_(model.parameters(), MAX_NORM)
                assert float(norm) > MAX_NORM, f"the norm {float(norm)} does not clip"
                seen.append(float(norm))
                seen.append(float(acc.gather_for_metrics(loss.detach()).mean()))
            opt.step()
            sched.step()
            opt.zero_grad()
    return seen


def _weights(acc, model) -> dict:
    return {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}


def _run(kind: str, rank: int, fastcoll_kwargs=None, mixed_precision: str = "no", steps: int = STEPS, schedule_on="torch"):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from fastcoll.integrations.accelerate import FastCollAccelerator

    AcceleratorState._reset_state()  # the mixed precision is fixed per process otherwise (the process group stays)
    common = dict(cpu=True, gradient_accumulation_steps=ACCUM, mixed_precision=mixed_precision)
    acc = Accelerator(**common) if kind == "torch" else FastCollAccelerator(fastcoll=fastcoll_kwargs, **common)
    model, opt, sched = _setup(acc, tiny_gpt2(), schedule_on)
    seen = _train(acc, model, opt, sched, rank, steps)
    return acc, model, opt, sched, seen


def _ddp_worker(rank: int, world_size: int, tmp: str) -> None:
    import os

    from accelerate import Accelerator
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import fastcoll
    from fastcoll.integrations.accelerate import FastCollAccelerator

    torchrun_env(rank, world_size)
    for precision in ("no", "bf16"):
        _, tmodel, _, _, tseen = _run("torch", rank, mixed_precision=precision)
        assert type(tmodel) is TorchDDP
        acc, model, opt, sched, seen = _run("fastcoll", rank, mixed_precision=precision)
        assert type(model) is fastcoll.DDP and model._is_accelerate_prepared, type(model)
        assert seen == tseen, f"{precision}: norms/losses {seen} != torch DDP's {tseen}"
        compare_states(_weights(acc, model), _weights(acc, tmodel), f"{precision}: weights after {STEPS} steps", exact=True)

    # DistributedDataParallelKwargs maps onto fastcoll.DDP; fastcoll's own options reach it too.
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    from fastcoll.integrations.accelerate import FastCollKwargs

    handler = DistributedDataParallelKwargs(bucket_cap_mb=1, find_unused_parameters=True, comm_hook=DDPCommunicationHookType.BF16)
    acc = FastCollAccelerator(
        cpu=True, kwargs_handlers=[handler], fastcoll=FastCollKwargs(stall_timeout=30.0, ddp_kwargs={"first_bucket_mb": 0.5})
    )
    m = acc.prepare(tiny_gpt2())
    assert m.find_unused_parameters and m.stall_timeout == 30.0, vars(m).keys()
    assert "bf16" in str(m._comm_hook_desc), m._comm_hook_desc
    # Frozen and evaluation-only models are not wrapped, as accelerate does not wrap them.
    frozen = tiny_gpt2().requires_grad_(False)
    assert not isinstance(acc.prepare(frozen), TorchDDP)
    assert not isinstance(acc.prepare_model(tiny_gpt2(), evaluation_mode=True), TorchDDP)
    # A model the user wrapped in fastcoll.DDP is kept (not wrapped again in torch DDP); torch DDP is refused.
    mine = fastcoll.DDP(tiny_gpt2())
    assert acc.prepare(mine) is mine
    with pytest.raises(TypeError, match="already wrapped in torch DDP"):
        acc.prepare(TorchDDP(tiny_gpt2()))

    # save_state / load_state: a run resumed from step 2 ends where the uninterrupted run ends, bitwise.
    acc, model, opt, sched, _ = _run("fastcoll", rank, steps=2)
    acc.save_state(os.path.join(tmp, "state"))
    _train(acc, model, opt, sched, rank, 1, first=2)
    want = _weights(acc, model)
    acc2 = FastCollAccelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    model2, opt2, sched2 = _setup(acc2, tiny_gpt2(seed=7))
    acc2.load_state(os.path.join(tmp, "state"))
    _train(acc2, model2, opt2, sched2, rank, 1, first=2)
    compare_states(_weights(acc2, model2), want, "resumed from save_state", exact=True)
    # save_model writes the bare model's weights
    acc2.save_model(model2, os.path.join(tmp, "model"))
    acc2.wait_for_everyone()
    import safetensors.torch

    saved = safetensors.torch.load_file(os.path.join(tmp, "model", "model.safetensors"))
    assert not any(k.startswith("module.") for k in saved)
    assert torch.equal(saved["transformer.h.0.attn.c_attn.weight"], want["transformer.h.0.attn.c_attn.weight"])
    Accelerator(cpu=True)  # leave the shared GradientState as a plain accelerator would


def test_accelerate_fastcoll_ddp_matches_torch_ddp(tmp_path):
    """fastcoll.DDP through prepare(): accumulation, clipping, cosine schedule, bf16 autocast, resume: bitwise torch DDP."""
    run_ranks(_ddp_worker, WORLD, str(tmp_path), timeout=270, pg_timeout=60)


def _sharded_worker(rank: int, world_size: int, tmp: str, grads: str, schedule_on: str) -> None:
    import os

    import fastcoll
    from fastcoll.integrations.accelerate import FastCollAccelerator, FastCollKwargs

    torchrun_env(rank, world_size)
    pool = grads.endswith("-pool")  # ZeRO-2: gradient buffers from a pool, each micro-batch reduce-scattered
    grads = grads.removesuffix("-pool")
    options = FastCollKwargs(sharded_optimizer=True, grads=grads, grad_buffers="pool" if pool else "persistent")
    _, tmodel, topt, _, tseen = _run("torch", rank)
    acc, model, opt, sched, seen = _run("fastcoll", rank, fastcoll_kwargs=options, schedule_on=schedule_on)
    assert isinstance(opt.optimizer, fastcoll.ShardedOptimizer), type(opt.optimizer)
    assert (opt.optimizer.grad_pool is not None) == pool
    torch.testing.assert_close(seen, tseen, rtol=1e-5, atol=0)
    compare_states(_weights(acc, model), _weights(acc, tmodel), f"grads={grads}: weights after {STEPS} steps", exact=False)
    # The learning rate the schedule set is the one the optimizer steps with.
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in topt.param_groups]

    # save_state writes the plain AdamW state dict (every rank computes it: a collective); load_state resumes.
    acc, model, opt, sched, _ = _run("fastcoll", rank, fastcoll_kwargs=options, steps=2, schedule_on=schedule_on)
    acc.save_state(os.path.join(tmp, "state"))
    _train(acc, model, opt, sched, rank, 1, first=2)
    want = _weights(acc, model)
    acc2 = FastCollAccelerator(cpu=True, gradient_accumulation_steps=ACCUM, fastcoll=options)
    model2, opt2, sched2 = _setup(acc2, tiny_gpt2(seed=7), schedule_on)
    acc2.load_state(os.path.join(tmp, "state"))
    _train(acc2, model2, opt2, sched2, rank, 1, first=2)
    compare_states(_weights(acc2, model2), want, "resumed from save_state", exact=True)
    # The file is a torch AdamW state dict: the plain optimizer of a 1-process run loads it.
    saved = torch.load(os.path.join(tmp, "state", "optimizer.bin"), weights_only=True)
    torch.optim.AdamW(tiny_gpt2().parameters(), lr=1e-2).load_state_dict(saved)


@pytest.mark.parametrize(
    "grads,schedule_on", [("full", "torch"), ("sharded", "torch"), ("sharded", "prepared"), ("sharded-pool", "torch")]
)
def test_accelerate_sharded_optimizer_matches_torch_ddp(tmp_path, grads, schedule_on):
    """ShardedOptimizer through prepare() vs torch DDP + plain AdamW; save_state/load_state resume.

    A schedule built on the torch optimizer before prepare() must drive the sharded optimizer (it
    shares that optimizer's param groups).
    """
    run_ranks(_sharded_worker, WORLD, str(tmp_path), grads, schedule_on, timeout=270, pg_timeout=60)


def _errors_worker(rank: int, world_size: int) -> None:
    import os

    from accelerate.utils import FullyShardedDataParallelPlugin

    from fastcoll.integrations.accelerate import FastCollAccelerator, FastCollKwargs

    torchrun_env(rank, world_size)
    with pytest.raises(ValueError, match="fsdp_plugin.* is configured.*fastcoll.DDP would not be used"):
        FastCollAccelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin())
    with pytest.raises(ValueError, match="ACCELERATE_USE_FSDP is configured"):  # the plugin's constructor set it
        FastCollAccelerator(cpu=True)
    del os.environ["ACCELERATE_USE_FSDP"]
    with pytest.raises(ValueError, match="main_grad_dtype needs sharded_optimizer"):
        FastCollKwargs(main_grad_dtype=torch.float32)
    with pytest.raises(ValueError, match="no argument bucket_cap"):
        FastCollKwargs(ddp_kwargs={"bucket_cap": 1})
    with pytest.raises(ValueError, match="grad_buffers='pool' needs sharded_optimizer"):
        FastCollKwargs(grad_buffers="pool")
    with pytest.raises(ValueError, match="pool_buffers needs sharded_optimizer"):
        FastCollKwargs(pool_buffers=1)
    acc = FastCollAccelerator(cpu=True, fastcoll=FastCollKwargs(sharded_optimizer=True))
    opt = torch.optim.AdamW(tiny_gpt2().parameters())
    with pytest.raises(ValueError, match="pass the model to prepare\\(\\) before the optimizer"):
        acc.prepare(opt)
    # The pool's arguments are the ShardedOptimizer's: refused by it at prepare(), on every rank.
    acc = FastCollAccelerator(cpu=True, fastcoll=FastCollKwargs(sharded_optimizer=True, grad_buffers="pool"))
    model = tiny_gpt2()
    with pytest.raises(ValueError, match="grad_buffers='pool' needs grads='sharded'"):
        acc.prepare(model, torch.optim.AdamW(model.parameters()))


def test_accelerate_refuses_what_would_bypass_fastcoll():
    run_ranks(_errors_worker, WORLD, timeout=270, pg_timeout=60)


def _save_two_ranks(rank: int, world_size: int, tmp: str) -> None:
    from fastcoll.integrations.accelerate import FastCollKwargs

    torchrun_env(rank, world_size)
    acc, *_ = _run("fastcoll", rank, fastcoll_kwargs=FastCollKwargs(sharded_optimizer=True, grads="sharded"), steps=2)
    acc.save_state(tmp)


def _resume_three_ranks(rank: int, world_size: int, tmp: str) -> None:
    """Resume the 2-rank sharded checkpoint at 3 ranks, with torch DDP + AdamW and with the sharded optimizer."""
    import os

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from fastcoll.integrations.accelerate import FastCollAccelerator, FastCollKwargs

    torchrun_env(rank, world_size)
    saved = torch.load(os.path.join(tmp, "optimizer.bin"), weights_only=True)
    weights = {}
    for kind in ("torch", "fastcoll"):
        AcceleratorState._reset_state()
        if kind == "torch":
            acc = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
        else:
            options = FastCollKwargs(sharded_optimizer=True, grads="sharded")
            acc = FastCollAccelerator(cpu=True, gradient_accumulation_steps=ACCUM, fastcoll=options)
        model, opt, sched = _setup(acc, tiny_gpt2(seed=7))
        acc.load_state(tmp)
        state = opt.state_dict()  # the sharded optimizer's: gathered from 3 ranks' pieces
        assert state["param_groups"] == saved["param_groups"], kind
        for i, st in saved["state"].items():
            for k, v in st.items():
                assert torch.equal(state["state"][i][k], v), f"{kind}: state {i} {k} after load_state at 3 ranks"
        _train(acc, model, opt, sched, rank, 1, first=2)
        weights[kind] = _weights(acc, model)
    compare_states(weights["fastcoll"], weights["torch"], "a step after resuming at 3 ranks", exact=False)


@pytest.mark.timeout(450)  # two launches (2 ranks, then 3)
def test_accelerate_sharded_checkpoint_resumes_at_another_world_size(tmp_path):
    """A sharded optimizer's save_state at 2 ranks resumes at 3: the state round-trips exactly, the next step is
    torch DDP + AdamW's (resumed from the same files)."""
    run_ranks(_save_two_ranks, 2, str(tmp_path), timeout=160, pg_timeout=60)
    run_ranks(_resume_three_ranks, 3, str(tmp_path), timeout=270, pg_timeout=60)


def _direct_bf16_run(rank: int, grads: str) -> tuple:
    """The same loop written against fastcoll directly: fastcoll.DDP(main_grad_dtype) + ShardedOptimizer(master_dtype),
    no_sync for the first micro-batch, the loss divided by ACCUM, the schedule stepped once per rank and step (as
    accelerate's AcceleratedScheduler does)."""
    import contextlib

    from transformers import get_cosine_schedule_with_warmup

    import fastcoll

    ddp = fastcoll.DDP(tiny_gpt2().to(torch.bfloat16), main_grad_dtype=torch.float32)
    inner = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.01)
    opt = fastcoll.ShardedOptimizer(inner, ddp, grads=grads, master_dtype=torch.float32)
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=1, num_training_steps=2 * STEPS * WORLD)
    seen = []
    for micro in range(STEPS * ACCUM):
        last = (micro + 1) % ACCUM == 0
        with contextlib.nullcontext() if last else ddp.no_sync():
            loss = ddp(input_ids=_batch(rank, micro), labels=_batch(rank, micro)).loss
            (loss / ACCUM).backward()
        if last:
            seen.append(float(opt.clip_grad_norm_(MAX_NORM)))
            opt.step()
            for _ in range(WORLD):
                sched.step()
            opt.zero_grad(set_to_none=True)
    return ddp, seen


def _bf16_worker(rank: int, world_size: int) -> None:
    from accelerate.state import AcceleratorState

    from fastcoll.integrations.accelerate import FastCollAccelerator, FastCollKwargs

    torchrun_env(rank, world_size)
    for grads in ("full", "sharded"):
        AcceleratorState._reset_state()
        options = FastCollKwargs(sharded_optimizer=True, grads=grads, main_grad_dtype=torch.float32, master_dtype=torch.float32)
        acc = FastCollAccelerator(cpu=True, gradient_accumulation_steps=ACCUM, fastcoll=options)
        model, opt, sched = _setup(acc, tiny_gpt2().to(torch.bfloat16), schedule_on="prepared")
        assert model.main_grad_dtype == torch.float32 and opt.optimizer.master_dtype == torch.float32
        seen = _train(acc, model, opt, sched, rank, STEPS)[0::2]  # the clipping norms
        direct, want = _direct_bf16_run(rank, grads)
        assert seen == want, f"grads={grads}: norms {seen} != fastcoll used directly {want}"
        got = _weights(acc, model)
        assert all(v.dtype == torch.bfloat16 for v in got.values())
        compare_states(got, _weights(acc, direct), f"grads={grads}: bf16 weights vs fastcoll used directly", exact=True)
        state = opt.state_dict()
        assert all(st["fastcoll_master"].dtype == torch.float32 for st in state["state"].values())


def test_accelerate_bf16_main_grads_and_masters_as_fastcoll_directly():
    """bf16 weights, float32 main gradients and master weights through prepare(): bitwise the same loop written
    against fastcoll.DDP + ShardedOptimizer directly (whose numerics fastcoll's own tests check), both grads modes."""
    run_ranks(_bf16_worker, WORLD, timeout=270, pg_timeout=60)
