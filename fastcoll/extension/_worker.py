"""Compiles the extension in a process of its own (run by fastcoll/extension/compile.py, by path).

It imports neither fastcoll (whose import would compile) nor anything beside
this file: only torch.utils.cpp_extension, whose ``load`` writes the ninja
file, compiles, links, and imports the result (proving that it loads). The job
is a JSON file named by the only argument: load's arguments.
"""

import json
import sys

from torch.utils.cpp_extension import load


def main() -> None:
    with open(sys.argv[-1]) as f:
        job = json.load(f)
    load(**job, verbose=True, is_python_module=True)
    print("fastcoll: the extension built and loads", flush=True)


if __name__ == "__main__":
    main()
