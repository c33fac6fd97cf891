"""The build cache, its key and its lock, and the import's fallbacks: none of it runs a real compiler.

A fake build (``compile.run`` replaced by a function that writes a few bytes)
stands in for the compiler where a build must happen; the tests that go
through ``import fastcoll`` run it in a child process, on a copy of the
package without an ahead-of-time build, with a cache of their own. The real
compiler is exercised by tests/test_build_jit.py (slow, CI's install stage).
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from fastcoll.extension import cache, compile, jit, key, lock, spec, toolchain
from fastcoll.extension.errors import BuildFailed, ExtensionUnavailable, LockTimeout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 120  # seconds, for any child process


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("FASTCOLL_CACHE_DIR", str(path))
    return path


@pytest.fixture
def fake_build(monkeypatch):
    """Replace the compile by one that writes 1000 bytes; returns the list of build folders it was called in."""
    calls = []

    def run(plan, build_dir):
        calls.append(build_dir)
        lib = os.path.join(build_dir, "_C.so")
        with open(lib, "wb") as f:
            f.write(b"\x7fELF" + b"x" * 996)
        return lib

    monkeypatch.setattr(compile, "run", run)
    return calls


def tree_copy(tmp_path, with_sources: bool = True) -> str:
    """A copy of the package (no compiled library) and, optionally, of csrc/: a checkout without a build."""
    root = tmp_path / "tree"
    ignore = shutil.ignore_patterns("*.so", "__pycache__", "_C.build.json")
    shutil.copytree(os.path.join(REPO, "fastcoll"), root / "fastcoll", ignore=ignore)
    if with_sources:
        shutil.copytree(os.path.join(REPO, "csrc"), root / "csrc")
    return str(root)


def run_python(code: str, tree: str, cache_path, args=None, **env) -> subprocess.CompletedProcess:
    """``python -c code`` (or ``python *args``) on ``tree``, with a cache of its own and no inherited fastcoll knobs."""
    full_env = dict(os.environ, PYTHONPATH=tree, FASTCOLL_CACHE_DIR=str(cache_path), OMP_NUM_THREADS="1", **env)
    for name in ("FASTCOLL_NO_EXT", "FASTCOLL_REQUIRE_EXT", "FASTCOLL_JIT"):
        if name not in env:
            full_env.pop(name, None)
    return subprocess.run(
        [sys.executable, *(args or ["-c", textwrap.dedent(code)])],
        cwd=tree,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


# ---------------------------------------------------------------------------
# The key
# ---------------------------------------------------------------------------


def test_plan_records_what_the_build_is_for(cache_dir):
    plan = key.plan()
    inputs = plan.inputs
    assert inputs["torch"] == torch.__version__ and inputs["torch_git"] == torch.version.git_version
    assert inputs["python"].startswith(sys.implementation.cache_tag)
    assert inputs["python"].endswith(importlib.machinery.EXTENSION_SUFFIXES[0])
    assert inputs["cxx11_abi"] == bool(torch._C._GLIBCXX_USE_CXX11_ABI)
    assert inputs["machine"] == os.uname().machine
    assert inputs["cpu_isa_builds"] == list(spec.cpu_isa_builds(os.uname().machine))
    assert inputs["sources"] == spec.sources_hash(plan.csrc)
    assert inputs["flags"]["cxx"] == list(spec.CXX_FLAGS + spec.JIT_CXX_FLAGS)
    assert plan.key.startswith(f"torch{torch.__version__}-") and plan.key == key.make_key(inputs)


@pytest.mark.parametrize(
    "field, value",
    [
        ("sources", "0" * 64),
        ("flags", {"cxx": ["-O2"]}),
        ("torch", "2.99.0"),
        ("torch_git", "f" * 40),
        ("cuda", "13.0"),
        ("python", "cpython-312.cpython-312-x86_64-linux-gnu.so"),
        ("cxx11_abi", False),
        ("machine", "aarch64"),
        ("cpu_isa_builds", ["default"]),
        ("compiler", ["clang++", None]),
    ],
)
def test_key_changes_with_each_input(cache_dir, field, value):
    inputs = key.plan().inputs
    assert inputs[field] != value
    assert key.make_key(dict(inputs, **{field: value})) != key.make_key(inputs)


def test_key_follows_the_environment(cache_dir, monkeypatch):
    base = key.plan().key
    monkeypatch.setenv("CXX", "clang++")
    assert key.plan().key != base
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(torch, "__version__", "2.99.0+cpu")
    assert key.plan().key != base


def test_key_of_a_changed_source(tmp_path, cache_dir, monkeypatch):
    tree = tree_copy(tmp_path)
    monkeypatch.setattr(key, "_PACKAGE", os.path.join(tree, "fastcoll"))
    before = key.plan()
    assert before.csrc == os.path.join(tree, "csrc")
    with open(os.path.join(tree, "csrc", "fastcoll.h"), "a") as f:
        f.write("\n// changed\n")
    assert key.plan().key != before.key


def test_cuda_torch(cache_dir, monkeypatch):
    """A CUDA torch: the CUDA kernels when nvcc is there (their arch list in the key), else the CPU kernels only."""
    cpu_key = key.plan().key
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(toolchain, "cuda_home", lambda: "/opt/cuda")
    monkeypatch.setattr(toolchain, "nvcc", lambda home: None)
    plan = key.plan()
    assert not plan.with_cuda and "nvcc was not found" in plan.cuda_missing and plan.key == cpu_key
    monkeypatch.setattr(toolchain, "nvcc", lambda home: "/opt/cuda/bin/nvcc")
    plan = key.plan()
    assert plan.with_cuda and plan.cuda_missing is None and "-cu13.0-" in plan.key
    assert plan.inputs["flags"]["cuda_archs"] == spec.DEFAULT_CUDA_ARCHS
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert key.plan().key != plan.key
    monkeypatch.setenv("FASTCOLL_CUDA", "0")
    assert not key.plan().with_cuda


def test_fastcoll_cuda_1_without_cuda(cache_dir, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setenv("FASTCOLL_CUDA", "1")
    with pytest.raises(ExtensionUnavailable, match="FASTCOLL_CUDA=1"):
        key.plan()


def test_wheel_manifest_spares_the_hash(tmp_path):
    csrc = tmp_path / "csrc"
    shutil.copytree(os.path.join(REPO, "csrc"), csrc)
    assert key.hash_sources(str(csrc)) == spec.sources_hash(os.path.join(REPO, "csrc"))
    (csrc / spec.MANIFEST).write_text(json.dumps({"sha256": "abc"}))
    assert key.hash_sources(str(csrc)) == "abc"


# ---------------------------------------------------------------------------
# The lock
# ---------------------------------------------------------------------------


def test_lock_note_of_a_dead_process_is_taken_over(tmp_path):
    path = str(tmp_path / "k.lock")
    with open(path, "w") as f:
        f.write("pid 999999999 on host elsewhere since 2020-01-01 00:00:00")
    messages = []
    start = time.monotonic()
    with lock.acquire(path, 5, messages.append) as waited:
        assert not waited and not messages
        assert f"pid {os.getpid()} " in lock.holder(path)
    assert time.monotonic() - start < 2


HOLD = """
import sys, time
from fastcoll.extension import lock
with lock.acquire(sys.argv[1], 5, print):
    print("locked", flush=True)
    time.sleep(600)
