"""Replica verification (issue #12): fastcoll.ddp.replicas.verify_replicas(ddp), behind fastcoll.DDP.verify_replicas().

Multi-rank tests on 2 and 3 gloo ranks (tests/multiproc.py, hard timeouts):
a parameter or a buffer perturbed on some ranks makes every rank raise
ReplicaMismatchError with the same message, naming the tensors and the
majority and outlier ranks; unperturbed replicas pass with exactly one
collective. The message logic is also unit-tested without processes.
"""

from __future__ import annotations

import ddp_models as M
import pytest
import torch
import torch.distributed as dist
from multiproc import run_ranks
from torch import nn

import fastcoll
from fastcoll.ddp import replicas as _replicas
from fastcoll.errors import ReplicaMismatchError

_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "all_gather_object", "barrier")


class CollectiveCounter:
    """Counts torch.distributed collective calls (the module attributes fastcoll.ddp.replicas calls through)."""

    def __init__(self):
        self.calls = []
        self._saved = {}

    def __enter__(self):
        for name in _COLLECTIVES:
            fn = getattr(dist, name)
            self._saved[name] = fn

            def counted(*args, _fn=fn, _name=name, **kwargs):
                self.calls.append(_name)
                return _fn(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _bump(t: torch.Tensor, ulps: int = 1) -> None:
    """Change the first element's lowest mantissa bits (a difference no tolerance-based check would see)."""
    with torch.no_grad():
        first = t.view(-1)[:1]
        (first.view(torch.int32) if t.dtype == torch.float32 else first).add_(ulps)


def _raises_everywhere(model) -> ReplicaMismatchError:
    """verify_replicas raises; the message is the same on every rank. Returns this rank's error."""
    with pytest.raises(ReplicaMismatchError) as info:
        _replicas.verify_replicas(model)
    msg = str(info.value)
    msgs = [None] * dist.get_world_size()
    dist.all_gather_object(msgs, msg)
    assert len(set(msgs)) == 1, f"messages differ across ranks: {msgs}"
    assert isinstance(info.value, RuntimeError)
    return info.value


# --------------------------------------------------------------------------- 2 ranks


def parameter_worker(rank, world_size):
    model = fastcoll.DDP(M.build("mlp", 0), bucket_cap_mb=0.001)
    with CollectiveCounter() as counter:
        _replicas.verify_replicas(model)  # unperturbed: passes
    assert counter.calls == ["all_gather"], counter.calls
    if rank == 1:
        _bump(model.module.layers[3].weight)
    err = _raises_everywhere(model)
    msg = str(err)
    assert "parameter 'layers.3.weight': majority: rank 0; outliers: rank 1" in msg, msg
    assert "1 of 26 synchronized parameters and buffers" in msg and "Outlier ranks: 1." in msg, msg
    assert err.mismatches == [("layers.3.weight", "parameter", [[0], [1]])]
    assert err.outlier_ranks == [1]
    # Training goes on after a caught error; restoring the copy makes the check pass again.
    if rank == 1:
        _bump(model.module.layers[3].weight, -1)
    _replicas.verify_replicas(model)
    model.close()
    return msg


def test_perturbed_parameter_named_on_every_rank():
    msgs = run_ranks(parameter_worker, 2, timeout=120)
    assert msgs[0] == msgs[1]


def buffer_worker(rank, world_size):
    model = fastcoll.DDP(M.build("convbn", 0))
    x, y = M.global_batch("convbn", world_size, 0)
    M.loss_of("convbn", model, M.chunk_of(x, rank), M.chunk_of(y, rank), rank, 0).backward()
    # After a forward, BatchNorm's running statistics come from the local batch (they differ
    # until the next forward's broadcast): resynchronize them the way DDP does.
    model._sync_buffers()
    _replicas.verify_replicas(model)
    if rank == 1:
        model.module.bn2.num_batches_tracked += 1  # an int64 buffer
        _bump(model.module.bn1.running_var)
    err = _raises_everywhere(model)
    assert [(n, k) for n, k, _ in err.mismatches] == [("bn1.running_var", "buffer"), ("bn2.num_batches_tracked", "buffer")]
    msg = str(err)
    assert "buffer 'bn2.num_batches_tracked': majority: rank 0; outliers: rank 1" in msg, msg
    model.close()
    # Buffers that DDP does not broadcast are not verified (unless asked for).
    unsynced = fastcoll.DDP(model.module, broadcast_buffers=False, init_sync=False)
    _replicas.verify_replicas(unsynced)
    with pytest.raises(ReplicaMismatchError, match="bn1.running_var"):
        _replicas.verify_replicas(unsynced, buffers=True)
    unsynced.close()


def test_perturbed_buffer_named_on_every_rank():
    run_ranks(buffer_worker, 2, timeout=120)


def ignored_worker(rank, world_size):
    module = M.build("mlp", 0)
    fastcoll.DDP._set_params_and_buffers_to_ignore_for_model(module, ["layers.0.bias"])
    model = fastcoll.DDP(module)
    if rank == 1:
        _bump(module.layers[0].bias)  # ignored by DDP: not verified
    _replicas.verify_replicas(model)
    if rank == 0:
        for p in module.parameters():
            _bump(p)  # every other parameter: 25 differ, 10 named
    err = _raises_everywhere(model)
    msg = str(err)
    assert "25 of 25 synchronized" in msg and "... and 15 more" in msg, msg
    assert msg.count("majority: rank 0; outliers: rank 1") == 10, msg  # two ranks that disagree: rank 0 is the majority
    assert "layers.0.bias" not in msg and len(err.mismatches) == 25
    model.close()


def test_ignored_tensors_skipped_and_at_most_ten_named():
    run_ranks(ignored_worker, 2, timeout=120)


# --------------------------------------------------------------------------- 3 ranks


def three_rank_worker(rank, world_size):
    model = fastcoll.DDP(M.build("convbn", 0))
    with CollectiveCounter() as counter:
        _replicas.verify_replicas(model)
    assert counter.calls == ["all_gather"], counter.calls
    m = model.module
    if rank in (1, 2):
        _bump(m.conv2.weight, rank)  # two outliers, each with its own version
    if rank == 0:
        _bump(m.fc.bias)  # rank 0 alone: the majority is ranks 1 and 2
    if rank in (0, 2):
        m.bn1.num_batches_tracked += 7  # ranks 0 and 2 agree: rank 1 is the outlier
    err = _raises_everywhere(model)
    msg = str(err)
    assert err.mismatches == [
        ("conv2.weight", "parameter", [[0], [1], [2]]),
        ("fc.bias", "parameter", [[1, 2], [0]]),
        ("bn1.num_batches_tracked", "buffer", [[0, 2], [1]]),
    ], err.mismatches
    assert "parameter 'conv2.weight': majority: rank 0; outliers: rank 1 | rank 2 (2 different versions)" in msg, msg
    assert "parameter 'fc.bias': majority: ranks 1, 2; outliers: rank 0" in msg, msg
    assert "buffer 'bn1.num_batches_tracked': majority: ranks 0, 2; outliers: rank 1" in msg, msg
    assert err.outlier_ranks == [0, 1, 2] and "3 of 15 synchronized" in msg, msg
    model.close()
    return msg


def test_three_ranks_two_outliers_with_different_versions():
    msgs = run_ranks(three_rank_worker, 3, timeout=150)
    assert len(set(msgs)) == 1


def single_outlier_worker(rank, world_size):
    model = fastcoll.DDP(M.build("mlp", 0))
    _replicas.verify_replicas(model)
    if rank == 1:
        _bump(model.module.head.weight)
    err = _raises_everywhere(model)
    assert err.mismatches == [("head.weight", "parameter", [[0, 2], [1]])]
    assert "majority: ranks 0, 2; outliers: rank 1" in str(err)
    model.close()


def test_three_ranks_one_outlier():
    run_ranks(single_outlier_worker, 3, timeout=150)


# --------------------------------------------------------------------------- without processes


class _FakeDDP:
    def __init__(self, module, broadcast_buffers=True):
        self.module = module
        self.broadcast_buffers = broadcast_buffers
        self.process_group = None


def test_synchronized_tensors_follow_ddp():
    bn = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    bn._ddp_params_and_buffers_to_ignore = ["1.running_mean", "0.bias"]
    names = [(n, k) for n, k, _ in _replicas.synchronized_tensors(_FakeDDP(bn))]
    assert names == [
        ("0.weight", "parameter"),
        ("1.weight", "parameter"),
        ("1.bias", "parameter"),
        ("1.running_var", "buffer"),
        ("1.num_batches_tracked", "buffer"),
    ]
    assert [n for n, _, _ in _replicas.synchronized_tensors(_FakeDDP(bn, broadcast_buffers=False))] == [
        "0.weight",
        "1.weight",
        "1.bias",
    ]


def test_explain_groups_and_ties():
    named = [("a", "parameter", torch.zeros(1)), ("b", "buffer", torch.zeros(1)), ("c", "parameter", torch.zeros(1))]
    rows = [[9, 1, 5, 7], [9, 2, 5, 7], [9, 3, 5, 8], [9, 2, 5, 8]]
    err = _replicas._explain(rows, [0, 1, 2, 3], named)
    # 'a': versions {0}, {1, 3}, {2}: the majority is ranks 1, 3. 'c': a 2-2 tie goes to the group holding rank 0.
    assert err.mismatches == [("a", "parameter", [[1, 3], [0], [2]]), ("c", "parameter", [[0, 1], [2, 3]])]
    assert err.outlier_ranks == [0, 2, 3]
    assert "parameter 'a': majority: ranks 1, 3; outliers: rank 0 | rank 2 (2 different versions)" in str(err)
    assert _replicas._explain([[9, 1, 5, 7]] * 3, [0, 1, 2], named) is None
    # Global ranks of a subgroup are reported as such.
    err = _replicas._explain([[9, 1, 5, 7], [9, 1, 6, 7]], [4, 6], named)
    assert err.mismatches == [("b", "buffer", [[4], [6]])]


def test_explain_structure_mismatch():
    named = [("a", "parameter", torch.zeros(1))]
    err = _replicas._explain([[1, 5], [2, 5], [1, 5]], [0, 1, 2], named)
    assert isinstance(err, ReplicaMismatchError) and err.outlier_ranks == [1]
    assert "do not hold the same parameters and buffers" in str(err)


def test_layout_digest_sees_names_shapes_dtypes():
    base = [("a", "parameter", torch.zeros(2, 3))]
    d = _replicas._layout_digest(base)
    assert d == _replicas._layout_digest([("a", "parameter", torch.ones(2, 3))])
    assert d != _replicas._layout_digest([("b", "parameter", torch.zeros(2, 3))])
    assert d != _replicas._layout_digest([("a", "parameter", torch.zeros(3, 2))])
    assert d != _replicas._layout_digest([("a", "parameter", torch.zeros(2, 3, dtype=torch.float64))])


def test_local_checksums_match_the_op_and_handle_non_dense():
    a, b = torch.randn(4, 6), torch.randn(3)
    assert torch.equal(_replicas.local_checksums([a, b]), fastcoll.ops.checksum([a, b]))
    nd = a[:, ::2]
    assert _replicas.local_checksums([nd]).item() == fastcoll.ops.checksum([nd.contiguous()]).item()


def test_single_process_is_a_no_op():
    assert not dist.is_initialized()
    _replicas.verify_replicas(_FakeDDP(nn.Linear(2, 2)))
