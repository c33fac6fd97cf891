"""The contract of fastcoll.ShardedOptimizer, entry by entry, against torch DDP + the plain torch optimizer.

A ``ShardedOptimizer`` must be usable by any torch code as the optimizer it
wraps: each entry below (a *pattern*: what torch code does with an optimizer,
its parameters and its gradients) either behaves exactly as under torch DDP +
the plain torch optimizer, or raises, on every rank, an error that names
fastcoll. A silent difference fails.

How each case is judged:

* float32 (``fp32``): the pattern runs twice in the same rank process, once
  on torch DDP + the plain torch optimizer, once on fastcoll.DDP +
  ShardedOptimizer(grads=...), same seeds, same data; what the pattern
  observes (losses, parameters, norms, hook calls, state) must be bitwise
  equal at 2 ranks, within rtol 1e-6 (absolute floor 1e-6 of the largest
  value) at 3 ranks, or where the pattern itself sums in another order
  (``ROUNDING``: norms).
* bfloat16 with float32 main gradients and float32 masters (``bf16``): torch
  has no equivalent, so the reference is the same fastcoll model driven the
  way ``tests/test_main_grads.py`` verifies against a float32 reference (the
  *canonical route*: ``opt.zero_grad()``, ``opt.clip_grad_norm_``, schedulers
  built on the wrapper, ``opt.finish_param_sync()`` before reading the
  parameters); the pattern's route must give the same observations.

The cases run batched: one launch of ranks per (world size, chunk of
patterns), each case on a fresh process group so that a case that leaves a
collective unfinished on one rank cannot break the next; every rank reports
its outcome and the test of each case asserts on the ranks' reports.
"""

from __future__ import annotations

import copy
import datetime
import functools
import os
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist
from multiproc import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastcoll

pytestmark = pytest.mark.timeout(600)

BF16 = torch.bfloat16
GLOBAL_BATCH = 6  # 2 and 3 ranks get whole chunks
STEPS = 4
CAPS = dict(bucket_cap_mb=0.0004, first_bucket_mb=0.0002)  # ~100-element buckets: parameters straddle the ranges


# --------------------------------------------------------------------------- the model and one training run


class Net(nn.Module):
    """Odd sizes, a frozen layer, a forward that calls its modules out of registration order.

    ``bf16``: every layer but the head in bfloat16 (main gradients and masters in float32 under fastcoll).
    """

    def __init__(self, bf16: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(7, 13)
        self.mid = nn.Linear(13, 11)
        self.frozen = nn.Linear(7, 11)
        self.frozen.requires_grad_(False)
        self.side = nn.Linear(7, 11)
        self.out = nn.Linear(11, 5)
        self.low = BF16 if bf16 else torch.float32
        for m in (self.emb, self.mid, self.frozen, self.side):
            m.to(self.low)
        #: ``use_reentrant`` of torch.utils.checkpoint around ``mid`` (None: no activation checkpointing)
        self.reentrant: Optional[bool] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.low)
        s = self.side(x) + self.frozen(x)
        h = torch.tanh(self.emb(x))
        if self.reentrant is None:
            m = self.mid(h)
        else:  # the module's own call is recomputed in the backward: its hooks run again there
            m = torch.utils.checkpoint.checkpoint(self.mid, h, use_reentrant=self.reentrant)
        return self.out(torch.tanh(m + s).float())


def batch(step: int, rank: int, world: int) -> torch.Tensor:
    """This rank's chunk of the global batch of ``step``."""
    x = torch.randn(GLOBAL_BATCH, 7, generator=torch.Generator().manual_seed(1000 + step))
    n = GLOBAL_BATCH // world
    return x[rank * n : (rank + 1) * n]


