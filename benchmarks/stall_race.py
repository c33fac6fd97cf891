"""Repeat the stall scenarios of issue 30 and count the runs whose survivors name the culprit.

Three gloo ranks train ``fastcoll.DDP`` with ``stall_timeout=5`` (tests/test_ddp_stall.py's
scenarios) and one misbehaves: rank 2 is killed mid-backward ("dies"), or rank 1
sleeps before its backward ("stuck"). Every rank's process ends as soon as it has
its StallError (as a script whose error goes uncaught), so a store hosted by rank 0
goes away with it. A run passes when every survivor raised a StallError whose first
line is the same everywhere and names the culprit alone (never "the store host is
unreachable").

Usage::

    PYTHONPATH=$PWD python benchmarks/stall_race.py --runs 20 --store tcp-init tcp-agent --scenario dies stuck

Stores: ``tcp-init`` (``init_method="tcp://..."``: rank 0 hosts the store), ``tcp-agent``
(a TCPStore in this process, which outlives the ranks), ``file`` (a FileStore).
Prints one line per run and a pass count per (store, scenario).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List, Tuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from stall_harness import Outcome, run_stall_ranks  # noqa: E402
from test_ddp_stall import SCENARIOS, scenario_failure  # noqa: E402


def one_run(store: str, scenario: str) -> Tuple[bool, str, float]:
    """One run of ``scenario`` on ``store``: (passed, what went wrong or the agreed line, seconds)."""
    fn, need, _live, _culprit = SCENARIOS[scenario]
    t0 = time.monotonic()
    try:
        out: Dict[int, Outcome] = run_stall_ranks(fn, 3, need=need, store=store, exit_on_report=True, timeout=120)
    except TimeoutError as exc:
        return False, f"hung: {exc}", time.monotonic() - t0
    failure = scenario_failure(scenario, out)
    if failure:
        return False, failure, time.monotonic() - t0
    live = SCENARIOS[scenario][2]
    # Survivors whose diagnosis found the store gone and reported the verdict their board thread had kept.
    kept = [r for r in live if "\n  store error: " in out[r].value["report"]]
    note = f"[rank(s) {kept} reported a kept copy] " if kept else ""
    return True, note + out[live[0]].value["line"], time.monotonic() - t0


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--store", nargs="+", default=["tcp-init", "tcp-agent"])
    ap.add_argument("--scenario", nargs="+", default=list(SCENARIOS))
    args = ap.parse_args(argv)
    counts: Dict[Tuple[str, str], List[Any]] = {}
    for store in args.store:
        for scenario in args.scenario:
            passed = 0
            for i in range(args.runs):
                ok, text, secs = one_run(store, scenario)
                passed += ok
                print(
                    f"{store:9s} {scenario:5s} run {i + 1:2d}: {'pass' if ok else 'FAIL'} ({secs:.1f} s) {text[:300]}", flush=True
                )
            counts[(store, scenario)] = [passed, args.runs]
    for (store, scenario), (passed, runs) in counts.items():
        print(f"{store:9s} {scenario:5s} {passed}/{runs} runs name the culprit")
    return 0 if all(p == n for p, n in counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
