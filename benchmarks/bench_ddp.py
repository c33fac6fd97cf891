"""Benchmark of fastcoll.DDP against torch DDP; same as ``python -m fastcoll.bench ddp``.

    python benchmarks/bench_ddp.py [--device cpu|cuda] [--quick] [--threads N|all] [--json PATH]

See fastcoll/bench/ddp.py for what is measured. Results: tables on the
terminal, benchmarks/out/ddp_<device>.json and a PNG chart next to it.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a clean clone

from fastcoll.bench.ddp import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
