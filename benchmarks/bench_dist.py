"""Benchmark of fastcoll.dist's collectives; same as ``python -m fastcoll.bench dist``.

    python benchmarks/bench_dist.py [--quick] [--threads N|all] [--json PATH]

See fastcoll/bench/dist.py for what is measured. Results: a table on the
terminal and benchmarks/out/dist_cpu.json.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a clean clone

from fastcoll.bench.dist import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
