"""fastcoll.DDP against torch DDP and against one process on the global batch.

Every multi-rank check runs through ``multiproc.run_ranks`` (gloo, 1 thread
per rank, hard timeout). To keep the file fast, each spawned run performs a
group of related checks; assertion messages say which one failed.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import io
import tempfile
import time
import types
from collections import namedtuple

import ddp_models as M
import pytest
import torch
import torch.distributed as dist
from multiproc import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastcoll
from fastcoll import bucketing

STEPS = 4
LR, MOMENTUM = 0.1, 0.9

# (model, fastcoll.DDP kwargs, options). Torch DDP gets the same kwargs minus first_bucket_mb.
PARITY_CONFIGS = [
    ("mlp", {}, {}),
    ("mlp", {"bucket_cap_mb": 1e-6, "first_bucket_mb": 1e-6}, {"one_param_per_bucket": True}),
    ("mlp", {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.002}, {"set_to_none": False}),
    ("mlp", {"gradient_as_bucket_view": True}, {}),
    ("mlp", {"static_graph": True, "bucket_cap_mb": 0.002}, {}),
    ("convbn", {}, {}),
    ("convbn_cl", {"gradient_as_bucket_view": True, "bucket_cap_mb": 1e-6}, {"set_to_none": False}),
    ("encoder", {"bucket_cap_mb": 0.01}, {}),
    ("branchy", {"find_unused_parameters": True}, {}),
    ("branchy", {"find_unused_parameters": True, "gradient_as_bucket_view": True, "bucket_cap_mb": 1e-6}, {"set_to_none": False}),
    ("mixed", {"bucket_cap_mb": 1e-4}, {}),
    ("tied", {"bucket_cap_mb": 1e-6}, {}),
    ("sparse", {}, {}),
    ("sparse", {"gradient_as_bucket_view": True, "bucket_cap_mb": 1e-6}, {"set_to_none": False}),
]


def _tol(t: torch.Tensor, low_precision_model: bool = False) -> dict:
    """Tolerance against the single-process run (different summation order; fp16/bf16 rounding)."""
    if low_precision_model or t.dtype in (torch.float16, torch.bfloat16):
        return {"rtol": 1e-2, "atol": 1e-2}
    return {"rtol": 1e-4, "atol": 1e-5}


def _torch_twin(model: nn.Module) -> nn.Module:
    """A copy of ``model`` for torch DDP, with sparse=False on its embeddings.

    torch DDP all-reduces sparse gradients with gloo's sparse all-reduce, which
    corrupts the heap now and then ("malloc(): unaligned tcache chunk detected"
    in a gloo thread: torch DDP alone on SparseEmb, 2 gloo ranks under CPU load,
    crashed within minutes). The twin's dense gradients are the same numbers, so
    torch DDP is still the reference for the averaged gradients and the trained
    weights; fastcoll's gradients are compared densified.
    """
    twin = copy.deepcopy(model)
    for m in twin.modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            m.sparse = False
    return twin


def _assert_grads_equal(a: nn.Module, b: nn.Module, what: str) -> None:
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        if p.grad is None or q.grad is None:
            assert p.grad is None and q.grad is None, (
                f"{what}: {n}.grad is {p.grad is None and 'None' or 'set'} vs torch {q.grad is None and 'None' or 'set'}"
            )
        else:
            got = p.grad.to_dense() if p.grad.is_sparse and not q.grad.is_sparse else p.grad  # vs _torch_twin
            torch.testing.assert_close(got, q.grad, msg=lambda m: f"{what}: grad of {n}: {m}")


def _assert_state_equal(a: nn.Module, b: nn.Module, what: str, tol: bool = False) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb), what
    for k in sa:
        kw = _tol(sa[k]) if tol and sa[k].is_floating_point() else {}
        torch.testing.assert_close(sa[k], sb[k], **kw, msg=lambda m: f"{what}: {k}: {m}")


def _grad_in_bucket(ddp: fastcoll.DDP) -> None:
    """Every trainable parameter's .grad is its bucket view (gradient_as_bucket_view)."""
    for b in ddp.reducer.buckets:
        for p, v, name in zip(b.params, b.views, b.names):
            if p.grad is not None:
                assert p.grad.data_ptr() == v.data_ptr() and p.grad.stride() == v.stride(), f"{name}.grad is not its bucket view"


def parity_worker(rank: int, world_size: int, configs) -> None:
    for name, kwargs, opts in configs:
        what = f"{name} {kwargs} {opts} (rank {rank}/{world_size})"
        set_to_none = opts.get("set_to_none", True)
        torch_kwargs = {k: v for k, v in kwargs.items() if k != "first_bucket_mb"}
        # Rank-dependent initialization: init_sync must make every rank start from rank 0's.
        model = M.build(name, seed=rank)
        fast = fastcoll.DDP(copy.deepcopy(model), **kwargs)
        ref = TorchDDP(_torch_twin(model), **torch_kwargs)
        _assert_state_equal(fast, ref, what + " after construction")
        of = torch.optim.SGD(fast.parameters(), lr=LR, momentum=MOMENTUM)
        ot = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
        for step in range(STEPS):
            M.backward_on_chunk(name, world_size, rank, step, ((fast, of), (ref, ot)), set_to_none)
            _assert_grads_equal(fast, ref, f"{what} step {step}")
            if kwargs.get("gradient_as_bucket_view"):
                _grad_in_bucket(fast)
            of.step()
            ot.step()
        _assert_state_equal(fast, ref, what + " after training")
        if opts.get("one_param_per_bucket"):
            n = sum(1 for p in fast.parameters() if p.requires_grad)
            assert len(fast.bucket_info()) == n, f"{what}: {len(fast.bucket_info())} buckets for {n} parameters"
        if name == "branchy":
            assert fast.module.never.weight.grad is None, f"{what}: globally unused parameter got a gradient"
        if rank == 0:
            single = M.reference_train(name, world_size, STEPS, LR, MOMENTUM, set_to_none)
            for (n, p), (_, q) in zip(fast.module.named_parameters(), single.named_parameters()):
                torch.testing.assert_close(p, q, **_tol(p, name == "mixed"), msg=lambda m: f"{what}: {n} vs single process: {m}")
        fast.close()


