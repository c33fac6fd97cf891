"""``ShardedOptimizer(grads="sharded", grad_buffers="pool")`` (ZeRO-2), on 2, 3 and 4 gloo ranks.

* Results: the pool trains exactly as persistent buffers do (bitwise where the summation order is the same:
  one backward per step, ``accumulate="full"`` under ``no_sync``, synchronized micro-batches against
  ``accumulate="reduce_scatter"``), within rounding otherwise, and as torch DDP + AdamW in float32;
  bf16 parameters with float32 main gradients and masters; uneven buckets, parameters without a parameter
  buffer (odd sizes: their all-gather stage comes from the pool) and straddling ranges; find_unused, static_graph,
  clipping, the non-finite check, comm_accum_dtype=float32 with comm_dtype=bf16.
* The bound: the pool never lends more than ``pool_buffers`` buffers (its counter), and after backward and step no
  bucket holds a full-size buffer (the control: persistent buckets do).
* The combination of tests/test_sharded_compose.py (no_sync x find_unused_parameters x comm_dtype x a checkpoint
  round trip, 2 and 3 ranks) on the pool, each accumulation choice against the run with its arithmetic.
* Checkpoints saved with the pool load without it and at another world size.
* Refusals.
"""

from __future__ import annotations

import os
from typing import Optional

import pytest
import torch
from multiproc import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastcoll
from fastcoll.optim import checkpoint as ckpt

pytestmark = pytest.mark.timeout(600)

BF16 = torch.bfloat16


class Net(nn.Module):
    """Uneven parameters: two of odd sizes (301, 77) keep their buckets from a parameter buffer; an unused head."""

    def __init__(self, unused: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 24)
        self.odd = nn.Parameter(torch.randn(301) * 0.1)
        self.b = nn.Linear(24, 40)
        self.odd2 = nn.Parameter(torch.randn(77) * 0.1)
        self.c = nn.Linear(40, 8)
        self.head = nn.Linear(8, 3) if unused else None

    def forward(self, x):
        h = torch.tanh(self.a(x)) + self.odd[:24]
        h = torch.tanh(self.b(h)) * (1 + self.odd2[:40])
        return self.c(h)


