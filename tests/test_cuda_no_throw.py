"""No C++ exception ever crosses code that nvcc compiled (issue 32, item 1).

On one GPU machine, argument checks that threw through nvcc-built host code
crashed the process (SIGSEGV) instead of raising. Since then every check of
the CUDA ops runs in host-compiler code (csrc/ops.cpp, csrc/cuda/cuda_ops.cpp)
and the .cu files hold only kernels and noexcept launchers that return CUDA
error codes (csrc/cuda/launch.h). These tests keep it so, without a GPU:

* the sources: no throwing macro, ``throw``, torch/ATen header or torch call
  in any ``.cu`` / ``.cuh`` file, and every launcher ``noexcept``;
* the objects, where a CUDA build is at hand (``make cuda-build-check`` leaves
  them in build/cuda-check/tmp; ``FASTCOLL_CUDA_OBJECTS`` may name another
  directory): no object compiled from a ``.cu`` file refers to a symbol that
  throws (``__cxa_throw``, torch's check failures, libstdc++'s ``__throw_*``).

The error messages themselves are tested on the CPU by tests/test_ops*.py and
tests/test_checksum.py (the same checks, csrc/ops.cpp) and on a GPU by
tests/test_cuda_paths.py.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from typing import Dict, List

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")

#: Tokens that throw, or call torch code that may (in code, not comments or strings).
THROWING = re.compile(
    r"\b(TORCH_CHECK\w*|TORCH_INTERNAL_ASSERT\w*|TORCH_WARN\w*|AT_ERROR|AT_ASSERT\w*|C10_THROW_ERROR|"
    r"C10_CUDA_CHECK\w*|C10_CUDA_KERNEL_LAUNCH_CHECK|AT_CUDA_CHECK|throw|try|catch|at::|torch::|"
    r"c10::cuda::|data_ptr|dtype_code|elementSize)\b"
)
#: Headers a .cu/.cuh file may include from torch: c10's scalar types only (dtypes.h includes them too).
ALLOWED_TORCH_HEADERS = {"c10/util/BFloat16.h", "c10/util/Half.h", "c10/core/ScalarType.h"}
#: Symbols an object compiled from a .cu file must not refer to (demangled names, substrings).
THROWING_SYMBOLS = (
    "__cxa_throw",
    "__cxa_rethrow",
    "__cxa_allocate_exception",
    "torchCheckFail",
    "torchInternalAssertFail",
    "c10::Error::Error",
    "c10_cuda_check_implementation",
    "std::__throw_",
)


def strip_comments_and_strings(text: str) -> str:
    """``text`` with C++ comments, string and character literals blanked (line numbers kept)."""
    pattern = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)
    return pattern.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def cuda_sources() -> List[str]:
    """Every .cu and .cuh file under csrc/, relative to it."""
    found = []
    for root, _, files in os.walk(CSRC):
        for name in files:
            if name.endswith((".cu", ".cuh")):
                found.append(os.path.relpath(os.path.join(root, name), CSRC))
    return sorted(found)


def throwing_lines(text: str) -> List[str]:
    """``line N: token`` for each throwing token in the code of ``text``."""
    code = strip_comments_and_strings(text)
    return [f"line {code.count(chr(10), 0, m.start()) + 1}: {m.group(0)}" for m in THROWING.finditer(code)]


def test_the_scan_sees_what_it_must():
    """The scanner finds every kind of throw the old kernels had, and ignores comments and strings."""
    old = """
    TORCH_CHECK(n <= INT_MAX, "fastcoll.", op, ": too many");   // TORCH_CHECK in a comment is fine
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    C10_CUDA_CHECK(cudaMemsetAsync(acc.data_ptr(), 0, 8, stream));
    auto host = at::empty({4}, at::TensorOptions());
    if (bad) throw std::runtime_error("x");
    const char* s = "throw TORCH_CHECK at:: in a string";
    """
    found = [line.split(": ")[1] for line in throwing_lines(old)]
    assert found == ["TORCH_CHECK", "C10_CUDA_KERNEL_LAUNCH_CHECK", "C10_CUDA_CHECK", "data_ptr", "at::", "at::", "throw"]


def test_cuda_sources_exist():
    names = cuda_sources()
    assert {"cuda/flatten_scale_cuda.cu", "cuda/health_cuda.cu", "cuda/accumulate_cuda.cu", "cuda/checksum_cuda.cu"} <= set(
        names
    ), names


@pytest.mark.parametrize("rel", cuda_sources())
def test_no_throw_in_cuda_sources(rel):
    with open(os.path.join(CSRC, rel)) as f:
        text = f.read()
    found = throwing_lines(text)
    assert not found, f"csrc/{rel}: code that throws or calls torch (move it to csrc/cuda/cuda_ops.cpp): {found}"
    includes = re.findall(r'#include\s*[<"]([^>"]+)[>"]', strip_comments_and_includes_kept(text))
    torch_headers = [h for h in includes if h.split("/")[0] in ("ATen", "c10", "torch") and h not in ALLOWED_TORCH_HEADERS]
    assert not torch_headers, f"csrc/{rel} includes torch headers whose code may throw: {torch_headers}"
    assert "fastcoll.h" not in includes, f"csrc/{rel} includes fastcoll.h (ATen tensors); use cuda/launch.h"


def strip_comments_and_includes_kept(text: str) -> str:
    """``text`` without comments (the include lines' quoted names kept)."""
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)