@pytest.mark.parametrize("world_size", [2, 3])
def test_parity_with_torch_ddp_and_single_process(world_size):
    run_ranks(parity_worker, world_size, PARITY_CONFIGS, timeout=150)


def _early_pack_worker(rank, world_size, configs):
    import fastcoll.reducer as R

    # Every parameter of the test models takes the CPU early-pack path.
    probe = R.Reducer([torch.nn.Parameter(torch.ones(1))], ["probe"])
    assert probe.bucket_info()[0]["packed_early"] == ["probe"], "FASTCOLL_EARLY_PACK_MIN_NUMEL=1 did not enable early packing"
    probe.close()
    parity_worker(rank, world_size, configs)


def test_parity_with_early_packing_of_every_gradient():
    """The same parity checks with every CPU gradient packed as soon as it is final."""
    run_ranks(_early_pack_worker, 2, PARITY_CONFIGS, timeout=150, env={"FASTCOLL_EARLY_PACK_MIN_NUMEL": "1"})


def test_off_the_cpu_only_bucket_views_and_main_gradients_pack_large_gradients_early():
    """Which gradients are packed as soon as they are final, for buckets off the CPU (meta tensors stand in for a
    GPU's): large ones of gradient_as_bucket_view buckets (copied into their views and released, as torch DDP does,
    rather than kept alive until their bucket completes) and of main-gradient buckets; none of other buckets, whose
    gradients are the user's .grad anyway and pack in one launch; never a small one."""
    from fastcoll.reducer.layout import build_buckets, packs_early

    big, small = (torch.nn.Parameter(torch.empty(s, device="meta")) for s in ((300, 300), (10,)))
    for view in (False, True):
        buckets = build_buckets([[0, 1]], [big, small], ["big", "small"], [False, False], None, view)
        assert packs_early(buckets, 2) == [view, False], f"gradient_as_bucket_view={view}"
    half = [p.to(torch.bfloat16) for p in (big, small)]
    buckets = build_buckets([[0, 1]], half, ["big", "small"], [False, False], None, False, main_dtype=torch.float32)
    assert packs_early(buckets, 2) == [True, False]


# --------------------------------------------------------------------------- features


def _mlp_pair(rank, **kwargs):
    model = M.build("mlp", 0)
    torch_kwargs = {k: v for k, v in kwargs.items() if k != "first_bucket_mb"}
    return fastcoll.DDP(copy.deepcopy(model), **kwargs), TorchDDP(copy.deepcopy(model), **torch_kwargs)


def _other_rank_grad(t: torch.Tensor) -> torch.Tensor:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out[1 - dist.get_rank()]


def _check_no_sync(rank, ws):
    for view in (False, True):
        fast, ref = _mlp_pair(rank, gradient_as_bucket_view=view, bucket_cap_mb=0.002)
        what = f"no_sync(gradient_as_bucket_view={view})"
        for it in range(2):
            for mod in (fast, ref):
                mod.zero_grad(set_to_none=(it == 0))
                for micro in range(3):
                    x, y = M.global_batch("mlp", ws, 10 * it + micro)
                    xr, yr = M.chunk_of(x, rank), M.chunk_of(y, rank)
                    if micro < 2:
                        with mod.no_sync():
                            M.loss_of("mlp", mod, xr, yr, rank, 0).backward()
                        if mod is fast and micro == 1:
                            g = fast.module.head.weight.grad
                            assert not torch.equal(g, _other_rank_grad(g)), f"{what}: gradients were synchronized inside no_sync"
                    else:
                        M.loss_of("mlp", mod, xr, yr, rank, 0).backward()
            _assert_grads_equal(fast, ref, f"{what} iteration {it}")
            if view:
                _grad_in_bucket(fast)
        # The decision is taken at forward time, as in torch: forward inside, backward outside -> no sync.
        fast.zero_grad()
        x, y = M.global_batch("mlp", ws, 99)
        with fast.no_sync():
            loss = M.loss_of("mlp", fast, M.chunk_of(x, rank), M.chunk_of(y, rank), rank, 0)
        loss.backward()
        g = fast.module.head.weight.grad
        assert not torch.equal(g, _other_rank_grad(g)), f"{what}: backward after leaving no_sync synchronized a no_sync forward"
        fast.require_backward_grad_sync = False  # the attribute no_sync() toggles, as frameworks use it
        fast.zero_grad()
        M.loss_of("mlp", fast, M.chunk_of(x, rank), M.chunk_of(y, rank), rank, 0).backward()
        g = fast.module.head.weight.grad
        assert not torch.equal(g, _other_rank_grad(g)), f"{what}: require_backward_grad_sync=False still synchronized"
        fast.close()


