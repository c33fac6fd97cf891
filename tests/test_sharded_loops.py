"""fastcoll.ShardedOptimizer driven the way libraries drive an optimizer, against torch DDP + the plain optimizer.

Each loop is written as the library writes it (read from the installed
packages), and judged as in ``tests/test_sharded_contract.py`` (same harness,
same tolerances, same bf16 reference: the fastcoll model on its canonical route):

* Lightning ``Trainer`` (automatic optimization): ``optimizer.step(closure)``
  with ``zero_grad()`` and ``torch.nn.utils.clip_grad_norm_`` over the
  parameters of ``optimizer.param_groups`` (``gradient_clip_val``) inside the
  closure (``torch.nn.utils.clip_grad_value_`` with ``gradient_clip_algorithm="value"``),
  a per-step scheduler from ``configure_optimizers``, gradient
  accumulation through the wrapper's ``no_sync``; the fastcoll run uses the
  ``fastcoll_ddp`` strategy and wraps its optimizer in ``configure_optimizers``.
* transformers' ``Trainer`` inner loop, by hand: AdamW with the decay /
  no-decay groups, ``get_cosine_schedule_with_warmup`` built on the torch
  optimizer before it is wrapped, ``model.zero_grad()`` on the wrapped model,
  micro-batches under ``no_sync``, ``Accelerator.clip_grad_norm_(model.parameters())``,
  the learning rate read from ``optimizer.param_groups[0]["lr"]``, and the
  optimizer's ``state_dict()`` taken on the main process only (``should_save``);
  also with the optimizer passed through ``accelerator.prepare`` and the
  scheduler built on the prepared one (what ``Trainer`` does with an optimizer).
* EMA after every step: ``torch.optim.swa_utils.AveragedModel`` with
  ``use_buffers=True``, the in-place update diffusers' ``EMAModel.step`` does
  over ``model.parameters()``, timm's ``ModelEmaV3`` (when timm imports).
* Gradient accumulation with ``no_sync``: with ``opt.zero_grad()`` and with
  ``model.zero_grad(set_to_none=False)``.
* Activation checkpointing (``torch.utils.checkpoint`` around a layer, reentrant
  or not, as transformers' ``gradient_checkpointing_enable`` sets it up): the
  layer's forward and its hooks run again inside the backward.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Callable, Dict, List

import pytest
import torch
from test_sharded_contract import CAPS, STEPS, Net, Obs, Run, contract_worker, judge, launch

import fastcoll

pytestmark = pytest.mark.timeout(600)

ACCUM = 2  # micro-batches per step


def micro_batch(step: int, micro: int, rank: int, world: int) -> torch.Tensor:
    """Micro-batch ``micro`` of this rank's share of ``step`` (two rows: the global batch is 2 * world rows)."""
    x = torch.randn(2 * ACCUM * world, 7, generator=torch.Generator().manual_seed(3000 + step))
    rows = x.view(world, ACCUM, 2, 7)[rank, micro]
    return rows


def accumulate(run: Run, step: int) -> None:
    """One step's micro-batches: all but the last under no_sync(); the loss divided by their number."""
    for micro in range(ACCUM):
        sync = micro == ACCUM - 1
        with contextlib.nullcontext() if sync else run.ddp.no_sync():
            loss = run.ddp(micro_batch(step, micro, run.rank, run.world)).pow(2).mean() / ACCUM
            run.losses.append(loss.detach().clone())
            loss.backward()


def finish(run: Run, obs: Obs) -> Obs:
    run.settle()
    obs["losses"] = torch.stack(run.losses)
    obs.update(run.params())
    return obs


# --------------------------------------------------------------------------- transformers' Trainer, by hand


@functools.lru_cache(maxsize=None)
def accelerator(rank: int, world: int) -> Any:
    """accelerate's Accelerator on this rank's process group (as tests/test_integrations_hf.py makes it)."""
    accelerate = pytest.importorskip("accelerate")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    return accelerate.Accelerator(cpu=True)


