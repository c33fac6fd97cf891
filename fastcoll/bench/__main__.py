"""Command line of the fastcoll benchmarks (docs/benchmarks.md).

    python -m fastcoll.bench {ops,ddp,dist,timeline,health,zero,all} [--full] [--device cpu|cuda] [--threads N|all] [--json PATH]

Each benchmark prints its tables and writes ``benchmarks/out/<name>_<device>.json`` (and a PNG chart). The default run
takes rounds until every target's 90% interval resolves, within caps sized so that ``all`` takes about 10 minutes on a
2-core machine; ``--full`` runs every row with higher caps. A benchmark module exposes ``run(args) -> int`` and is
imported only when it runs (the device checked first).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path
from typing import List, Optional

import torch

SUBCOMMANDS = ("ops", "ddp", "dist", "timeline", "health", "zero")
#: Seconds each benchmark took in a default run on the quiet 2-core box (2026-12-02); ``all`` scales them by its pace
#: so far to estimate the time left, so only their proportions matter after the first benchmark.
TYPICAL_S = {"ops": 19, "ddp": 47, "dist": 31, "timeline": 38, "health": 99, "zero": 110}


def _threads(value: str):
    if value == "all":
        return value
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'all', got {value!r}")
    return int(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fastcoll.bench", description="fastcoll benchmarks: tables on the "
                                     "terminal, JSON and charts in benchmarks/out/ (docs/benchmarks.md).")  # fmt: skip
    parser.add_argument("command", choices=SUBCOMMANDS + ("all",), help="which benchmark to run")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run (default: cpu)")
    parser.add_argument("--threads", type=_threads, default=None, metavar="N|all",
                        help="intra-op threads (ops: default 1 and all; multi-rank benchmarks: per rank, default 1)")  # fmt: skip
    parser.add_argument("--full", action="store_true", help="every row, more rounds (make bench-full: about 35 minutes)")
    parser.add_argument("--quick", action="store_true", help="the default run (kept for old scripts)")
    parser.add_argument("--json", metavar="PATH", default=None, help="where to write the JSON (default benchmarks/out/"
                        "<benchmark>_<device>.json); with 'all', PATH's stem gets _<benchmark> appended")  # fmt: skip
    # A tiny configuration for the tests: checks the code runs, measures nothing useful.
    parser.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    return parser


def level(args: argparse.Namespace) -> str:
    """``smoke``, ``full`` or ``default``: which configuration each benchmark runs."""
    return "smoke" if args.smoke else "full" if args.full else "default"


def _args_for(args: argparse.Namespace, name: str) -> argparse.Namespace:
    sub = argparse.Namespace(**vars(args))
    sub.command, sub.level = name, level(args)
    if args.command == "all" and args.json:
        p = Path(args.json)
        sub.json = str(p.with_name(f"{p.stem}_{name}{p.suffix or '.json'}"))
    return sub


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("fastcoll.bench: --device cuda but torch.cuda.is_available() is False")
        return 2
    names = SUBCOMMANDS if args.command == "all" else (args.command,)
    status, started, spent_typical = 0, time.perf_counter(), 0.0
    for i, name in enumerate(names):
        if len(names) > 1:  # the time left: the typical durations still to come, scaled by this run's pace so far
            pace = (time.perf_counter() - started) / spent_typical if spent_typical else 1.0
            left = pace * sum(TYPICAL_S[n] for n in names[i:])
            print(f"fastcoll.bench: {name} ({i + 1}/{len(names)}), about {left / 60:.0f} min left in all", flush=True)
        t0 = time.perf_counter()
        rc = importlib.import_module(f"fastcoll.bench.{name}").run(_args_for(args, name)) or 0
        spent_typical += TYPICAL_S[name]
        print(f"fastcoll.bench {name}: done in {time.perf_counter() - t0:.1f} s" + (f" (exit status {rc})" if rc else ""))
        status = status or rc
    return status


if __name__ == "__main__":
    sys.exit(main())