def _check_checkpoint(rank, ws):
    model = M.build("convbn", 0)
    fast = fastcoll.DDP(copy.deepcopy(model))
    ref = TorchDDP(copy.deepcopy(model))
    x, y = M.global_batch("convbn", ws, 0)
    for mod in (fast, ref):
        M.loss_of("convbn", mod, M.chunk_of(x, rank), M.chunk_of(y, rank), rank, 0).backward()
    sd_fast, sd_ref = fast.state_dict(), ref.state_dict()
    assert list(sd_fast) == list(sd_ref) and all(k.startswith("module.") for k in sd_fast), list(sd_fast)
    # torch DDP checkpoint -> fastcoll.DDP and back, through torch.save/torch.load.
    for src, dst_cls in ((ref, fastcoll.DDP), (fast, TorchDDP)):
        buf = io.BytesIO()
        torch.save(src.state_dict(), buf)
        buf.seek(0)
        dst = dst_cls(M.build("convbn", 7))
        dst.load_state_dict(torch.load(buf))
        _assert_state_equal(dst, src, f"load {type(src).__name__} checkpoint into {dst_cls.__name__}")
        if isinstance(dst, fastcoll.DDP):
            dst.close()
    # .module's own state_dict loads into a bare model, as with torch DDP.
    bare = M.build("convbn", 3)
    bare.load_state_dict(fast.module.state_dict())
    fast.close()


def _check_bucket_info_and_rebuild(rank, ws):
    for view in (False, True):
        what = f"reordered (gradient_as_bucket_view={view})"
        fast, ref = (
            fastcoll.DDP(M.build("reordered", 0), bucket_cap_mb=1e-6, gradient_as_bucket_view=view),
            TorchDDP(M.build("reordered", 0), bucket_cap_mb=1e-6, gradient_as_bucket_view=view),
        )
        info = fast.bucket_info()
        assert [b["names"] for b in info] == [[n] for n in ["a.bias", "a.weight", "b.bias", "b.weight", "c.bias", "c.weight"]], (
            info
        )
        assert [b["index"] for b in info] == list(range(6))
        assert info[1]["bytes"] == 64 * 4 and info[1]["numel"] == 64
        assert info[1]["dtype"] == torch.float32 and info[1]["device"] == torch.device("cpu")
        for step in range(3):
            x, y = M.global_batch("reordered", ws, step)
            for mod in (fast, ref):
                mod.zero_grad(set_to_none=not view)
                M.loss_of("reordered", mod, M.chunk_of(x, rank), M.chunk_of(y, rank), rank, step).backward()
            _assert_grads_equal(fast, ref, f"{what} step {step}")
            if view:
                _grad_in_bucket(fast)
        names = [b["names"][0] for b in fast.bucket_info()]
        assert names[0].startswith("c.") and names[-1].startswith("a."), f"{what}: layout not rebuilt from ready order: {names}"
        assert fast.reducer.rebuilt and fast.reducer.recorded_order is None
        fast.close()

    # First bucket cap: one parameter in the first bucket, the rest together.
    fast = fastcoll.DDP(M.build("reordered", 0), first_bucket_mb=1e-6)
    assert [len(b["names"]) for b in fast.bucket_info()] == [1, 5]
    fast.close()

    # Rank 0's layout wins: rank 1 runs the two branches in the other order, so
    # its gradients become ready in another order; every rank must end with rank 0's layout.
    torch.manual_seed(0)
    model = TwoBranch()
    fast, ref = fastcoll.DDP(copy.deepcopy(model), bucket_cap_mb=1e-6), TorchDDP(copy.deepcopy(model), bucket_cap_mb=1e-6)
    x = torch.randn(4, 8) + rank
    recorded = None
    for step in range(3):
        for mod in (fast, ref):
            mod.zero_grad()
            mod(x, flip=rank == 1).backward()
        if step == 0:
            recorded = fast.reducer.recorded_order
            assert recorded is not None and sorted(recorded) == list(range(len(fast.reducer.params)))
        _assert_grads_equal(fast, ref, f"rank-0 layout step {step}")
    orders = [None] * ws
    dist.all_gather_object(orders, recorded)
    assert orders[0] != orders[1], f"the ranks observed the same ready order, the test proves nothing: {orders}"
    specs = [bucketing.ParamSpec.of(p) for p in fast.reducer.params]
    expected = bucketing.assign_buckets(
        specs, bucketing.order_from_ready(orders[0], len(specs)), fast.first_bucket_bytes, fast.bucket_bytes_cap
    )
    layouts = [None] * ws
    dist.all_gather_object(layouts, fast.reducer.layout())
    assert layouts[0] == layouts[1] == expected, f"ranks disagree on the rebuilt layout: {layouts}"
    fast.close()


class TwoBranch(nn.Module):
    """Two independent branches; ``flip`` runs them in the other order, which reverses their gradients' ready order."""

    def __init__(self):
        super().__init__()
        self.p = nn.Linear(8, 8)
        self.q = nn.Linear(8, 8)

    def forward(self, x, flip=False):
        if flip:
            b = self.q(x)
            a = self.p(x)
        else:
            a = self.p(x)
            b = self.q(x)
        return (a * b).sum()


Pair = namedtuple("Pair", "left right")


@dataclasses.dataclass
class DOut:
    value: torch.Tensor
    meta: str


