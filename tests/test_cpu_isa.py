"""The builds of the CPU inner loops (default, AVX2, AVX2 + AVX-512 BF16) store the same bits (NaN payloads aside).

flatten_accumulate is in the probe too: its fused multiply-add (VFMADD in the vector builds, std::fma
in the baseline build and the scalar tails) rounds once in every build; so is sum_chunks (float64
sums the compiler vectorizes per build).

``FASTCOLL_CPU_ISA`` picks a build for a process (``fastcoll.build_info()["cpu_isa"]``
says which runs). Each build this CPU can run computes the same ops on the
same inputs, among them the values where the builds' conversions differ
unless handled (NaN, subnormals, values that round to infinity, zeros of
both signs), in every dtype pair and at lengths that exercise the vector
loops and their scalar tails; the results must agree bit for bit, except the
payload of a NaN (the baseline build stores torch's scalar NaN, the vector
builds at::vec's; both vector builds store the same). Then the
built library is checked for AVX-512 instructions outside the functions meant
to hold them (the AVX-512 BF16 build's, and those named ``*avx512*``): an inline function that several files emit may be
taken by the linker from any of them, and one built with AVX-512 would crash
a CPU without it.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

import fastcoll

pytestmark = pytest.mark.skipif(not fastcoll.build_info()["extension"], reason="needs the compiled extension")

ISAS = ("default", "avx2", "avx512bf16")

# Runs in a fresh process (the build is chosen once per process); prints one
# hex digest per result, in a fixed order.
_PROBE = textwrap.dedent(
    """
    import hashlib, struct, sys
    import torch
    import fastcoll
    from fastcoll import ops

    torch.set_num_threads(1)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    g = torch.Generator().manual_seed(0)

    def values(n, dtype):
        x = torch.randn(n, generator=g, dtype=torch.float64) * 3.0
        specials = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -3e-39, 1e-45,
                    3.3e38, -3.39e38, 65519.0, 65520.0, -70000.0, 1e-8, 6e-8]
        for k, v in enumerate(specials):
            x[(k * 7919) % n] = v
        return x.to(dtype)

    def digest(t):
        # NaN payloads aside (the baseline build stores torch's scalar NaN, 0x7FC0 in bfloat16;
        # the vector builds 0xFFFF, as at::vec does): every other bit, and where the NaNs are.
        nan = torch.isnan(t)
        t = torch.where(nan, torch.zeros((), dtype=t.dtype), t)
        data = t.contiguous().view(torch.uint8).numpy().tobytes() + nan.numpy().tobytes()
        return hashlib.sha256(data).hexdigest()[:16]

    out = [fastcoll.build_info()["cpu_isa"]]
    for src in dtypes:
        for dst in dtypes:
            for scale in (1.0, 0.125, 1 / 3):
                sizes = [1, 15, 16, 17, 31, 33, 100, 257, 4099]
                grads = [values(n, src) for n in sizes]
                flat = torch.empty(sum(sizes), dtype=dst)
                ops.flatten_scale(grads, flat, scale)
                out.append(digest(flat))
                flag = torch.zeros(1, dtype=torch.int32)
                flat2 = torch.empty_like(flat)
                ops.flatten_scale(grads, flat2, scale, nonfinite=flag)
                out.append(digest(flat2) + str(int(flag)))
                back = [torch.empty(n, dtype=src) for n in sizes]
                ops.unflatten_scale(values(sum(sizes), dst), back, scale)
                out.append(digest(torch.cat([b.view(-1) for b in back])))
                s = torch.zeros(1, dtype=torch.float64)
                finite = [torch.nan_to_num(v.to(torch.float64), 0.0, 0.0, 0.0).clamp(-1e3, 1e3).to(src) for v in grads]
                ops.unflatten_scale(torch.cat([f.to(dst) for f in finite]), back, scale, sumsq=s)
                out.append(digest(torch.cat([b.view(-1) for b in back])) + struct.pack("<d", float(s)).hex())
                main = values(sum(sizes) + 3, dst)  # prefilled, specials included; 3 elements of tail
                ops.flatten_accumulate(grads, main, scale)
                out.append(digest(main))
                main = torch.nan_to_num(values(sum(sizes), dst), 0.0, 0.0, 0.0)  # the flag: overflow only
                flag = torch.zeros(1, dtype=torch.int32)
                ops.flatten_accumulate([torch.nan_to_num(v, 0.0, 0.0, 0.0) for v in grads], main, scale, nonfinite=flag)
                out.append(digest(main) + str(int(flag)))
    for src in (torch.bfloat16, torch.float16):  # sum_chunks: every row count's tail, both outputs
        for rows, n in ((1, 17), (2, 4099), (3, 257), (8, 1000)):
            chunks = values(rows * n, src).view(rows, n)
            for dst in (torch.float32, src):
                for scale in (1.0, 0.125, 1 / 3):
                    got = torch.empty(n, dtype=dst)
                    ops.sum_chunks(chunks, got, scale)
                    out.append(digest(got))
    print("\\n".join(out))
    """
)


def _supported_isas() -> list[str]:
    best = fastcoll.build_info().get("cpu_isa")
    if best not in ISAS:
        pytest.skip(f"this build does not report its CPU ISA ({best!r})")
    return list(ISAS[: ISAS.index(best) + 1])


def _run_probe(isa: str) -> list[str]:
    env = {**os.environ, "FASTCOLL_CPU_ISA": isa, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.split()
    assert lines[0] == isa, f"asked for {isa}, ran {lines[0]}"
    return lines[1:]


def test_every_build_stores_the_same_bits():
    isas = _supported_isas()
    if len(isas) < 2:
        pytest.skip(f"this CPU runs only the {isas[0]} build")
    results = {isa: _run_probe(isa) for isa in isas}
    reference = results[isas[0]]
    assert len(reference) == 4 * 4 * 3 * 6 + 2 * 4 * 2 * 3
    for isa in isas[1:]:
        diff = [i for i, (a, b) in enumerate(zip(reference, results[isa])) if a != b]
        assert not diff, f"{isa} differs from {isas[0]} in results {diff[:10]} (of {len(reference)})"


def test_unknown_or_unsupported_isa_is_a_clear_error():
    code = (
        "import fastcoll, torch; print(fastcoll.build_info()['cpu_isa']); "
        "fastcoll.ops.flatten_scale([torch.ones(3)], torch.empty(3))"
    )
    env = {**os.environ, "FASTCOLL_CPU_ISA": "sse9"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "FASTCOLL_CPU_ISA=sse9 is not one of default, avx2, avx512bf16" in proc.stdout + proc.stderr
    isas = _supported_isas()
    if len(isas) < len(ISAS):
        env["FASTCOLL_CPU_ISA"] = ISAS[len(isas)]
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and "asks for instructions this CPU lacks" in proc.stdout + proc.stderr


# EVEX-encoded instructions start with the byte 0x62 (after an optional 0x67
# or segment prefix); the mask-register instructions (kmovw, kortestw, ...)
# are VEX-encoded, recognized by their mnemonic.
_EVEX = re.compile(r"^\s*[0-9a-f]+:\s+(?:(?:26|2e|36|3e|64|65|67) )*62 ")
_MASK_OP = re.compile(r"\tk(?:mov|or|and|andn|xor|xnor|not|test|ortest|unpck|shift|add)[bwdq]?\b")
# Functions meant to hold AVX-512 code (picked only after a run-time check): the
# avx512bf16 build of copy_scale.h, and functions named for it (checksum's sum_words_avx512).
_OWN = ("fastcoll::cpu_avx512bf16::", "at::vec::AVX2_BF16::", "avx512")


def test_avx512_instructions_only_where_meant():
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump is not installed")
    lib = importlib.util.find_spec("fastcoll._C").origin
    proc = subprocess.run([objdump, "-d", "-C", "-w", lib], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    func, found, offenders = "?", 0, {}
    header = re.compile(r"^[0-9a-f]+ <(.*)>:$")
    for line in proc.stdout.splitlines():
        m = header.match(line)
        if m:
            func = m.group(1)
            continue
        if _EVEX.match(line) or _MASK_OP.search(line):
            if any(own in func for own in _OWN):
                found += 1
            else:
                offenders.setdefault(func, line.strip())
    assert not offenders, "AVX-512 instructions outside the avx512bf16 build: " + "; ".join(
        f"{f}: {i}" for f, i in list(offenders.items())[:10]
    )
    if platform.machine() in ("x86_64", "AMD64"):
        assert found > 0, "the avx512bf16 build holds no AVX-512 instruction: the check cannot see it"
