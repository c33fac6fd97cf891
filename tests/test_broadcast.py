"""CoalescedBroadcast / broadcast_coalesced: one message per device, every dtype and layout arrives intact.

Each rank starts from different values; after the broadcast every tensor must
equal the source rank's bit for bit, including integer and bool tensors that
share the message with floating-point ones, non-dense (strided) tensors that
are copied one by one, zero-element tensors, and a cap that forces several
messages. The number of collectives is counted by wrapping dist.broadcast.
"""

from __future__ import annotations

import pytest
import torch

from tests.multiproc import run_ranks

pytestmark = pytest.mark.timeout(120)


def _tensors(rank: int, round_: int = 0):
    g = torch.Generator().manual_seed(100 + rank + 10 * round_)
    base = torch.randn(6, 10, generator=g)
    return [
        torch.randn(5, generator=g),  # float32
        torch.randint(0, 1000, (3,), generator=g),  # int64 (num_batches_tracked-like)
        torch.randn(7, generator=g).half(),  # odd-sized float16: the next section must realign
        torch.randn(4, 3, generator=g).double(),
        torch.randint(0, 2, (9,), generator=g).bool(),
        torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
        base[:, ::2],  # non-dense float32: copied elementwise
        torch.empty(0),
        torch.randn(3, generator=g).bfloat16(),
        torch.tensor(rank * 7 + 1, dtype=torch.int32),
    ]


def _check_broadcast(rank: int, world_size: int, cap_bytes: int, src: int):
    import torch.distributed as dist

    from fastcoll.ddp.broadcast import CoalescedBroadcast

    calls = []
    real = dist.broadcast

    def counting(tensor, *a, **k):
        calls.append(tensor.numel())
        return real(tensor, *a, **k)

    dist.broadcast = counting
    try:
        mine = _tensors(rank)
        before_strides = [t.stride() for t in mine]
        bc = CoalescedBroadcast(mine, cap_bytes)
        for round_ in range(2):  # the messages are reused
            if round_:
                for t, new in zip(mine, _tensors(rank, round_)):  # fresh per-rank values, in place
                    t.copy_(new)
            bc(None, src)
            for i, (t, e) in enumerate(zip(mine, _tensors(src, round_))):
                assert t.dtype == e.dtype and t.shape == e.shape, i
                assert torch.equal(t, e), f"round {round_}: tensor {i} ({t.dtype}) differs from rank {src}'s on rank {rank}"
            assert [t.stride() for t in mine] == before_strides
        return len(calls), len(bc.messages)
    finally:
        dist.broadcast = real


@pytest.mark.parametrize("src", [0, 1])
def test_one_message_for_mixed_dtypes(src):
    counts = run_ranks(_check_broadcast, 2, 1 << 30, src)
    for calls, messages in counts:
        assert messages == 1
        assert calls == 2  # two rounds, one collective each


def test_cap_splits_into_messages_and_one_shot_helper():
    counts = run_ranks(_check_broadcast, 3, 64, 2)
    for calls, messages in counts:
        assert messages > 1
        assert calls == 2 * messages


def _one_shot(rank: int, world_size: int):
    from fastcoll.ddp.broadcast import broadcast_coalesced

    mine = _tensors(rank)
    broadcast_coalesced(mine, None, 1)
    return all(torch.equal(a, b) for a, b in zip(mine, _tensors(1)))


def test_broadcast_coalesced_function():
    assert run_ranks(_one_shot, 2) == [True, True]


def test_staging_memory_is_one_message_not_the_whole_set():
    """Broadcasting a whole model needs one message of staging memory, not a second copy of the model."""
    from fastcoll.ddp.broadcast import CoalescedBroadcast

    tensors = [torch.randn(1000) for _ in range(64)]  # 256,000 bytes in all
    cap = 16_000
    bc = CoalescedBroadcast(tensors, cap)
    assert len(bc.messages) == 16
    assert bc.staging_bytes == max(m.nbytes for m in bc.messages) <= cap
    assert sum(m.nbytes for m in bc.messages) == 256_000  # what holding every message at once would cost
    big = CoalescedBroadcast([torch.randn(10_000), torch.randn(10)], cap)  # a tensor above the cap travels alone
    assert big.staging_bytes == 40_000
