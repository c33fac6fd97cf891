"""fastcoll.DDP under torch.compile, against torch DDP, on 2 gloo ranks.

Both wrapping orders (``DDP(torch.compile(model))`` and
``torch.compile(DDP(model))``) must train exactly like eager torch DDP, and
dynamo's DDPOptimizer must split the compiled graph at bucket boundaries as it
does for torch DDP (counted with a counting backend: one call per subgraph).
With aot_eager (one autograd node per compiled subgraph), the first bucket's
all-reduce is launched before the compiled backward has finished. With the
private torch API behind that split removed, training stays correct (one
graph, every bucket launched after its backward).

The model is a user-defined class (dynamo skips torch.nn built-ins such as
nn.Sequential as frames). Width 512: every layer holds ~1 MiB of parameters,
so a 1 MiB bucket cap gives one bucket, and one subgraph, per layer.
"""

from __future__ import annotations

import sys
import types

import ddp_models as M
import pytest
import torch
from multiproc import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastcoll
from fastcoll.ddp import compile_support as _compile_support

WIDTH, DEPTH, BATCH = 512, 4, 4
STEPS = 3
LR = 0.1


def _net() -> nn.Module:
    """DEPTH layers of WIDTH x WIDTH and a 3-way head."""
    return M.MLP(WIDTH, DEPTH)


