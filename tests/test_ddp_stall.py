"""fastcoll.DDP never hangs silently: the issue's stall scenarios through the wrapper itself (3 gloo ranks).

Each scenario trains a small model with ``stall_timeout=5`` and makes one rank
misbehave (killed mid-backward, asleep before backward, missing a gradient,
an extra fastcoll.dist collective); the live ranks must raise
``fastcoll.StallError`` naming it, with the same first line everywhere and
a JSON trace, within the deadline. Every rank process is killed and reaped
by the harness (tests/stall_harness.py) before the test returns.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
from stall_harness import run_stall_ranks, survivors_agree
from torch import nn

pytestmark = pytest.mark.timeout(150)

TIMEOUT = 5.0


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x, skip_fc2=False):
        h = torch.tanh(self.fc1(x))
        if not skip_fc2:
            h = torch.tanh(self.fc2(h))
        return self.head(h)


def _train(rank, misbehave, steps=4, **kwargs):
    """Train; ``misbehave(rank, step, stage, model)`` may sleep, kill, or return "skip_fc2". Returns the StallError as data."""
    import fastcoll

    model = fastcoll.DDP(Net(), stall_timeout=TIMEOUT, bucket_cap_mb=0.0005, **kwargs)
    t0 = time.monotonic()
    try:
        for step in range(steps):
            x = torch.randn(8, 16) + rank
            model.zero_grad()
            skip = misbehave(rank, step, "forward", model) == "skip_fc2"
            out = model(x, skip_fc2=skip)
            misbehave(rank, step, "backward", model)
            out.square().mean().backward()
    except fastcoll.StallError as e:
        return {"line": e.first_line, "culprits": e.culprits, "report": str(e), "elapsed": time.monotonic() - t0}
    return None


def _check(out, live, culprit, trace_dir=None):
    res, line = survivors_agree(out, live)
    assert all(x["culprits"] == [culprit] for x in res), [x["culprits"] for x in res]
    assert max(x["elapsed"] for x in res) < TIMEOUT + 30
    if trace_dir is not None:
        for r in live:
            data = json.loads((trace_dir / f"stall-rank{r}.json").read_text())
            assert data["first_line"] == line
    return line, res[0]["report"]


def _killed(rank, world_size):
    def misbehave(r, step, stage, model):
        if r == 2 and step == 2 and stage == "backward":
            os.kill(os.getpid(), signal.SIGKILL)

    return _train(rank, misbehave)


def test_rank_killed_mid_backward_is_named(tmp_path):
    out = run_stall_ranks(_killed, 3, need={0, 1, 2}, env={"FASTCOLL_TRACE_DIR": str(tmp_path)})
    assert out[2].kind == "dead", out[2]
    line, _ = _check(out, (0, 1), 2, tmp_path)
    assert "rank 2" in line, line


def _asleep(rank, world_size):
    def misbehave(r, step, stage, model):
        if r == 1 and step == 2 and stage == "backward":
            time.sleep(120)

    return _train(rank, misbehave)


def test_rank_asleep_before_backward_is_named_behind():
    out = run_stall_ranks(_asleep, 3, need={0, 2})
    line, _ = _check(out, (0, 2), 1)
    assert "rank 1" in line and "behind" in line and "forward of iteration" in line, line


def _missing(rank, world_size):
    def misbehave(r, step, stage, model):
        if r == 2 and step == 2 and stage == "forward":
            return "skip_fc2"  # fc2 gets no gradient on rank 2 only (find_unused_parameters=False)
        return None

    import fastcoll

    try:
        return _train(rank, misbehave)
    except RuntimeError as e:  # rank 2 itself raises at its next forward, naming the parameters
        if rank == 2 and not isinstance(e, fastcoll.StallError):
            return {"own": str(e)}
        raise


def test_rank_missing_a_gradient_is_named_with_the_parameter():
    out = run_stall_ranks(_missing, 3, need={0, 1, 2})
    line, report = _check(out, (0, 1), 2)
    assert "fc2.weight" in line or "fc2.weight" in report, report
    own = out[2].value
    assert out[2].kind == "ok" and own, out[2]
    text = own.get("own") or own.get("report")
    assert "fc2" in text, text


def _extra_collective(rank, world_size):
    import fastcoll

    def misbehave(r, step, stage, model):
        if r == 1 and step == 2 and stage == "forward":
            fastcoll.reduce_mean(torch.ones(8))  # a collective of its own, on rank 1 only

    return _train(rank, misbehave)


def test_extra_collective_on_one_rank_is_named():
    out = run_stall_ranks(_extra_collective, 3, need={0, 1, 2})
    live = [r for r in range(3) if out[r].kind == "ok" and out[r].value]
    assert live, out
    for r in live:
        assert 1 in out[r].value["culprits"], out[r].value


def _healthy_slow(rank, world_size):
    def misbehave(r, step, stage, model):
        if stage == "forward" and step == 1:
            time.sleep(TIMEOUT + 2)  # compute longer than the stall timeout, on every rank

    return _train(rank, misbehave, steps=3)


def test_healthy_training_with_slow_compute_does_not_raise():
    out = run_stall_ranks(_healthy_slow, 3)
    assert all(out[r].kind == "ok" and out[r].value is None for r in range(3)), out
