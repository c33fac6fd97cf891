"""The CPU kernels' streaming-store threshold: chosen from the machine, overridable, and harmless to results.

* The choice (fastcoll/ops/stores.py) from fake sysfs trees and cgroup files:
  the last-level cache found per CPU, shared instances counted once, no more
  instances than the CPUs the process may use; a third of that is the threshold;
  no cache reported keeps 16 MiB.
* ``FASTCOLL_CPU_STREAM_MIN_BYTES`` wins over the machine, and a value that
  is not a threshold raises an error naming the variable (also at import).
* Streaming and cached stores give the same bits, equal to a float64
  reference, on outputs poisoned with NaN first.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Sequence

import pytest
import torch

import fastcoll
from fastcoll import _knobs
from fastcoll.ops import loader, stores

MiB = 1 << 20
VAR = _knobs.CPU_STREAM_MIN_BYTES
IDLE = (1.0, "load 0.5 on 2 CPU(s)")
REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


# ---------------------------------------------------------------------------
# Fake machines
# ---------------------------------------------------------------------------


def fake_sysfs(root: Path, cpus: Dict[int, Sequence[tuple]]) -> str:
    """A sysfs CPU folder: ``cpus[n]`` lists (level, type, size, shared_cpu_list) per cache index of CPU n."""
    for cpu, caches in cpus.items():
        for i, (level, kind, size, shared) in enumerate(caches):
            d = root / f"cpu{cpu}" / "cache" / f"index{i}"
            d.mkdir(parents=True)
            for name, value in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
                (d / name).write_text(f"{value}\n")
    return str(root)


def epyc_ccx(cpu: int, ccx: str) -> List[tuple]:
    """One core of an AMD EPYC: private L1d/L1i/L2, an L3 of 32 MiB shared by the CPUs in ``ccx``."""
    return [(1, "Data", "32K", cpu), (1, "Instruction", "32K", cpu), (2, "Unified", "512K", cpu), (3, "Unified", "32768K", ccx)]


def fake_cgroup(root: Path, files: Dict[str, str]) -> str:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text + "\n")
    return str(root)


def test_parse_size():
    assert stores.parse_size("32768K") == 32 * MiB
    assert stores.parse_size("1M") == MiB
    assert stores.parse_size("512") == 512
    with pytest.raises(ValueError, match="cache size"):
        stores.parse_size("big")


def test_sysfs_one_shared_l3(tmp_path):
    root = fake_sysfs(tmp_path, {0: epyc_ccx(0, "0-1"), 1: epyc_ccx(1, "0-1")})
    llc = stores.sysfs_llc([0, 1], root)
    assert llc == stores.LastLevelCache(3, (32 * MiB,), "sysfs")
    nbytes, how = stores.usable_llc([0, 1], root, str(tmp_path / "no-cgroup"), use_sysconf=False)
    assert nbytes == 32 * MiB and "L3 32 MiB" in how


def test_sysfs_two_ccx_counted_up_to_usable_cpus(tmp_path):
    cpus = {c: epyc_ccx(c, "0-1" if c < 2 else "2-3") for c in range(4)}
    root = fake_sysfs(tmp_path / "sys", cpus)
    none = str(tmp_path / "no-cgroup")
    assert stores.sysfs_llc(range(4), root).sizes == (32 * MiB, 32 * MiB)
    assert stores.usable_llc(range(4), root, none, use_sysconf=False)[0] == 64 * MiB
    # affinity inside one CCX: only its L3
    assert stores.usable_llc([2, 3], root, none, use_sysconf=False)[0] == 32 * MiB
    # a cgroup quota of 1 CPU (v2): one instance, whatever the affinity
    v2 = fake_cgroup(tmp_path / "cg2", {"cpu.max": "100000 100000"})
    assert stores.cgroup_cpu_limit(v2) == 1.0
    assert stores.usable_llc(range(4), root, v2, use_sysconf=False)[0] == 32 * MiB
    # 1.5 CPUs (v1) round up to 2
    v1 = fake_cgroup(tmp_path / "cg1", {"cpu,cpuacct/cpu.cfs_quota_us": "150000", "cpu,cpuacct/cpu.cfs_period_us": "100000"})
    assert stores.cgroup_cpu_limit(v1) == 1.5
    assert stores.usable_llc(range(4), root, v1, use_sysconf=False)[0] == 64 * MiB


def test_cgroup_unlimited(tmp_path):
    assert stores.cgroup_cpu_limit(fake_cgroup(tmp_path / "a", {"cpu.max": "max 100000"})) is None
    v1 = fake_cgroup(tmp_path / "b", {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"})
    assert stores.cgroup_cpu_limit(v1) is None
    assert stores.cgroup_cpu_limit(str(tmp_path / "none")) is None


def test_sysfs_highest_level_and_missing(tmp_path):
    # a VM reporting only private L2s: the L2 is the last level, one instance per CPU
    cpus = {c: [(1, "Data", "48K", c), (2, "Unified", "2048K", c)] for c in range(2)}
    root = fake_sysfs(tmp_path / "l2", cpus)
    assert stores.sysfs_llc([0, 1], root) == stores.LastLevelCache(2, (2 * MiB, 2 * MiB), "sysfs")
    # an instruction cache is never the data's last level; nothing usable: None
    root = fake_sysfs(tmp_path / "icache", {0: [(3, "Instruction", "8M", 0)]})
    assert stores.sysfs_llc([0], root) is None
    assert stores.sysfs_llc([0], str(tmp_path / "nothing")) is None
    nbytes, how = stores.usable_llc([0], str(tmp_path / "nothing"), str(tmp_path), use_sysconf=False)
    assert nbytes is None and "no cache size" in how


# ---------------------------------------------------------------------------
# The rule and the override
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "llc_bytes, expected",
    [
        (32 * MiB, 11184810),  # AMD EPYC, one CCX: 10.67 MiB (the 12.5 MiB bf16 buckets stream, the 9.3 MiB one not)
        (480 * MiB, 160 * MiB),  # the Intel Xeon VM of issue 32: a 27 MiB bucket is not streamed
        (3 * MiB, 1 * MiB),
    ],
)
def test_rule_a_third_of_the_llc(llc_bytes, expected):
    c = stores.choose(env={}, llc=(llc_bytes, "fake"), busy=IDLE)
    assert (c.min_bytes, c.rule, c.llc_bytes) == (expected, "llc", llc_bytes)
    assert "fake" in c.reason


def test_issue_buckets_on_both_machines():
    """The 27 MiB GPT-2/BERT bucket streams on the EPYC (32 MiB L3), not on the Xeon (480 MiB)."""
    bucket = 27 * MiB
    assert bucket >= stores.choose(env={}, llc=(32 * MiB, "epyc"), busy=IDLE).min_bytes
    assert bucket < stores.choose(env={}, llc=(480 * MiB, "xeon"), busy=IDLE).min_bytes


def test_oversubscribed_machine_lowers_the_threshold_to_a_floor():
    """Load 24 on 2 CPUs: a 32 MiB L3 is shared with a dozen tasks; the 9.3 MiB ResNet-50 bucket then streams."""
    loaded = stores.choose(env={}, llc=(32 * MiB, "epyc"), busy=(12.0, "load 24 on 2 CPU(s)"))
    assert loaded.min_bytes == stores.BUSY_FLOOR_BYTES and "load 24" in loaded.reason
    assert stores.choose(env={}, llc=(480 * MiB, "xeon"), busy=(2.0, "load 4 on 2")).min_bytes == 80 * MiB
    # the floor never raises a threshold the cache rule put below it
    assert stores.choose(env={}, llc=(6 * MiB, "small"), busy=(8.0, "load 16 on 2")).min_bytes == 2 * MiB


def test_oversubscription_from_loadavg(tmp_path):
    path = tmp_path / "loadavg"
    path.write_text("24.11 23.64 21.03 38/274 7576\n")
    factor, how = stores.oversubscription(str(path), cpus_online=2)
    assert factor == pytest.approx(12.055) and "load 24.11 on 2" in how
    path.write_text("0.50 0.40 0.30 1/100 42\n")
    assert stores.oversubscription(str(path), cpus_online=2)[0] == 1.0
    assert stores.oversubscription(str(tmp_path / "missing"), cpus_online=2) == (1.0, "load unknown")


def test_no_cache_reported_falls_back():
    c = stores.choose(env={}, llc=(None, "no cache size reported"))
    assert (c.min_bytes, c.rule) == (stores.FALLBACK_MIN_BYTES, "fallback")


@pytest.mark.parametrize(
    "value, expected",
    [
        ("0", 0),
        ("1048576", MiB),
        ("16MiB", 16 * MiB),
        ("16 mb", 16 * MiB),
        ("512K", 512 << 10),
        ("1GiB", 1 << 30),
        ("always", 0),
        (" NEVER ", _knobs.STREAM_NEVER),
    ],
)
def test_override_wins(value, expected):
    for llc in ((32 * MiB, "fake"), (None, "none")):
        c = stores.choose(env={VAR: value}, llc=llc, busy=(12.0, "load 24 on 2 CPU(s)"))
        assert (c.min_bytes, c.rule) == (expected, "override")
        assert VAR in c.reason


@pytest.mark.parametrize("value", ["", "auto", "AUTO"])
def test_auto_is_the_rule(value):
    assert stores.choose(env={VAR: value}, llc=(48 * MiB, "fake"), busy=IDLE).min_bytes == 16 * MiB


@pytest.mark.parametrize("value", ["abc", "-1", "1.5MiB", "16 XB", "16MiBs", "0x10"])
def test_invalid_override_raises(value):
    with pytest.raises(ValueError, match=VAR) as info:
        stores.choose(env={VAR: value}, llc=(32 * MiB, "fake"))
    assert repr(value) in str(info.value)


def _import_fastcoll(value: str) -> subprocess.CompletedProcess:
    env = {**os.environ, VAR: value, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    code = "import fastcoll; from fastcoll import _C; print(fastcoll.build_info()['cpu_stream_min_bytes'])"
    code += "; print(_C._cpu_stream_min_bytes())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(loader._C is None, reason="needs the compiled extension")
def test_import_applies_override_and_rejects_bad_value():
    ok = _import_fastcoll("3MiB")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.split() == [str(3 * MiB)] * 2
    bad = _import_fastcoll("lots")
    assert bad.returncode != 0
    assert f"{VAR}='lots' is not a streaming-store threshold" in bad.stderr


def test_bad_value_rejected_without_the_extension():
    """The reference ops never stream, but a bad value is still an error rather than silently ignored."""
    env = {**os.environ, VAR: "-5", "PYTHONPATH": str(REPO), "FASTCOLL_NO_EXT": "1"}
    out = subprocess.run([sys.executable, "-c", "import fastcoll"], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode != 0 and f"{VAR}='-5' is not a streaming-store threshold" in out.stderr


@pytest.mark.skipif(loader._C is None, reason="needs the compiled extension")
def test_loaded_extension_uses_the_choice():
    choice = stores.current()
    assert choice is not None
    again = stores.choose()  # the load average may have moved since the import; the cache has not
    assert (again.rule, again.llc_bytes) == (choice.rule, choice.llc_bytes)
    if choice.rule == "llc":
        base = choice.llc_bytes // stores.LLC_DIVISOR
        assert min(base, stores.BUSY_FLOOR_BYTES) <= choice.min_bytes <= base
    assert loader._C._cpu_stream_min_bytes() == choice.min_bytes
    info = fastcoll.build_info()
    assert info["cpu_stream_min_bytes"] == choice.min_bytes
    assert info["cpu_stream_choice"]["rule"] == choice.rule


# ---------------------------------------------------------------------------
# Both store kinds give the same results
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def stores_forced(kind: str) -> Iterator[None]:
    """Every CPU kernel call with streaming ("stream") or cached ("cached") stores."""
    saved = loader._C._cpu_stream_min_bytes()
    loader._C._set_cpu_stream_min_bytes(0 if kind == "stream" else _knobs.STREAM_NEVER)
    try:
        yield
    finally:
        loader._C._set_cpu_stream_min_bytes(saved)


F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
# sizes with odd tails, one above the kernels' 32768-element grain; a 3-element slice of a buffer
# misaligns the next tensor's start (the streaming path's scalar head)
SIZES = [1, 3, 31, 1000, 65537, 7]


def _grads(dtype: torch.dtype, seed: int) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    storage = torch.randn(sum(SIZES) + len(SIZES), generator=gen, dtype=F64).to(dtype)
    out, at = [], 1  # start at element 1: misaligned for the vector loops
    for n in SIZES:
        out.append(storage[at : at + n])
        at += n + 1
    return out


@pytest.mark.skipif(loader._C is None, reason="needs the compiled extension")
@pytest.mark.parametrize("src, dst", [(F32, F32), (F32, BF16), (BF16, F32), (F16, F32), (F64, F32), (F32, F16)])
@pytest.mark.parametrize("scale", [0.125, 1.0 / 3.0])
@pytest.mark.parametrize("threads", [1, 2])
def test_stream_and_cached_identical(src, dst, scale, threads):
    grads = _grads(src, seed=7)
    n = sum(SIZES)
    # float64 reference: the op multiplies in float32 (float64 when either side is), then casts
    opmath = F64 if F64 in (src, dst) else F32
    flat_ref = torch.cat([(g.to(opmath) * scale).to(dst) for g in grads])
    back_ref = [(flat_ref[o : o + g.numel()].to(F64) * 2.0).to(opmath).to(src) for o, g in zip(_offsets(grads), grads)]
    results = {}
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for kind in ("stream", "cached"):
            bucket = torch.full((n + 1,), float("nan"), dtype=dst)[1:]  # misaligned by one element, poisoned
            dests = [torch.full_like(g, float("nan")) for g in grads]
            with stores_forced(kind):
                fastcoll.ops.flatten_scale(grads, bucket, scale)
                fastcoll.ops.unflatten_scale(bucket, dests, 2.0)
            results[kind] = (bucket, dests)
    finally:
        torch.set_num_threads(saved)
    for kind, (bucket, dests) in results.items():
        torch.testing.assert_close(bucket, flat_ref, rtol=0, atol=0, msg=lambda m: f"{kind} pack: {m}")
        for i, (d, ref) in enumerate(zip(dests, back_ref)):
            torch.testing.assert_close(d, ref, rtol=0, atol=0, msg=lambda m: f"{kind} unpack, tensor {i}: {m}")
    assert torch.equal(results["stream"][0], results["cached"][0])
    for a, b in zip(results["stream"][1], results["cached"][1]):
        assert torch.equal(a, b)


def _offsets(tensors: Sequence[torch.Tensor]) -> List[int]:
    out, at = [], 0
    for t in tensors:
        out.append(at)
        at += t.numel()
    return out


# ---------------------------------------------------------------------------
# benchmarks/store_choice.py (not part of the CLI): its verdict and one bucket end to end
# ---------------------------------------------------------------------------


def _store_choice_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("store_choice", REPO / "benchmarks" / "store_choice.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_verdict():
    sc = _store_choice_module()
    assert sc.verdict((0.7, 1.04)) == "met"
    assert sc.verdict((1.06, 1.3)) == "MISSED"
    assert sc.verdict((0.98, 1.12)) == "unresolved"


@pytest.mark.skipif(loader._C is None, reason="needs the compiled extension")
def test_benchmark_one_bucket():
    from fastcoll.bench import ops as bench_ops

    sc = _store_choice_module()
    saved = loader._C._cpu_stream_min_bytes()
    layout = bench_ops.synthetic_layouts(counts=(3,), dtypes=(torch.bfloat16,), total=40_001)[0]
    try:
        row = sc.bench_bucket(layout, threads=1, threshold=layout.nbytes, reps=3, target_s=0.0005)
        assert loader._C._cpu_stream_min_bytes() == layout.nbytes  # left at the automatic threshold it was given
    finally:
        loader._C._set_cpu_stream_min_bytes(saved)
    assert row["auto"] == "stream" and row["verdict"] in ("met", "MISSED", "unresolved")
    assert len(row["samples_s"]["stream"]) == len(row["samples_s"]["cached"]) == 3
    lo, hi = row["stream/cached_ci90"]
    assert lo <= row["stream/cached"] <= hi
