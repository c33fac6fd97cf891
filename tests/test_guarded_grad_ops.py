"""In-place elementwise operations on guarded gradients (``p.grad`` a ``ShardedGradient``), 2 gloo ranks.

With ``ShardedOptimizer(grads="sharded")`` or float32 main gradients, ``p.grad``
stands for values held elsewhere. ``clamp_`` (``torch.nn.utils.clip_grad_value_``,
both its foreach and per-tensor routes), ``div_``, ``mul_`` and ``nan_to_num_``
with scalar operands act on those values; the parameters after the steps must
be those of the same operation applied where the values are plainly visible:

* float32, ``grads="sharded"``: torch DDP + the plain torch optimizer with the
  operation on its ``.grad`` (bitwise at 2 ranks);
* bfloat16 with float32 main gradients, ``grads="full"``: the same fastcoll
  model with the operation applied to ``ddp.main_grad(p)`` (the documented view
  of the float32 main gradient), bitwise;
* bfloat16 with main gradients, ``grads="sharded"``: the ``grads="full"`` run
  with the operation on ``p.grad`` (the sums of two ranks are the same either way).

An operand shaped like the gradient cannot be applied to a rank's range of it:
refused with an error that names fastcoll, on every rank, before anything changes.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List

import pytest
import torch
from multiproc import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastcoll

pytestmark = pytest.mark.timeout(300)

BF16 = torch.bfloat16
GLOBAL = 8
STEPS = 3


class Net(nn.Module):
    """Two 16-bit layers (``bf16``) and a float32 head; sizes that straddle the ranks' ranges."""

    def __init__(self, bf16: bool):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(5, 9)
        self.b = nn.Linear(9, 7)
        self.head = nn.Linear(7, 3)
        self.low = BF16 if bf16 else torch.float32
        self.a.to(self.low)
        self.b.to(self.low)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.b(torch.tanh(self.a(x.to(self.low)))))
        return self.head(h.float())


def _batch(step: int, rank: int, world: int) -> torch.Tensor:
    x = torch.randn(GLOBAL, 5, generator=torch.Generator().manual_seed(100 + step)) * 3
    if step == 1:  # a non-finite input: non-finite gradients for nan_to_num_
        x[0, 2] = math.inf
    n = GLOBAL // world
    return x[rank * n : (rank + 1) * n]


# name -> what the loop does to a list of gradients (plain or guarded) between backward and step
OPS: Dict[str, Callable[[List[torch.Tensor]], None]] = {
    "clip_value_foreach": lambda gs: (torch._foreach_clamp_min_(gs, -0.02), torch._foreach_clamp_max_(gs, 0.02)),
    "clamp": lambda gs: [g.clamp_(min=-0.02, max=0.03) for g in gs],
    "div": lambda gs: [g.div_(3.0) for g in gs],
    "div_tensor_foreach": lambda gs: torch._foreach_div_(gs, torch.tensor(3.0)),
    "mul_per_tensor_foreach": lambda gs: torch._foreach_mul_(gs, [0.5 + k for k in range(len(gs))]),
    "nan_to_num": lambda gs: [torch.nan_to_num_(g, nan=0.0, posinf=0.5, neginf=-0.5) for g in gs],
}


def _train(impl: str, grads: str, bf16: bool, op: str, on_main: bool, rank: int, world: int) -> List[torch.Tensor]:
    model = Net(bf16)
    if impl == "torch":
        ddp = TorchDDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    else:
        ddp = fastcoll.DDP(model, main_grad_dtype=torch.float32 if bf16 else None, bucket_cap_mb=0.0002)
        inner = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        opt = fastcoll.ShardedOptimizer(inner, ddp, grads=grads, master_dtype=torch.float32 if bf16 else None)
    for step in range(STEPS):
        opt.zero_grad()
        x = _batch(step, rank, world)
        if op != "nan_to_num" and step == 1:
            x = torch.nan_to_num(x, posinf=1.0)
        ddp(x).pow(2).mean().backward()
        params = list(model.parameters())
        if on_main:  # the values in the open: main gradients of the 16-bit layers, .grad of the float32 head
            gs = [ddp.main_grad(p) if p.dtype == BF16 else p.grad for p in params]
        else:
            gs = [p.grad for p in params]
        if op == "clip_value":
            torch.nn.utils.clip_grad_value_(params, 0.02, foreach=False)
        else:
            OPS[op](gs)
        opt.step()
    if impl != "torch":
        opt.finish_param_sync()
        ddp.close()
    return [p.detach().float().clone() for p in model.parameters()]


