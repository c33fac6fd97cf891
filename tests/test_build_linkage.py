"""The extension uses the process's shared C++ runtime, never a static copy of its own (issue 32).

On the H200 image this project was tested on, the compiler driver (a g++ wrapper)
linked libstdc++ statically into shared libraries. fastcoll's extension then
carried a second libstdc++ beside the shared one that python and torch load, and
every error message that formatted a number crashed the process (SIGSEGV inside
std::ostream's integer insertion; the native backtrace is in benchmarks/RESULTS.md).
The extension is linked with ``-l:libstdc++.so.6`` (fastcoll/extension/spec.py ``LD_FLAGS``):
the runtime's shared library by its file name, which no static archive or linker script
named ``libstdc++.so`` in the driver's own folders can stand in for (a plain ``-lstdc++``
did not help there). Tested here:

* the mechanism: a small shared library linked by a driver that links libstdc++ statically
  (``-static-libstdc++``; a toolchain folder whose ``libstdc++.so`` resolves to the static
  archive, as the H200 image's), with and without ``LD_FLAGS`` (fails if the flag is dropped);
* the extension built in this tree lists ``libstdc++.so.6`` among its needed libraries
  and defines none of the runtime's stream code itself.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from typing import List

import pytest

from fastcoll.extension import spec

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF linkage (Linux)")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A libstdc++ symbol that the H200 backtrace showed inside the extension: std::ostream's integer insertion.
STREAM_INSERT = "_ZNSo9_M_insertIlEERSoT_"

SOURCE = """
#include <sstream>
#include <string>
extern "C" int message_length(long n) {
  std::ostringstream out;
  out << "tensors[" << n << "] is on another device";
  return static_cast<int>(out.str().size());
}
"""


def needed(path: str) -> List[str]:
    """The shared libraries an ELF file names as needed (readelf -d)."""
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    return [line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


def defines(path: str, symbol: str) -> bool:
    """Whether the ELF file defines ``symbol`` (in its full symbol table, or its dynamic one when stripped)."""
    for flags in (["--defined-only"], ["-D", "--defined-only"]):
        out = subprocess.run(["nm", *flags, path], capture_output=True, text=True).stdout
        if any(line.split()[-1] == symbol for line in out.splitlines() if line.strip()):
            return True
    return False


def tools() -> None:
    for tool in ("readelf", "nm"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} (binutils) is not installed")


def static_driver_flags(kind: str, cxx: str, tmp_path) -> List[str]:
    """Link flags that make a g++ driver link libstdc++ statically, as two kinds of toolchain do."""
    if kind == "static-libstdc++":  # the driver's own flag
        return ["-static-libstdc++"]
    # The H200 image's compiler: a wrapper whose -B library folder holds a libstdc++.so that resolves to the
    # static archive, so even an explicit -lstdc++ links it statically (modelled by a linker script here).
    archive = subprocess.run([cxx, "-print-file-name=libstdc++.a"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(archive):
        pytest.skip("this g++ has no libstdc++.a")
    folder = tmp_path / "toolchain"
    folder.mkdir()
    (folder / "libstdc++.so").write_text(f"INPUT({archive})\n")
    return [f"-B{folder}/", f"-L{folder}"]


@pytest.mark.parametrize("kind", ["static-libstdc++", "wrapper-folder"])
@pytest.mark.parametrize("with_flags", [False, True], ids=["driver-flags-only", "with-LD_FLAGS"])
def test_a_driver_that_links_libstdcxx_statically_is_overridden(tmp_path, kind, with_flags):
    tools()
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if cxx is None or "clang" in os.path.basename(cxx):
        pytest.skip("needs g++ (a GNU driver's flags)")
    src = tmp_path / "message.cpp"
    src.write_text(SOURCE)
    lib = tmp_path / "libmessage.so"
    driver = static_driver_flags(kind, cxx, tmp_path)
    # The driver's own flags come first, the user's link flags after them, as setuptools orders a link.
    extra = [f for f in spec.LD_FLAGS if f != "-fopenmp"] if with_flags else []
    cmd = [cxx, *driver, "-shared", "-fPIC", "-O2", str(src), "-o", str(lib), *extra]
    if kind == "static-libstdc++":
        cmd = [cxx, "-shared", "-fPIC", "-O2", str(src), "-o", str(lib), *extra, *driver]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    shared = any(n.startswith("libstdc++.so") for n in needed(str(lib)))
    static_copy = defines(str(lib), STREAM_INSERT)
    if with_flags:
        assert shared and not static_copy, (needed(str(lib)), static_copy)
    else:  # the control: without the flag the same link does carry its own copy (else this test proves nothing)
        assert not shared and static_copy, (needed(str(lib)), static_copy)


def test_the_built_extension_uses_the_shared_cxx_runtime():
    tools()
    built = glob.glob(os.path.join(ROOT, "fastcoll", "_C*.so"))
    if not built:
        pytest.skip("no ahead-of-time build in this tree (make build)")
    for path in built:
        libs = needed(path)
        assert any(n.startswith("libstdc++.so") for n in libs), f"{path} does not need libstdc++: {libs}"
        assert not defines(path, STREAM_INSERT), f"{path} carries its own copy of libstdc++'s stream code"
