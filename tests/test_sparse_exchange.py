"""SparseExchange: the sum of per-rank sparse gradients, built from two dense all-gathers.

Each rank holds a random coalesced sparse tensor (random row counts, including
zero rows on some or all ranks, duplicate rows across ranks, one or two sparse
dimensions, float32/float64/bfloat16 values). After the exchange every rank
must hold the float64 sum of all ranks' dense equivalents, coalesced, and the
exact same indices and values as every other rank. The collectives are counted:
one all-gather of row counts, and one of rows only when some rank has rows.
"""

from __future__ import annotations

import pytest
import torch

from tests.multiproc import run_ranks

pytestmark = pytest.mark.timeout(120)

# (shape, sparse_dim, dtype, rows per rank for each round: None = random in [0, 6])
CASES = [
    ((20, 6), 1, torch.float32),  # nn.Embedding's layout
    ((9, 4, 3), 2, torch.float64),  # two sparse dimensions, one dense
    ((30, 5), 1, torch.bfloat16),
    ((12,), 1, torch.float32),  # no dense dimension
]


def _local(rank: int, round_: int, shape, sparse_dim: int, dtype, zero_ranks):
    g = torch.Generator().manual_seed(1000 * round_ + rank)
    n = 0 if rank in zero_ranks else int(torch.randint(1, 7, (1,), generator=g))
    idx = torch.stack([torch.randint(0, shape[d], (n,), generator=g) for d in range(sparse_dim)])
    vals = torch.randn(n, *shape[sparse_dim:], generator=g).to(dtype)
    return torch.sparse_coo_tensor(idx, vals, shape, check_invariants=True).coalesce()


def _exchange_worker(rank: int, world_size: int):
    import torch.distributed as dist

    from fastcoll.distributed.sparse import SparseExchange, all_gather_flat

    calls = []

    def counting(out, inp, what):
        calls.append(inp.numel())
        return all_gather_flat(out, inp, dist.group.WORLD)

    for shape, sparse_dim, dtype in CASES:
        # zero rows: on no rank, on rank 0 only, on every rank
        for round_, zero_ranks in enumerate([(), (0,), tuple(range(world_size))]):
            mine = _local(rank, round_, shape, sparse_dim, dtype, zero_ranks)
            everyone = [_local(r, round_, shape, sparse_dim, dtype, zero_ranks) for r in range(world_size)]
            expected = sum(t.to(torch.float64).to_dense() for t in everyone)
            calls.clear()
            x = SparseExchange(mine, world_size, counting, lambda work, what: work.wait(), "test")
            x.start_gather()
            got = x.result()
            all_empty = len(zero_ranks) == world_size
            assert len(calls) == (1 if all_empty else 2), (shape, zero_ranks, calls)
            assert all(c > 0 for c in calls), f"a collective moved zero elements: {calls}"
            assert got.is_sparse and got.is_coalesced() and got.dtype == dtype and got.shape == mine.shape
            tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(
                got.to(torch.float64).to_dense(),
                expected,
                **tol,
                msg=lambda m: f"{shape} {dtype} zero rows on {zero_ranks}: {m}",
            )
            # identical on every rank, bit for bit
            gathered = [None] * world_size
            dist.all_gather_object(gathered, (got._indices().tolist(), got._values().float().tolist()))
            assert all(g == gathered[0] for g in gathered), f"{shape}: ranks disagree"


@pytest.mark.parametrize("world_size", [2, 3])
def test_sparse_exchange_sums_across_ranks(world_size):
    run_ranks(_exchange_worker, world_size, timeout=90)