def make_optimizer(name: str, params: List[nn.Parameter]) -> torch.optim.Optimizer:
    if name == "adamw_no_decay_biases":  # the two groups transformers' Trainer builds
        return torch.optim.AdamW(
            [{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
             {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}], lr=0.01
        )  # fmt: skip
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


class Run:
    """One model, wrapper and optimizer as a user builds them; ``impl`` "torch" (reference) or "fastcoll".

    ``canonical`` (bf16 reference only): the helpers below take fastcoll's own route instead of the pattern's.
    """

    def __init__(
        self,
        impl: str,
        grads: str,
        bf16: bool,
        rank: int,
        world: int,
        group: Any,
        canonical: bool = False,
        opt_name: str = "adamw",
        overlap: Optional[bool] = None,
        before_wrap: Optional[Callable[["Run"], Any]] = None,
        leave_out: str = "",
        find_unused: bool = False,
    ):
        self.impl, self.grads, self.bf16, self.rank, self.world = impl, grads, bf16, rank, world
        self.canonical = canonical
        self.model = Net(bf16)
        if impl == "torch":
            self.ddp = TorchDDP(self.model, process_group=group, find_unused_parameters=find_unused)
        else:
            main = torch.float32 if bf16 else None
            self.ddp = fastcoll.DDP(
                self.model, process_group=group, main_grad_dtype=main, find_unused_parameters=find_unused, **CAPS
            )
        params = [p for n, p in self.model.named_parameters() if not (leave_out and n.startswith(leave_out))]
        self.inner = make_optimizer(opt_name, params)
        self.early = before_wrap(self) if before_wrap is not None else None  # e.g. a scheduler on the inner optimizer
        if impl == "torch":
            self.opt = self.inner
        else:
            kw = {} if overlap is None else {"overlap_param_gather": overlap}
            self.opt = fastcoll.ShardedOptimizer(
                self.inner, self.ddp, grads=grads, master_dtype=torch.float32 if bf16 else None, **kw
            )
        self.losses: List[torch.Tensor] = []

    # --------------------------------------------------------------- what every loop does

    def backward(self, step: int, scaler: Any = None) -> torch.Tensor:
        loss = self.ddp(batch(step, self.rank, self.world)).pow(2).mean()
        self.losses.append(loss.detach().clone())
        (loss if scaler is None else scaler.scale(loss)).backward()
        return loss

    def group_params(self) -> List[torch.Tensor]:
        """The parameters of ``opt.param_groups``, as Lightning's and accelerate's clipping collect them."""
        return [p for g in self.opt.param_groups for p in g["params"]]

    def settle(self) -> None:
        """Make the parameters current the way fastcoll documents it today (a no-op on torch)."""
        finish = getattr(self.opt, "finish_param_sync", None)
        if finish is not None:
            finish()

    def params(self) -> Dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    # --------------------------------------------------------------- a pattern's step, or the canonical one

    def zero(self, how: str, set_to_none: bool = True) -> None:
        if self.canonical or how == "opt":
            self.opt.zero_grad(set_to_none=set_to_none)
        elif how == "module":
            self.model.zero_grad(set_to_none=set_to_none)
        elif how == "wrapper":
            nn.Module.zero_grad(self.ddp, set_to_none=set_to_none)
        elif how == "ddp":  # fastcoll.DDP's own zero_grad (the kept gradients too); torch DDP's is nn.Module's
            self.ddp.zero_grad(set_to_none=set_to_none)
        elif how == "inner":
            self.inner.zero_grad(set_to_none=set_to_none)
        else:
            raise ValueError(how)

    def clip(self, max_norm: float) -> torch.Tensor:
        if self.canonical:
            return self.opt.clip_grad_norm_(max_norm)
        return torch.nn.utils.clip_grad_norm_(self.group_params(), max_norm)

    def read_point(self) -> None:
        """Right after step(): the canonical route finishes the parameters' all-gathers first."""
        if self.canonical:
            self.settle()

    def close(self) -> None:
        if self.impl == "fastcoll":
            self.settle()
            self.ddp.close()


# --------------------------------------------------------------------------- the patterns
# Each takes a factory (keyword arguments of Run -> Run) and returns its observations: name -> tensor.

Obs = Dict[str, Any]


def _train(run: Run, steps: int = STEPS, zero: str = "opt", set_to_none: bool = True, clip: Optional[float] = None,
           after_step: Optional[Callable[[Run, int], None]] = None, between: Optional[Callable[[Run, int], None]] = None,
           sched: Any = None, start: int = 0) -> Obs:  # fmt: skip
    """Steps ``start`` to ``steps - 1`` of the loop, with the pattern's calls; the losses so far and the parameters."""
    obs: Obs = {}
    for step in range(start, steps):
        if zero:
            run.zero(zero, set_to_none)
        run.backward(step)
        if clip is not None:
            obs[f"norm{step}"] = run.clip(clip).detach().clone().float()
        if between is not None:
            between(run, step)
        run.opt.step()
        if after_step is not None:
            after_step(run, step)
        if sched is not None:
            sched.step()
    run.settle()
    obs["losses"] = torch.stack(run.losses)
    obs.update(run.params())
    return obs


def p_param_groups(new: Callable[..., Run]) -> Obs:
    """opt.param_groups are the inner optimizer's group dicts, holding the model's parameters; defaults the same."""
    run = new()
    if run.canonical:  # the bf16 reference: what a plain torch optimizer's own groups are
        return {"groups_are_the_inner_ones": torch.tensor(True), "groups_hold_the_model_parameters": torch.tensor(True),
                "defaults_equal": torch.tensor(True), **_train(run)}  # fmt: skip
    shared = run.opt.param_groups is run.inner.param_groups or (
        len(run.opt.param_groups) == len(run.inner.param_groups)
        and all(a is b for a, b in zip(run.opt.param_groups, run.inner.param_groups))
    )
    model_ids = [id(p) for p in run.model.parameters()]
    held = [id(p) for p in run.group_params()]
    return {
        "groups_are_the_inner_ones": torch.tensor(bool(shared)),
        "groups_hold_the_model_parameters": torch.tensor(sorted(held) == sorted(model_ids)),
        "defaults_equal": torch.tensor(run.opt.defaults == run.inner.defaults),
        **_train(run),
    }


def _sched(kind: str, opt: torch.optim.Optimizer) -> Any:
    if kind == "cosine":  # what transformers' Trainer / get_scheduler build, usually before any wrapping
        transformers = pytest.importorskip("transformers")
        return transformers.get_cosine_schedule_with_warmup(opt, num_warmup_steps=1, num_training_steps=STEPS)
    if kind == "step":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    if kind == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 3 * s))
    if kind == "onecycle":  # also cycles AdamW's betas
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS + 1)
    raise ValueError(kind)