"""


@pytest.mark.timeout(TIMEOUT)
def test_lock_of_a_killed_holder_is_free(tmp_path):
    """A live holder makes others wait (and time out naming the lock file); killed, it blocks nobody."""
    path = str(tmp_path / "k.lock")
    env = dict(os.environ, FASTCOLL_NO_EXT="1", PYTHONPATH=REPO)
    holder = subprocess.Popen([sys.executable, "-W", "ignore", "-c", HOLD, path], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        messages = []
        with pytest.raises(LockTimeout) as info:
            with lock.acquire(path, 0.5, messages.append):
                pass
        assert path in str(info.value) and f"pid {holder.pid} " in str(info.value)
        assert len(messages) == 1 and f"pid {holder.pid} " in messages[0] and path in messages[0]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=TIMEOUT)
    start = time.monotonic()
    with lock.acquire(path, 5, messages.append) as waited:
        assert not waited
    assert time.monotonic() - start < 2


# ---------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------


def test_build_once_then_hit(cache_dir, fake_build):
    lines = []
    first = jit.ensure(report=lines.append)
    assert first.how == jit.COMPILED and len(fake_build) == 1 and first.seconds is not None
    assert len(lines) == 2 and "compiling" in lines[0] and "python -m fastcoll.extension" in lines[0]
    assert str(cache_dir) in lines[0] and "compiled the extension in" in lines[1]
    meta = first.entry.meta()
    assert meta["key"] == first.plan.key and meta["size"] == 1000 and meta["torch"] == torch.__version__
    assert not os.path.exists(fake_build[0])  # the build folder is gone
    second = jit.ensure(report=lines.append)
    assert second.how == jit.CACHE_HIT and second.path == first.path and len(fake_build) == 1 and len(lines) == 2
    assert jit.ensure(force=True).how == jit.COMPILED and len(fake_build) == 2


@pytest.mark.parametrize("damage", ["truncated", "no record", "bad record", "other key", "no library"])
def test_damaged_entry_is_rebuilt(cache_dir, fake_build, damage):
    entry = jit.ensure().entry
    if damage == "truncated":
        with open(entry.lib, "r+b") as f:
            f.truncate(10)
    elif damage == "no record":
        os.unlink(entry.meta_path)
    elif damage == "bad record":
        with open(entry.meta_path, "w") as f:
            f.write("{not json")
    elif damage == "other key":
        record = dict(entry.meta(), key="other")
        with open(entry.meta_path, "w") as f:
            json.dump(record, f)
    else:
        os.unlink(entry.lib)
    assert not entry.valid()
    again = jit.ensure()
    assert again.how == jit.COMPILED and len(fake_build) == 2 and again.entry.valid()


def test_failed_build_is_reported_not_retried(cache_dir, monkeypatch):
    calls = []

    def fail(plan, build_dir):
        calls.append(1)
        log = os.path.join(build_dir, "build.log")
        with open(log, "w") as f:
            f.write("[1/9] c++ ops.cpp\nops.cpp:3:1: error: expected ';'\nninja: build stopped\n")
        raise BuildFailed("compiling the C++ extension failed (exit 1): ops.cpp:3:1: error: expected ';'", "Fix it", log=log)

    monkeypatch.setattr(compile, "run", fail)
    with pytest.raises(BuildFailed) as first:
        jit.ensure(report=lambda m: None)
    entry = cache.Entry(cache.root(), key.plan().key)
    assert first.value.log == entry.failed_log and "expected ';'" in open(entry.failed_log).read()
    with pytest.raises(BuildFailed, match="earlier compile.*expected ';'") as second:
        jit.ensure(report=lambda m: None)
    assert len(calls) == 1 and "python -m fastcoll.extension" in str(second.value)
    with pytest.raises(BuildFailed):
        jit.ensure(report=lambda m: None, retry_failed=True)
    assert len(calls) == 2


def test_no_compiler(cache_dir, monkeypatch, fake_build):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(ExtensionUnavailable, match=r"no C\+\+ compiler.*CXX"):
        jit.ensure()
    assert not fake_build


def test_unwritable_cache(tmp_path, monkeypatch, fake_build):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("FASTCOLL_CACHE_DIR", str(blocker / "cache"))  # below a file: cannot be created
    with pytest.raises(ExtensionUnavailable, match="FASTCOLL_CACHE_DIR"):
        jit.ensure()


CONCURRENT = """
import os, sys, time
from fastcoll.extension import compile, jit