class Multi(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.last = None

    def forward(self, x, kind="tuple"):
        h = self.lin(x)
        out = {"tuple": Pair(h, [h * 2, {"k": h}]), "dict": {"a": h, "b": (h, 3)}, "dc": DOut(h, "m")}[kind]
        self.last = out
        return out


def _check_outputs_and_patching(rank, ws):
    fast = fastcoll.DDP(Multi(), find_unused_parameters=True)
    x = torch.randn(2, 4)
    for kind in ("tuple", "dict", "dc"):
        out = fast(x, kind=kind)
        assert out is fast.module.last, f"{kind}: DDP did not return the module's output object unchanged"
        t = {"tuple": lambda o: o.right[1]["k"], "dict": lambda o: o["b"][0], "dc": lambda o: o.value}[kind](out)
        t.sum().backward()
    # Lightning-style: patch forward on the module instance after wrapping.
    inner = fast.module
    inner.forward = types.MethodType(lambda self, x: self.lin(x) * 0 + 42.0, inner)
    assert torch.all(fast(x) == 42.0), "DDP did not call the instance-patched forward"
    fast.close()


class WithBuffers(nn.Module):
    def __init__(self, rank):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("fbuf", torch.full((3,), float(rank)))
        self.register_buffer("ibuf", torch.full((2,), rank, dtype=torch.int64))
        self.register_buffer("bbuf", torch.tensor([rank == 0, rank != 0]))
        self.register_buffer("hbuf", torch.full((5,), float(rank), dtype=torch.float16))

    def forward(self, x):
        return self.lin(x)


def _check_buffers_and_init_sync(rank, ws):
    torch.manual_seed(rank)
    m = WithBuffers(rank)
    fast = fastcoll.DDP(m, init_sync=False, broadcast_buffers=False)
    other = _other_rank_grad(m.lin.weight.detach())
    assert not torch.equal(m.lin.weight, other) and m.fbuf[0].item() == rank, "init_sync=False synchronized"
    fast(torch.randn(2, 4))
    assert m.fbuf[0].item() == rank and m.ibuf[0].item() == rank, "broadcast_buffers=False broadcast buffers"
    fast.close()

    fast = fastcoll.DDP(m)  # init_sync: parameters and buffers from rank 0
    assert torch.equal(m.lin.weight, _other_rank_grad(m.lin.weight.detach())), "init_sync did not synchronize parameters"
    assert (
        m.fbuf.tolist() == [0.0] * 3
        and m.ibuf.tolist() == [0, 0]
        and m.bbuf.tolist() == [True, False]
        and m.hbuf.tolist() == [0.0] * 5
    )
    m.fbuf.fill_(rank + 5)
    m.ibuf.fill_(rank + 5)
    m.bbuf.fill_(rank == 1)
    m.hbuf.fill_(rank + 5)
    fast(torch.randn(2, 4)).sum().backward()
    assert (
        m.fbuf.tolist() == [5.0] * 3
        and m.ibuf.tolist() == [5, 5]
        and m.bbuf.tolist() == [False, False]
        and m.hbuf.tolist() == [5.0] * 5
    ), "buffers not broadcast from rank 0 before forward"
    # As in torch: a forward after a non-synchronizing forward (no_grad) does not broadcast.
    with torch.no_grad():
        fast(torch.randn(2, 4))
    assert fast.require_forward_param_sync is False
    m.fbuf.fill_(rank + 7)
    with torch.no_grad():
        fast(torch.randn(2, 4))
    assert m.fbuf[0].item() == rank + 7
    fast.close()


class UnusedLayer(nn.Module):
    """Tensor output (torch DDP's static_graph does not synchronize its first iteration for dataclass outputs)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.trunk(x)))


def _check_static_graph_and_traversal(rank, ws):
    torch.manual_seed(0)
    model = UnusedLayer()
    fast = fastcoll.DDP(copy.deepcopy(model), find_unused_parameters=True, static_graph=True, bucket_cap_mb=1e-6)
    ref = TorchDDP(copy.deepcopy(model), find_unused_parameters=True, static_graph=True, bucket_cap_mb=1e-6)
    assert fast.static_graph is True

    for step in range(3):
        x, y = M.global_batch("branchy", ws, step)
        for mod in (fast, ref):
            mod.zero_grad()
            nn.functional.cross_entropy(mod(M.chunk_of(x, rank)), M.chunk_of(y, rank)).backward()
        _assert_grads_equal(fast, ref, f"static_graph step {step}")
        g = fast.module.head.weight.grad
        assert torch.equal(g, _other_rank_grad(g)), f"static_graph step {step}: not synchronized"
    assert fast.module.never.weight.grad is None
    stats = fast.reducer.stats()
    assert stats["unused_searches"] == 0, "graph traversal ran under static_graph"
    assert stats["host_reads"] == 1, f"static_graph reads the used-parameter map once (learning iteration): {stats}"
    fast.close()

    model = M.build("branchy", 0)
    # Without static_graph the traversal runs every iteration.
    fast = fastcoll.DDP(copy.deepcopy(model), find_unused_parameters=True)
    for _ in range(2):
        out = fast(torch.randn(2, 8))
        out.logits.sum().backward()
    assert fast.reducer.stats()["unused_searches"] == 2 and fast.reducer.stats()["host_reads"] == 2, fast.reducer.stats()
    fast.close()
    # Without unused-parameter tracking the reducer never reads back from the device.
    fast = fastcoll.DDP(M.build("mlp", 0))
    for step in range(2):
        x, y = M.global_batch("mlp", ws, step)
        M.loss_of("mlp", fast, M.chunk_of(x, rank), M.chunk_of(y, rank), rank, step).backward()
    assert fast.reducer.stats()["host_reads"] == 0, fast.reducer.stats()
    fast.close()


def _check_remove_hooks(rank, ws):
    model = M.build("mlp", 0)
    fast = fastcoll.DDP(model)
    fast._remove_hooks()
    assert fast.bucket_info() == []
    x = torch.randn(4, 8) + rank
    fast(x).sum().backward()
    g = model.head.weight.grad
    assert not torch.equal(g, _other_rank_grad(g)), "gradients synchronized after _remove_hooks()"
    # Re-wrap the same module (frameworks do this between fits), dropping the old wrapper by GC.
    fast2 = fastcoll.DDP(model)
    ref = TorchDDP(copy.deepcopy(model))
    del fast
    gc.collect()
    for mod in (fast2, ref):
        mod.zero_grad()
        mod(x).sum().backward()
    _assert_grads_equal(fast2, ref, "re-wrapped module")
    fast2.close()
    # A wrapper dropped without close() removes its hooks when collected.
    fast3 = fastcoll.DDP(model)
    del fast3
    gc.collect()
    hooks = model.head.weight._post_accumulate_grad_hooks
    assert not hooks, f"hooks left behind by a collected DDP: {hooks}"


class Opaque:
    def __init__(self, t):
        self.t = t


class HidesOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return Opaque(self.lin(x))


def _check_reduction_errors(rank, ws):
    # No find_unused_parameters, unused parameters: the NEXT forward raises, naming them.
    fast = fastcoll.DDP(M.build("branchy", 0), bucket_cap_mb=1e-6)
    x = torch.randn(4, 8)
    fast(x).logits.sum().backward()
    with pytest.raises(RuntimeError) as err:
        fast(x)
    msg = str(err.value)
    for n in ("never.weight", "never.bias", "sometimes.weight", "sometimes.bias"):
        assert n in msg, msg
    assert "trunk.weight" not in msg and "find_unused_parameters=True" in msg, msg
    # Outputs hidden from the traversal: parameters are marked unused, then get gradients.
    fast2 = fastcoll.DDP(HidesOutput(), find_unused_parameters=True)
    with pytest.raises(RuntimeError, match="marked ready twice"):
        fast2(x[:, :4]).t.sum().backward()


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.mid = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.last = nn.Linear(8, 3)

    def forward(self, x, reentrant: bool):
        h = torch.tanh(self.first(x))
        h = torch.utils.checkpoint.checkpoint(self.mid, h, use_reentrant=reentrant)
        return self.last(h)


def _check_activation_checkpointing(rank, ws):
    import torch.utils.checkpoint  # noqa: F401

    for reentrant in (True, False):
        torch.manual_seed(0)
        model = Checkpointed()
        fast = fastcoll.DDP(copy.deepcopy(model), bucket_cap_mb=1e-6)
        ref = TorchDDP(copy.deepcopy(model), bucket_cap_mb=1e-6)
        for step in range(2):
            x, y = M.global_batch("mlp", ws, step)
            for mod in (fast, ref):
                mod.zero_grad()
                out = mod(M.chunk_of(x, rank).requires_grad_(), reentrant=reentrant)
                nn.functional.cross_entropy(out, M.chunk_of(y, rank)).backward()
            _assert_grads_equal(fast, ref, f"checkpoint(use_reentrant={reentrant}) step {step}")
        fast.close()


def features_worker(rank, world_size):
    for check in (
        _check_no_sync,
        _check_checkpoint,
        _check_bucket_info_and_rebuild,
        _check_outputs_and_patching,
        _check_buffers_and_init_sync,
        _check_static_graph_and_traversal,
        _check_remove_hooks,
        _check_activation_checkpointing,
        _check_reduction_errors,
    ):
        try:
            check(rank, world_size)
        except BaseException as exc:
            raise AssertionError(f"{check.__name__}: {type(exc).__name__}: {exc}") from exc


def test_features():
    run_ranks(features_worker, 2, timeout=120)


# --------------------------------------------------------------------------- bad input


def _expect(exc_type, match, fn):
    with pytest.raises(exc_type, match=match):
        fn()


def bad_args_worker(rank, world_size):
    mk = lambda: nn.Linear(4, 4)  # noqa: E731
    _expect(ValueError, "bucket_cap_mb", lambda: fastcoll.DDP(mk(), bucket_cap_mb=0))
    _expect(ValueError, "bucket_cap_mb", lambda: fastcoll.DDP(mk(), bucket_cap_mb=-1.0))
    _expect(ValueError, "first_bucket_mb", lambda: fastcoll.DDP(mk(), first_bucket_mb=0))
    _expect(RuntimeError, "requires a gradient", lambda: fastcoll.DDP(mk().requires_grad_(False)))
    _expect(ValueError, "device_ids", lambda: fastcoll.DDP(mk(), device_ids=[0]))
    _expect(ValueError, "device_ids", lambda: fastcoll.DDP(mk(), device_ids=[0, 1]))
    _expect(ValueError, "output_device", lambda: fastcoll.DDP(mk(), output_device=0))

    class TwoDevices(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = nn.Linear(2, 2, device="meta")

    _expect(ValueError, "one device type", lambda: fastcoll.DDP(TwoDevices()))
    fp8 = nn.Module()
    fp8.w = nn.Parameter(torch.zeros(2, dtype=torch.float8_e4m3fn))
    _expect(TypeError, "float8_e4m3fn", lambda: fastcoll.DDP(fp8))
    _expect(TypeError, "process_group", lambda: fastcoll.DDP(mk(), process_group="nccl"))
    # A bad argument on one rank only: every rank raises the same error, naming the rank; nobody hangs.
    _expect(ValueError, "rank 1: bucket_cap_mb must be", lambda: fastcoll.DDP(mk(), bucket_cap_mb=0 if rank == 1 else None))
    # The ranks are still in step: a good wrapper works.
    good = fastcoll.DDP(mk())
    good(torch.randn(2, 4) + rank).sum().backward()
    g = good.module.weight.grad
    assert torch.equal(g, _other_rank_grad(g))
    good.close()
    # Without a process group.
    dist.destroy_process_group()
    _expect(RuntimeError, "process group has not been initialized", lambda: fastcoll.DDP(mk()))


class Permuted(nn.Module):
    """Four 256x256 layers used in another order than registered: the first backward's ready order rebuilds the buckets."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(4))

    def forward(self, x):
        for i in (2, 0, 3, 1):
            x = torch.tanh(self.layers[i](x))
        return x.pow(2).mean()


def rebuild_peak_worker(rank, world_size, view):
    """Per iteration and wrapper, the most tensor bytes held at once above what was held when it started
    (fastcoll.bench's MemoryProbe: torch.profiler's record of c10's CPU allocator)."""
    from fastcoll.bench.runner import MemoryProbe

    torch.manual_seed(0)
    model = Permuted()
    kw = dict(bucket_cap_mb=0.3, gradient_as_bucket_view=view)
    wrappers = {"fastcoll": fastcoll.DDP(copy.deepcopy(model), **kw), "torch": TorchDDP(copy.deepcopy(model), **kw)}
    x = torch.randn(8, 256) + rank
    peaks = {k: [] for k in wrappers}
    for _ in range(4):
        for name, w in wrappers.items():
            probe = MemoryProbe("cpu", tensors=True)
            probe.start()
            w.module.zero_grad(set_to_none=True)
            w(x).backward()
            peaks[name].append(probe.tensor_peak())
    layout = [b["names"] for b in wrappers["fastcoll"].bucket_info()]
    wrappers["fastcoll"].close()
    return peaks, layout


@pytest.mark.parametrize("view", [False, True], ids=["copies", "bucket-view"])
def test_bucket_rebuild_frees_the_old_buffers_before_allocating_the_new(view):
    """The iteration whose forward rebuilds the buckets from the ready order (the second) holds no more tensor bytes
    than a later one: the old bucket buffers go before the new ones are allocated. With gradients as bucket views a
    second set of buffers alive at once would add a whole gradient's bytes (torch DDP holds both sets then)."""
    peaks, layout = run_ranks(rebuild_peak_worker, 2, view, timeout=120)[0]
    assert layout[0][0].startswith("layers.1.") and len(layout) > 1, f"the buckets were not rebuilt: {layout}"
    fc, tc, slack = peaks["fastcoll"], peaks["torch"], 16 * 1024
    assert fc[1] <= fc[3] + slack, f"the rebuild iteration held {fc[1]} bytes above its start, a later one {fc[3]}"
    assert fc[1] <= tc[1] + slack, f"the rebuild iteration held {fc[1]} bytes above its start, torch DDP's {tc[1]}"


def rewrap_worker(rank, world_size):
    """fastcoll.DDP around a fastcoll.DDP and around a torch DDP: a warning on every rank naming what is wrapped,
    and the same training as one wrapper (the gradients are averaged twice, identical values)."""
    import warnings

    def train(wrap):
        torch.manual_seed(0)
        model = M.build("mlp", 0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp = wrap(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(2):
            x, y = M.global_batch("mlp", world_size, step)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(M.chunk_of(x, rank)), M.chunk_of(y, rank)).backward()
            opt.step()
        return [str(w.message) for w in caught if "already" in str(w.message)], [p.detach().clone() for p in model.parameters()]

    none, once = train(fastcoll.DDP)
    assert none == [], none
    for inner in (fastcoll.DDP, TorchDDP):
        messages, twice = train(lambda m, inner=inner: fastcoll.DDP(inner(m)))
        assert len(messages) == 1 and f"already a {inner.__module__}.{inner.__qualname__}" in messages[0], messages
        for a, b in zip(once, twice):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_wrapping_a_ddp_again_warns_on_every_rank():
    run_ranks(rewrap_worker, 2, timeout=120)


def create_graph_worker(rank, world_size):
    """backward(create_graph=True): the gradients are the average over ranks, and a warning on every rank says that
    their graph is each rank's own (torch DDP warns of the same); a plain backward warns of nothing."""
    import warnings

    for view in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        ddp = fastcoll.DDP(model, gradient_as_bucket_view=view)
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))
        local = torch.autograd.grad(model(x).pow(3).mean(), [model.weight, model.bias])
        expected = []
        for g in local:
            everyone = [torch.empty_like(g) for _ in range(world_size)]
            dist.all_gather(everyone, g.contiguous())
            expected.append(sum(everyone) / world_size)
        for create_graph in (True, False):
            ddp.zero_grad()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ddp(x).pow(3).mean().backward(create_graph=create_graph)
            said = [str(w.message) for w in caught if str(w.message).startswith("fastcoll.DDP: backward(create_graph")]
            assert len(said) == create_graph, f"view={view} create_graph={create_graph} (rank {rank}): {said}"
            for p, e in zip((model.weight, model.bias), expected):
                torch.testing.assert_close(p.grad.detach(), e, msg=lambda m: f"view={view} create_graph={create_graph}: {m}")
        ddp.close()