def _sched_pattern(kind: str, where: str) -> Callable[[Callable[..., Run]], Obs]:
    """A scheduler built on the wrapper, or on the inner optimizer before or after wrapping."""

    def pattern(new: Callable[..., Run]) -> Obs:
        if where == "before":
            run = new(before_wrap=lambda r: None if r.canonical else _sched(kind, r.inner))
        else:
            run = new()
        on_inner = where in ("before", "after") and not run.canonical
        sched = run.early if where == "before" and not run.canonical else _sched(kind, run.inner if on_inner else run.opt)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            obs = _train(run, sched=sched)
        order = [w for w in caught if "lr_scheduler.step()" in str(w.message)]
        obs["scheduler_order_warnings"] = torch.tensor(len(order))
        obs["last_lr"] = torch.tensor(sched.get_last_lr(), dtype=torch.float64)
        return obs

    return pattern


def p_inner_lr_edit(new: Callable[..., Run]) -> Obs:
    """A direct edit of the inner optimizer's param_groups[0]["lr"] between steps (the canonical: the wrapper's)."""
    run = new()

    def edit(r: Run, step: int) -> None:
        if step == 1:
            (r.opt if r.canonical else r.inner).param_groups[0]["lr"] = 0.001

    return _train(run, after_step=edit)


def _zero_pattern(how: str, set_to_none: bool) -> Callable[[Callable[..., Run]], Obs]:
    def pattern(new: Callable[..., Run]) -> Obs:
        return _train(new(opt_name="sgd"), zero=how, set_to_none=set_to_none)

    return pattern


def _zero_after_forward(how: str, set_to_none: bool) -> Callable[[Callable[..., Run]], Obs]:
    """The reset between a forward and its backward (loops that zero the gradients after computing the loss)."""

    def pattern(new: Callable[..., Run]) -> Obs:
        run = new(opt_name="sgd")
        for step in range(STEPS):
            loss = run.ddp(batch(step, run.rank, run.world)).pow(2).mean()
            run.losses.append(loss.detach().clone())
            run.zero(how, set_to_none)
            loss.backward()
            run.opt.step()
        run.settle()
        return {"losses": torch.stack(run.losses), **run.params()}

    return pattern


def _step_without_backward(how: str, set_to_none: bool) -> Callable[[Callable[..., Run]], Obs]:
    """A skipped batch: the reset, then a step with no backward before it. torch steps the zeroed gradients
    (``set_to_none=False``: AdamW's state and weight decay move) or nothing (``set_to_none=True``: no gradient).

    The bf16 reference reaches the same gradients its own way: a backward of a loss times zero, or no step.
    """

    def pattern(new: Callable[..., Run]) -> Obs:
        run = new()
        for step in range(STEPS):
            run.zero("opt")
            run.backward(step)
            run.opt.step()
            if step != 1:
                continue
            if not run.canonical:
                run.zero(how, set_to_none)
                run.opt.step()
            elif not set_to_none:
                run.zero("opt")
                (run.ddp(batch(step, run.rank, run.world)).sum() * 0).backward()
                run.opt.step()
        run.settle()
        return {"losses": torch.stack(run.losses), **run.params()}

    return pattern


def p_step_twice(new: Callable[..., Run]) -> Obs:
    """step() twice on the same gradients (no backward between): torch steps them again."""
    run = new()

    def again(r: Run, step: int) -> None:
        if step == 1:
            r.opt.step()

    return _train(run, after_step=again)


def p_plateau(new: Callable[..., Run]) -> Obs:
    """ReduceLROnPlateau on the wrapper, stepped with a metric that never improves (the lr halves every step)."""
    run = new()
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(run.opt, factor=0.5, patience=0)
    obs = _train(run, after_step=lambda r, step: sched.step(1.0))
    obs["lrs"] = torch.tensor([g["lr"] for g in run.opt.param_groups], dtype=torch.float64)
    return obs


def _local_grads(run: Run) -> List[torch.Tensor]:
    """The gradients between micro-batches: ``p.grad``; fastcoll's own route reads the float32 main gradients."""
    params = [p for p in run.model.parameters() if p.requires_grad]
    if run.canonical:
        return [run.ddp.main_grad(p) if p.dtype == BF16 else p.grad for p in params]
    return [p.grad for p in params if p.grad is not None]


