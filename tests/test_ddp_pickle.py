"""Pickling and copying a whole fastcoll.DDP, as torch DDP allows, and collectives forced at world size 1.

``torch.save(ddp_model)`` / ``torch.load`` and ``copy.deepcopy(ddp_model)`` must
give a wrapper that trains and synchronizes at once: the pickled state leaves
out the process group, the reducer and its hooks, and loading rebuilds them
against the default process group.
"""

from __future__ import annotations

import copy
import io

import ddp_models as M
import pytest
import torch
import torch.distributed as dist
from multiproc import run_ranks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastcoll

pytestmark = pytest.mark.timeout(120)


def _step(mod, name, rank, ws, step):
    x, y = M.global_batch(name, ws, step)
    mod.zero_grad()
    M.loss_of(name, mod, M.chunk_of(x, rank), M.chunk_of(y, rank), rank, step).backward()
    return [p.grad.detach().clone() for p in mod.module.parameters()]


def _same_on_all_ranks(grads, what):
    for i, g in enumerate(grads):
        out = [torch.empty_like(g) for _ in range(dist.get_world_size())]
        dist.all_gather(out, g)
        assert all(torch.equal(out[0], o) for o in out), f"{what}: gradient {i} differs across ranks"


def _check_pickle_and_deepcopy(rank, ws):
    for name, kwargs in (("convbn", {"bucket_cap_mb": 0.001}), ("mlp", {"static_graph": True, "gradient_as_bucket_view": True})):
        fast = fastcoll.DDP(M.build(name, seed=rank), **kwargs)
        _step(fast, name, rank, ws, 0)
        buf = io.BytesIO()
        torch.save(fast, buf)
        buf.seek(0)
        copies = {"torch.load": torch.load(buf, weights_only=False), "deepcopy": copy.deepcopy(fast)}
        for how, loaded in copies.items():
            what = f"{name} {kwargs} {how} (rank {rank})"
            assert isinstance(loaded, fastcoll.DDP) and loaded.process_group is dist.distributed_c10d._get_default_group()
            assert loaded.bucket_bytes_cap == fast.bucket_bytes_cap and loaded.static_graph == fast.static_graph, what
            assert loaded.reducer is not fast.reducer and loaded.module is not fast.module, what
            for step in (1, 2):
                grads = _step(loaded, name, rank, ws, step)
                _same_on_all_ranks(grads, f"{what} step {step}")
            ref = TorchDDP(M.build(name, seed=0), **kwargs)  # no optimizer: the weights stay rank 0's initial ones
            for step in (0, 1, 2):
                want = _step(ref, name, rank, ws, step)
            for g, w in zip(grads, want):
                torch.testing.assert_close(g, w, msg=lambda m: f"{what}: loaded model's gradient vs torch DDP: {m}")
            loaded.close()
        # The original keeps training on its own module, unaffected by the copies' hooks.
        _same_on_all_ranks(_step(fast, name, rank, ws, 1), f"{name}: original after copying")
        fast.close()


def test_pickle_and_deepcopy_train_and_synchronize():
    run_ranks(_check_pickle_and_deepcopy, 2)


def _count_collectives_at_world_size_one(rank, ws):
    fast = fastcoll.DDP(M.build("mlp", 0), bucket_cap_mb=0.001)
    seen = []
    fast.reducer.add_collective_listener(seen.append)
    for step in range(3):
        _step(fast, "mlp", rank, ws, step)
    nb = len(fast.bucket_info())
    fast.close()
    return [c.what for c in seen], nb


def test_force_collectives_at_world_size_one():
    ((forced, nb),) = run_ranks(_count_collectives_at_world_size_one, 1, env={"FASTCOLL_FORCE_COLLECTIVES": "1"})
    # layout broadcast once (before step 1), then every bucket's all-reduce each step
    assert forced.count("layout") == 1 and len([w for w in forced if w.startswith("bucket")]) == 3 * nb, forced
    ((plain, _),) = run_ranks(_count_collectives_at_world_size_one, 1)
    assert plain == [], plain
