#!/usr/bin/env bash
# The AVX2 builds of the CPU loops against libstdc++ 13's headers (g++ 13: Ubuntu 24.04, Debian 13).
#
# libstdc++ 13 marks std::allocator's members always_inline; built under a target pragma, they can no
# longer be inlined into default-target code, and g++ 13 stops with "inlining failed in call to
# 'always_inline' ... target specific option mismatch" (seen on the first GPU machine, 2026-11-26).
# csrc/cpu/avx2_target.h includes the standard headers before its pragma to avoid that. This check
# compiles the files that include it with the local g++ against libstdc++ 13's headers (Debian's
# libstdc++-13-dev, fetched once into CACHE), which reproduces the error when the order is wrong.
# Where the package cannot be fetched (no network), it says so and exits 0.
#
# Environment: VPY (the venv's python, for torch's include paths), CACHE (default ~/.cache/fastcoll/libstdcxx13).
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=${VPY:-.venv/bin/python}
CACHE=${CACHE:-$HOME/.cache/fastcoll/libstdcxx13}
CXX=${CXX:-g++}
inc=$CACHE/root/usr/include
if [ ! -d "$inc/c++/13" ]; then
    rm -rf "$CACHE" && mkdir -p "$CACHE/lists/partial" "$CACHE/archives/partial"
    echo "deb http://deb.debian.org/debian trixie main" >"$CACHE/sources.list"
    apt_opts=(-o "Dir::Etc::SourceList=$CACHE/sources.list" -o Dir::Etc::SourceParts=/dev/null
              -o "Dir::State::Lists=$CACHE/lists" -o "Dir::Cache::Archives=$CACHE/archives" -o Debug::NoLocking=1
              -o APT::Sandbox::User=root)
    if ! { timeout 120 apt-get "${apt_opts[@]}" -qq update &&
           (cd "$CACHE" && timeout 120 apt-get "${apt_opts[@]}" -qq download libstdc++-13-dev) &&
           dpkg -x "$CACHE"/libstdc++-13-dev_*.deb "$CACHE/root"; } >"$CACHE/fetch.log" 2>&1; then
        echo "gcc13-check: SKIPPED: could not fetch Debian's libstdc++-13-dev (log: $CACHE/fetch.log)"
        exit 0
    fi
fi
torch_inc=$("$VPY" -c 'import torch.utils.cpp_extension as c; print(" ".join("-I" + p for p in c.include_paths()))')
py_inc=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
rc=0
for src in $(grep -l 'cpu/avx2_target.h' csrc/cpu/*.cpp); do
    # shellcheck disable=SC2086
    if "$CXX" -nostdinc++ -isystem "$inc/c++/13" -isystem "$inc/x86_64-linux-gnu/c++/13" -isystem "$inc/c++/13/backward" \
        -std=c++17 -O2 -fPIC -DNDEBUG -Icsrc $torch_inc -I"$py_inc" -c "$src" -o /dev/null 2>"$CACHE/compile.log"; then
        echo "gcc13-check: $src compiles against libstdc++ 13"
    else
        grep -m5 'error' "$CACHE/compile.log" || tail -20 "$CACHE/compile.log"
        echo "gcc13-check: FAILED: $src does not compile against libstdc++ 13 (g++ 13 would not build the extension)"
        rc=1
    fi
done
exit "$rc"