def p_grad_between_micro_batches(new: Callable[..., Run]) -> Obs:
    """Gradient accumulation under no_sync: the local gradient norm read, and the local sums scaled, between
    micro-batches (torch DDP's .grad holds the local sums there)."""
    if new.bf16 and new.grads == "sharded":  # type: ignore[attr-defined]
        pytest.skip("16-bit parameters' .grad is None between micro-batches with grads='sharded' (documented)")
    run = new(opt_name="sgd")
    obs: Obs = {}
    for step in range(STEPS):
        run.zero("opt")
        with run.ddp.no_sync():
            run.backward(2 * step)
        grads = _local_grads(run)
        obs[f"local_norm{step}"] = torch.nn.utils.get_total_norm(grads).float()
        torch._foreach_mul_(grads, 0.5)
        run.backward(2 * step + 1)
        run.opt.step()
    run.settle()
    return {**obs, "losses": torch.stack(run.losses), **run.params()}


def p_no_zero_grad(new: Callable[..., Run]) -> Obs:
    """No zero_grad at all: the gradients accumulate across steps, as torch's .grad do."""
    return _train(new(opt_name="sgd"), zero="")


def _after_step_reads(read: Callable[[Run], Any]) -> Callable[[Callable[..., Run]], Obs]:
    """Reads of the parameters right after step() returns (the default overlap_param_gather)."""

    def pattern(new: Callable[..., Run]) -> Obs:
        run = new()
        seen: Obs = {}
        state: Dict[str, Any] = {}

        def after(r: Run, step: int) -> None:
            r.read_point()
            for k, v in read(r, state).items():
                seen[f"{k}@{step}"] = v

        obs = _train(run, after_step=after)
        obs.update(seen)
        return obs

    return pattern


