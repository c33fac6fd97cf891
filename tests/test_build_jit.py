"""The compile at first import, with the real compiler (slow: one build, about 2 minutes of 2 cores).

Skipped unless ``FASTCOLL_TEST_JIT=1``. CI's install stage (.ci/install_check.sh)
runs it against fastcoll installed from a plain ``pip install .`` of a clean
copy of the tree; by hand it runs on a copy of this checkout without a build:

    FASTCOLL_TEST_JIT=1 pytest -s tests/test_build_jit.py

``FASTCOLL_TEST_JIT_PYTHON``: the interpreter under test (default: this one,
on that copy); ``FASTCOLL_TEST_JIT_CACHE``: the cache folder to fill, empty or
absent (default: a temporary one). The tests run in file order and share the
cache: the first one compiles, the others load its build. Each prints its
measurements (the compile time, the cache hit's cost).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from typing import List, NamedTuple

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("FASTCOLL_TEST_JIT") != "1", reason="compiles the extension: FASTCOLL_TEST_JIT=1"),
]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPILE_TIMEOUT = 900  # seconds: the build on a busy 2-core machine, with room
TIMEOUT = 180


class Target(NamedTuple):
    python: str
    env: dict
    cwd: str
    cache: str


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Target:
    base = tmp_path_factory.mktemp("jit")
    cache = os.environ.get("FASTCOLL_TEST_JIT_CACHE") or str(base / "cache")
    assert not os.path.exists(cache) or not os.listdir(cache), f"{cache} must be empty: the first test compiles"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTCOLL_") and k != "PYTHONPATH"}
    env.update(FASTCOLL_CACHE_DIR=cache, OMP_NUM_THREADS="1")
    python = os.environ.get("FASTCOLL_TEST_JIT_PYTHON")
    if python is None:  # this checkout, copied without its build
        python = sys.executable
        ignore = shutil.ignore_patterns("*.so", "__pycache__", "_C.build.json")
        shutil.copytree(os.path.join(REPO, "fastcoll"), base / "tree" / "fastcoll", ignore=ignore)
        shutil.copytree(os.path.join(REPO, "csrc"), base / "tree" / "csrc")
        env["PYTHONPATH"] = str(base / "tree")
    return Target(python, env, str(base), cache)


def run(t: Target, code: str, timeout: float = TIMEOUT, args: List[str] = ()) -> subprocess.CompletedProcess:
    cmd = [t.python, *(args or ["-c", textwrap.dedent(code)])]
    return subprocess.run(cmd, cwd=t.cwd, env=t.env, capture_output=True, text=True, timeout=timeout)


def report(line: str) -> None:
    print(f"\n[install check] {line}", file=sys.__stdout__, flush=True)


IMPORT = """
import json, os, sys, time
while not os.path.exists(os.path.join(sys.argv[1], "go")):
    time.sleep(0.01)
start = time.perf_counter()
import torch
torch_s = time.perf_counter() - start
import fastcoll
from fastcoll.ops import loader
info = fastcoll.build_info()
print(json.dumps({"import_s": time.perf_counter() - start - torch_s, "torch_s": torch_s, "lookup_s": loader.LOOKUP_SECONDS,
                  "origin": info["extension_origin"], "extension": info["extension"], "path": info["extension_path"],
                  "key": info["cache_key"], "file": fastcoll.__file__}))
