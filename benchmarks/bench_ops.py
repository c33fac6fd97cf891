"""Benchmark of the fused flatten/unflatten ops; same as ``python -m fastcoll.bench ops``.

    python benchmarks/bench_ops.py [--device cpu|cuda] [--threads N|all] [--quick] [--json PATH]

See fastcoll/bench/ops.py for what is measured. Results: a table on the
terminal, benchmarks/out/ops_<device>.json and a PNG chart next to it.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a clean clone

from fastcoll.bench.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["ops", *sys.argv[1:]]))