def test_backward_with_create_graph_warns_on_every_rank_and_averages():
    run_ranks(create_graph_worker, 2, timeout=120)


def unwrapped_worker(rank, world_size):
    """Gradients through the unwrapped module before any forward through the wrapper: one warning on every rank
    (torch DDP leaves them unaveraged silently); none once the wrapper's forward has run, nor under no_sync()."""
    import warnings

    def warned(run):
        model = nn.Linear(4, 3)
        ddp = fastcoll.DDP(model)
        x = torch.randn(5, 4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                run(model, ddp, x)
        ddp.close()
        return [str(w.message) for w in caught if "no forward has gone through the DDP wrapper" in str(w.message)]

    def no_sync(model, ddp, x):
        with ddp.no_sync():
            ddp(x).sum().backward()

    assert len(warned(lambda model, ddp, x: model(x).sum().backward())) == 1
    assert len(warned(lambda model, ddp, x: ddp.module(x).sum().backward())) == 1
    assert warned(lambda model, ddp, x: ddp(x).sum().backward()) == []
    assert warned(no_sync) == []
    assert warned(lambda model, ddp, x: (ddp(x).sum().backward(), model(x).sum().backward())) == []


def test_gradients_without_a_wrapper_forward_warn_once_on_every_rank():
    run_ranks(unwrapped_worker, 2, timeout=120)


def test_bad_arguments():
    run_ranks(bad_args_worker, 2, timeout=60)


def _variant(kind: str, odd: bool) -> nn.Module:
    m = nn.Module()
    m.l1 = nn.Linear(4, 4)
    m.l2 = nn.Linear(4, 4)
    if not odd:
        return m
    if kind == "shape":
        m.l2 = nn.Linear(4, 5)
    elif kind == "count":
        m.l3 = nn.Linear(4, 4)
    elif kind == "dtype":
        m.l2 = m.l2.double()
    elif kind == "name":
        del m.l2
        m.l2b = nn.Linear(4, 4)
    elif kind == "stride":
        m.l2.weight = nn.Parameter(m.l2.weight.detach().t().contiguous().t())
    elif kind == "frozen":
        m.l2.bias.requires_grad_(False)
    return m


MISMATCH_EXPECT = {
    "shape": ["#2", "'l2.weight' shape (4, 4)", "'l2.weight' shape (5, 4)"],
    "count": ["#4", "no such parameter (4 parameters in all)", "'l3.weight'"],
    "dtype": ["#2", "dtype float32", "dtype float64"],
    "name": ["#2", "'l2.weight'", "'l2b.weight'"],
    "stride": ["#2", "stride (4, 1)", "stride (1, 4)"],
    "frozen": ["#3", "requires_grad=True", "requires_grad=False"],
}


def mismatch_worker(rank, world_size):
    odd_rank = world_size - 1
    for kind, needles in MISMATCH_EXPECT.items():
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as err:
            fastcoll.DDP(_variant(kind, rank == odd_rank))
        msg = str(err.value)
        assert time.monotonic() - t0 < 10, f"{kind}: took {time.monotonic() - t0:.1f}s"
        for needle in needles + ["differs across ranks", f"rank {odd_rank}:", "rank"]:
            assert needle in msg, f"{kind}: {needle!r} not in {msg!r}"
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_mismatched_models_raise_on_every_rank(world_size):
    assert run_ranks(mismatch_worker, world_size, timeout=60, pg_timeout=20) == [True] * world_size


# --------------------------------------------------------------------------- unit


def test_bucket_assignment():
    f32 = lambda n: bucketing.ParamSpec(n, 4, ("cpu", torch.float32))  # noqa: E731
    f16 = lambda n: bucketing.ParamSpec(n, 2, ("cpu", torch.float16))  # noqa: E731
    specs = [f32(10), f16(10), f32(10), f16(10), f32(10)]
    order = bucketing.reverse_registration_order(5)
    assert order == [4, 3, 2, 1, 0]
    # first cap 40 bytes: one f32 param; later cap 80 bytes: two.
    assert bucketing.assign_buckets(specs, order, 40, 80) == [[4], [3, 1], [2, 0]]
    assert bucketing.assign_buckets(specs, order, 10**9, 10**9) == [[3, 1], [4, 2, 0]]
    assert bucketing.assign_buckets(specs, order, 1, 1) == [[4], [3], [2], [1], [0]]
    assert bucketing.order_from_ready([2, 2, 0], 5) == [2, 0, 4, 3, 1]
    with pytest.raises(ValueError):
        bucketing.assign_buckets(specs, [0, 1], 1, 1)
    with pytest.raises(ValueError):
        bucketing.assign_buckets(specs, order, 0, 1)


def test_not_initialized():
    assert fastcoll.DistributedDataParallel is fastcoll.DDP
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="not been initialized"):
            fastcoll.DDP(nn.Linear(2, 2))


