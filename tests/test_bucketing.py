"""fastcoll.bucketing: bucket assignment with one cap and with per-bucket caps, and parsing ``bucket_cap_mb``.

Pure bookkeeping, no processes: the layouts are checked parameter by
parameter against hand-worked expectations.
"""

from __future__ import annotations

import math

import pytest
import torch

from fastcoll import bucketing
from fastcoll.bucketing import (
    MIB,
    ParamSpec,
    assign_buckets,
    bucket_caps_from_mb,
    caps_to_mb,
)


def f32(n: int) -> ParamSpec:
    return ParamSpec(n, 4, ("cpu", torch.float32))


def f16(n: int) -> ParamSpec:
    return ParamSpec(n, 2, ("cpu", torch.float16))


# ------------------------------------------------------------ one cap (DDP's rule)


def test_single_cap_semantics():
    specs = [f32(10), f16(10), f32(10), f16(10), f32(10)]
    order = bucketing.reverse_registration_order(5)
    # first cap 40 bytes: one f32 param; later cap 80 bytes: two.
    assert assign_buckets(specs, order, 40, 80) == [[4], [3, 1], [2, 0]]
    assert assign_buckets(specs, order, 10**9, 10**9) == [[3, 1], [4, 2, 0]]
    assert assign_buckets(specs, order, 1, 1) == [[4], [3], [2], [1], [0]]


def test_bucket_closes_once_it_reaches_its_cap():
    # 4 params of 40 bytes; cap 80: the bucket closes when it reaches 80, the crossing param joins it.
    specs = [f32(10)] * 4
    order = [3, 2, 1, 0]
    assert assign_buckets(specs, order, 80, 80) == [[3, 2], [1, 0]]
    assert assign_buckets(specs, order, 70, 70) == [[3, 2], [1, 0]]  # 40 < 70, 80 >= 70: closes with two
    assert assign_buckets(specs, order, 90, 90) == [[3, 2, 1], [0]]


def test_a_parameter_above_alone_above_gets_a_bucket_of_its_own():
    # 40-byte params and one of 400 bytes (index 1); cap 200: without the rule the large one closes the bucket it joins
    specs = [f32(10), f32(100), f32(10), f32(10), f32(10)]
    order = [4, 3, 2, 1, 0]
    assert assign_buckets(specs, order, 200, 200) == [[4, 3, 2, 1], [0]]
    # with it, the open bucket closes before it (its gradients wait for no larger one), and it fills one alone
    assert assign_buckets(specs, order, 200, 200, alone_above=200) == [[4, 3, 2], [1], [0]]
    # first in order, or below a larger cap of the list: still alone; the list counts its bucket as any other
    assert assign_buckets(specs, [1, 4, 3, 2, 0], 200, 200, alone_above=200) == [[1], [4, 3, 2, 0]]
    assert assign_buckets(specs, order, 1, [80, 1000, 80], alone_above=300) == [[4, 3], [2], [1], [0]]
    # at or below the threshold: the usual rule
    assert assign_buckets(specs, order, 200, 200, alone_above=400) == [[4, 3, 2, 1], [0]]


def test_sparse_parameters_get_their_own_bucket_and_do_not_count():
    specs = [f32(10), ParamSpec(10, 4, ("cpu", torch.float32), sparse=True), f32(10), f32(10)]
    order = [3, 2, 1, 0]
    assert assign_buckets(specs, order, 40, 10**6) == [[3], [1], [2, 0]]
    # with per-bucket caps, the sparse bucket does not use up a cap
    assert assign_buckets(specs, order, 1, [40, 10**6]) == [[3], [1], [2, 0]]


def test_buckets_sorted_by_completion_across_dtypes():
    specs = [f32(10), f16(10), f32(10), f16(10)]
    order = [0, 1, 2, 3]
    # f32: [0] closes at 40 bytes, [2] is the next; f16: 20 + 20 = 40 closes [1, 3].
    # sorted by the position of the last member: [0] (0), [2] (2), [1, 3] (3).
    assert assign_buckets(specs, order, 40, 40) == [[0], [2], [1, 3]]


def test_errors():
    specs = [f32(10)] * 3
    with pytest.raises(ValueError, match="permutation"):
        assign_buckets(specs, [0, 1], 1, 1)
    with pytest.raises(ValueError, match="positive"):
        assign_buckets(specs, [0, 1, 2], 0, 1)
    with pytest.raises(ValueError, match="positive"):
        assign_buckets(specs, [0, 1, 2], 1, 0)
    with pytest.raises(ValueError, match="non-empty"):
        assign_buckets(specs, [0, 1, 2], 1, [])
    with pytest.raises(ValueError, match="non-empty"):
        assign_buckets(specs, [0, 1, 2], 1, [40, 0])


# ------------------------------------------------------------------ per-bucket caps


