"""Command line of the fastcoll benchmarks.

    python -m fastcoll.bench {ops,ddp,dist,timeline,health,zero,all} [--device cpu|cuda] [--threads N|all] [--quick] [--json PATH]

``ops`` times the fused flatten/unflatten ops against torch's ways of doing the
same work (fastcoll.bench.ops); ``ddp`` and ``dist`` time the DDP wrapper and
the distributed utilities (fastcoll.bench.ddp, fastcoll.bench.dist);
``timeline`` sweeps bucket caps against ``bucket_cap_mb="auto"`` and torch DDP
and charts each bucket's pack, communication and write-back rank by rank
(fastcoll.bench.timeline); ``health`` times gradient clipping with torch DDP
and with fastcoll.DDP's fused norm, and what ``compute_grad_norm`` and
``check_nonfinite`` cost (fastcoll.bench.health); ``zero`` times
``fastcoll.ShardedOptimizer`` against torch's ZeroRedundancyOptimizer and
DDP with AdamW, with optimizer state, peak memory and the parameters'
all-gather per step (fastcoll.bench.zero); ``all`` runs them in turn.
Each writes a table to the terminal and JSON (plus a PNG chart where it has
one) to benchmarks/out/.
Every subcommand module is imported only when it runs and exposes
``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path
from typing import List, Optional

SUBCOMMANDS = ("ops", "ddp", "dist", "timeline", "health", "zero")


def _threads(value: str):
    if value == "all":
        return value
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'all', got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'all', got {value!r}")
    return n


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fastcoll.bench",
        description="fastcoll benchmarks: tables on the terminal, JSON and charts in benchmarks/out/.",
    )
    parser.add_argument("command", choices=SUBCOMMANDS + ("all",), help="which benchmark to run")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run (default: cpu)")
    parser.add_argument(
        "--threads",
        type=_threads,
        default=None,
        metavar="N|all",
        help="CPU intra-op threads (torch.set_num_threads); default: both 1 and all",
    )
    parser.add_argument("--quick", action="store_true", help="fewer layouts and repetitions (about a minute)")
    parser.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help="where to write the JSON results (default benchmarks/out/<benchmark>_<device>.json); "
        "with 'all', PATH's stem gets _<benchmark> appended for each",
    )
    # A tiny configuration for tests/test_bench.py: checks the code runs, measures nothing useful.
    parser.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    return parser


def _load(name: str):
    """The benchmark module ``fastcoll.bench.<name>``, or None (with a message) if it does not exist yet."""
    modname = f"fastcoll.bench.{name}"
    try:
        return importlib.import_module(modname)
    except ModuleNotFoundError as exc:
        if exc.name != modname:
            raise  # a real missing dependency inside the module: show it
        print(f"fastcoll.bench: the '{name}' benchmark ({modname}) is not available in this checkout; skipping it")
        return None


def _args_for(args: argparse.Namespace, name: str) -> argparse.Namespace:
    sub = argparse.Namespace(**vars(args))
    sub.command = name
    if args.command == "all" and args.json:
        p = Path(args.json)
        sub.json = str(p.with_name(f"{p.stem}_{name}{p.suffix or '.json'}"))
    return sub


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    names = SUBCOMMANDS if args.command == "all" else (args.command,)
    status = 0
    for name in names:
        module = _load(name)
        if module is None:
            if args.command != "all":
                return 2
            continue
        t0 = time.perf_counter()
        rc = module.run(_args_for(args, name)) or 0
        print(f"fastcoll.bench {name}: done in {time.perf_counter() - t0:.1f} s" + (f" (exit status {rc})" if rc else ""))
        status = status or rc
    return status


if __name__ == "__main__":
    sys.exit(main())