def hf_loop(new: Callable[..., Run], save_on_main: bool = False, prepared: bool = False) -> Obs:
    """transformers' Trainer._inner_training_loop, reduced to what it calls on the model and the optimizer.

    ``prepared``: the optimizer goes through ``accelerator.prepare`` (an AcceleratedOptimizer, which round-trips its
    state dict at construction) and the scheduler is built on that afterwards, as ``Trainer`` does with an
    optimizer it is given; otherwise the scheduler is built on the torch optimizer before the user wraps it.
    """
    transformers = pytest.importorskip("transformers")

    def schedule(opt: torch.optim.Optimizer) -> Any:
        return transformers.get_cosine_schedule_with_warmup(opt, num_warmup_steps=1, num_training_steps=STEPS)

    # create_optimizer_and_scheduler: both built before the user's code wraps the optimizer
    run = new(opt_name="adamw_no_decay_biases", before_wrap=lambda r: None if r.canonical or prepared else schedule(r.inner))
    acc = accelerator(run.rank, run.world)
    stepper = acc.prepare_optimizer(run.opt) if prepared else run.opt
    sched = schedule(stepper) if prepared or run.canonical else run.early
    obs: Obs = {}
    run.zero("wrapper")  # model.zero_grad() before the loop, and after each step
    for step in range(STEPS):
        accumulate(run, step)
        if run.canonical:
            norm = run.opt.clip_grad_norm_(0.05)
        else:  # Trainer._clip_grad_norm: accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
            norm = acc.clip_grad_norm_(run.ddp.parameters(), 0.05)
        obs[f"grad_norm{step}"] = norm.detach().clone().float()
        stepper.step()
        if not prepared or not acc.optimizer_step_was_skipped:
            sched.step()
        run.zero("wrapper")
        obs[f"lr{step}"] = torch.tensor(stepper.param_groups[0]["lr"], dtype=torch.float64)  # Trainer's logged lr
        if save_on_main and step == 1 and run.rank == 0:  # _save_optimizer_and_scheduler: if args.should_save
            sd = run.opt.state_dict()
            for k in sorted(sd["state"]):
                for key, v in sd["state"][k].items():
                    obs[f"saved{k}.{key}"] = v.detach().clone() if torch.is_tensor(v) else torch.tensor(float(v))
    return finish(run, obs)


def hf_loop_saving(new: Callable[..., Run]) -> Obs:
    return hf_loop(new, save_on_main=True)


def hf_loop_prepared(new: Callable[..., Run]) -> Obs:
    return hf_loop(new, prepared=True)


# --------------------------------------------------------------------------- EMA after every step


def ema_loop(run: Run, update: Callable[[int], None], averaged: torch.nn.Module, obs: Obs) -> Obs:
    """Steps with accumulated micro-batches, ``update(step)`` right after each step; the averaged weights at the end."""
    for step in range(STEPS):
        run.zero("opt")
        accumulate(run, step)
        run.opt.step()
        run.read_point()
        update(step)
    obs.update({f"ema.{n}": p.detach().clone() for n, p in averaged.named_parameters()})
    return finish(run, obs)


