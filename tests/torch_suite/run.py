"""Run PyTorch's own DDP tests against torch DDP and against fastcoll.DDP; print both results side by side.

``make test-torch-ddp-suite`` runs this. The tests are those of
``torch.testing._internal.distributed.distributed_test.DistributedTest._DistTestBase``
that construct a DDP and run on CPU with gloo and two ranks (:data:`TESTS`;
every other DDP test there needs GPUs, NCCL or torchvision, or is skipped
upstream). Each implementation runs them in one ``ddp_suite.py`` process
(which spawns two rank processes per test). A fastcoll failure listed in
:data:`EXPLAINED` is expected, with the reason printed; any other failure
(one without an entry, unless torch DDP fails or skips it the same way)
makes the run exit 1.

Usage::

    python tests/torch_suite/run.py [--only torch|fastcoll] [--timeout SECONDS] [test_name ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
SUITE = os.path.join(HERE, "ddp_suite.py")

#: The DDP tests of _DistTestBase that run on CPU + gloo + 2 ranks (torch 2.13's distributed_test.py).
TESTS: List[str] = [
    "test_DistributedDataParallelCPU",
    "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad",
    "test_ddp_create_graph",
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_grad_is_view",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_ddp_logging_data_cpu",
    "test_static_graph_api_cpu",
    "test_grads_same_across_ranks_with_no_sync",
]

#: fastcoll.DDP failures that are expected, and why (a test reading torch's C++ reducer internals).
EXPLAINED: Dict[str, str] = {}


def run_one(implementation: str, tests: List[str], timeout: float) -> Dict[str, Any]:
    """Run ``tests`` with ``implementation`` in one suite process; returns its JSON results (plus wall time and marks)."""
    with tempfile.TemporaryDirectory(prefix="fastcoll_peer_") as tmp:
        out = os.path.join(tmp, "results.json")
        marks = os.path.join(tmp, "marks")
        os.mkdir(marks)
        env = dict(os.environ, FASTCOLL_PEER_DDP=implementation, FASTCOLL_PEER_MARKS=marks, BACKEND="gloo", WORLD_SIZE="2")
        env.setdefault("OMP_NUM_THREADS", "1")
        t0 = time.monotonic()
        try:
            proc = subprocess.run(
                [sys.executable, SUITE, out, *tests], env=env, timeout=timeout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
            log = proc.stdout.decode(errors="replace")
        except subprocess.TimeoutExpired as exc:
            log = (exc.stdout or b"").decode(errors="replace") + f"\n[run.py] timed out after {timeout:.0f}s"
        seconds = time.monotonic() - t0
        results: Dict[str, Any] = {"tests": {}}
        if os.path.exists(out):
            with open(out) as f:
                results = json.load(f)
        results["seconds"] = seconds
        results["log"] = log
        results["marks"] = [open(os.path.join(marks, m)).read() for m in os.listdir(marks)]
    return results


def first_error_line(detail: str) -> str:
    """The most telling line of a failure: the ranks' last exception line (torch's harness prints each rank's traceback)."""
    lines = [ln.strip() for ln in detail.splitlines() if ln.strip()]
    errors = [
        ln
        for ln in lines
        if (ln.split(":")[0].endswith(("Error", "Exception")) and not ln.startswith(("Traceback", "RuntimeError: Process")))
    ]
    return (errors[-1] if errors else (lines[-1] if lines else ""))[:300]


def table(rows: List[List[str]]) -> str:
    """A Markdown table of ``rows`` (the first row is the header)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    fmt = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join([fmt[0], "|" + "|".join("-" * (w + 2) for w in widths) + "|", *fmt[1:]])


def main() -> int:
    """Run both implementations, print the table; exit 1 on an unexplained fastcoll failure."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tests", nargs="*", help="test names (default: all of TESTS)")
    parser.add_argument("--only", choices=["torch", "fastcoll"], help="run one implementation")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for each implementation's whole run")
    parser.add_argument("--verbose", action="store_true", help="print each suite process's output")
    args = parser.parse_args()
    tests = args.tests or TESTS
    impls = [args.only] if args.only else ["torch", "fastcoll"]
    results = {}
    t0 = time.monotonic()
    for impl in impls:
        print(f"[torch-ddp-suite] {len(tests)} tests with {impl} DDP ...", flush=True)
        results[impl] = r = run_one(impl, tests, args.timeout)
        if args.verbose or not r["tests"]:
            print(r["log"])
        print(f"[torch-ddp-suite] {impl}: {r['seconds']:.0f} s ({r.get('from', '?')})", flush=True)
    if "fastcoll" in results:
        marks = results["fastcoll"]["marks"]
        if any(m != "fastcoll.ddp.wrapper.DDP" for m in marks) or not marks:
            print(f"[torch-ddp-suite] the fastcoll run's rank processes did not all use fastcoll.DDP: {marks}")
            return 1
        print(f"[torch-ddp-suite] {len(marks)} rank processes ran with fastcoll.DDP substituted")

    rows = [["test", *(f"{i} DDP" for i in impls), "reason (fastcoll failures)"]]
    unexplained = []
    for name in tests:
        cells = [name]
        for impl in impls:
            cells.append(results[impl]["tests"].get(name, {}).get("outcome", "not run"))
        reason = ""
        fc = results.get("fastcoll", {}).get("tests", {}).get(name)
        td = results.get("torch", {}).get("tests", {}).get(name)
        if fc is not None and fc["outcome"] != "passed":
            reason = EXPLAINED.get(name, "")
            if not reason and td is not None and td["outcome"] == fc["outcome"]:
                reason = f"{fc['outcome']} with torch DDP too: " + first_error_line(fc["detail"])
            elif not reason:
                unexplained.append(name)
                reason = "UNEXPLAINED: " + first_error_line(fc["detail"])
        cells.append(reason)
        rows.append(cells)
    print()
    print(table(rows))
    print()
    for impl in impls:
        passed = sum(1 for t in tests if results[impl]["tests"].get(t, {}).get("outcome") == "passed")
        print(f"{impl} DDP: {passed} of {len(tests)} passed ({results[impl]['seconds']:.0f} s)")
    print(f"total: {time.monotonic() - t0:.0f} s")
    for name in unexplained:
        print(f"\n--- fastcoll.DDP {name} ---\n{results['fastcoll']['tests'][name]['detail'][-4000:]}")
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