def _x(step: int, micro: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(4, 16, generator=g)


def train(rank: int, world: int, cfg: dict) -> dict:
    """``cfg``: impl (torch / persistent / pool), bf16, micro, no_sync, and fastcoll.DDP / optimizer options."""
    model = Net(unused=cfg.get("find_unused", False))
    if cfg.get("bf16"):
        model = model.to(BF16)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    pool_stats = {}
    if cfg["impl"] == "torch":
        ddp, opt = TorchDDP(model, find_unused_parameters=cfg.get("find_unused", False)), inner
    else:
        kw = dict(
            bucket_cap_mb=cfg.get("cap", 0.004), first_bucket_mb=0.0003, find_unused_parameters=cfg.get("find_unused", False)
        )
        kw.update({k: cfg[k] for k in ("static_graph", "check_nonfinite", "comm_dtype", "comm_accum_dtype") if k in cfg})
        if cfg.get("bf16"):
            kw["main_grad_dtype"] = torch.float32
        ddp = fastcoll.DDP(model, **kw)
        okw = {k: cfg[k] for k in ("accumulate", "pool_buffers", "overlap_param_gather") if k in cfg}
        if cfg["impl"] == "pool":
            okw["grad_buffers"] = "pool"
        master = torch.float32 if cfg.get("bf16") else None
        opt = fastcoll.ShardedOptimizer(inner, ddp, grads="sharded", master_dtype=master, **okw)
    micro = cfg.get("micro", 1)
    lent_after = []
    for step in range(cfg.get("steps", 3)):
        opt.zero_grad()
        for m in range(micro):
            sync = not cfg.get("no_sync") or m == micro - 1
            ctx = ddp.no_sync() if not sync else _Null()
            with ctx:
                x = _x(step, m, rank).to(BF16 if cfg.get("bf16") else torch.float32)
                ddp(x).float().pow(2).mean().backward()
            if cfg["impl"] == "pool":
                lent_after.append(opt.grad_pool.live)
        if cfg.get("clip"):
            norm = opt.clip_grad_norm_(cfg["clip"]) if cfg["impl"] != "torch" else nn.utils.clip_grad_norm_(
                model.parameters(), cfg["clip"])  # fmt: skip
            pool_stats.setdefault("norms", []).append(float(norm))
        opt.step()
    if cfg["impl"] != "torch":
        opt.finish_param_sync()
        bucket_bytes = sum(b.flat_padded.numel() * b.flat_padded.element_size() for b in ddp.reducer.buckets)
        pool_stats["bucket_bytes"] = bucket_bytes
    if cfg["impl"] == "pool":
        p = opt.grad_pool
        pool_stats.update(chunked=sum(p.chunked(b) for b in ddp.reducer.buckets), bound=p.bound, peak=p.peak,
                          live=p.live, held=p.held, peak_held=p.peak_held, lent_after_backward=lent_after,
                          buckets=len(ddp.reducer.buckets))  # fmt: skip
    params = [q.detach().double().clone() for q in model.parameters()]
    return {"params": params, **pool_stats}


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _same(a: dict, b: dict, exact: bool, tol: float = 0.0) -> None:
    for k, (x, y) in enumerate(zip(a["params"], b["params"])):
        if exact:
            assert torch.equal(x, y), (k, (x - y).abs().max())
        else:
            assert torch.allclose(x, y, atol=tol, rtol=tol), (k, (x - y).abs().max())


def _run(world: int, **cfg) -> dict:
    out = run_ranks(train, world, cfg, timeout=240)
    for r in out[1:]:  # every rank holds the same parameters after the all-gather
        _same(out[0], r, exact=True)
    return out[0]


# --------------------------------------------------------------------------- results


@pytest.mark.parametrize("world", [2, 3])
def test_fp32_pool_equals_persistent_and_torch(world):
    torch_ref = _run(world, impl="torch")
    persistent = _run(world, impl="persistent")
    pool = _run(world, impl="pool")
    _same(pool, persistent, exact=True)
    _same(pool, torch_ref, exact=False, tol=1e-5)
    assert pool["peak"] == 2 and pool["live"] == 0 and pool["buckets"] > 2  # the bound was reached, never passed
    assert pool["bucket_bytes"] == 0 and persistent["bucket_bytes"] > 0  # no full-size buffer kept (the control)


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_main_grads_masters_pool_equals_persistent(world):
    persistent = _run(world, impl="persistent", bf16=True)
    pool = _run(world, impl="pool", bf16=True)
    _same(pool, persistent, exact=True)
    assert pool["peak"] == 2 and pool["bucket_bytes"] == 0 and persistent["bucket_bytes"] > 0


@pytest.mark.parametrize("bf16", [False, True])
def test_accumulation_choices(bf16):
    """4 micro-batches: "full" under no_sync is persistent's arithmetic (bitwise); "reduce_scatter" reduces every
    micro-batch: bitwise equal to persistent buffers synchronizing every micro-batch, within rounding of no_sync."""
    world = 2
    persistent_nosync = _run(world, impl="persistent", bf16=bf16, micro=4, no_sync=True)
    persistent_sync = _run(world, impl="persistent", bf16=bf16, micro=4)
    full = _run(world, impl="pool", bf16=bf16, micro=4, no_sync=True, accumulate="full")
    rs = _run(world, impl="pool", bf16=bf16, micro=4, no_sync=True, accumulate="reduce_scatter")
    _same(full, persistent_nosync, exact=True)
    _same(rs, persistent_sync, exact=True)
    _same(rs, persistent_nosync, exact=False, tol=2e-2 if bf16 else 1e-5)
    for res in (full, rs):
        assert res["peak"] <= 2 and res["live"] == 0 and res["held"] == 0
    # "full" holds one accumulation buffer per main-gradient bucket between micro-batches (bf16), none for fp32.
    assert (full["peak_held"] > 0) == bf16 and rs["peak_held"] == 0
    if bf16:
        assert max(full["lent_after_backward"]) == 0  # the held buffers are outside the bound, released after sync
    if not bf16:
        torch_ref = _run(world, impl="torch", micro=4, no_sync=True)
        _same(full, torch_ref, exact=False, tol=1e-5)
        _same(rs, torch_ref, exact=False, tol=1e-5)


@pytest.mark.parametrize("bound", [1, 3])
def test_pool_bound(bound):
    persistent = _run(2, impl="persistent", bf16=True, cap=0.0003)
    pool = _run(2, impl="pool", bf16=True, pool_buffers=bound, cap=0.0003)
    _same(pool, persistent, exact=True)
    assert pool["buckets"] > bound and pool["bound"] == bound and pool["peak"] == bound and pool["live"] == 0


def _largest_allocation(fn):
    """``fn()``'s result and the bytes of the largest single CPU allocation it made (torch's profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    return out, max([e.self_cpu_memory_usage for e in prof.events()] + [0])


def construction_worker(rank: int, world: int, impl: str) -> dict:
    """bf16 parameters in one bucket, float32 main gradients: the largest allocation of building the wrapper and the
    optimizer, then of two steps, against the bytes of the bucket's float32 buffer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 64)).to(BF16)
    numel = sum(p.numel() for p in model.parameters())

    def build():
        ddp = fastcoll.DDP(model, main_grad_dtype=torch.float32, bucket_cap_mb=25)
        kw = {"grad_buffers": "pool", "pool_buffers": 1} if impl == "pool" else {}
        inner = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        return ddp, fastcoll.ShardedOptimizer(inner, ddp, grads="sharded", master_dtype=torch.float32, **kw)

    (ddp, opt), built = _largest_allocation(build)
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(rank)).to(BF16)

    def steps():
        for _ in range(2):
            opt.zero_grad()
            ddp(x).float().pow(2).mean().backward()
            opt.step()
        opt.finish_param_sync()

    _, stepped = _largest_allocation(steps)
    slot = opt.grad_pool.slot_bytes if opt.grad_pool is not None else None
    return {"numel": numel, "buckets": len(ddp.reducer.buckets), "built": built, "stepped": stepped, "slot": slot}


