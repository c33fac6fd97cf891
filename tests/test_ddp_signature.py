"""fastcoll.DDP's constructor against torch DDP's: the same parameters, order and defaults, plus keyword-only extras."""

from __future__ import annotations

import inspect

import pytest
import torch

import fastcoll

FASTCOLL_ONLY = {
    "first_bucket_mb": 1.0,
    "comm_dtype": None,
    "compute_grad_norm": False,
    "check_nonfinite": False,
    "record_timeline": True,
    "stall_timeout": None,
    "verify_replicas_every": 0,
    "main_grad_dtype": None,
    "comm_accum_dtype": None,
}

# torch 2.13's DistributedDataParallel.__init__, in order, with defaults (the version fastcoll tracks).
TORCH_2_13 = [
    ("module", inspect.Parameter.empty), ("device_ids", None), ("output_device", None), ("dim", 0),
    ("broadcast_buffers", None), ("init_sync", True), ("process_group", None), ("bucket_cap_mb", None),
    ("find_unused_parameters", False), ("check_reduction", False), ("gradient_as_bucket_view", False),
    ("static_graph", False), ("delay_all_reduce_named_params", None), ("param_to_hook_all_reduce", None),
    ("mixed_precision", None), ("device_mesh", None), ("skip_all_reduce_unused_params", False),
    ("bucket_cap_mb_list", None), ("batched_grad_copy", False), ("forward_sync_buffers", None),
]  # fmt: skip


def _params(cls):
    return [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]


def test_signature_is_torch_2_13s_plus_keyword_only_extras():
    ours = _params(fastcoll.DDP)
    assert [(p.name, p.default) for p in ours[: len(TORCH_2_13)]] == TORCH_2_13
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in ours[: len(TORCH_2_13)])
    extra = ours[len(TORCH_2_13) :]
    assert {p.name: p.default for p in extra} == FASTCOLL_ONLY
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extra)


def test_every_parameter_of_the_running_torch_ddp_is_accepted_in_its_place():
    """Whatever torch is installed (2.6 onward): each of its parameters exists here, in the same relative order, same default."""
    theirs = _params(torch.nn.parallel.DistributedDataParallel)
    ours = {p.name: (i, p.default) for i, p in enumerate(_params(fastcoll.DDP))}
    missing = [p.name for p in theirs if p.name not in ours]
    assert not missing, f"torch DDP arguments fastcoll.DDP does not take: {missing}"
    positions = [ours[p.name][0] for p in theirs]
    assert positions == sorted(positions), "fastcoll.DDP orders torch's parameters differently"
    for p in theirs:
        if p.name == "broadcast_buffers" and p.default is True:  # torch < 2.13: True; 2.13 made it None (= True)
            continue
        assert ours[p.name][1] == p.default, (p.name, ours[p.name][1], p.default)


def test_a_torch_ddp_subclass():
    """(That torch's constructor, reducer and logger never run: tests/test_ddp_members.py, on a live wrapper.)"""
    assert issubclass(fastcoll.DDP, torch.nn.parallel.DistributedDataParallel)
    assert fastcoll.DistributedDataParallel is fastcoll.DDP


def test_bucket_cap_mb_list_in_force_follows_torch_2_13():
    """torch's rule: a non-empty list replaces bucket_cap_mb (a number is ignored); None or [] leave it in force."""
    from fastcoll.ddp.arguments import bucket_cap_mb_in_force as f

    assert f(None, [1, 25]) == [1, 25]
    assert f(5, (1, 2.5)) == [1, 2.5]
    assert f(-3, [1]) == [1]  # ignored, as torch ignores it
    assert f(7, []) == 7 and f(None, []) is None and f(None, None) is None and f("auto", None) == "auto"
    for bad in ([1, 0], [1, -2], [float("nan")], [float("inf")], [True], ["1"]):
        with pytest.raises(ValueError, match=r"bucket_cap_mb_list\[\d\] is .*positive finite number of MiB"):
            f(None, bad)
    for bad in (5, "1,2", {1: 2}):
        with pytest.raises(TypeError, match="bucket_cap_mb_list must be a list"):
            f(None, bad)
    for cap in ([2, 8], (2,), "auto"):
        with pytest.raises(ValueError, match="both ask for a bucket layout; give one of them"):
            f(cap, [1, 4])