def r_averaged_model(run: Run, state: Dict[str, Any]) -> Obs:
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    if "ema" not in state:
        state["ema"] = AveragedModel(run.model, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    state["ema"].update_parameters(run.model)
    return {f"ema.{n}": p.detach().clone() for n, p in state["ema"].module.named_parameters()}


def r_parameters_to_vector(run: Run, state: Dict[str, Any]) -> Obs:
    return {"vector": torch.nn.utils.parameters_to_vector(run.model.parameters()).detach().clone()}


def r_deepcopy(run: Run, state: Dict[str, Any]) -> Obs:
    twin = copy.deepcopy(run.model)
    with torch.no_grad():
        out = twin(batch(50, run.rank, run.world))
    return {"copy_out": out, **{f"copy.{n}": p.detach().clone() for n, p in twin.named_parameters()}}


def r_state_dict(run: Run, state: Dict[str, Any]) -> Obs:
    return {f"sd.{k}": v.detach().clone() for k, v in run.model.state_dict().items()}


def p_timm_ema(new: Callable[..., Run]) -> Obs:
    timm_utils = pytest.importorskip("timm.utils")
    run = new()
    ema = timm_utils.ModelEmaV3(run.model, decay=0.5)
    seen: Obs = {}

    def after(r: Run, step: int) -> None:
        r.read_point()
        ema.update(r.model, step=step)
        seen.update({f"ema.{n}@{step}": p.detach().clone() for n, p in ema.module.named_parameters()})

    obs = _train(run, after_step=after)
    obs.update(seen)
    return obs


def p_overlap_opt_in(new: Callable[..., Run]) -> Obs:
    """overlap_param_gather=True, explicitly: reads after the next forward are current."""
    run = new(overlap=True)
    obs: Obs = {}
    for step in range(STEPS):
        run.zero("opt")
        run.backward(step)
        if step > 0:  # after this step's forward: the previous step's update must be there
            obs[f"after_forward@{step}"] = torch.nn.utils.parameters_to_vector(run.model.parameters()).detach().clone()
        run.opt.step()
    run.settle()
    obs.update(run.params())
    return obs


def p_torch_clip(new: Callable[..., Run]) -> Obs:
    """torch.nn.utils.clip_grad_norm_ over opt.param_groups' parameters (Lightning's and accelerate's clipping)."""
    return _train(new(), clip=0.05)


def p_clip_grad_value(new: Callable[..., Run]) -> Obs:
    """torch.nn.utils.clip_grad_value_ over the model's parameters (Lightning's gradient_clip_algorithm="value")."""

    def between(r: Run, step: int) -> None:
        torch.nn.utils.clip_grad_value_(r.model.parameters(), 0.01)

    return _train(new(), between=between)


def p_grad_div(new: Callable[..., Run]) -> Obs:
    """Every p.grad divided in place by a number, a 0-dim tensor or (foreach) per tensor (a loop averaging by hand)."""

    def between(r: Run, step: int) -> None:
        grads = [p.grad for p in r.model.parameters() if p.grad is not None]
        if step % 2:
            torch._foreach_div_(grads, [float(k + 2) for k in range(len(grads))])
        else:
            for g in grads:
                g.div_(torch.tensor(4.0) if step else 4)

    return _train(new(), between=between)


def _scaler_pattern(clip: bool) -> Callable[[Callable[..., Run]], Obs]:
    """GradScaler: scale(loss).backward(); unscale_(opt); [torch's clip]; step(opt); update()."""

    def pattern(new: Callable[..., Run]) -> Obs:
        run = new()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        obs: Obs = {}
        for step in range(STEPS):
            run.zero("opt")
            run.backward(step, scaler=scaler)
            scaler.unscale_(run.opt)
            if clip:
                obs[f"norm{step}"] = run.clip(0.05).detach().clone()
            scaler.step(run.opt)
            scaler.update()
            obs[f"scale{step}"] = torch.tensor(scaler.get_scale())
        run.settle()
        obs["losses"] = torch.stack(run.losses)
        obs.update(run.params())
        return obs

    return pattern


def _trained(new: Callable[..., Run], steps: int = 2, **kw: Any) -> Run:
    run = new(**kw)
    _train(run, steps=steps)
    return run


def _state_obs(prefix: str, states: List[Dict[str, Any]]) -> Obs:
    out: Obs = {}
    for k, st in enumerate(states):
        for key, v in st.items():
            out[f"{prefix}{k}.{key}"] = v.detach().clone() if torch.is_tensor(v) else torch.tensor(float(v))
    return out


def p_state_per_param(new: Callable[..., Run]) -> Obs:
    """opt.state[p] for every model parameter: torch's value on every rank (an empty or partial dict is silent)."""
    run = _trained(new)
    states = [dict(run.opt.state[p]) for p in run.model.parameters() if p.requires_grad]
    obs = _state_obs("state", states)
    obs["params_with_state"] = torch.tensor(sum(1 for p in run.model.parameters() if run.opt.state.get(p)))
    return obs


def p_state_dict_round_trip(new: Callable[..., Run]) -> Obs:
    """opt.state_dict() then load_state_dict() of it (into the same and into a fresh optimizer), and train on."""
    run = _trained(new)
    sd = copy.deepcopy(run.opt.state_dict())
    obs = _state_obs("sd", [sd["state"][k] for k in sorted(sd["state"])])
    run.opt.load_state_dict(copy.deepcopy(sd))
    resumed = new()  # a resumed run: the model's and the optimizer's state dicts loaded before its first step
    resumed.model.load_state_dict(run.model.state_dict())
    resumed.opt.load_state_dict(sd)
    for r in (run, resumed):
        obs.update({f"{k}#{r is resumed}": v for k, v in _train(r, start=2).items()})
    return obs


def p_dcp_optimizer_state_dict(new: Callable[..., Run]) -> Obs:
    """torch.distributed.checkpoint.state_dict's get_optimizer_state_dict / set_optimizer_state_dict."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    run = _trained(new)
    osd = get_optimizer_state_dict(run.model, run.opt)
    obs: Obs = {}
    for fqn in sorted(osd["state"]):
        for key, v in osd["state"][fqn].items():
            obs[f"dcp.{fqn}.{key}"] = v.detach().clone() if torch.is_tensor(v) else torch.tensor(float(v))
    obs["dcp_groups_lr"] = torch.tensor([g["lr"] for g in osd["param_groups"]], dtype=torch.float64)
    set_optimizer_state_dict(run.model, run.opt, copy.deepcopy(osd))
    obs.update(_train(run, start=2))
    return obs


def p_step_closure(new: Callable[..., Run]) -> Obs:
    run = new()
    losses = []
    for step in range(STEPS):

        def closure(step: int = step) -> torch.Tensor:
            run.zero("opt")
            return run.backward(step)

        losses.append(run.opt.step(closure).detach().clone())
    run.settle()
    return {"closure_losses": torch.stack(losses), **run.params()}


def p_step_hooks(new: Callable[..., Run]) -> Obs:
    """register_step_pre_hook / register_step_post_hook: called with the optimizer; the post hook sees the update."""
    run = new()
    calls: Obs = {"pre": 0, "post": 0, "bad_self": 0}
    seen: Obs = {}

    def pre(opt: Any, args: Any, kwargs: Any) -> None:
        calls["pre"] += 1
        calls["bad_self"] += opt is not run.opt

    def post(opt: Any, args: Any, kwargs: Any) -> None:
        calls["post"] += 1
        calls["bad_self"] += opt is not run.opt
        if run.canonical:
            run.settle()
        seen[f"in_post_hook@{calls['post']}"] = torch.nn.utils.parameters_to_vector(run.model.parameters()).detach().clone()

    run.opt.register_step_pre_hook(pre)
    run.opt.register_step_post_hook(post)
    obs = _train(run)
    obs.update(seen)
    obs.update({k: torch.tensor(v) for k, v in calls.items()})
    return obs


def p_state_dict_hooks(new: Callable[..., Run]) -> Obs:
    """The four state-dict hooks: called once each, the post hook's returned dict is what state_dict() returns."""
    run = _trained(new)
    calls = {"sd_pre": 0, "sd_post": 0, "load_pre": 0, "load_post": 0}

    def sd_pre(opt: Any) -> None:
        calls["sd_pre"] += 1

    def sd_post(opt: Any, sd: Dict[str, Any]) -> Dict[str, Any]:
        calls["sd_post"] += 1
        sd["marker"] = 7
        return sd

    def load_pre(opt: Any, sd: Dict[str, Any]) -> Dict[str, Any]:
        calls["load_pre"] += 1
        sd = dict(sd)
        sd.pop("marker", None)
        return sd

    def load_post(opt: Any) -> None:
        calls["load_post"] += 1

    run.opt.register_state_dict_pre_hook(sd_pre)
    run.opt.register_state_dict_post_hook(sd_post)
    run.opt.register_load_state_dict_pre_hook(load_pre)
    run.opt.register_load_state_dict_post_hook(load_post)
    sd = run.opt.state_dict()
    marker = sd.get("marker", 0)
    run.opt.load_state_dict(sd)
    return {"marker": torch.tensor(marker), **{k: torch.tensor(v) for k, v in calls.items()}}


def p_add_param_group(new: Callable[..., Run]) -> Obs:
    """The head joins the optimizer after construction (fine-tuning that unfreezes in stages)."""
    run = _trained(new, leave_out="out")
    run.opt.add_param_group({"params": list(run.model.out.parameters()), "lr": 0.003})
    return _train(run, start=2)


def p_requires_grad_change(new: Callable[..., Run]) -> Obs:
    """model.emb is frozen after two steps (find_unused_parameters=True, so that torch DDP accepts it)."""

    def freeze(r: Run, step: int) -> None:
        if step == 1:
            r.model.emb.requires_grad_(False)

    return _train(new(find_unused=True), after_step=freeze)


def p_grad_by_hand(new: Callable[..., Run]) -> Obs:
    """p.grad written between backward and step: scaled in place for one, replaced for another."""

    def edit(r: Run, step: int) -> None:
        r.model.mid.weight.grad.mul_(0.25)
        r.model.side.bias.grad = torch.zeros_like(r.model.side.bias)

    return _train(new(), between=edit)


def p_data_write(new: Callable[..., Run]) -> Obs:
    """p.data written between steps: a weight reset (reset_parameters) and an in-place scaling."""

    def reset(r: Run, step: int) -> None:
        if step == 1:
            r.read_point()
            torch.manual_seed(5)
            r.model.mid.reset_parameters()
            r.model.emb.weight.data.mul_(0.5)

    return _train(new(), after_step=reset)


def p_data_swap(new: Callable[..., Run]) -> Obs:
    """p.data replaced by a new tensor between steps (a checkpoint loaded by assignment): new storage, new values."""

    def swap(r: Run, step: int) -> None:
        if step == 1:
            r.read_point()
            torch.manual_seed(6)
            w = r.model.mid.weight
            w.data = torch.randn(w.shape, dtype=w.dtype) * 0.1

    return _train(new(), after_step=swap)


def p_profiled(new: Callable[..., Run]) -> Obs:
    """The loop under torch.profiler with Python tracing and memory: at each step the tracer inspects the optimizer
    that steps, looking up the state of each parameter of its param_groups (torch's own memory timeline analysis is
    left out: it fails on torch DDP itself, "version mismatch")."""
    from torch.profiler import ProfilerActivity, profile

    run = new()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True):
        return _train(run, steps=2)


