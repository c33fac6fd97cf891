"""The GPU tests' own logic on the CPU, in every ``make test``.

``tests/test_cuda_paths.py`` and ``tests/test_cuda_sharded.py`` run only where a
GPU is (``make gpu-test``), which is rarely; a change of behaviour on the CPU
side (a collective renamed, a count changed) would otherwise first show in a
GPU session. Their tests that are not CUDA-specific also run with gloo and CPU
tensors (``FASTCOLL_CUDA_PATHS_DEVICE=cpu``, see their module docstring): this
runs that dry run in a child pytest and requires it to pass with at least as
many tests as it has today.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
#: Tests the dry run passed (2026-11-29, with the complex-parameter tests): fewer means tests stopped running there.
AT_LEAST = 43


def test_the_cuda_path_tests_pass_on_the_cpu():
    env = dict(os.environ, FASTCOLL_CUDA_PATHS_DEVICE="cpu", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = TESTS + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "test_cuda_paths"]
    cmd += [os.path.join(TESTS, f) for f in ("test_cuda_paths.py", "test_cuda_sharded.py")]
    out = subprocess.run(cmd, cwd=os.path.dirname(TESTS), env=env, capture_output=True, text=True, timeout=900)
    tail = (out.stdout[-6000:] + out.stderr[-2000:]).strip()
    assert out.returncode == 0, f"the CPU dry run of the CUDA tests failed:\n{tail}"
    passed = re.search(r"(\d+) passed", out.stdout)
    assert passed and int(passed.group(1)) >= AT_LEAST, f"only {passed and passed.group(1)} passed:\n{tail}"