def equal_worker(rank: int, world: int) -> Dict[str, List[str]]:
    """Per case, the parameters that differ from the reference (none expected)."""
    out = {}
    for op in ["clip_value", *OPS]:
        cases = {
            "fp32 sharded": (_train("fastcoll", "sharded", False, op, False, rank, world),
                             _train("torch", "full", False, op, False, rank, world)),
            "bf16 full": (_train("fastcoll", "full", True, op, False, rank, world),
                          _train("fastcoll", "full", True, op, True, rank, world)),
        }  # fmt: skip
        cases["bf16 sharded"] = (_train("fastcoll", "sharded", True, op, False, rank, world), cases["bf16 full"][0])
        for name, (got, want) in cases.items():
            out[f"{op}, {name}"] = [str(i) for i, (g, w) in enumerate(zip(got, want)) if not torch.equal(g, w)]
    return out


def test_elementwise_operations_act_on_the_values_the_guards_stand_for():
    for rank_out in run_ranks(equal_worker, 2, timeout=240):
        assert {k: v for k, v in rank_out.items() if v} == {}


def refusal_worker(rank: int, world: int) -> Dict[str, str]:
    """Each refusal's message, and whether the gradients were left as they were."""
    model = Net(False)
    ddp = fastcoll.DDP(model, bucket_cap_mb=0.0002)
    opt = fastcoll.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), ddp, grads="sharded")
    ddp(_batch(0, rank, world)).pow(2).mean().backward()
    w = model.a.weight
    attempts = {
        "mul_ by a tensor": lambda: w.grad.mul_(torch.full_like(w, 2.0)),
        "foreach div_ by tensors": lambda: torch._foreach_div_([w.grad], [torch.full_like(w, 2.0)]),
        "clamp_ by tensors": lambda: w.grad.clamp_(min=torch.zeros_like(w)),
        "a guard as operand": lambda: torch.ones_like(w).mul_(w.grad),
    }
    out = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            out[name] = "accepted"
        except RuntimeError as e:
            out[name] = str(e)
    before = [p.detach().clone() for p in model.parameters()]
    ref = TorchDDP(Net(False))
    ref(_batch(0, rank, world)).pow(2).mean().backward()
    torch.optim.SGD(ref.module.parameters(), lr=0.1).step()
    opt.step()  # the refused calls changed nothing: the step is torch's
    opt.finish_param_sync()
    out["step unchanged"] = str(all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.module.parameters())))
    out["parameters moved"] = str(any(not torch.equal(a, b) for a, b in zip(model.parameters(), before)))
    ddp.close()
    return out


def test_operands_shaped_like_the_gradient_are_refused():
    for out in run_ranks(refusal_worker, 2, timeout=120):
        assert out.pop("step unchanged") == "True" and out.pop("parameters moved") == "True"
        for name, message in out.items():
            assert "fastcoll" in message and "a.weight" in message, (name, message)


# --------------------------------------------------------------------------- GradScaler's verdict


def scaler_worker(rank: int, world: int, case: str) -> List[float]:
    """An overflow in one gradient element on rank 1 only, at step 2, under torch's GradScaler.

    The loop maps non-finite gradients to finite ones before ``unscale_``: ``sanitized`` with ``nan_to_num_``,
    ``clamped`` with ``clip_grad_value_``. torch's check then finds nothing and steps: no step is skipped under
    torch DDP, and every rank must do the same under fastcoll (whose ranks saw the overflow in the reduction).
    """
    out = []
    for impl in ("fastcoll", "torch"):
        model = Net(False)
        inner = torch.optim.AdamW(model.parameters(), lr=0.01)
        if impl == "torch":
            ddp, opt = TorchDDP(model), inner
        else:
            ddp = fastcoll.DDP(model, bucket_cap_mb=0.0002)
            opt = fastcoll.ShardedOptimizer(inner, ddp, grads="sharded")
        now = {"step": 0}

        def overflow(g: torch.Tensor) -> torch.Tensor:
            if now["step"] != 2 or rank != 1:
                return g
            g = g.clone()
            g.view(-1)[-1] = math.inf
            return g

        model.a.weight.register_hook(overflow)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
        scales = []
        for step in range(4):
            now["step"] = step
            opt.zero_grad()
            scaler.scale(ddp(_batch(0, rank, world)).pow(2).mean()).backward()
            if case == "sanitized":
                for p in model.parameters():
                    torch.nan_to_num_(p.grad, posinf=1.0)
            else:
                torch.nn.utils.clip_grad_value_(model.parameters(), 100.0)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        if impl == "fastcoll":
            opt.finish_param_sync()
            ddp.close()
        out.append((scales, [p.detach().clone() for p in model.parameters()]))
    (s_ours, p_ours), (s_ref, p_ref) = out
    assert s_ours == s_ref, (s_ours, s_ref)
    assert all(torch.equal(a, b) for a, b in zip(p_ours, p_ref))
    return s_ours