# name -> (pattern, allows a loud refusal: True, "sharded" (with grads="sharded" only) or False; rounding: sums in
# another order than torch's; runs in bf16 too: only where the pattern's route differs from the canonical one, which
# is the bf16 reference (elsewhere the comparison could not fail; tests/test_main_grads.py covers those routes)
PATTERNS: Dict[str, tuple] = {
    "param_groups_are_the_inner_ones": (p_param_groups, False, False, True),
    "sched_step_on_wrapper": (_sched_pattern("step", "wrapper"), False, False, False),
    "sched_cosine_on_inner_before_wrapping": (_sched_pattern("cosine", "before"), False, False, True),
    "sched_lambda_on_inner_after_wrapping": (_sched_pattern("lambda", "after"), False, False, True),
    "sched_onecycle_on_wrapper": (_sched_pattern("onecycle", "wrapper"), False, False, False),
    "sched_onecycle_on_inner_before_wrapping": (_sched_pattern("onecycle", "before"), False, False, False),
    "inner_lr_edit": (p_inner_lr_edit, False, False, True),
    "zero_grad_module": (_zero_pattern("module", True), False, False, True),
    "zero_grad_module_keep": (_zero_pattern("module", False), False, False, True),
    "zero_grad_wrapper_module_keep": (_zero_pattern("wrapper", False), False, False, False),
    "zero_grad_module_after_forward": (_zero_after_forward("module", True), False, False, True),
    "zero_grad_module_keep_after_forward": (_zero_after_forward("module", False), False, False, True),
    # with the pool's accumulate="reduce_scatter" each micro-batch is reduced: norms of its guards are refused
    "grad_between_micro_batches": (p_grad_between_micro_batches, "sharded", True, True),
    "step_without_backward_after_zero_grad": (_step_without_backward("opt", True), False, False, True),
    "step_without_backward_after_zero_grad_keep": (_step_without_backward("opt", False), False, False, True),
    "step_without_backward_after_module_zero_grad_keep": (_step_without_backward("module", False), False, False, True),
    "step_without_backward_after_ddp_zero_grad_keep": (_step_without_backward("ddp", False), False, False, True),
    "step_twice_on_the_same_gradients": (p_step_twice, False, False, False),
    "sched_plateau_on_wrapper": (p_plateau, False, False, False),
    "zero_grad_inner": (_zero_pattern("inner", True), False, False, True),
    "zero_grad_inner_keep": (_zero_pattern("inner", False), False, False, False),
    "zero_grad_opt_keep": (_zero_pattern("opt", False), False, False, False),
    # grads="sharded" may add the step's reduced gradients in another order than torch's p.grad += reduced
    "no_zero_grad_accumulates": (p_no_zero_grad, False, True, False),
    "current_averaged_model_ema": (_after_step_reads(r_averaged_model), False, False, True),
    "current_parameters_to_vector": (_after_step_reads(r_parameters_to_vector), False, False, True),
    "current_deepcopy": (_after_step_reads(r_deepcopy), False, False, True),
    "current_model_state_dict": (_after_step_reads(r_state_dict), False, False, False),
    "current_timm_model_ema_v3": (p_timm_ema, False, False, False),
    "overlap_opt_in_current_after_forward": (p_overlap_opt_in, False, False, False),
    "clip_torch_over_param_groups": (p_torch_clip, "sharded", True, True),
    "clip_grad_value": (p_clip_grad_value, False, False, False),
    "grad_div": (p_grad_div, False, False, False),
    "grad_scaler": (_scaler_pattern(False), False, False, False),
    "grad_scaler_torch_clip": (_scaler_pattern(True), "sharded", True, False),
    "state_per_param": (p_state_per_param, True, False, False),
    "state_dict_round_trip": (p_state_dict_round_trip, True, False, False),
    "dcp_optimizer_state_dict": (p_dcp_optimizer_state_dict, True, False, False),
    "step_closure": (p_step_closure, False, False, False),
    "step_hooks": (p_step_hooks, True, False, True),
    "state_dict_hooks": (p_state_dict_hooks, True, False, False),
    "add_param_group": (p_add_param_group, True, False, False),
    "requires_grad_change": (p_requires_grad_change, True, False, False),
    "grad_by_hand": (p_grad_by_hand, "sharded", False, False),
    "data_write": (p_data_write, True, False, True),
    "data_swap": (p_data_swap, True, False, True),
    "profiled_with_python_tracing": (p_profiled, False, False, False),
}