def _counting_backend(inner: str = "eager"):
    """A dynamo backend that records each graph it is given (one per DDPOptimizer subgraph)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        if inner == "aot_eager":
            from torch._dynamo.backends.registry import lookup_backend

            return lookup_backend("aot_eager")(gm, example_inputs)
        return gm.forward

    return backend, graphs


def _compiled_backward_nodes(out: torch.Tensor) -> list:
    """The autograd nodes of the compiled (aot) subgraphs reachable from ``out``."""
    found, seen, stack = [], set(), [out.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if "CompiledFunction" in fn.name():
            found.append(fn)
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return found


def _train(rank, wrapper, order, bucket_cap_mb, backend=None, track_overlap=False):
    """STEPS SGD steps of _net() on this rank's data; returns (params, last grads, #graphs, overlap record)."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _net()
    graphs = None
    if order == "eager":
        step_model = wrapper(model, bucket_cap_mb=bucket_cap_mb)
    else:
        backend, graphs = backend or _counting_backend()
        if order == "inner":
            step_model = wrapper(torch.compile(model, backend=backend), bucket_cap_mb=bucket_cap_mb)
        else:
            step_model = torch.compile(wrapper(model, bucket_cap_mb=bucket_cap_mb), backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(100 + rank)
    record = None
    for step in range(STEPS):
        x = torch.randn(BATCH, WIDTH, generator=gen)
        opt.zero_grad(set_to_none=True)
        out = step_model(x)
        if track_overlap and step == STEPS - 1:
            # At each bucket launch, how many compiled subgraph backwards have finished.
            nodes = _compiled_backward_nodes(out)
            done = [0]
            for node in nodes:
                node.register_hook(lambda *_: done.__setitem__(0, done[0] + 1))
            reducer = step_model.reducer if order == "inner" else step_model._orig_mod.reducer
            launched = []
            # Each bucket's all-reduce is issued when the bucket launches.
            stop_listening = reducer.add_collective_listener(
                lambda c: launched.append(done[0]) if c.what.startswith("bucket") else None
            )
            record = (len(nodes), launched)
        out.square().mean().backward()
        if record is not None:
            stop_listening()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    return params, grads, None if graphs is None else len(graphs), record


def _assert_same(a, b, what):
    for i, (x, y) in enumerate(zip(a, b)):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: tensor #{i}: {m}")


def _check_against(ref, got, what):
    _assert_same(got[0], ref[0], f"{what}: parameters after {STEPS} steps")
    _assert_same(got[1], ref[1], f"{what}: gradients of the last step")


# ---------------------------------------------------------------------------
# Multi-rank workers
# ---------------------------------------------------------------------------


def parity_worker(rank, world_size):
    # An eager fastcoll.DDP does not pay for importing dynamo.
    had_dynamo = "torch._dynamo" in sys.modules
    torch.manual_seed(0)
    m = fastcoll.DDP(_net(), bucket_cap_mb=1)
    m(torch.randn(BATCH, WIDTH)).sum().backward()
    assert had_dynamo or "torch._dynamo" not in sys.modules, "an eager fastcoll.DDP forward imported torch._dynamo"
    # The active module dynamo reads is restored even when the wrapped module raises.
    with pytest.raises(RuntimeError):
        m(torch.randn(BATCH, WIDTH + 1))
    assert TorchDDP._get_active_ddp_module() is None, "fastcoll.DDP left itself active after a failed forward"

    counts = {}
    ref = _train(rank, TorchDDP, "eager", 1)
    ref_small = _train(rank, TorchDDP, "eager", 0.25)
    for order in ("inner", "outer"):
        torch_run = _train(rank, TorchDDP, order, 1)
        fc_run = _train(rank, fastcoll.DDP, order, 1)
        _check_against(ref, torch_run, f"torch DDP, {order}")  # sanity of the harness
        _check_against(ref, fc_run, f"fastcoll.DDP, {order}")
        assert torch_run[2] > 1, f"{order}: torch DDP's graph was not split ({torch_run[2]} subgraph)"
        assert fc_run[2] == torch_run[2], f"{order}: fastcoll.DDP compiled into {fc_run[2]} subgraphs, torch DDP {torch_run[2]}"
        counts[order] = fc_run[2]
        # A bucket cap below the 1 MiB first bucket: torch DDP's compile asserts on
        # it; fastcoll's graph is split as for a 1 MiB cap.
        small = _train(rank, fastcoll.DDP, order, 0.25)
        _check_against(ref_small, small, f"fastcoll.DDP, {order}, bucket_cap_mb=0.25")
        assert small[2] == torch_run[2], f"{order}, bucket_cap_mb=0.25: {small[2]} subgraphs, expected {torch_run[2]}"
    return counts


def overlap_worker(rank, world_size):
    """aot_eager: the first bucket's all-reduce starts before the compiled backward has finished."""
    ref = _train(rank, TorchDDP, "eager", 1)
    run = _train(rank, fastcoll.DDP, "inner", 1, backend=_counting_backend("aot_eager"), track_overlap=True)
    _check_against(ref, run, "fastcoll.DDP, inner, aot_eager")
    n_nodes, launched = run[3]
    assert launched, "no bucket was launched in the tracked backward"
    assert run[2] == n_nodes > 1, f"{run[2]} subgraphs compiled, {n_nodes} compiled backward nodes"
    assert launched[0] < n_nodes, f"the first bucket was launched after all {n_nodes} subgraph backwards: no overlap ({launched})"
    return run[2], launched


def _remove_private_api():
    """Make torch look like a version without DDP's active-module API (for fastcoll).

    Dynamo itself still calls ``_get_active_ddp_module``; it now always returns None.
    """
    saved = {k: TorchDDP.__dict__[k] for k in ("_get_active_ddp_module", "_active_ddp_module")}
    TorchDDP._get_active_ddp_module = classmethod(lambda cls: None)
    del TorchDDP._active_ddp_module

    def restore():
        for k, v in saved.items():
            setattr(TorchDDP, k, v)

    return restore


def fallback_worker(rank, world_size):
    ref = _train(rank, TorchDDP, "eager", 1)  # torch DDP needs the API removed below
    restore = _remove_private_api()
    try:
        assert _compile_support.activate(object()) is _compile_support._NOTHING
        counts = {}
        for order in ("inner", "outer"):
            run = _train(rank, fastcoll.DDP, order, 1)
            _check_against(ref, run, f"fallback, fastcoll.DDP, {order}")
            assert run[2] == 1, f"fallback, {order}: {run[2]} subgraphs, expected 1 (no split without the API)"
            counts[order] = run[2]
        # aot_eager: one compiled backward, after which every bucket is launched.
        run = _train(rank, fastcoll.DDP, "outer", 1, backend=_counting_backend("aot_eager"), track_overlap=True)
        _check_against(ref, run, "fallback, fastcoll.DDP, outer, aot_eager")
        n_nodes, launched = run[3]
        assert run[2] == n_nodes == 1 and launched == [1] * len(launched), (run[2], n_nodes, launched)
    finally:
        restore()
    return counts


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


def test_compiled_matches_torch_ddp_both_orders():
    counts = run_ranks(parity_worker, 2, timeout=150)
    assert counts[0] == counts[1]


def test_compiled_backward_overlaps_communication():
    run_ranks(overlap_worker, 2, timeout=120)


def test_fallback_without_private_api():
    assert run_ranks(fallback_worker, 2, timeout=120) == [{"inner": 1, "outer": 1}] * 2


# ---------------------------------------------------------------------------
# Single process: what dynamo sees, and activation bookkeeping
# ---------------------------------------------------------------------------


def test_dynamo_view_keeps_cap_at_least_first_bucket():
    import torch.distributed as dist

    first = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 1 << 20)
    small = types.SimpleNamespace(bucket_bytes_cap=1000, static_graph=True)
    view = _compile_support.DynamoView(small)
    assert view.bucket_bytes_cap == first and view.static_graph is True and bool(view)
    big = types.SimpleNamespace(bucket_bytes_cap=25 << 20)
    assert _compile_support.DynamoView(big).bucket_bytes_cap == 25 << 20


def test_activate_restore_nests():
    outer_ddp = types.SimpleNamespace(bucket_bytes_cap=4 << 20)
    inner_ddp = types.SimpleNamespace(bucket_bytes_cap=8 << 20)
    before = TorchDDP._get_active_ddp_module()
    t1 = _compile_support.activate(outer_ddp)
    assert TorchDDP._get_active_ddp_module().ddp is outer_ddp
    t2 = _compile_support.activate(inner_ddp)
    assert TorchDDP._get_active_ddp_module().bucket_bytes_cap == 8 << 20
    _compile_support.restore(t2)
    assert TorchDDP._get_active_ddp_module().ddp is outer_ddp
    _compile_support.restore(t1)
    assert TorchDDP._get_active_ddp_module() is before
