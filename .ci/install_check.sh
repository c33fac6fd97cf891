#!/usr/bin/env bash
# CI's install stage (issue 21), `make install-check`: fastcoll installed the way users install it.
#
# 1. A clean copy of the tree (what git tracks, plus untracked files it does not ignore).
# 2. A fresh venv with the CI's CPU torch: the torch that `make setup` installed in .venv is
#    shared through a .pth file rather than installed again (pip sees it as installed).
#    Plain `pip install TREE` there: an isolated build, which must compile nothing.
# 3. tests/test_build_jit.py against that install, with an empty cache: 4 processes import
#    fastcoll at once (one compiles: its time is printed), a later import is a cache hit (its
#    cost is printed), a 2-rank gloo fastcoll.DDP step and an op round trip on the cached
#    build, and `python -m fastcoll.extension`.
# 4. The sdist (`python -m build --sdist`) installed into another fresh venv, sharing .venv's
#    torch as in 2; the installed metadata must require torch>=2.6, numpy and ninja (what makes
#    torch come in as a dependency where there is none). Its import finds the build of step 3
#    in the shared cache (same sources, torch, Python): a cache hit. INSTALL_CHECK_FULL=1
#    installs it into an empty venv instead, torch coming in as a dependency, held to the CI's
#    CPU build by a constraint (about a minute more: torch's own dependencies are resolved too).
# Every step prints its time. Work folder: INSTALL_CHECK_DIR (default build/install-check).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VPY=$(realpath -ms "${VPY:-.venv/bin/python}")  # absolute, the venv's own link (not what it points to)
REPO=$PWD
TORCH_CPU=${TORCH_CPU:-torch==2.13.0}
OUT=$(realpath -m "${INSTALL_CHECK_DIR:-build/install-check}")
export FASTCOLL_CACHE_DIR="$OUT/cache"
export PIP_DISABLE_PIP_VERSION_CHECK=1
unset FASTCOLL_NO_EXT FASTCOLL_JIT FASTCOLL_REQUIRE_EXT PYTHONPATH

seconds_since() { awk -v s="$1" -v e="$(date +%s%N)" 'BEGIN { printf "%.1f", (e - s) / 1e9 }'; }
step_name="" step_start=$(date +%s%N)
step() {  # step NAME: ends the previous step (printing its time) and starts NAME
    [ -n "$step_name" ] && echo "install-check: $(seconds_since "$step_start") s: $step_name"
    step_name="$*" step_start=$(date +%s%N)
    [ -n "$step_name" ] && echo "install-check: $step_name ..."
    return 0
}
# share_torch VENV_PYTHON: .venv's site-packages (its torch, numpy, ninja) visible in that venv.
share_torch() {
    "$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
        >"$("$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_ci_shared_torch.pth"
}

rm -rf "$OUT" && mkdir -p "$OUT/tree"
step "copying the tree"
git ls-files -z -co --exclude-standard | tar --null --ignore-failed-read -cf - -T - 2>/dev/null | tar -xf - -C "$OUT/tree"

step "a fresh venv sharing the CI's CPU torch (.venv's)"
"$PYTHON" -m venv "$OUT/venv-a"
VA="$OUT/venv-a/bin/python"
share_torch "$VA"

step "pip install TREE (isolated build)"
"$VA" -m pip install -q "$OUT/tree"
# Without importing fastcoll (that would compile): the installed package has the sources, not a library.
# (Python snippets run from $OUT: from the checkout, `import fastcoll` would find ./fastcoll.)
cd "$OUT"
"$VA" - "$OUT/venv-a" <<'PY'
import glob, importlib.util, os, sys
pkg = os.path.dirname(importlib.util.find_spec("fastcoll").origin)
assert pkg.startswith(sys.argv[1]), f"fastcoll comes from {pkg}, not the fresh venv"
assert not glob.glob(os.path.join(pkg, "_C*.so")), "the isolated build compiled the extension"
assert os.path.isfile(os.path.join(pkg, "_csrc", "SOURCES.json")), "the wheel carries no sources"
print(f"install-check: installed {pkg}: sources, no compiled library")
PY

step "first import (4 processes, empty cache), cache hit, DDP step, ops, python -m fastcoll.extension"
(cd "$REPO" && FASTCOLL_TEST_JIT=1 FASTCOLL_TEST_JIT_PYTHON="$VA" FASTCOLL_TEST_JIT_CACHE="$FASTCOLL_CACHE_DIR" \
    "$VPY" -m pytest -q -s -p no:cacheprovider tests/test_build_jit.py)

step "sdist (python -m build --sdist)"
"$VA" -m pip install -q build
"$VA" -m build -q --sdist --outdir "$OUT/dist" "$OUT/tree" >/dev/null
ls "$OUT"/dist/fastcoll-*.tar.gz

step "pip install SDIST into a fresh venv"
"$PYTHON" -m venv "$OUT/venv-b"
VB="$OUT/venv-b/bin/python"
if [ "${INSTALL_CHECK_FULL:-0}" = 1 ]; then
    echo "$TORCH_CPU" >"$OUT/constraints.txt"  # the CI's CPU build, not the index's default (CUDA) one
    "$VB" -m pip install -q -c "$OUT/constraints.txt" "$OUT"/dist/fastcoll-*.tar.gz
else
    share_torch "$VB"
    "$VB" -m pip install -q "$OUT"/dist/fastcoll-*.tar.gz
fi
"$VB" - <<'PY'
from importlib.metadata import requires
needs = sorted(requires("fastcoll") or [])
assert {"torch>=2.6", "numpy", "ninja"} <= set(needs), needs
print(f"install-check: the sdist's fastcoll requires {', '.join(n for n in needs if 'extra ==' not in n)}")
PY
"$VB" - "$OUT/cache" <<'PY'
import sys, time
start = time.perf_counter()
import fastcoll
took = time.perf_counter() - start
info = fastcoll.build_info()
assert fastcoll.__file__.startswith(sys.prefix), fastcoll.__file__
assert info["extension"] and info["extension_origin"] == "cache hit", info
assert info["extension_path"].startswith(sys.argv[1]), info
print(f"install-check: the sdist's import (torch {info['torch']}) is a cache hit: {took:.2f} s with torch's import")
PY
step ""