def cases() -> List[tuple]:
    out = []
    for name, (_, _, _, bf16) in PATTERNS.items():
        for grads in ("full", "sharded"):
            for dtype in ("fp32", "bf16") if bf16 else ("fp32",):
                out.append((name, grads, dtype))
    return out


# --------------------------------------------------------------------------- judging one case


def loud(exc: BaseException) -> bool:
    """A refusal that names fastcoll (what the contract accepts in place of torch's behaviour)."""
    return "fastcoll" in f"{type(exc).__module__}.{type(exc).__name__}: {exc}"


#: Relative tolerance of a float32 case whose sums run in another order than torch's (a worker may widen it).
FP32_ROUNDING_RTOL = 1e-6


def differences(got: Obs, want: Obs, bitwise: bool, bf16_rounding: bool) -> List[str]:
    """Where ``got`` differs from ``want``: missing or extra observations, or values out of tolerance."""
    problems = []
    if sorted(got) != sorted(want):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        problems.append(f"observations differ: missing {missing[:6]}, extra {extra[:6]}")
    # Scalars first (counts, flags, learning rates, norms: they say most), then the tensors.
    for k in sorted(set(got) & set(want), key=lambda k: (want[k].numel() > 1, k)):
        a, b = got[k], want[k]
        if a.shape != b.shape or a.dtype != b.dtype:
            problems.append(f"{k}: shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
            continue
        if torch.equal(a, b):
            continue
        if bitwise or not a.is_floating_point():
            ok = False
        else:
            rtol = 2e-2 if bf16_rounding else FP32_ROUNDING_RTOL
            af, bf = a.double(), b.double()
            ok = bool(torch.allclose(af, bf, rtol=rtol, atol=rtol * float(bf.abs().max())))
        if not ok:
            diff = float((a.double() - b.double()).abs().max()) if a.is_floating_point() else None
            top = float(b.double().abs().max()) if b.is_floating_point() and b.numel() else None
            problems.append(f"{k}: max |diff| {diff} (max |ref| {top})" if diff is not None else f"{k}: {a} vs {b}")
    return problems


def _where(exc: BaseException) -> str:
    """The innermost frames of ``exc``'s traceback, in one line."""
    tb = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in tb if os.path.basename(f.filename).startswith("test_sharded_")][-1:]
    frames = ours + [f for f in tb[-2:] if f not in ours]
    return " -> ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames)


