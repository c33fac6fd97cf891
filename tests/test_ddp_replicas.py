"""fastcoll.DDP's replica checks: ``verify_replicas()`` and ``verify_replicas_every=N`` on 2 gloo ranks."""

from __future__ import annotations

import ddp_models as M
import pytest
import torch
from multiproc import run_ranks

import fastcoll

pytestmark = pytest.mark.timeout(120)


def every_worker(rank, world_size):
    model = fastcoll.DDP(M.build("mlp", 0), verify_replicas_every=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    caught = None
    for step in range(6):
        x, y = M.global_batch("mlp", world_size, step)
        opt.zero_grad()
        try:
            M.loss_of("mlp", model, M.chunk_of(x, rank), M.chunk_of(y, rank), rank, step).backward()
        except fastcoll.ReplicaMismatchError as e:
            caught = (step, str(e))
            break
        opt.step()
        if step == 2 and rank == 1:
            with torch.no_grad():
                model.module.layers[4].bias[0] += 1e-3  # silent divergence on rank 1 only
    model.close()
    return caught


def test_verify_replicas_every_catches_a_diverged_parameter_within_two_iterations():
    results = run_ranks(every_worker, 2)
    assert all(r is not None for r in results), results
    steps = {r[0] for r in results}
    messages = {r[1] for r in results}
    assert len(steps) == 1 and len(messages) == 1, results  # the same forward, the same message on every rank
    step, msg = results[0]
    assert step in (3, 4), results  # perturbed after step 2's update: checked at iteration 4's forward at the latest
    assert "layers.4.bias" in msg and "1" in msg, msg


def healthy_worker(rank, world_size):
    model = fastcoll.DDP(M.build("convbn", 0), verify_replicas_every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x, y = M.global_batch("convbn", world_size, step)
        opt.zero_grad()
        M.loss_of("convbn", model, M.chunk_of(x, rank), M.chunk_of(y, rank), rank, step).backward()
        opt.step()
    model.close()
    # An explicit check after a step (a model without BatchNorm: its running statistics differ until the next broadcast).
    mlp = fastcoll.DDP(M.build("mlp", 0))
    x, y = M.global_batch("mlp", world_size, 0)
    M.loss_of("mlp", mlp, M.chunk_of(x, rank), M.chunk_of(y, rank), rank, 0).backward()
    mlp.verify_replicas()
    mlp.close()
    with pytest.raises(ValueError, match="verify_replicas_every"):
        fastcoll.DDP(M.build("mlp", 0), verify_replicas_every=-1)


def test_healthy_replicas_pass_every_check():
    run_ranks(healthy_worker, 2)