# --------------------------------------------------------------------------- CUDA


def _cuda_parity(rank, world_size, configs, device_ids):
    torch.cuda.set_device(0)
    for name, kwargs, opts in configs:
        what = f"cuda {name} {kwargs}"
        model = M.build(name, seed=rank).cuda()
        torch_kwargs = {k: v for k, v in kwargs.items() if k != "first_bucket_mb"}
        fast = fastcoll.DDP(copy.deepcopy(model), device_ids=device_ids, **kwargs)
        ref = TorchDDP(copy.deepcopy(model), device_ids=device_ids, **torch_kwargs)
        of = torch.optim.SGD(fast.parameters(), lr=LR, momentum=MOMENTUM)
        ot = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
        for step in range(STEPS):
            x, y = M.global_batch(name, world_size, step)
            xr, yr = M.chunk_of(x, rank).cuda(), M.chunk_of(y, rank).cuda()
            for mod, opt in ((fast, of), (ref, ot)):
                opt.zero_grad(set_to_none=opts.get("set_to_none", True))
                M.loss_of(name, mod, xr, yr, rank, step).backward()
                opt.step()
        torch.cuda.synchronize()
        _assert_state_equal(fast, ref, what, tol=True)
        fast.close()


CUDA_CONFIGS = [
    ("mlp", {"bucket_cap_mb": 0.002}, {}),
    ("convbn_cl", {"gradient_as_bucket_view": True, "bucket_cap_mb": 1e-6}, {"set_to_none": False}),
    ("branchy", {"find_unused_parameters": True}, {}),
    ("mixed", {}, {}),
]