def run_case(rank: int, world: int, name: str, grads: str, dtype: str, table: Optional[Dict[str, tuple]] = None) -> tuple:
    """(status, detail) on this rank: "ok", "refused" (an error naming fastcoll), "differs", "error", "skipped".

    ``table``: the patterns (name -> (pattern, refusal allowed, rounding, bf16)); :data:`PATTERNS` by default.
    """
    pattern, refusal_ok, rounding, _ = (PATTERNS if table is None else table)[name]
    bf16 = dtype == "bf16"
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=20))

    def factory(impl: str, canonical: bool) -> Callable[..., Run]:
        def new(**kw: Any) -> Run:
            run = Run(impl, grads, bf16, rank, world, group, canonical=canonical, **kw)
            runs.append(run)
            return run

        # What a pattern that builds its own model and wrapper (a Lightning Trainer) needs to know.
        new.impl, new.grads, new.bf16, new.canonical, new.group = impl, grads, bf16, canonical, group  # type: ignore[attr-defined]
        new.rank, new.world = rank, world  # type: ignore[attr-defined]
        return new

    runs: List[Run] = []
    try:
        want = pattern(factory("fastcoll" if bf16 else "torch", bf16))
    except pytest.skip.Exception as exc:
        return "skipped", str(exc)
    except BaseException as exc:  # the reference itself must run
        return "error", f"the reference raised {type(exc).__name__}: {exc} (at {_where(exc)})"
    finally:
        for r in runs:
            r.close()
    runs = []
    try:
        got = pattern(factory("fastcoll", False))
    except BaseException as exc:
        allowed = refusal_ok is True or refusal_ok == grads
        if allowed and loud(exc):
            return "refused", f"{type(exc).__name__}: {str(exc)[:300]}"
        return "error", f"{type(exc).__name__}: {str(exc)[:300]} (at {_where(exc)})"
    finally:
        for r in runs:
            try:
                r.close()
            except BaseException:
                pass
    bitwise = world <= 2 and not rounding and not bf16
    problems = differences(got, want, bitwise, bf16 and rounding)
    return ("differs", "; ".join(problems[:4])) if problems else ("ok", "")


def contract_worker(rank: int, world: int, names: List[tuple], table: Optional[Dict[str, tuple]] = None) -> Dict[tuple, tuple]:
    """Every case of ``names`` on this rank; per case, every rank's (status, detail)."""
    out = {}
    for case in names:
        status = run_case(rank, world, *case, table=table)
        reports: List[Any] = [None] * world
        dist.all_gather_object(reports, status)  # on the default group: each case's own group may be broken
        out[case] = reports
    return out


def verdict(reports: List[tuple]) -> Optional[str]:
    """None when the case passes on every rank; else what went wrong, per rank."""
    statuses = {s for s, _ in reports}
    if statuses <= {"ok"} or statuses == {"refused"} or statuses == {"skipped"}:
        return None
    return " | ".join(f"rank {r}: {s} {d}" for r, (s, d) in enumerate(reports) if s != "ok")


# --------------------------------------------------------------------------- the tests

CASES = cases()
CHUNKS = 3  # launches per world size


def _chunk_of(case: tuple) -> int:
    return list(PATTERNS).index(case[0]) * CHUNKS // len(PATTERNS)


def launch(worker: Callable[..., Any], world: int, cases: List[tuple]) -> Dict[tuple, Any]:
    """One launch of ``world`` ranks running ``cases``: per case, the ranks' reports (or the launch's failure)."""
    try:
        per_rank = run_ranks(worker, world, cases, timeout=400, pg_timeout=60)
    except Exception as exc:  # a launch that fails fails each of its cases with its text
        return {c: f"launch failed: {type(exc).__name__}: {str(exc)[:2000]}" for c in cases}
    return per_rank[0]


def judge(res: Any) -> None:
    """Fail, skip or pass one case's test from its ranks' reports."""
    if isinstance(res, str):
        pytest.fail(res)
    if {s for s, _ in res} == {"skipped"}:
        pytest.skip(res[0][1])
    problem = verdict(res)
    assert problem is None, problem


@functools.lru_cache(maxsize=None)
def results(world: int, chunk: int) -> Dict[tuple, Any]:
    return launch(contract_worker, world, [c for c in CASES if _chunk_of(c) == chunk])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_contract(case, world):
    judge(results(world, _chunk_of(case))[case])