def test_list_caps_per_bucket_last_repeats():
    specs = [f32(10)] * 8  # 40 bytes each
    order = list(range(7, -1, -1))
    # caps 40, 80, then 120 repeating: 1 param, 2 params, 3 params, then the rest (2 params, still open)
    assert assign_buckets(specs, order, 10**9, [40, 80, 120]) == [[7], [6, 5], [4, 3, 2], [1, 0]]
    # first_cap_bytes is ignored for a list
    assert assign_buckets(specs, order, 1, [40, 80, 120]) == assign_buckets(specs, order, 10**9, [40, 80, 120])
    # a one-element list is one cap for every bucket, first included
    assert assign_buckets(specs, order, 1, [80]) == assign_buckets(specs, order, 80, 80)
    assert assign_buckets(specs, order, 1, (80,)) == [[7, 6], [5, 4], [3, 2], [1, 0]]


def test_list_caps_equal_to_two_caps_match_the_int_form():
    specs = [f32(n) for n in (3, 100, 7, 50, 1, 1, 200, 9, 30, 30, 30)]
    order = bucketing.reverse_registration_order(len(specs))
    for first, cap in ((4, 4), (40, 400), (400, 40), (1, 10**9), (123, 456)):
        assert assign_buckets(specs, order, first, [first, cap]) == assign_buckets(specs, order, first, cap)


def test_list_caps_count_per_dtype_group():
    # f32 and f16 groups each go through the cap list on their own.
    specs = [f32(10), f16(20), f32(10), f16(20), f32(10), f16(20)]  # every param 40 bytes
    order = [0, 1, 2, 3, 4, 5]
    layout = assign_buckets(specs, order, 1, [40, 10**6])
    assert sorted(map(sorted, layout)) == [[0], [1], [2, 4], [3, 5]]
    assert layout == [[0], [1], [2, 4], [3, 5]]


def test_every_parameter_in_exactly_one_bucket():
    g = torch.Generator().manual_seed(0)
    for trial in range(50):
        n = int(torch.randint(1, 40, (1,), generator=g))
        specs = [
            f32(int(torch.randint(1, 1000, (1,), generator=g))) if i % 3 else f16(int(torch.randint(1, 1000, (1,), generator=g)))
            for i in range(n)
        ]
        order = torch.randperm(n, generator=g).tolist()
        caps = [int(c) for c in torch.randint(1, 4000, (1 + trial % 4,), generator=g)]
        layout = assign_buckets(specs, order, 1, caps)
        assert sorted(i for b in layout for i in b) == list(range(n))
        for b in layout:
            assert len({specs[i].key for i in b}) == 1
            pos = [order.index(i) for i in b]
            assert pos == sorted(pos)  # members in reduction order


# ----------------------------------------------------------------- bucket_caps_from_mb


def test_caps_from_mb_numbers():
    assert bucket_caps_from_mb(25) == 25 * MIB
    assert bucket_caps_from_mb(0.5) == MIB // 2
    assert bucket_caps_from_mb(None) == 25 * MIB  # the default
    assert bucket_caps_from_mb(1e-6) == 1  # int(1e-6 MiB) = 1 byte, as DDP always computed it
    assert bucket_caps_from_mb(1e-9) == 1  # positive but below a byte: one byte
    assert bucket_caps_from_mb(0.002) == int(0.002 * MIB)
    import numpy as np

    assert bucket_caps_from_mb(np.float32(2.0)) == 2 * MIB


def test_caps_from_mb_lists_and_auto():
    assert bucket_caps_from_mb([1, 4, 16]) == [MIB, 4 * MIB, 16 * MIB]
    assert bucket_caps_from_mb((0.5,)) == [MIB // 2]
    assert bucket_caps_from_mb("auto") == "auto" == bucketing.AUTO


@pytest.mark.parametrize(
    "bad",
    [
        0,
        -1,
        0.0,
        -0.5,
        math.nan,
        math.inf,
        True,
        False,
        [],
        (),
        [1, 0],
        [1, -2],
        [1, True],
        [1, "2"],
        [1, None],
        "Auto",
        "",
        "25",
        b"auto",
        {1: 2},
        object(),
    ],
)
def test_caps_from_mb_rejects(bad):
    with pytest.raises(ValueError, match=r"^fastcoll\.DDP: bucket_cap_mb must be .*; got "):
        bucket_caps_from_mb(bad)


def test_caps_from_mb_messages_name_the_problem():
    with pytest.raises(ValueError, match="an empty list"):
        bucket_caps_from_mb([])
    with pytest.raises(ValueError, match=r"an entry 0 in \[1, 0\]"):
        bucket_caps_from_mb([1, 0])
    with pytest.raises(ValueError, match=r"got 'fast'"):
        bucket_caps_from_mb("fast")


def test_caps_to_mb():
    assert caps_to_mb(25 * MIB) == 25.0
    assert caps_to_mb([MIB // 2, 4 * MIB]) == [0.5, 4.0]
    assert caps_to_mb(bucket_caps_from_mb([1, 2.5])) == [1.0, 2.5]