@pytest.mark.parametrize("case", ["sanitized", "clamped"])
def test_grad_scaler_checks_what_torch_checks_on_every_rank(case):
    scales = run_ranks(scaler_worker, 2, case, timeout=120)
    assert scales[0] == scales[1] and scales[0] == sorted(scales[0]), scales  # no step skipped: the scale only grew


# --------------------------------------------------------------------------- whole main gradients


def _unitwise_norm(x: torch.Tensor) -> torch.Tensor:
    return x.norm(2) if x.ndim <= 1 else x.norm(2, dim=tuple(range(1, x.ndim)), keepdim=True)


def _adaptive_clip(params: List[torch.Tensor], grad_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """timm's adaptive gradient clipping (``timm.utils.agc.adaptive_clip_grad``), reading gradients with ``grad_of``."""
    for p in params:
        g = grad_of(p).detach()
        max_norm = _unitwise_norm(p.detach()).clamp_(min=1e-3).mul_(0.01)
        grad_norm = _unitwise_norm(g)
        clipped = g * (max_norm / grad_norm.clamp(min=1e-6))
        grad_of(p).detach().copy_(torch.where(grad_norm < max_norm, g, clipped))


def whole_worker(rank: int, world: int) -> Dict[str, bool]:
    """bf16 with float32 main gradients and grads="full": every rank holds whole gradients, so any operation on
    ``p.grad`` runs on the float32 main gradient, as ``ddp.main_grad(p)`` shows it (reads, copy_, a full-shaped
    operand, norms along dimensions); a change of shape is refused. With grads="sharded" the same reads raise."""
    out: Dict[str, bool] = {}
    runs = {}
    for route in ("p.grad", "main_grad"):
        model = Net(True)
        ddp = fastcoll.DDP(model, main_grad_dtype=torch.float32, bucket_cap_mb=0.0002)
        inner = torch.optim.AdamW(model.parameters(), lr=0.01)
        opt = fastcoll.ShardedOptimizer(inner, ddp, grads="full", master_dtype=torch.float32)

        def grad_of(p: torch.Tensor) -> torch.Tensor:
            return ddp.main_grad(p) if route == "main_grad" and p.dtype == BF16 else p.grad

        for step in range(STEPS):
            opt.zero_grad()
            ddp(torch.nan_to_num(_batch(step, rank, world), posinf=1.0)).pow(2).mean().backward()
            if route == "p.grad" and step == 0:
                w, main = model.a.weight, ddp.main_grad(model.a.weight)
                out["abs().max()"] = torch.equal(w.grad.abs().max(), main.abs().max())
                out["clone()"] = torch.equal(w.grad.clone(), main) and w.grad.clone().dtype == torch.float32
                out["isfinite"] = bool(torch.isfinite(w.grad).all())
                out["norm(dim=1)"] = torch.equal(w.grad.norm(dim=1), main.norm(dim=1))
                out["view(-1)[:3]"] = torch.equal(w.grad.view(-1)[:3], main.view(-1)[:3])
                with pytest.raises(RuntimeError, match="fastcoll.*'a.weight'.*changes its shape"):
                    w.grad.t_()
            noise = torch.linspace(-1e-3, 1e-3, model.b.weight.numel()).view_as(model.b.weight)
            grad_of(model.b.weight).add_(noise)  # a full-shaped operand
            _adaptive_clip(list(model.parameters()), grad_of)
            opt.step()
        opt.finish_param_sync()
        runs[route] = [p.detach().clone() for p in model.parameters()]
        ddp.close()
    out["trained as on main_grad"] = all(torch.equal(a, b) for a, b in zip(runs["p.grad"], runs["main_grad"]))
    model = Net(True)
    ddp = fastcoll.DDP(model, main_grad_dtype=torch.float32, bucket_cap_mb=0.0002)
    opt = fastcoll.ShardedOptimizer(torch.optim.AdamW(model.parameters()), ddp, grads="sharded", master_dtype=torch.float32)
    ddp(_batch(0, rank, world)).pow(2).mean().backward()
    for name, read in {"clone": lambda g: g.clone(), "abs": lambda g: g.abs(), "norm(dim=1)": lambda g: g.norm(dim=1)}.items():
        with pytest.raises(RuntimeError, match="fastcoll.*'a.weight'.*each hold a range"):
            read(model.a.weight.grad)
            print(f"sharded {name} was not refused")
    ddp.close()
    return out


def test_whole_main_gradients_take_any_operation_ranges_refuse():
    for out in run_ranks(whole_worker, 2, timeout=120):
        assert all(out.values()), out
