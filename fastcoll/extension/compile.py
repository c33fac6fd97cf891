"""Runs one build of the extension: torch.utils.cpp_extension.load with ninja, in a child process.

A child process keeps a failed build from leaving half-registered ops in the
importing process, lets the build be interrupted as a whole (its process
group), and captures the compiler's output for the failure message.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from typing import List

from . import spec, toolchain
from .errors import BuildFailed
from .key import Plan

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker.py")
_RUN_WORKER = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"


def _define_flags(defines: List[tuple]) -> List[str]:
    # cpp_extension.load writes extra flags into the ninja file unquoted, and ninja runs them
    # through the shell: quote them (a define's value has quotes, spaces, semicolons).
    return [shlex.quote(f"-D{name}={value}") for name, value in defines]


def job(plan: Plan, build_dir: str, compiler: str) -> dict:
    """The arguments of torch.utils.cpp_extension.load for ``plan``, building in ``build_dir``."""
    defines = spec.defines(plan.with_cuda, plan.cuda_archs) + [("FASTCOLL_COMPILER", f'"{compiler}"')]
    return {
        "name": spec.NAME,
        "sources": [os.path.join(plan.csrc, s) for s in spec.compiled_sources(plan.csrc, plan.with_cuda)],
        "extra_cflags": list(spec.CXX_FLAGS + spec.JIT_CXX_FLAGS) + _define_flags(defines),
        "extra_cuda_cflags": (list(spec.NVCC_FLAGS) + _define_flags(defines)) if plan.with_cuda else None,
        "extra_ldflags": list(spec.LD_FLAGS),
        "extra_include_paths": [plan.csrc],
        "build_directory": build_dir,
        "with_cuda": plan.with_cuda,
    }


_DIAGNOSTIC = re.compile(r"(\berror\b|undefined reference|undefined symbol|No such file)", re.IGNORECASE)
_PY_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b: ")


def first_error(output: str) -> str:
    """The build's error, in one line.

    The first diagnostic of the compiler or linker (ninja's own progress and
    ``FAILED:`` lines and Python tracebacks aside), else the exception that
    ended the build process (its last line of the form ``SomeError: ...``),
    else the last line of ``output``.
    """
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    in_traceback = False
    for line in lines:
        in_traceback = (in_traceback or line.startswith("Traceback")) and not _PY_EXCEPTION.match(line)
        if in_traceback or line.startswith(("[", "FAILED:", "ninja:", "RuntimeError:", "subprocess.")):
            continue
        if _DIAGNOSTIC.search(line) and not _PY_EXCEPTION.match(line):
            return line[:300]
    exceptions = [line for line in lines if _PY_EXCEPTION.match(line)]
    return (exceptions or lines or ["no output"])[-1][:300]


def error_excerpt(output: str, limit: int = 60) -> str:
    """The part of a failed build's output worth reading: from the first failed step on, Python tracebacks
    left out (the exception's own line stays), at most ``limit`` lines."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("FAILED:")), 0)
    kept, in_traceback = [], False
    for line in lines[start:]:
        in_traceback = (in_traceback or line.startswith("Traceback")) and not _PY_EXCEPTION.match(line)
        if not in_traceback and not line.startswith("The above exception") and not line.startswith("During handling"):
            kept.append(line)
    return "\n".join(kept[:limit] if start else kept[-limit:])


def run(plan: Plan, build_dir: str) -> str:
    """Compile ``plan`` in ``build_dir``.

    Args:
        plan: What to build (key.plan()).
        build_dir: An empty folder of this build's own.

    Returns:
        The path of the built library (in ``build_dir``).

    Raises:
        BuildFailed: The compiler, linker or loading the result failed; ``.log`` holds the output.
    """
    compiler = spec.compiler_name(toolchain.find_cxx())
    job_path = os.path.join(build_dir, "job.json")
    with open(job_path, "w") as f:
        json.dump(job(plan, build_dir, compiler), f, indent=1)
    log_path = os.path.join(build_dir, "build.log")
    env = toolchain.build_env(plan.with_cuda, plan.cuda_home, plan.cuda_archs or "")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", _RUN_WORKER, _WORKER, job_path],
            cwd=build_dir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # one process group: ninja and the compilers end with it
        )
        try:
            rc = proc.wait()
        except BaseException:  # KeyboardInterrupt, SystemExit: stop the whole build
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    lib = os.path.join(build_dir, spec.NAME + ".so")
    if rc == 0 and os.path.exists(lib):
        return lib
    with open(log_path, errors="replace") as f:
        output = f.read()
    raise BuildFailed(
        f"compiling the C++ extension failed (exit {rc}): {first_error(output)}",
        "Fix the cause shown in the log, then run `python -m fastcoll.extension` to compile again",
        log=log_path,
    )
