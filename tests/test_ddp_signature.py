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


@pytest.mark.parametrize("mb_list", [[1, 4, 16]])
def test_bucket_cap_mb_list_is_refused_with_a_list_bucket_cap(mb_list):
    from fastcoll.ddp.arguments import refuse_torch_only

    with pytest.raises(ValueError, match="give the per-bucket caps once"):
        refuse_torch_only(None, None, None, [2, 8], mb_list)
    refuse_torch_only(None, None, None, 25, mb_list)  # a number with a list: the list wins, as in torch