def ema_averaged_model(new: Callable[..., Run]) -> Obs:
    """AveragedModel(use_buffers=True) with an EMA updated after every step, a scheduler, accumulation."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    run = new()
    sched = torch.optim.lr_scheduler.StepLR(run.opt, step_size=1, gamma=0.7)
    ema = AveragedModel(run.model, multi_avg_fn=get_ema_multi_avg_fn(0.8), use_buffers=True)
    obs: Obs = {}

    def update(step: int) -> None:
        ema.update_parameters(run.model)
        sched.step()
        with torch.no_grad():
            obs[f"ema_out{step}"] = ema(micro_batch(99, 0, run.rank, run.world)).clone()

    return ema_loop(run, update, ema.module, obs)


def ema_diffusers_style(new: Callable[..., Run]) -> Obs:
    """The shadow update of diffusers' EMAModel.step: s.sub_((1 - decay) * (s - p)) over model.parameters()."""
    run = new()
    shadow = [p.detach().clone() for p in run.model.parameters()]
    obs: Obs = {}
    for step in range(STEPS):
        run.zero("opt")
        run.backward(step)
        run.opt.step()
        run.read_point()
        decay = min(0.9, (1 + step) / (10 + step))
        with torch.no_grad():
            for s, p in zip(shadow, run.model.parameters()):
                if p.requires_grad:
                    s.sub_((1 - decay) * (s - p))
                else:
                    s.copy_(p)
    obs.update({f"shadow{k}": s.clone() for k, s in enumerate(shadow)})
    return finish(run, obs)


def ema_timm_v3(new: Callable[..., Run]) -> Obs:
    """timm's ModelEmaV3, updated after every step (as timm's train script does)."""
    timm_utils = pytest.importorskip("timm.utils")
    run = new()
    ema = timm_utils.ModelEmaV3(run.model, decay=0.8)
    return ema_loop(run, lambda step: ema.update(run.model, step=step), ema.module, {})


# --------------------------------------------------------------------------- gradient accumulation


def _accumulation(zero: str, set_to_none: bool) -> Callable[[Callable[..., Run]], Obs]:
    def pattern(new: Callable[..., Run]) -> Obs:
        run = new(opt_name="sgd")
        for step in range(STEPS):
            run.zero(zero, set_to_none)
            accumulate(run, step)
            run.opt.step()
        return finish(run, {})

    return pattern


def _checkpointed(reentrant: bool) -> Callable[[Callable[..., Run]], Obs]:
    """Activation checkpointing around a layer (transformers' ``gradient_checkpointing_enable``: the layer's call
    recomputed in the backward, its forward hooks run again there), with and without no_sync micro-batches."""

    def pattern(new: Callable[..., Run]) -> Obs:
        run = new()
        if not run.canonical:
            run.model.reentrant = reentrant
        for step in range(STEPS):
            run.zero("opt")
            if step % 2:
                accumulate(run, step)
            else:
                run.backward(step)
            run.opt.step()
        return finish(run, {})

    return pattern


# --------------------------------------------------------------------------- Lightning's Trainer


def lightning_trainer(new: Callable[..., Run], accumulate_grad_batches: int = 1, clip_algorithm: str = "norm") -> Obs:
    """Trainer.fit with gradient_clip_val and a per-step scheduler; the fastcoll run on the fastcoll_ddp strategy.

    ``clip_algorithm="value"``: Lightning clips with ``torch.nn.utils.clip_grad_value_`` (at a value small enough
    to clamp many gradient elements).
    """
    pl = pytest.importorskip("lightning.pytorch")
    import fastcoll.integrations.lightning as fl

    impl, grads, rank, world = new.impl, new.grads, new.rank, new.world  # type: ignore[attr-defined]
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.update(NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")  # the process group exists already

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()
            self.seen: List[torch.Tensor] = []
            self.lrs: List[float] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self(batch[0]).pow(2).mean()
            self.seen.append(loss.detach().clone())
            return loss

        def on_train_batch_end(self, *args: Any) -> None:
            self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

        def configure_optimizers(self) -> Dict[str, Any]:
            opt = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)
            if impl == "fastcoll":  # the strategy has wrapped the module in fastcoll.DDP by now
                opt = fastcoll.ShardedOptimizer(opt, self.trainer.strategy.model, grads=grads)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    group = new.group  # type: ignore[attr-defined]
    if impl == "torch":
        strategy = pl.strategies.DDPStrategy(process_group=group)
    else:
        strategy = fl.UnifiedFastCollDDPStrategy(process_group=group, **CAPS)
    rows = torch.randn(2 * world * STEPS * accumulate_grad_batches, 7, generator=torch.Generator().manual_seed(77))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(rows), batch_size=2, shuffle=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        num_nodes=1,
        strategy=strategy,
        max_epochs=1,
        gradient_clip_val=0.05 if clip_algorithm == "norm" else 0.002,
        gradient_clip_algorithm=clip_algorithm,
        accumulate_grad_batches=accumulate_grad_batches,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    lit = Lit()
    trainer.fit(lit, train_dataloaders=loader)
    # What the user has once fit() returns: the module's parameters, and its state_dict() (what gets saved).
    obs: Obs = {"losses": torch.stack(lit.seen), "lrs": torch.tensor(lit.lrs, dtype=torch.float64)}
    obs["global_step"] = torch.tensor(trainer.global_step)
    obs.update({n: p.detach().clone() for n, p in lit.named_parameters()})
    try:
        obs.update({f"saved.{k}": v.clone() for k, v in lit.state_dict().items()})
    except Exception as exc:  # reported as an observation the reference lacks, so the parameters are judged too
        obs[f"lit.state_dict() raised {type(exc).__name__}: {exc}"] = torch.tensor(1)
    return obs


