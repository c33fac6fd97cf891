"""examples/train.py launched the ways the README shows: one process, torchrun on one node, torchrun on two nodes.

The two "nodes" are two torchrun launcher processes on this machine talking over
loopback (--nnodes=2 --node_rank=0|1 --master_addr=127.0.0.1), each starting one
gloo worker. Every launch runs under a timeout and is killed (with its whole
process group) if it hangs. The script writes each rank's final weights and
their SHA-256 to --out; all ranks must end with identical weights (BatchNorm
buffers included). The transformer (LayerNorm, no dropout) trained on two nodes
with half the per-process batch must also match one process on the same global
batch, to float rounding.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "examples", "train.py")
TIMEOUT = 150
STEPS = "8"


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "TORCHELASTIC_", "SLURM_", "OMPI_", "PMI_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK"):
        env.pop(k, None)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH", "")) if p)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_all(commands: list, cwd: str) -> list:
    """Start every command at once (each in its own process group); wait for all; kill all on timeout."""
    procs = [
        subprocess.Popen(
            cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        for cmd in commands
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=TIMEOUT)
            outputs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        logs = "\n".join(f"--- command {i} ---\n{(p.communicate()[0] or '')[-3000:]}" for i, p in enumerate(procs))
        pytest.fail(f"launch did not finish within {TIMEOUT}s:\n{logs}")
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"command {i} {commands[i]} exited with {p.returncode}:\n{out[-6000:]}"
    return outputs


def _torchrun(*args: str) -> list:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def _results(out_dir, world: int) -> list:
    res = []
    for r in range(world):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            summary = json.load(f)
        state = torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True)
        res.append((summary, state))
    return res


def _check_identical(results: list, world: int) -> None:
    assert [s["rank"] for s, _ in results] == list(range(world))
    assert all(s["world_size"] == world for s, _ in results)
    assert len({s["sha256"] for s, _ in results}) == 1, [s["sha256"] for s, _ in results]
    for _, state in results[1:]:
        for k, v in results[0][1].items():
            assert torch.equal(state[k], v), k
    assert results[0][0]["eval_accuracy"] is not None  # rank 0 gathered the evaluation
    assert all(s["eval_accuracy"] is None for s, _ in results[1:])


# SGD: Adam would turn the float noise in gradients that are zero in exact
# arithmetic (attention key biases) into full-size, run-dependent updates.
TRANSFORMER = ["--model", "transformer", "--optimizer", "sgd", "--max-steps", STEPS, "--log-every", "4", "--eval-samples", "101"]


@pytest.fixture(scope="module")
def single_process_transformer(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    log = _run_all([[sys.executable, SCRIPT, *TRANSFORMER, "--batch-size", "32", "--out", str(out)]], str(out))[0]
    assert "1 process(es)" in log, log
    return _results(out, 1)[0]


@pytest.mark.timeout(TIMEOUT + 30)
def test_single_process(single_process_transformer):
    summary, state = single_process_transformer
    assert summary["world_size"] == 1 and summary["steps"] == int(STEPS)
    assert summary["eval_accuracy"] is not None and all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


@pytest.mark.timeout(TIMEOUT + 30)
def test_torchrun_one_node_two_processes(tmp_path):
    """The conv net (BatchNorm) on one node: parameters and buffers identical on both ranks."""
    cmd = _torchrun(
        "--nproc_per_node=2",
        f"--master_port={_free_port()}",
        SCRIPT,
        "--max-steps",
        STEPS,
        "--grad-accum",
        "2",
        "--out",
        str(tmp_path),
    )
    log = _run_all([cmd], str(tmp_path))[0]
    assert "2 process(es)" in log, log
    _check_identical(_results(tmp_path, 2), 2)


@pytest.mark.timeout(2 * TIMEOUT + 30)
def test_torchrun_two_nodes_on_loopback(tmp_path, single_process_transformer):
    port = _free_port()
    commands = [
        _torchrun(
            "--nnodes=2",
            f"--node_rank={node}",
            "--nproc_per_node=1",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            SCRIPT,
            *TRANSFORMER,
            "--batch-size",
            "16",
            "--out",
            str(tmp_path),
        )
        for node in (0, 1)
    ]
    logs = _run_all(commands, str(tmp_path))
    assert "2 process(es)" in logs[0], logs[0]
    results = _results(tmp_path, 2)
    _check_identical(results, 2)
    # same global batch (2 x 16 vs 1 x 32), same sample order: the same model up to float rounding
    ref_summary, ref_state = single_process_transformer
    for k, v in ref_state.items():
        torch.testing.assert_close(results[0][1][k], v, rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")
    assert results[0][0]["eval_accuracy"] == pytest.approx(ref_summary["eval_accuracy"], abs=0.02)


@pytest.mark.timeout(TIMEOUT + 30)
def test_slurm_launch_simulated(tmp_path):
    """`srun --ntasks=2 python examples/train.py`: two tasks with SLURM's variables (no torchrun), init_dist('slurm')."""
    port = str(_free_port())
    commands = []
    for task in (0, 1):
        env_prefix = [
            "env",
            f"SLURM_PROCID={task}",
            "SLURM_NTASKS=2",
            f"SLURM_LOCALID={task}",
            "SLURM_NODELIST=localhost",
            f"MASTER_PORT={port}",
        ]
        commands.append([*env_prefix, sys.executable, SCRIPT, "--max-steps", "4", "--out", str(tmp_path)])
    logs = _run_all(commands, str(tmp_path))
    assert "2 process(es)" in logs[0], logs[0]
    _check_identical(_results(tmp_path, 2), 2)