def fake(plan, build_dir):
    open(os.path.join(sys.argv[1], "built-%d" % os.getpid()), "w").close()
    time.sleep(1.5)
    lib = os.path.join(build_dir, "_C.so")
    with open(lib, "wb") as f:
        f.write(b"x" * 1000)
    return lib

compile.run = fake
while not os.path.exists(os.path.join(sys.argv[1], "go")):
    time.sleep(0.01)
got = jit.ensure(report=lambda m: print("REPORT", m, flush=True))
print("HOW", got.how, flush=True)
"""


@pytest.mark.timeout(TIMEOUT + 30)
def test_concurrent_first_imports_build_once(tmp_path, cache_dir):
    """4 processes want the extension at once, from an empty cache: one builds, three wait and load it."""
    marks = tmp_path / "marks"
    marks.mkdir()
    env = dict(os.environ, FASTCOLL_NO_EXT="1", PYTHONPATH=REPO)
    procs = [
        subprocess.Popen(
            [sys.executable, "-W", "ignore", "-c", CONCURRENT, str(marks)], env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    try:
        time.sleep(0.5)
        (marks / "go").write_text("")
        outs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), outs
    hows = sorted(line.split(" ", 1)[1] for out in outs for line in out.splitlines() if line.startswith("HOW"))
    assert hows == [jit.CACHE_HIT] * 3 + [jit.COMPILED], outs
    assert len([n for n in os.listdir(marks) if n.startswith("built-")]) == 1
    waiting = [line for out in outs for line in out.splitlines() if "waiting for pid" in line]
    assert waiting and all(".lock" in line for line in waiting), outs


# ---------------------------------------------------------------------------
# The pieces of a build
# ---------------------------------------------------------------------------


def test_max_jobs(monkeypatch):
    monkeypatch.setenv("MAX_JOBS", "3")
    assert toolchain.max_jobs() == 3
    monkeypatch.delenv("MAX_JOBS")
    assert toolchain.max_jobs() == min(8, len(os.sched_getaffinity(0)))
    env = toolchain.build_env(False, None, "")
    assert env["MAX_JOBS"] == str(toolchain.max_jobs())
    assert env["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)


def test_job_compiles_what_setup_py_compiles(cache_dir):
    plan = key.plan()
    job = compile.job(plan, "/tmp/b", "g++ (Debian 12) 12.2")
    names = sorted(os.path.relpath(s, plan.csrc) for s in job["sources"])
    assert "python_module.cpp" in names and os.path.join("cpu", "copy_scale_avx2.cpp") in names
    assert not any(n.endswith(".cu") for n in names)
    assert job["extra_cflags"][:4] == ["-O3", "-fopenmp", "-DNDEBUG", "-fwrapv"]
    # ninja runs the flags through the shell: the define with quotes and spaces is quoted whole
    assert shlex.split(job["extra_cflags"][-1]) == ['-DFASTCOLL_COMPILER="g++ (Debian 12) 12.2"']
    assert job["extra_ldflags"] == list(spec.LD_FLAGS) and job["build_directory"] == "/tmp/b"
    cuda_plan = plan._replace(with_cuda=True, cuda_archs="8.0;9.0+PTX")
    cuda_job = compile.job(cuda_plan, "/tmp/b", "g++")
    assert any(s.endswith(".cu") for s in cuda_job["sources"])
    # the CUDA ops' host side (every check and throw) is C++, compiled only with the kernels
    assert os.path.join("cuda", "cuda_ops.cpp") not in names
    assert os.path.join(plan.csrc, "cuda", "cuda_ops.cpp") in cuda_job["sources"]
    assert "'-DFASTCOLL_CUDA_ARCHS=\"8.0;9.0+PTX\"'" in cuda_job["extra_cuda_cflags"]


def test_first_error():
    out = "[1/3] c++ -c a.cpp\nFAILED: a.o\na.cpp:1:2: error: boom\nninja: build stopped: subcommand failed.\n"
    out += "Traceback (most recent call last):\n  File x, line 1\n    raise RuntimeError(message) from e\n"
    out += "RuntimeError: Error building extension '_C'\n"
    assert compile.first_error(out) == "a.cpp:1:2: error: boom"
    tb = "Traceback (most recent call last):\n  File x\n    raise CalledProcessError(1)\nsubprocess.CalledProcessError: boom\n"
    assert compile.first_error(tb) == "subprocess.CalledProcessError: boom"
    assert compile.first_error("/usr/bin/ld: x.o: undefined reference to `f'\ncollect2: ld returned 1") == (
        "/usr/bin/ld: x.o: undefined reference to `f'"
    )
    assert compile.first_error("") == "no output"


def test_setup_py_puts_the_sources_in_the_wheel(tmp_path):
    """An isolated build (no torch: FASTCOLL_AOT=0 here) copies csrc/ to fastcoll/_csrc with its hash."""
    out = tmp_path / "lib"
    env = dict(os.environ, FASTCOLL_AOT="0")
    subprocess.run(
        [sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(out)],
        cwd=REPO,
        env=env,
        check=True,
        capture_output=True,
        timeout=TIMEOUT,
    )
    shipped = out / "fastcoll" / "_csrc"
    manifest = json.loads((shipped / spec.MANIFEST).read_text())
    assert manifest["files"] == spec.source_files(os.path.join(REPO, "csrc")) == spec.source_files(str(shipped))
    assert manifest["sha256"] == spec.sources_hash(os.path.join(REPO, "csrc")) == spec.sources_hash(str(shipped))
    assert (out / "fastcoll" / "extension" / "_worker.py").exists()


# ---------------------------------------------------------------------------
# import fastcoll when the compile is impossible
# ---------------------------------------------------------------------------

INFO = """
import warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import fastcoll
import json, torch
x = [torch.ones(3), torch.ones(2)]
out = torch.empty(5)
fastcoll.ops.flatten_scale(x, out, 2.0)
assert out.tolist() == [2.0] * 5
print(json.dumps({"info": fastcoll.build_info(), "warnings": [str(w.message) for w in caught]}))
"""


def import_info(tree, cache_path, **env) -> dict:
    proc = run_python(INFO, tree, cache_path, **env)
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout.splitlines()[-1]), stderr=proc.stderr)


def test_import_without_a_compiler_falls_back(tmp_path):
    tree = tree_copy(tmp_path)
    got = import_info(tree, tmp_path / "cache", CXX="/nonexistent/c++")
    info = got["info"]
    assert not info["extension"] and info["extension_origin"] is None and "no C++ compiler" in info["fallback_reason"]
    assert info["cache_dir"] == str(tmp_path / "cache")
    [warning] = [w for w in got["warnings"] if "reference ops" in w]
    assert "no C++ compiler" in warning and "CXX" in warning and "FASTCOLL_REQUIRE_EXT" in warning
    proc = run_python("import fastcoll", tree, tmp_path / "cache", CXX="/nonexistent/c++", FASTCOLL_REQUIRE_EXT="1")
    assert proc.returncode != 0 and "FASTCOLL_REQUIRE_EXT=1, but no C++ compiler" in proc.stderr


def test_jit_off_and_no_ext(tmp_path):
    tree = tree_copy(tmp_path)
    info = import_info(tree, tmp_path / "cache", FASTCOLL_JIT="0")["info"]
    assert not info["extension"] and "FASTCOLL_JIT=0" in info["fallback_reason"]
    info = import_info(tree, tmp_path / "cache", FASTCOLL_NO_EXT="1", FASTCOLL_REQUIRE_EXT="1")["info"]
    assert info["fallback_reason"] == "FASTCOLL_NO_EXT is set"
    assert not os.path.exists(tmp_path / "cache")  # neither compiled nor looked


def test_ahead_of_time_build_for_another_torch_is_skipped(tmp_path):
    """setup.py's record says the library is for another torch: it is not even loaded (that could crash);
    and without sources (an installation from an old wheel) there is nothing to compile either."""
    tree = tree_copy(tmp_path, with_sources=False)
    lib = os.path.join(tree, "fastcoll", "_C" + importlib.machinery.EXTENSION_SUFFIXES[0])
    with open(lib, "wb") as f:
        f.write(b"not a library")
    with open(os.path.join(tree, "fastcoll", "_C.build.json"), "w") as f:
        json.dump({"torch": "2.0.0", "torch_git": "x", "size": os.path.getsize(lib)}, f)
    info = import_info(tree, tmp_path / "cache")["info"]
    assert not info["extension"] and "is for torch 2.0.0, not" in info["fallback_reason"]
    assert "carries no C++ sources" in info["fallback_reason"]


@pytest.mark.parametrize("edited", [True, False])
def test_ahead_of_time_build_from_other_sources_is_skipped(tmp_path, edited):
    """An in-place build (pip install -e .) whose record names other sources than csrc/ now (edited since) is
    not loaded: the import goes on to the build cache. Control: the same sources' hash, and it is loaded."""
    tree = tree_copy(tmp_path)
    lib = os.path.join(tree, "fastcoll", "_C" + importlib.machinery.EXTENSION_SUFFIXES[0])
    with open(lib, "wb") as f:
        f.write(b"not a library")  # loading it fails: the reason says whether it was tried
    sources = spec.sources_hash(os.path.join(tree, "csrc"))
    record = {"torch": torch.__version__, "torch_git": torch.version.git_version, "size": os.path.getsize(lib),
              "sources": "0" * len(sources) if edited else sources}  # fmt: skip
    with open(os.path.join(tree, "fastcoll", "_C.build.json"), "w") as f:
        json.dump(record, f)
    reason = import_info(tree, tmp_path / "cache", CXX="/nonexistent/c++")["info"]["fallback_reason"]
    assert "no C++ compiler" in reason  # then the cache: it could not compile here
    assert ("compiled from other sources than" in reason) == edited
    assert ("could not be imported" in reason) == (not edited)