def lightning_trainer_accumulating(new: Callable[..., Run]) -> Obs:
    return lightning_trainer(new, accumulate_grad_batches=2)


def lightning_trainer_clip_by_value(new: Callable[..., Run]) -> Obs:
    return lightning_trainer(new, clip_algorithm="value")


# name -> (pattern, refusal allowed, rounding, bf16), as test_sharded_contract.PATTERNS
LOOPS: Dict[str, tuple] = {
    # Accelerator.clip_grad_norm_ is torch's clip over p.grad: with grads="sharded" a refusal naming fastcoll is allowed
    "hf_trainer_loop": (hf_loop, "sharded", True, True),
    # opt.state_dict() gathers every rank's state: a collective called on one rank only can only fail, loudly
    # (fastcoll.integrations.transformers saves on every rank)
    "hf_trainer_loop_saving_on_main_only": (hf_loop_saving, True, True, False),
    "hf_trainer_loop_accelerate_prepared_optimizer": (hf_loop_prepared, "sharded", True, True),
    "ema_averaged_model_every_step": (ema_averaged_model, False, False, True),
    "ema_diffusers_style_every_step": (ema_diffusers_style, False, False, True),
    "ema_timm_model_ema_v3": (ema_timm_v3, False, False, False),
    "accumulate_no_sync_opt_zero_grad": (_accumulation("opt", True), False, False, False),
    "accumulate_no_sync_module_zero_grad_keep": (_accumulation("module", False), False, False, True),
    "activation_checkpointing": (_checkpointed(False), False, False, True),
    "activation_checkpointing_reentrant": (_checkpointed(True), False, False, True),
    # gradient_clip_val: torch's clip over p.grad, allowed to refuse with grads="sharded"
    "lightning_trainer_clip_and_scheduler": (lightning_trainer, "sharded", True, False),
    "lightning_trainer_accumulate_grad_batches": (lightning_trainer_accumulating, "sharded", True, False),
    # gradient_clip_algorithm="value": torch.nn.utils.clip_grad_value_ over p.grad, elementwise: no refusal
    "lightning_trainer_clip_by_value": (lightning_trainer_clip_by_value, False, False, False),
}

CASES = [
    (name, grads, dtype)
    for name, (_, _, _, bf16) in LOOPS.items()
    for grads in ("full", "sharded")
    for dtype in (("fp32", "bf16") if bf16 else ("fp32",))
]


def loops_worker(rank: int, world: int, cases: List[tuple]) -> Dict[tuple, tuple]:
    return contract_worker(rank, world, cases, table=LOOPS)


@functools.lru_cache(maxsize=None)
def results(world: int) -> Dict[tuple, Any]:
    return launch(loops_worker, world, CASES)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_loop(case, world):
    judge(results(world)[case])