def test_launchers_are_noexcept():
    """Every launcher declared in launch.h and defined in a .cu file is noexcept."""
    declared: Dict[str, str] = {}
    with open(os.path.join(CSRC, "cuda", "launch.h")) as f:
        header = strip_comments_and_strings(f.read())
    for m in re.finditer(r"\b(cudaError_t|bool)\s+(\w+)\s*\(([^;{]*?)\)\s*(noexcept)?\s*;", header):
        declared[m.group(2)] = m.group(4) or ""
    assert {"launch_copy_scale", "launch_accumulate", "launch_health", "launch_sum_partials", "launch_checksum"} <= set(
        declared
    ), declared
    assert all(declared.values()), f"launchers declared without noexcept: {[k for k, v in declared.items() if not v]}"
    defined = {}
    for rel in cuda_sources():
        with open(os.path.join(CSRC, rel)) as f:
            code = strip_comments_and_strings(f.read())
        for m in re.finditer(r"\b(cudaError_t|bool)\s+(\w+)\s*\(([^;{]*?)\)\s*(noexcept)?\s*\{", code):
            defined[m.group(2)] = (rel, m.group(4) or "")
    missing = set(declared) - set(defined)
    assert not missing, f"launchers declared in launch.h but defined in no .cu file: {missing}"
    bad = {name: rel for name, (rel, nx) in defined.items() if not nx}
    assert not bad, f"functions of .cu files that return an error code without noexcept: {bad}"


def cuda_objects() -> List[str]:
    """Objects compiled from .cu files in the CUDA build check's directory (or FASTCOLL_CUDA_OBJECTS)."""
    where = os.environ.get("FASTCOLL_CUDA_OBJECTS") or os.path.join(ROOT, "build", "cuda-check", "tmp")
    found = glob.glob(os.path.join(where, "**", "*.o"), recursive=True)
    stems = {os.path.splitext(os.path.basename(s))[0] for s in cuda_sources() if s.endswith(".cu")}
    # setuptools names them <stem>.o (nvcc) beside <stem>.o of .cpp files in other folders: keep cuda/*.cu ones
    return sorted(p for p in found if os.path.basename(p).split(".")[0] in stems)


def undefined_symbols(obj: str) -> List[str]:
    out = subprocess.run(["nm", "-C", "--undefined-only", obj], capture_output=True, text=True, check=True).stdout
    return [line.split(None, 1)[-1].strip() for line in out.splitlines() if line.strip()]


def test_cuda_objects_refer_to_nothing_that_throws():
    objs = cuda_objects()
    if not objs:
        pytest.skip("no CUDA objects here: run `make cuda-build-check` (or set FASTCOLL_CUDA_OBJECTS)")
    if shutil.which("nm") is None:
        pytest.skip("nm (binutils) is not installed")
    for obj in objs:
        bad = sorted({s for s in undefined_symbols(obj) if any(t in s for t in THROWING_SYMBOLS)})
        assert not bad, f"{obj} (compiled by nvcc) refers to symbols that throw: {bad}"
