"""fastcoll.DDP and fastcoll.ShardedOptimizer are freed by reference counting alone, as torch's own objects are.

PyTorch's ``test_no_cyclic_references`` (test/optim/test_lrscheduler.py)
deletes an optimizer with the garbage collector disabled and expects nothing
left for ``gc.collect()``. Here, on 1, 2 and 3 gloo ranks, each case builds a
``fastcoll.DDP`` and a ``ShardedOptimizer`` (both gradient modes, float32 and
bfloat16 with float32 main gradients and masters, with and without the
all-gather overlapping the next forward), trains 2 steps (LR scheduler on
the wrapper, ``clip_grad_norm_``, ``state_dict()``) with the collector
disabled, deletes everything, and asserts:

* weak references to the optimizer, the wrapped torch optimizer, the DDP,
  its reducer and the reducer's parts (kept gradients, parameter all-gather)
  are dead at once, without ``gc.collect()``;
* ``gc.collect()`` with ``gc.DEBUG_SAVEALL`` then finds no fastcoll object.

A control case closes one explicit cycle (the reducer pointing at its DDP)
and must be caught by the same check, so the check cannot pass vacuously.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any, Callable, Dict, List

import pytest
import torch
from multiproc import run_ranks
from torch import nn

import fastcoll

pytestmark = pytest.mark.timeout(300)

CAPS = dict(bucket_cap_mb=0.0004, first_bucket_mb=0.0002)  # several small buckets: pieces straddle the ranges
STEPS = 2

#: name -> (grads, bfloat16 model, overlap_param_gather, keep the inner module (how it is read first), control cycle)
CASES: Dict[str, tuple] = {
    "full-fp32": ("full", False, False, False, False),
    "sharded-fp32": ("sharded", False, False, False, False),
    "full-bf16": ("full", True, False, False, False),
    "sharded-bf16": ("sharded", True, False, False, False),
    "full-fp32-overlap": ("full", False, True, False, False),
    "sharded-bf16-overlap": ("sharded", True, True, False, False),
    # The user keeps the unwrapped module and drops the wrapper and optimizer with all-gathers still pending.
    "full-fp32-overlap-keep-module": ("full", False, True, "state_dict", False),
    "sharded-fp32-overlap-keep-module": ("sharded", False, True, "forward", False),
    "control": ("full", False, False, False, True),
}


def _qualname(obj: Any) -> str:
    if callable(obj) and not isinstance(obj, type) and hasattr(obj, "__qualname__"):
        return f"{getattr(obj, '__module__', '') or ''}.{obj.__qualname__}"  # functions, methods: where defined
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def leftovers(build: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    """Run ``build`` with the garbage collector disabled, drop what it returns, and report what survives.

    ``build`` returns the objects to watch (name -> object), plus ``"kept"``: what the caller goes on holding.
    It runs twice: the first run, with the collector enabled, is not watched.

    Returns:
        ``alive``: the watched names still alive with reference counting alone; ``cyclic``: the fastcoll
        types (and functions) among what ``gc.collect()`` then finds unreachable; ``kept``: ``build``'s
        ``"kept"``.
    """
    build()  # once before: first uses import lazily, and a failed import attempt leaves frames in a cycle
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        objects = build()
        kept = objects.pop("kept", None)
        refs = {name: weakref.ref(obj) for name, obj in objects.items()}
        del objects
        alive = sorted(name for name, ref in refs.items() if ref() is not None)
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            gc.collect()
            cyclic = sorted({n for n in map(_qualname, gc.garbage) if n.startswith("fastcoll.")})
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    finally:
        if enabled:
            gc.enable()
    return {"alive": alive, "cyclic": cyclic, "kept": kept}


def batch(step: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(4, 7, generator=torch.Generator().manual_seed(100 * step + rank)).to(dtype)


def train(grads: str, bf16: bool, overlap: bool, keep_module: Any, control: bool, rank: int) -> Dict[str, Any]:
    """DDP + ShardedOptimizer + scheduler, ``STEPS`` steps; the objects to watch (and the module when kept)."""
    torch.manual_seed(0)
    low = torch.bfloat16 if bf16 else torch.float32
    module = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 11), nn.Tanh(), nn.Linear(11, 5)).to(low)
    model = fastcoll.DDP(module, main_grad_dtype=torch.float32 if bf16 else None, **CAPS)
    inner = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    master = torch.float32 if bf16 else None
    opt = fastcoll.ShardedOptimizer(inner, model, grads=grads, master_dtype=master, overlap_param_gather=overlap)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    for step in range(STEPS):
        opt.zero_grad()
        model(batch(step, rank, low)).float().square().mean().backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
    if not keep_module:
        opt.state_dict()  # a collective: gathers every rank's state
    if control:
        model.reducer._control_cycle = model  # type: ignore[attr-defined]
    reducer = model.reducer
    watched = dict(optimizer=opt, wrapped=inner, scheduler=sched, ddp=model, reducer=reducer)
    watched["kept_gradients"] = reducer.kept
    if keep_module:  # its hooks hold the all-gathers (pending ones are written when it is next read)
        watched["kept"] = module
    else:
        watched.update(module=module, param_gather=reducer.param_gather)
    return watched


def final_params(grads: str, bf16: bool, rank: int) -> Dict[str, torch.Tensor]:
    """The parameters after :func:`train` without overlap, for the kept-module case to compare with."""
    module = train(grads, bf16, False, True, False, rank)["kept"]
    return {k: v.clone() for k, v in module.state_dict().items()}


def cycles_worker(rank: int, world: int, names: List[str]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for name in names:
        grads, bf16, overlap, keep_module, control = CASES[name]
        got = leftovers(lambda: train(grads, bf16, overlap, keep_module, control, rank))
        module = got.pop("kept")
        if module is not None:
            # The all-gathers pending at the deletion complete when the kept module is read (its state_dict
            # pre-hook) or run (its modules' forward pre-hooks), with the values of a run that waited for them in
            # step(): bitwise.
            expected = final_params(grads, bf16, rank)
            if keep_module == "forward":
                with torch.no_grad():
                    module(batch(0, rank, torch.float32))
                state = {k: p.detach() for k, p in module.named_parameters()}  # read bypassing state_dict's hook
            else:
                state = module.state_dict()
            got["kept_module_matches"] = all(torch.equal(state[k], v) for k, v in expected.items())
            module.zero_grad()  # guarded gradients left by the deleted DDP: reset as the docs advise
            module(batch(0, rank, torch.float32)).sum().backward()  # the module trains alone, unsynchronized
            got["kept_module_trains"] = all(p.grad is not None for p in module.parameters())
        out[name] = got
    return out


def ddp_only_worker(rank: int, world: int) -> Dict[str, Any]:
    """fastcoll.DDP with a plain torch optimizer, no_sync and join: freed by reference counting after ``del``."""

    def build() -> Dict[str, Any]:
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))
        model = fastcoll.DDP(module, **CAPS)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with model.join():
            for step in range(STEPS):
                opt.zero_grad()
                with model.no_sync():
                    model(batch(step, rank, torch.float32)).sum().backward()
                model(batch(step + 10, rank, torch.float32)).sum().backward()
                opt.step()
        return dict(ddp=model, reducer=model.reducer, optimizer=opt, module=module)

    return leftovers(build)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_freed_without_the_cyclic_collector(world: int) -> None:
    names = list(CASES)
    results = run_ranks(cycles_worker, world, names, timeout=240)
    for rank, per_case in enumerate(results):
        for name in names:
            got = per_case[name]
            where = f"rank {rank} of {world}, case {name}"
            if CASES[name][4]:  # the control: the same check must see the cycle it closes
                assert {"ddp", "reducer"} <= set(got["alive"]), f"{where}: control cycle not detected: {got}"
                assert {"fastcoll.ddp.wrapper.DDP", "fastcoll.reducer.core.Reducer"} <= set(got["cyclic"]), where
                continue
            assert got["alive"] == [], f"{where}: alive after del without gc.collect(): {got['alive']}"
            assert got["cyclic"] == [], f"{where}: fastcoll objects in reference cycles: {got['cyclic']}"
            if CASES[name][3]:
                assert got["kept_module_matches"], f"{where}: the pending all-gathers were not written into the module"
                assert got["kept_module_trains"], where


def test_ddp_alone_freed_without_the_cyclic_collector() -> None:
    for rank, got in enumerate(run_ranks(ddp_only_worker, 2, timeout=120)):
        assert got["alive"] == [] and got["cyclic"] == [], f"rank {rank}: {got}"


def test_orphaned_guard_names_fastcoll() -> None:
    """A guarded ``.grad`` whose DDP was deleted refuses with fastcoll's advice (its values were freed with it)."""
    run_ranks(orphan_worker, 1, timeout=120)


def orphan_worker(rank: int, world: int) -> None:
    torch.manual_seed(0)
    module = nn.Linear(7, 5)
    model = fastcoll.DDP(module, **CAPS)
    opt = fastcoll.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, grads="sharded")
    opt.zero_grad()
    model(batch(0, rank, torch.float32)).sum().backward()
    ref = weakref.ref(model)
    del model, opt
    assert ref() is None
    with pytest.raises(ReferenceError, match=r"fastcoll: this \.grad belongs to a fastcoll\.DDP that was deleted"):
        module.weight.grad.zero_()
    module.zero_grad()  # the advice works
    assert module.weight.grad is None
