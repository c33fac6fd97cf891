"""Every member of torch's DistributedDataParallel, and what fastcoll.DDP answers for it.

fastcoll.DDP subclasses torch's class without running its constructor, so
each inherited member must either work with fastcoll's meaning or refuse
loudly (naming fastcoll). The table below is the decision for each; the
tests check it against the running torch (a member torch adds later fails
the test until it is decided) and against a live wrapper.
"""

from __future__ import annotations

import pytest
import torch
from multiproc import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastcoll
from fastcoll.ddp.compat import TORCH_ONLY_ATTRIBUTES, UNSUPPORTED

#: fastcoll's own implementation, with torch's meaning.
FASTCOLL = {
    "__init__", "__getstate__", "__setstate__", "forward", "no_sync", "join", "join_hook", "join_device",
    "join_process_group", "register_comm_hook", "_register_builtin_comm_hook", "_set_static_graph", "_pre_forward",
    "_post_forward", "_sync_buffers", "will_sync_module_buffers", "_remove_autograd_hooks", "_check_reducer_finalized",
    "_set_ddp_sink_clone", "broadcast_buffers", "_get_ddp_logging_data", "_set_ddp_runtime_logging_sample_rate",
    "_log_and_throw",
}  # fmt: skip
#: torch's code, inherited: it only reads attributes fastcoll sets.
TORCH = {
    "train", "scatter", "gather", "to_kwargs", "_get_data_parallel_params", "_set_params_and_buffers_to_ignore_for_model",
    "_register_fused_optim", "_get_active_ddp_module", "_active_ddp_module", "_distributed_rank", "_get_parameters",
    "_build_debug_param_to_name_mapping", "_check_default_group", "_distributed_broadcast_coalesced",
    "_default_broadcast_coalesced", "_find_common_rank", "_passing_sync_batchnorm_handle", "_check_comm_hook",
}  # fmt: skip
#: Refused: NotImplementedError naming fastcoll and what to use instead.
REFUSED = set(UNSUPPORTED)

#: Attributes torch's constructor sets, and whether a fastcoll.DDP has them ("has") or refuses them ("refused").
INSTANCE = {
    **{name: "has" for name in (
        "module", "process_group", "device_ids", "output_device", "dim", "find_unused_parameters",
        "gradient_as_bucket_view", "static_graph", "require_backward_grad_sync", "require_forward_param_sync",
        "forward_sync_buffers", "broadcast_buffers", "parameters_to_ignore", "device", "device_type",
        "is_multi_device_module", "broadcast_bucket_size", "bucket_bytes_cap", "bucket_bytes_cap_list",
        "bucket_bytes_cap_default", "modules_buffers", "named_module_buffers", "mixed_precision",
        "skip_all_reduce_unused_params", "batched_grad_copy", "use_side_stream_for_tensor_copies", "reducer", "logger",
        "_module_parameters", "_has_rebuilt_buckets", "_join_config",
    )},
    **{name: "refused" for name in TORCH_ONLY_ATTRIBUTES},
}  # fmt: skip


def _torch_members():
    dunder = lambda k: k.startswith("__") and k not in ("__init__", "__getstate__", "__setstate__")  # noqa: E731
    return {k for k in vars(TorchDDP) if not dunder(k) and k != "_abc_impl"}  # (_abc_impl: the ABC's per-class cache)


def _defined_by_fastcoll(name: str) -> bool:
    """Whether a class before torch's in fastcoll.DDP's MRO defines ``name``."""
    mro = fastcoll.DDP.__mro__
    return any(name in vars(c) for c in mro[: mro.index(TorchDDP)])


def test_every_torch_member_is_decided():
    decided = FASTCOLL | TORCH | REFUSED
    assert not (FASTCOLL & TORCH) and not (FASTCOLL & REFUSED) and not (TORCH & REFUSED)
    undecided = sorted(_torch_members() - decided)
    assert not undecided, f"torch DDP members without a decision for fastcoll.DDP: {undecided}"


@pytest.mark.parametrize("name", sorted(FASTCOLL))
def test_fastcoll_members_override_torch(name):
    if name not in vars(TorchDDP):
        pytest.skip(f"torch {torch.__version__} has no {name}")
    assert _defined_by_fastcoll(name), name


@pytest.mark.parametrize("name", sorted(TORCH))
def test_inherited_members_are_torch_s(name):
    if name not in vars(TorchDDP):
        pytest.skip(f"torch {torch.__version__} has no {name}")
    assert not _defined_by_fastcoll(name), name


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_members_name_fastcoll(name):
    with pytest.raises(NotImplementedError, match=rf"fastcoll.DDP does not implement torch DDP's {name}\(\): \w"):
        getattr(fastcoll.DDP, name)(None)


def live_worker(rank: int, world: int) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    ddp = fastcoll.DDP(model)
    assert isinstance(ddp, TorchDDP) and type(ddp.reducer).__module__.startswith("fastcoll.reducer")
    for name, kind in INSTANCE.items():
        if kind == "has":
            assert hasattr(ddp, name), name
        else:
            assert not hasattr(ddp, name), name
            with pytest.raises(AttributeError, match=f"fastcoll.DDP has no torch DDP attribute '{name}'"):
                getattr(ddp, name)
    assert ddp.logger is None and ddp.mixed_precision is None
    assert ddp.will_sync_module_buffers() and len(ddp.modules_buffers) == 3 and set(ddp.named_module_buffers) == {
        "1.running_mean", "1.running_var", "1.num_batches_tracked"}  # fmt: skip
    # Inherited torch code working on fastcoll's attributes.
    assert ddp.train(False) is ddp and not model.training
    assert [p for p in TorchDDP._get_data_parallel_params(model)] == list(model.parameters())
    assert ddp._has_rebuilt_buckets is False
    ddp.train(True)
    ddp(torch.randn(3, 4)).sum().backward()
    ddp._check_reducer_finalized()  # nothing left unreduced
    ddp(torch.randn(3, 4))
    assert ddp._has_rebuilt_buckets is True  # the one rebuild from the ready order, at the second forward
    ddp.reducer._delay_all_reduce()  # torch's static-graph first iteration: already reduced here
    assert ddp.reducer._get_local_used_map().dtype == torch.int32
    with pytest.raises(AttributeError, match="fastcoll's Reducer has no torch Reducer method '_autograd_hook'"):
        ddp.reducer._autograd_hook(0)
    ddp._remove_autograd_hooks()


def test_a_live_wrapper_answers_torch_s_attributes():
    run_ranks(live_worker, 1, timeout=60)