def nccl_worker(rank, world_size):
    store = dist.FileStore(tempfile.mktemp(prefix="fastcoll_nccl_"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        _cuda_parity(0, 1, CUDA_CONFIGS, [0])
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
def test_cuda_nccl_one_rank():
    run_ranks(nccl_worker, 1, init_pg=False, timeout=240)


def gloo_cuda_worker(rank, world_size):
    _cuda_parity(rank, world_size, CUDA_CONFIGS, None)


@pytest.mark.cuda
def test_cuda_tensors_on_gloo_two_ranks():
    run_ranks(gloo_cuda_worker, 2, timeout=240)


class _RareSparse(nn.Module):
    """A sparse embedding used every step and one (``rare``) used only on some ranks, never at step 2."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 6, sparse=True)
        self.rare = nn.Embedding(20, 6, sparse=True)
        self.head = nn.Linear(6, 3)

    def forward(self, x, use_rare: bool):
        h = self.emb(x).mean(1)
        if use_rare:
            h = h + self.rare(x).mean(1)
        return self.head(h)


def _sparse_worker(rank, ws):
    # Layout: every sparse parameter in a bucket of its own, flagged in bucket_info.
    torch.manual_seed(0)
    model = _RareSparse()
    fast = fastcoll.DDP(copy.deepcopy(model), find_unused_parameters=True)
    info = fast.bucket_info()
    sparse_buckets = [b["names"] for b in info if b["sparse"]]
    assert sorted(sparse_buckets) == [["emb.weight"], ["rare.weight"]], info
    # A sparse embedding only some ranks use (find_unused_parameters): averaged over all ranks,
    # untouched when no rank uses it; compared with one process on the per-rank losses.
    single = copy.deepcopy(model)
    of = torch.optim.SGD(fast.parameters(), lr=LR, momentum=MOMENTUM)
    os_ = torch.optim.SGD(single.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(STEPS):
        x, y = M.global_batch("sparse", ws, step)
        of.zero_grad(set_to_none=True)
        os_.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(fast(M.chunk_of(x, rank), M.uses_sometimes(rank, step)), M.chunk_of(y, rank)).backward()
        losses = [
            nn.functional.cross_entropy(single(M.chunk_of(x, r), M.uses_sometimes(r, step)), M.chunk_of(y, r)) for r in range(ws)
        ]
        (sum(losses) / ws).backward()
        for (n, p), (_, q) in zip(fast.module.named_parameters(), single.named_parameters()):
            if q.grad is None:
                assert p.grad is None, f"step {step}: {n} unused on every rank but got a gradient"
            else:
                assert p.grad is not None and p.grad.is_sparse == q.grad.is_sparse, f"step {step}: {n}"
                gp, gq = (p.grad.coalesce(), q.grad.coalesce()) if q.grad.is_sparse else (p.grad, q.grad)
                torch.testing.assert_close(gp, gq, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step}: grad of {n}: {m}")
        of.step()
        os_.step()
    for (n, p), (_, q) in zip(fast.module.named_parameters(), single.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n} after training: {m}")
    # Comm hooks cannot take sparse buckets: a clear error naming the parameter.
    with pytest.raises(RuntimeError, match="sparse gradients.*emb.weight"):
        fast.register_comm_hook(None, lambda state, bucket: None)
    fast.close()

    # no_sync accumulation of sparse gradients, against torch DDP.
    fast = fastcoll.DDP(M.build("sparse", 0))
    ref = TorchDDP(_torch_twin(M.build("sparse", 0)))
    for mod in (fast, ref):
        for micro in range(3):
            x, y = M.global_batch("sparse", ws, 20 + micro)
            ctx = mod.no_sync() if micro < 2 else contextlib.nullcontext()
            with ctx:
                M.loss_of("sparse", mod, M.chunk_of(x, rank), M.chunk_of(y, rank), rank, 0).backward()
    _assert_grads_equal(fast, ref, "sparse no_sync accumulation")
    fast.close()

    # join() with uneven inputs: a joined rank replays the sparse all-reduce with an empty gradient.
    fast = fastcoll.DDP(M.build("sparse", 0))
    local = M.build("sparse", 0)
    steps = 3 if rank == 0 else 1
    with fast.join():
        for step in range(steps):
            x, y = M.global_batch("sparse", ws, 30 + step)
            fast.zero_grad(set_to_none=True)
            M.loss_of("sparse", fast, M.chunk_of(x, rank), M.chunk_of(y, rank), rank, 0).backward()
            if rank == 0 and step > 0:  # rank 1 has joined: the average is rank 0's gradient / 2
                local.zero_grad(set_to_none=True)
                M.loss_of("sparse", local, M.chunk_of(x, rank), M.chunk_of(y, rank), rank, 0).backward()
                for (n, p), (_, q) in zip(fast.module.named_parameters(), local.named_parameters()):
                    expected = (q.grad.coalesce() if q.grad.is_sparse else q.grad) / ws
                    got = p.grad.coalesce() if p.grad.is_sparse else p.grad
                    torch.testing.assert_close(got, expected, msg=lambda m: f"join step {step}: {n}: {m}")
    fast.close()


@pytest.mark.parametrize("world", [2, 3])
def test_sparse_gradients(world):
    """nn.Embedding / EmbeddingBag(sparse=True): own buckets, find_unused_parameters, no_sync, join, comm hook refusal."""
    run_ranks(_sparse_worker, world, timeout=90)


@pytest.mark.parametrize(
    "backend, device_ids, params, bound, current, want",
    [
        ("gloo", None, ["cpu"], None, None, "cpu"),
        ("gloo", [1], ["cuda:1"], None, 0, "cpu"),  # gloo takes CPU tensors: no CUDA needed for the check
        ("nccl", [3], ["cuda:3"], None, 0, "cuda:3"),  # model.to(3) without torch.cuda.set_device(3)
        ("nccl", None, ["cuda:2", "cuda:2"], None, 0, "cuda:2"),  # the module's device
        ("nccl", ["cuda:5"], ["cuda:5"], None, 0, "cuda:5"),
        ("nccl", None, ["cpu"], torch.device("cuda", 4), 0, "cuda:4"),  # a CPU module: the group's bound device
        ("nccl", None, ["cpu"], None, 6, "cuda:6"),  # else the current device
        ("cpu:gloo,cuda:nccl", [1], ["cuda:1"], None, 0, "cpu"),
    ],
)
def test_construction_check_device(backend, device_ids, params, bound, current, want):
    """The device of DDP's construction-time agreement comes from device_ids / the module, not from cuda:0."""
    from fastcoll.ddp.arguments import sync_device

    got = sync_device(backend, device_ids, [torch.device(p) for p in params], bound, current)
    assert got == torch.device(want)