def layout_worker(rank: int, world: int, impl: str) -> dict:
    """bf16 parameters with float32 main gradients, one far larger than the cap (an embedding's part): the buckets
    and the pool's slot."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(1500, 16), nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8)).to(BF16)
    ddp = fastcoll.DDP(model, main_grad_dtype=torch.float32, bucket_cap_mb=0.008, first_bucket_mb=0.008)
    kw = {"grad_buffers": "pool"} if impl == "pool" else {}
    opt = fastcoll.ShardedOptimizer(torch.optim.AdamW(ddp.parameters(), lr=1e-2), ddp, grads="sharded",
                                    master_dtype=torch.float32, **kw)  # fmt: skip
    for step in range(2):
        opt.zero_grad()
        idx = torch.randint(0, 1500, (6, 3), generator=torch.Generator().manual_seed(10 * step + rank))
        ddp(idx).float().pow(2).mean().backward()
        opt.step()
    opt.finish_param_sync()
    pool = opt.grad_pool
    return {"buckets": [b["names"] for b in ddp.bucket_info()], "numel": [b["numel"] for b in ddp.bucket_info()],
            "slot": pool.slot_bytes if pool else None, "chunked": [pool.chunked(b) for b in ddp.reducer.buckets] if pool
            else None, "params": [q.detach().double().clone() for q in model.parameters()]}  # fmt: skip


@pytest.mark.parametrize("world", [2, 3])
def test_pooled_buckets_count_their_buffers_bytes_and_a_large_parameter_is_alone(world):
    """Under the pool ``bucket_cap_mb`` counts the bytes of the buffers a slot holds: with float32 main gradients of
    a bf16 model, 4 per parameter, so a bucket holds half the parameters of a persistent one and a slot about the
    cap; a parameter larger than the cap (the embedding) has a bucket of its own, reduced in chunks, so that no
    other gradient waits for its pack. The results equal persistent buffers' (bitwise at 2 ranks)."""
    pool, persistent = (run_ranks(layout_worker, world, impl, timeout=120)[0] for impl in ("pool", "persistent"))
    cap = int(0.008 * 2**20)
    assert ["0.weight"] in pool["buckets"] and ["0.weight"] not in persistent["buckets"]
    emb = pool["buckets"].index(["0.weight"])
    assert pool["chunked"][emb] and sum(pool["chunked"]) == 1
    others = [n for k, n in enumerate(pool["numel"]) if k != emb]
    largest = 32 * 32  # the largest parameter but the embedding
    assert all(4 * n < cap + 4 * largest for n in others)  # closed once their float32 bytes reach the cap
    assert len(pool["buckets"]) > len(persistent["buckets"])
    assert pool["slot"] < cap + 4 * largest + 4096  # about the cap (whole ranks' slices, alignment)
    for a, b in zip(pool["params"], persistent["params"]):
        assert torch.equal(a, b) if world == 2 else torch.allclose(a, b, rtol=1e-2, atol=1e-4), (a - b).abs().max()