FAKE_CXX = """#!/bin/sh
case "$1" in  # answers torch's version checks like gcc, fails every compile
  -v|--version) echo "gcc version 12.2.0 (fake)"; exit 0;;
  -dumpfullversion|-dumpversion) echo 12.2.0; exit 0;;
esac
echo "$@" >> "$(dirname "$0")/calls"
echo "fake.cpp:1:1: error: this compiler compiles nothing" >&2
exit 1
"""


@pytest.mark.timeout(3 * TIMEOUT)
def test_compile_error_warns_once_then_reports(tmp_path):
    """A compiler that fails: one warning with the error and the log; the next import does not compile again;
    python -m fastcoll.extension does, and exits 1 with the compiler's error."""
    tree = tree_copy(tmp_path)
    cxx = tmp_path / "bin" / "c++"
    cxx.parent.mkdir()
    cxx.write_text(FAKE_CXX)
    cxx.chmod(0o755)
    got = import_info(tree, tmp_path / "cache", CXX=str(cxx))
    info = got["info"]
    assert not info["extension"] and "compiling the C++ extension failed" in info["fallback_reason"]
    assert "this compiler compiles nothing" in info["fallback_reason"] and ".failed.log" in info["fallback_reason"]
    assert "compiling the C++ extension (CPU kernels)" in got["stderr"]
    calls = (tmp_path / "bin" / "calls").read_text().count("\n")
    again = import_info(tree, tmp_path / "cache", CXX=str(cxx))
    assert "an earlier compile of this extension failed" in again["info"]["fallback_reason"]
    assert (tmp_path / "bin" / "calls").read_text().count("\n") == calls  # not compiled again
    cli = run_python("", tree, tmp_path / "cache", args=["-m", "fastcoll.extension"], CXX=str(cxx))
    assert cli.returncode == 1 and "this compiler compiles nothing" in cli.stderr, cli.stderr
    assert (tmp_path / "bin" / "calls").read_text().count("\n") > calls