"""


def start_imports(t: Target, n: int) -> List[dict]:
    """``n`` processes import fastcoll at the same moment; their build_info and timings."""
    go = os.path.join(t.cwd, f"go-{n}-{time.monotonic_ns()}")
    os.makedirs(go)
    procs = [
        subprocess.Popen(
            [t.python, "-c", IMPORT, go], cwd=t.cwd, env=t.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(n)
    ]
    try:
        time.sleep(0.5)
        open(os.path.join(go, "go"), "w").close()
        outs = [p.communicate(timeout=COMPILE_TIMEOUT) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
    return [dict(json.loads(out.splitlines()[-1]), stderr=err) for out, err in outs]


@pytest.mark.timeout(COMPILE_TIMEOUT + 60)
def test_first_imports_compile_once(target):
    """4 processes (the ranks of a node) import fastcoll at once into an empty cache: one compiles, three wait."""
    start = time.monotonic()
    results = start_imports(target, 4)
    wall = time.monotonic() - start
    origins = sorted(r["origin"] for r in results)
    assert origins == ["cache hit"] * 3 + ["compiled at import"], results
    assert all(r["extension"] and r["path"].startswith(target.cache) for r in results)
    if os.environ.get("FASTCOLL_TEST_JIT_PYTHON"):
        assert all("site-packages" in r["file"] for r in results), [r["file"] for r in results]
    [builder] = [r for r in results if r["origin"] == "compiled at import"]
    lines = builder["stderr"].splitlines()
    assert any("compiling the C++ extension" in x for x in lines) and any("compiled the extension in" in x for x in lines)
    waiting = [r for r in results if "waiting for pid" in r["stderr"]]
    assert waiting and all("compiling the C++ extension" not in r["stderr"] for r in waiting)
    with open(os.path.join(os.path.dirname(builder["path"]), "build.json")) as f:
        meta = json.load(f)
    report(
        f"first import: compile {meta['seconds']:.1f} s ({meta['cpu_seconds']:.0f} s of CPU, {os.cpu_count()} CPUs), "
        f"import of the compiling process {builder['import_s']:.1f} s, 4 processes {wall:.1f} s"
    )


@pytest.mark.timeout(TIMEOUT)
def test_cache_hit_import(target):
    """A later import loads the cached build: no compiler, no hashing, at most 0.2 s for the cache's part."""
    [r] = start_imports(target, 1)
    assert r["origin"] == "cache hit" and r["extension"], r
    assert "compiling" not in r["stderr"] and "waiting" not in r["stderr"], r["stderr"]
    assert r["lookup_s"] < 0.2, r
    lookup_ms = 1e3 * r["lookup_s"]
    report(
        f"cache-hit import: import fastcoll {r['import_s']:.3f} s (cache lookup {lookup_ms:.1f} ms), torch {r['torch_s']:.2f} s"
    )


DDP_STEP = """
import os, sys, tempfile
import torch, torch.distributed as dist, torch.multiprocessing as mp
import fastcoll
from fastcoll.ops import reference

def rank_main(rank, world, store_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    ref.load_state_dict(model.state_dict())
    ddp = fastcoll.DDP(model)
    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    ddp(xs[rank]).square().sum().backward()
    for x in xs:  # the gradient DDP must produce: the mean over the ranks' batches
        (ref(x).square().sum() / world).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    dist.destroy_process_group()

if __name__ == "__main__":
    info = fastcoll.build_info()
    assert info["extension"] and info["extension_origin"] == "cache hit", info
    assert fastcoll.ops.implementation() == "extension"
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(s, generator=g) for s in [(3, 5), (7,), (2, 2, 2)]] + [torch.randn(9).to(torch.bfloat16)]
    n = sum(t.numel() for t in tensors)
    flat, flat_ref = torch.empty(n), torch.empty(n)
    fastcoll.ops.flatten_scale(tensors, flat, 0.5)
    reference.flatten_scale(tensors, flat_ref, 0.5)
    assert torch.equal(flat, flat_ref)
    back = [torch.empty_like(t) for t in tensors]
    fastcoll.ops.unflatten_scale(flat, back, 2.0)
    assert all(torch.equal(a, b) for a, b in zip(back, tensors))
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(rank_main, args=(2, os.path.join(d, "store")), nprocs=2, join=True)
    print("ok")
"""


@pytest.mark.timeout(TIMEOUT + 30)
def test_ddp_step_and_op_round_trip(target, tmp_path):
    """The cached build at work: an op round trip (against the reference) and a 2-rank gloo fastcoll.DDP step."""
    script = tmp_path / "ddp_step.py"
    script.write_text(DDP_STEP)
    start = time.monotonic()
    proc = run(target, "", args=[str(script)])
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
    assert "compiling" not in proc.stderr
    report(f"2-rank gloo DDP step and op round trip on the cached build: {time.monotonic() - start:.1f} s")


@pytest.mark.timeout(TIMEOUT)
def test_prebuild_command(target):
    """python -m fastcoll.extension: prints the key and the path; the build is there already."""
    proc = run(target, "", args=["-m", "fastcoll.extension"])
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(":", 1) for line in proc.stdout.splitlines() if line.startswith(("key:", "path:")))
    assert lines["path"].strip().startswith(target.cache) and lines["key"].strip() in lines["path"]
    assert "already in the cache" in proc.stdout and "compiling" not in proc.stderr