def test_the_pool_never_allocates_the_full_float32_buckets():
    """With the pool, the float32 main-gradient buckets are never allocated: DDP's construction defers its buckets'
    buffers to their first need, and the optimizer built before the first forward installs pooled ones. Seen through
    torch's profiler: the largest allocation of construction stays below the float32 bucket (persistent buckets, the
    control, allocate it), and during steps only the pool's one slot reaches its size."""
    pool, persistent = (run_ranks(construction_worker, 2, impl, timeout=120)[0] for impl in ("pool", "persistent"))
    full = 4 * pool["numel"]  # the one bucket's float32 buffer (unpadded)
    assert pool["buckets"] == persistent["buckets"] == 1
    assert persistent["built"] >= full  # the control: the probe sees a full float32 bucket
    assert pool["built"] < full, (pool["built"], full)
    assert pool["slot"] >= full and pool["stepped"] <= pool["slot"]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("bf16", [False, True])
def test_buckets_larger_than_a_pool_buffer_reduce_in_chunks(world, bf16):
    """A cap below the parameters' sizes: their buckets are reduce-scattered in cap-sized chunks (each rank's range
    sliced alike). Bitwise at 2 ranks (each element is one sum of two values); beyond, gloo's all-reduce of a
    chunk may add the ranks' values in another order than the whole bucket's: within rounding."""
    persistent = _run(world, impl="persistent", bf16=bf16, cap=0.0003)
    pool = _run(world, impl="pool", bf16=bf16, cap=0.0003, pool_buffers=2)
    _same(pool, persistent, exact=world == 2, tol=2e-2 if bf16 else 1e-6)
    assert pool["peak"] == 2 and pool["live"] == 0 and pool["bucket_bytes"] == 0 and pool["chunked"] > 0


def test_chunks_with_a_wire_dtype_the_nonfinite_check_and_clipping():
    """Chunked packs cast float32 main gradients to a bf16 wire, raise the non-finite flag, feed the norm."""
    for extra in (dict(comm_dtype=BF16), dict(clip=0.05, check_nonfinite=True)):
        persistent = _run(2, impl="persistent", bf16=True, cap=0.0003, **extra)
        pool = _run(2, impl="pool", bf16=True, cap=0.0003, **extra)
        _same(pool, persistent, exact=True)
        assert pool["chunked"] > 0 and pool.get("norms") == persistent.get("norms")


@pytest.mark.parametrize("world", [2, 3])
def test_accumulation_and_one_rounding_with_buckets_larger_than_the_cap(world):
    """Buckets larger than the cap, 4 micro-batches: accumulate="full" reduces the held bucket whole (persistent's
    arithmetic, bitwise), "reduce_scatter" in chunks every micro-batch (bitwise at 2 ranks against persistent buckets
    synchronizing every micro-batch, within rounding beyond); with comm_accum_dtype the pool is not chunked (its
    buffers hold the largest bucket) and equals persistent buffers bitwise."""
    acc = dict(bf16=True, cap=0.0003, micro=4)
    full = _run(world, impl="pool", no_sync=True, accumulate="full", **acc)
    _same(full, _run(world, impl="persistent", no_sync=True, **acc), exact=True)
    assert full["chunked"] > 0 and full["peak_held"] > 0 and full["held"] == 0 and full["live"] == 0
    rs = _run(world, impl="pool", no_sync=True, accumulate="reduce_scatter", **acc)
    _same(rs, _run(world, impl="persistent", **acc), exact=world == 2, tol=2e-2)
    assert rs["chunked"] > 0 and rs["peak"] <= 2 and rs["peak_held"] == 0
    one = dict(bf16=True, cap=0.0003, comm_dtype=BF16, comm_accum_dtype=torch.float32)
    pool = _run(world, impl="pool", **one)
    _same(pool, _run(world, impl="persistent", **one), exact=True)
    assert pool["chunked"] == 0 and pool["peak"] <= 2


