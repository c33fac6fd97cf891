"""``python -m fastcoll.extension``: compile the extension into the cache ahead of time.

For a cluster: run it once (on a login node, say) with the environment the
jobs use, so that no job compiles at import. Prints the cache key and the
library's path; exits 1 with the compiler's error if the build fails.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from typing import List, Optional

from . import compile, jit
from .errors import ExtensionUnavailable

_LOG_LINES = 60


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command line.

    Args:
        argv: The arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 when the build is in the cache, 1 when it could not be made.
    """
    parser = argparse.ArgumentParser(prog="python -m fastcoll.extension", description=__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true", help="compile even if the cache already has this build")
    args = parser.parse_args(argv)
    try:
        got = jit.ensure(force=args.force, retry_failed=True)
    except ExtensionUnavailable as exc:
        if exc.log:
            with open(exc.log, errors="replace") as f:
                print(compile.error_excerpt(f.read(), _LOG_LINES), file=sys.stderr)
        print(f"fastcoll.extension: {exc}", file=sys.stderr)
        return 1
    state = f"compiled in {got.seconds:.0f} s" if got.seconds is not None else "already in the cache"
    print(f"key:  {got.plan.key}\npath: {got.path}\n({state})")
    if got.plan.cuda_missing:
        print(f"note: no CUDA kernels: {got.plan.cuda_missing}")
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ahead = sorted(glob.glob(os.path.join(package, "_C*.so")))
    if ahead:
        print(f"note: import uses the ahead-of-time build {ahead[0]} first, while it loads for this torch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
