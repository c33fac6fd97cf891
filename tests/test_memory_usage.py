"""``fastcoll.DDP.memory_usage()`` and ``fastcoll.ShardedOptimizer.memory_usage()``: the bytes fastcoll holds, by kind.

Checked against what the configuration must hold, computed apart from the library: the buckets' bytes from
``bucket_info()``, the ranges and masters from the numbers of elements, AdamW's two moments per element (2 gloo
ranks; the ranges are padded, so those counts are bounds: at least the even share, at most one alignment unit more
per bucket).
"""

from __future__ import annotations

import pytest
import torch
from multiproc import run_ranks
from torch import nn

import fastcoll

pytestmark = pytest.mark.timeout(300)

BF16 = torch.bfloat16


class _Odd(nn.Module):
    """A parameter of an odd size (301): its bucket gets no flat parameter buffer, its all-gather a stage."""

    def __init__(self):
        super().__init__()
        self.odd = nn.Parameter(torch.randn(301) * 0.1)

    def forward(self, x):
        return x * (1 + self.odd[: x.shape[-1]])


def _model(dtype: torch.dtype, odd: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), *([_Odd()] if odd else []), nn.Linear(64, 16)).to(dtype)


def _step(ddp: nn.Module, opt, rank: int, dtype: torch.dtype) -> None:
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(rank)).to(dtype)
    opt.zero_grad()
    ddp(x).float().sum().backward()
    opt.step()
    getattr(opt, "finish_param_sync", lambda: None)()


def _usage(rank: int, world: int, case: str) -> dict:
    bf16 = case in ("persistent", "pool")
    model = _model(BF16 if bf16 or case == "staged" else torch.float32, odd=case == "staged")
    numel = sum(p.numel() for p in model.parameters())
    kw = {"main_grad_dtype": torch.float32} if bf16 else {"comm_dtype": BF16} if case != "staged" else {}
    ddp = fastcoll.DDP(model, bucket_cap_mb=0.01, first_bucket_mb=0.002, gradient_as_bucket_view=case in ("view", "staged"), **kw)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if case == "staged":  # the gradients are the buckets': a staged bucket's all-gather needs a stage of its own
        opt = fastcoll.ShardedOptimizer(inner, ddp, grads="full")
    elif not bf16:
        opt = inner
    else:
        pool = {"grad_buffers": "pool"} if case == "pool" else {}
        opt = fastcoll.ShardedOptimizer(inner, ddp, grads="sharded", master_dtype=torch.float32, **pool)
    for _ in range(2):
        _step(ddp, opt, rank, BF16 if bf16 or case == "staged" else torch.float32)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    out = {"ddp": ddp.memory_usage(), "numel": numel, "sizes": sizes, "bucket_bytes": sum(b["bytes"] for b in ddp.bucket_info()),
           "buckets": len(ddp.bucket_info())}  # fmt: skip
    if bf16 or case == "staged":
        out["opt"] = opt.memory_usage()
        out["pool_nbytes"] = opt.grad_pool.nbytes if opt.grad_pool is not None else 0
        out["staged"] = opt.staged_parameters()
    return out


@pytest.mark.parametrize("case", ["plain", "view"])
def test_ddp_memory_usage_counts_its_buckets_and_wire_buffers(case):
    """float32 gradients, a bf16 wire: the buckets are the wire (2 bytes per element); with gradients as bucket
    views they hold the float32 gradients (bucket_info's bytes) and a separate bf16 wire buffer."""
    for r in run_ranks(_usage, 2, case):
        u, n = r["ddp"], r["numel"]
        assert r["bucket_bytes"] == 4 * n
        assert (u["buckets"], u["comm_buffers"]) == ((2 * n, 0) if case == "plain" else (4 * n, 2 * n))
        assert u["grad_ranges"] == 0 and u["param_stages"] == 0


@pytest.mark.parametrize("case", ["persistent", "pool"])
def test_sharded_memory_usage_counts_ranges_masters_state_and_pool(case):
    """bf16 parameters, float32 main gradients, grads="sharded" with float32 masters: per rank a float32 range of
    the gradients, float32 masters and AdamW's two float32 moments of about half the elements. Persistent buckets
    hold the float32 main gradients whole (the range is a view of them); pooled ones nothing after the step, the
    range is a buffer of its own and the pool's buffers are the optimizer's."""
    results = run_ranks(_usage, 2, case)
    for r in results:
        u, o, n, b = r["ddp"], r["opt"], r["numel"], r["buckets"]
        half = 4 * n / 2
        # every parameter lives in its bucket's flat parameter buffer and receives the all-gather there: no stage
        assert r["staged"] == [] and u["param_stages"] == 0
        assert half <= o["masters"] <= half + 4 * 64 * b  # a range may be padded to the alignment
        assert 2 * half <= o["state"] <= 2 * (half + 4 * 64 * b) + 64 * b  # + AdamW's step counters
        if case == "persistent":  # the reduced ranges are views of the buckets: counted there
            assert u["buckets"] >= 4 * n and u["grad_ranges"] == 0 and o["grad_pool"] == 0
        else:
            assert half <= u["grad_ranges"] <= half + 4 * 64 * b
            assert u["buckets"] == 0 and o["grad_pool"] == r["pool_nbytes"] > 0
    assert sum(r["opt"]["masters"] for r in results) >= 4 * results[0]["numel"]  # the ranks' ranges cover every element


def test_staged_all_gathers_count_their_stages():
    """bfloat16, gradients as bucket views, grads="full": the odd parameter's bucket has no flat parameter buffer
    (301 bf16 elements leave the next unaligned), so its parameters' all-gather goes through a stage of its own (the
    gradient bucket is the gradients'): at least their bf16 bytes."""
    for r in run_ranks(_usage, 2, "staged"):
        u, o = r["ddp"], r["opt"]
        staged = sum(r["sizes"][n] for n in r["staged"])
        assert "2.odd" in r["staged"] and 2 * staged <= u["param_stages"] <= 2 * staged + 64 * r["buckets"]
        assert (
            2 * r["numel"] <= u["buckets"] <= 2 * r["numel"] + 64 * r["buckets"]
            and u["grad_ranges"] == 0
            and o["masters"] == 0
            and o["grad_pool"] == 0
        )