def test_find_unused_static_graph_clip_nonfinite_check():
    for extra in (dict(find_unused=True), dict(static_graph=True), dict(clip=0.05, check_nonfinite=True)):
        persistent = _run(2, impl="persistent", bf16=True, **extra)
        pool = _run(2, impl="pool", bf16=True, **extra)
        _same(pool, persistent, exact=True)
        if "clip" in extra:
            assert pool["norms"] == persistent["norms"]


def test_comm_accum_dtype_under_the_pool():
    for world in (2, 3):
        cfg = dict(bf16=True, comm_dtype=BF16, comm_accum_dtype=torch.float32)
        _same(_run(world, impl="pool", **cfg), _run(world, impl="persistent", **cfg), exact=True)


def test_overlapped_param_gather_with_pool():
    persistent = _run(2, impl="persistent", bf16=True, overlap_param_gather=True)
    pool = _run(2, impl="pool", bf16=True, overlap_param_gather=True, pool_buffers=1)
    _same(pool, persistent, exact=True)
    assert pool["peak"] == 1


# --------------------------------------------------------------------------- checkpoints


def _ckpt_model(impl: str):
    model = Net().to(BF16)
    ddp = fastcoll.DDP(model, main_grad_dtype=torch.float32, bucket_cap_mb=0.0003, first_bucket_mb=0.0003)
    kw = {"grad_buffers": "pool"} if impl == "pool" else {}
    opt = fastcoll.ShardedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), ddp, grads="sharded", master_dtype=torch.float32, **kw
    )
    return model, ddp, opt