def test_import_rebuilds_a_damaged_entry(tmp_path, monkeypatch):
    """An entry whose size is right but whose library does not load: the import compiles it again."""
    tree = tree_copy(tmp_path)
    monkeypatch.setenv("FASTCOLL_CACHE_DIR", str(tmp_path / "cache"))
    entry = cache.Entry(cache.root(), key.plan().key)  # the copy's sources are these: the same key
    entry.make_dirs()
    junk = os.path.join(entry.new_build_dir(), "_C.so")
    with open(junk, "wb") as f:
        f.write(b"not a library")
    entry.publish(junk, {})
    assert entry.valid()
    info = import_info(tree, tmp_path / "cache", CXX="/nonexistent/c++")["info"]
    assert not info["extension"] and "no C++ compiler" in info["fallback_reason"]  # it tried to compile


def test_cuda_torch_without_cuda_kernels(tmp_path):
    """A CUDA torch whose extension has no CUDA kernels (nvcc was missing): CUDA tensors get the reference ops."""
    built = [n for n in os.listdir(os.path.join(REPO, "fastcoll")) if n.startswith("_C") and n.endswith((".so", ".json"))]
    if not any(n.endswith(".so") for n in built):
        pytest.skip("needs the ahead-of-time build (make build)")
    tree = tree_copy(tmp_path)
    for name in built:  # the library and setup.py's record of it
        shutil.copy(os.path.join(REPO, "fastcoll", name), os.path.join(tree, "fastcoll", name))
    code = """
        import json, torch
        torch.version.cuda = "13.0"  # as a CUDA build of torch would say
        import fastcoll
        info = fastcoll.build_info()
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        print(json.dumps([info["extension_origin"], info["cuda_kernels_missing"], has("fastcoll::flatten_scale", "CUDA")]))
    """
    proc = run_python(code, tree, tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr
    origin, missing, has_cuda_kernel = json.loads(proc.stdout.splitlines()[-1])
    assert origin == "ahead of time" and "without CUDA kernels" in missing and has_cuda_kernel