def _steps(ddp, opt, rank: int, world: int, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        rows = torch.cat([_x(step, 0, r) for r in range(4)])  # the same global batch at every world size
        mine = rows[rank * 16 // world : (rank + 1) * 16 // world].to(BF16)
        (ddp(mine).float().pow(2).sum() * (world / 16)).backward()
        opt.step()
    opt.finish_param_sync()


def ckpt_save(rank: int, world: int, directory: str) -> None:
    model, ddp, opt = _ckpt_model("pool")
    _steps(ddp, opt, rank, world, range(2))
    ckpt.save_sharded(opt, directory)
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(directory, "model.pt"))


def ckpt_load(rank: int, world: int, directory: str, impl: str) -> dict:
    model, ddp, opt = _ckpt_model(impl)
    if directory:
        model.load_state_dict(torch.load(os.path.join(directory, "model.pt"), weights_only=True))
        ckpt.load_sharded(opt, directory)
        _steps(ddp, opt, rank, world, range(2, 4))
    else:
        _steps(ddp, opt, rank, world, range(4))
    return {"params": [q.detach().double().clone() for q in model.parameters()]}


def test_checkpoint_saved_with_pool_loads_without_it_and_at_another_world_size(tmp_path):
    d = str(tmp_path / "ck")
    os.makedirs(d)
    run_ranks(ckpt_save, 2, d, timeout=120)
    straight = run_ranks(ckpt_load, 2, "", "persistent", timeout=120)[0]
    _same(run_ranks(ckpt_load, 2, d, "persistent", timeout=120)[0], straight, exact=True)
    _same(run_ranks(ckpt_load, 2, d, "pool", timeout=120)[0], straight, exact=True)
    other = run_ranks(ckpt_load, 3, d, "persistent", timeout=120)[0]  # another world size: within 16-bit noise
    _same(other, straight, exact=False, tol=2e-2)


# --------------------------------------------------------------------------- refusals


def refusal_worker(rank: int, world: int) -> list:
    msgs = []

    def refused(exc_type, **kw):
        model = Net()
        ddp = fastcoll.DDP(model, gradient_as_bucket_view=kw.pop("as_view", False))
        with pytest.raises(exc_type) as info:
            fastcoll.ShardedOptimizer(torch.optim.AdamW(model.parameters()), ddp, **kw)
        msgs.append(str(info.value))

    refused(ValueError, grads="full", grad_buffers="pool")
    refused(ValueError, grads="sharded", grad_buffers="pool", as_view=True)
    refused(ValueError, grads="sharded", grad_buffers="pool", pool_buffers=0)
    refused(ValueError, grads="sharded", grad_buffers="pool", accumulate="sometimes")
    refused(ValueError, grads="sharded", accumulate="full")
    refused(ValueError, grads="sharded", grad_buffers="pooled")
    # join() for uneven inputs: refused for divided buckets, so under the pool too (on every rank, before a collective)
    model = Net()
    ddp = fastcoll.DDP(model)
    fastcoll.ShardedOptimizer(torch.optim.AdamW(model.parameters()), ddp, grads="sharded", grad_buffers="pool")
    with pytest.raises(ValueError) as info:
        with ddp.join():
            pass
    msgs.append(str(info.value))
    return msgs


def test_refusals():
    per_rank = run_ranks(refusal_worker, 2, timeout=120)
    keys = ["grads='sharded'", "gradient_as_bucket_view", "pool_buffers", "accumulate", "pool", "grad_buffers", "join()"]
    for msgs in per_rank:
        assert len(msgs) == len(keys)
        for m, key in zip(msgs, keys):
            assert m.startswith("fastcoll.ShardedOptimizer" if key != "join()" else "fastcoll.DDP") and key in m, m


# --------------------------------------------------------------------------- other suites, under the pool


def _pooled(built: Optional[list] = None, **pool_kw):
    """A stand-in for the ``fastcoll`` module whose ShardedOptimizer gives grads="sharded" ``pool_kw`` (none: as is)
    unless the caller chose its own; ``built`` collects whether each one built has a pool."""
    import types

    class PooledSharded(fastcoll.ShardedOptimizer):
        def __init__(self, optimizer, model, *, grads="full", **kw):
            super().__init__(optimizer, model, grads=grads, **({**pool_kw, **kw} if grads == "sharded" else kw))
            if built is not None:
                built.append(self.grad_pool is not None)

    shim = types.ModuleType("fastcoll")
    shim.__dict__.update(fastcoll.__dict__)
    shim.ShardedOptimizer = PooledSharded
    return shim


def under_pool(rank: int, world: int, module: str, fn: str, *args) -> dict:
    """Run ``module.fn(rank, world, *args)`` (a worker of another test file) with every ShardedOptimizer that it
    builds with grads="sharded" given grad_buffers="pool"; returns its result and how many were pooled."""
    import importlib

    mod = importlib.import_module(module)
    built: list = []
    mod.fastcoll = _pooled(built, grad_buffers="pool")
    return {"result": getattr(mod, fn)(rank, world, *args), "pooled": sum(built)}


@pytest.mark.parametrize("world", [2, 3])
def test_contract_table_holds_under_the_pool(world):
    """Every entry of the ShardedOptimizer contract (p.grad, zero_grad, schedulers, GradScaler, clipping, state dicts
    and DCP, hooks, ...) behaves under the pool as tests/test_sharded_contract.py requires of grads="sharded"."""
    import test_sharded_contract as contract

    cases = [c for c in contract.CASES if c[1] == "sharded"]
    out = run_ranks(under_pool, world, "test_sharded_contract", "contract_worker", cases, timeout=580, pg_timeout=60)[0]
    res = out["result"]
    assert out["pooled"] >= len(cases), out["pooled"]  # every case ran on the pool
    problems = {c: p for c, r in res.items() for p in [contract.verdict(r)] if p is not None}
    assert len(res) == len(cases) and not problems, problems


def loops_under_pool(rank: int, world: int, cases: list, accumulate: str) -> dict:
    """tests/test_sharded_loops.py's worker with every grads="sharded" ShardedOptimizer on the pool (built by the
    contract's Run, or by the loop itself: Lightning's configure_optimizers).

    With ``accumulate="reduce_scatter"`` each micro-batch is reduced and the averages summed, where torch DDP averages
    the sum: every loop is judged within rounding, float32 to 1e-4 relative (AdamW's step divides by the root of the
    squared gradients, so a gradient that cancels to nearly zero turns a 1-ulp difference into a larger one; a
    micro-batch lost or counted twice differs by 1e-2).
    """
    import test_sharded_contract as contract
    import test_sharded_loops as loops

    table = loops.LOOPS
    if accumulate == "reduce_scatter":
        table = {name: (pattern, refusal, True, bf16) for name, (pattern, refusal, _, bf16) in table.items()}
        contract.FP32_ROUNDING_RTOL = 1e-4
    built: list = []
    contract.fastcoll = loops.fastcoll = _pooled(built, grad_buffers="pool", accumulate=accumulate)
    return {"result": contract.contract_worker(rank, world, cases, table=table), "pooled": sum(built)}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("accumulate", ["full", "reduce_scatter"])
def test_library_loops_hold_under_the_pool(accumulate, world):
    """The training loops libraries write (transformers' Trainer, accelerate, Lightning, EMA, no_sync accumulation,
    activation checkpointing) behave under the pool as tests/test_sharded_loops.py requires of grads="sharded",
    bitwise at 2 ranks with accumulate="full", within rounding with "reduce_scatter" (it sums the micro-batches'
    averages)."""
    import test_sharded_contract as contract
    import test_sharded_loops as loops

    cases = [c for c in loops.CASES if c[1] == "sharded"]
    out = run_ranks(loops_under_pool, world, cases, accumulate, timeout=580, pg_timeout=60)[0]
    res = out["result"]
    skipped = {c for c, r in res.items() if {s for s, _ in r} == {"skipped"}}  # a library that does not import here
    assert out["pooled"] >= len(cases) - len(skipped), out["pooled"]
    problems = {c: p for c, r in res.items() for p in [contract.verdict(r)] if p is not None}
    assert len(res) == len(cases) and not problems, problems


def combined_pool_worker(rank: int, world: int) -> None:
    """tests/test_sharded_compose.py's combination (no_sync accumulation x find_unused_parameters with a branch some
    ranks take in no_sync micro-batches only x comm_dtype x a checkpoint round trip) on the pool, each accumulation
    choice against the run that does its arithmetic: float32 against torch DDP + AdamW; a bf16 wire against
    persistent buffers, accumulating under no_sync for "full" and synchronizing every micro-batch for
    "reduce_scatter" (one bf16 rounding per micro-batch), bitwise at 2 ranks; at 3 the pool's re-cut buckets move
    where gloo cuts its chunks: within bfloat16 rounding."""
    import contextlib

    import test_sharded_compose as compose

    def run(accumulate, comm_dtype, resume_at=2, every_micro_batch=False, **kw):
        compose.fastcoll = _pooled(**({"grad_buffers": "pool", "accumulate": accumulate} if accumulate else {}))
        sync = contextlib.nullcontext if every_micro_batch else None
        saved = fastcoll.DDP.no_sync
        try:
            if sync is not None:
                fastcoll.DDP.no_sync = lambda self: sync()
            return compose._combined_run("fastcoll", "sharded", rank, world, comm_dtype, resume_at=resume_at, **kw)
        finally:
            fastcoll.DDP.no_sync = saved
            compose.fastcoll = fastcoll

    ref = compose._combined_run("torch", None, rank, world, None)
    for accumulate in ("reduce_scatter", "full"):
        compose._compare(ref, run(accumulate, None), f"pool {accumulate} x no_sync x find_unused x checkpoint vs torch", False)
    bf16 = torch.bfloat16
    refs = {"full": run(None, bf16, None, aligned=True), "reduce_scatter": run(None, bf16, None, True, aligned=True)}
    for accumulate, want in refs.items():
        got = run(accumulate, bf16, aligned=True)
        what = f"pool {accumulate} x no_sync x find_unused x comm_dtype x checkpoint"
        if world == 2:
            compose._compare(want, got, what)
        else:
            for n, p in want.items():
                assert torch.allclose(got[n], p, rtol=2e-3, atol=4e-3 * float(p.abs().max())), (what, n)


@pytest.mark.parametrize("world", [2, 3])
def test_combined_features_under_the_pool(world):
    run_ranks(combined_pool_worker, world, timeout=400)


@pytest.mark.parametrize("world", [2, 3])
def test_combined_features_bf16_main_grads_under_the_pool(world):
    """The bf16 combination (main gradients and masters, both grads modes, checkpoint round trip) with grads="sharded"
    on the pool, against grads="full"."""
    out = run_ranks(under_pool, world, "test_sharded_compose", "combined_bf16_worker", timeout=400)
    assert all(o["pooled"] >= 1 for o in out)


@pytest.mark.parametrize("where", [("emb.weight", 0), ("out.bias", -1)])
def test_grad_scaler_skips_the_same_steps_under_the_pool(where):
    """tests/test_sharded_optimizer.py's overflow on one rank: every rank skips the step, as torch DDP's."""
    out = run_ranks(under_pool, 2, "test_sharded_optimizer", "scaler_worker", "sharded", where, timeout=120)
    assert all(o["pooled"] == 1 for o in out)
    scales = [o["result"] for o in out]
    assert scales[0] == scales[1] and scales[0][2] < scales[0][1], scales


@pytest.mark.parametrize("aligned", [False, True], ids=["staged", "buffers"])
def test_under_torch_compile_with_the_pool(aligned):
    """tests/test_sharded_compose.py's torch.compile(fastcoll.DDP) case with the sharded run on the pool."""
    out = run_ranks(under_pool, 2, "test_sharded_compose", "compile_worker", "compile(ddp)", aligned, timeout=280)
    assert all(o["pooled"] == 1 for o in out)


# --------------------------------------------------------------------------- the bench section


def _run_pool_section(tmp_path) -> dict:
    """``python -m fastcoll.bench zero --smoke``'s pool section, run alone; the JSON it writes beside --json."""
    import json

    from fastcoll.bench import __main__ as cli
    from fastcoll.bench import zero_pool

    args = cli._args_for(cli.build_parser().parse_args(["zero", "--smoke", "--json", str(tmp_path / "zero.json")]), "zero")
    assert zero_pool.run_section(args) == 0
    return json.loads((tmp_path / "zero_pool.json").read_text())


def test_bench_section_smoke(tmp_path):
    """``python -m fastcoll.bench zero``'s pool section at the smoke level: it runs and writes its JSON beside --json."""
    from fastcoll.bench import zero_pool

    data = _run_pool_section(tmp_path)
    (row,) = data["results"]
    assert data["benchmark"] == "zero_pool" and row["world_size"] == 2 and row["label"].endswith(", N=2")
    assert data["config"]["methods"]["pool 1x10MB"]["bucket_cap_mb"] == 10.0
    assert set(row["methods"]) == set(zero_pool.MEMORY) and set(row["step_s"]) == set(zero_pool.TIMED)
    assert row["methods"]["pool"]["held"]["pool"] > 0 and row["methods"]["persistent"]["held"]["pool"] == 0
    for m in zero_pool.MEMORY:  # tensor bytes: at least what the method holds after its steps, on every rank
        assert all(b >= row["methods"][m]["held"]["total"] for b in row["methods"][m]["tensor_peak_bytes"]), m


def test_bench_section_one_rank_forced(tmp_path, monkeypatch):
    """The pool section at one rank with the collectives forced: the path ``bench zero --device cuda`` takes on one GPU,
    here on one gloo rank (held bytes 2 + 16/N at N = 1, the peak ratio reported without a target, the step target)."""
    from fastcoll.bench import zero_pool

    monkeypatch.setenv("FASTCOLL_FORCE_COLLECTIVES", "1")
    monkeypatch.setitem(zero_pool.CONFIGS, "smoke", {**zero_pool.CONFIGS["smoke"], "worlds": (1,)})
    (row,) = _run_pool_section(tmp_path)["results"]
    assert row["world_size"] == 1 and row["label"].endswith(", N=1")
    assert set(row["targets"]) == {"bytes pool", "bytes pool 1x10MB", "step", "step pool 1x10MB"}
    assert row["targets"]["bytes pool"]["pass"] and row["peak pool/persistent"] > 0
    assert row["tensor peak pool/persistent"] > 1  # at N = 1 the range is the whole bucket, and the pool comes on top
    assert row["methods"]["pool"]["held"]["pool"] > 0
