"""One rank of PyTorch's optimizer tests, plain or with every optimizer wrapped (see ``optim_adapter``).

Started by ``optim_run.py`` (``make test-torch-optim-suite``), one process per
rank; every rank runs the same tests in the same order (the tests seed
torch's generator in ``setUp``, so the ranks build the same tensors). Each
test gets a fresh gloo process group (``PrefixStore`` per test over one
TCPStore): a test that fails on one rank and leaves the other waiting in a
collective times out there and does not spill into the next test. Results go
to a JSON-lines file, one ``start`` line before and one result line after
each test, so the runner can tell which test hangs.

Usage::

    python optim_worker.py --suite test_optim --grads none|full|sharded --rank R --world-size N \
        --port P --sources DIR --out FILE [--tests-file FILE] [--list] [test names ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
import types
import unittest
from typing import Any, Dict

HERE = os.path.dirname(os.path.abspath(__file__))

#: Suite name -> (file under the sources' test/ folder, module name, test classes run).
SUITES: Dict[str, Any] = {
    "test_optim": ("test_optim.py", "test_optim", ["TestOptimRenewedCPU"]),
    "test_lrscheduler": ("optim/test_lrscheduler.py", "optim.test_lrscheduler", ["TestLRScheduler"]),
}

#: Modules the suites import only for test classes this runner does not run: stubbed when the sources lack them.
_SIBLINGS = {
    "optim.test_lrscheduler": "TestLRScheduler",
    "optim.test_optim": "TestDifferentiableOptimizer",
    "optim.test_swa_utils": "TestSWAUtils",
}


def _import_suite(sources: str, suite: str) -> types.ModuleType:
    """Import the suite's module from ``sources``/test (stubbing sibling modules that are absent)."""
    import importlib

    test_dir = os.path.join(sources, "test")
    sys.path.insert(0, test_dir)
    for name, cls in _SIBLINGS.items():
        if os.path.exists(os.path.join(test_dir, *name.split(".")) + ".py"):
            continue
        if "optim" not in sys.modules:
            pkg = types.ModuleType("optim")
            pkg.__path__ = [os.path.join(test_dir, "optim")]
            sys.modules["optim"] = pkg
        stub = types.ModuleType(name)
        setattr(stub, cls, type(cls, (), {}))
        sys.modules[name] = stub
    return importlib.import_module(SUITES[suite][1])


def _tests(module: types.ModuleType, suite: str) -> Dict[str, unittest.TestCase]:
    loader = unittest.defaultTestLoader
    out: Dict[str, unittest.TestCase] = {}
    for cls_name in SUITES[suite][2]:
        for t in loader.loadTestsFromTestCase(getattr(module, cls_name)):
            out[t.id().rsplit(".", 1)[-1]] = t
    return out


class _One(unittest.TestResult):
    """The outcome of one test: passed, failed (with the traceback), or skipped (with the reason)."""

    def __init__(self) -> None:
        super().__init__()
        self.outcome, self.detail = "passed", ""

    def addFailure(self, test: Any, err: Any) -> None:
        self.outcome, self.detail = "failed", "".join(traceback.format_exception(*err))

    addError = addFailure

    def addSkip(self, test: Any, reason: str) -> None:
        self.outcome, self.detail = "skipped", reason

    def addExpectedFailure(self, test: Any, err: Any) -> None:
        self.outcome, self.detail = "xfail", "".join(traceback.format_exception(*err))

    def addUnexpectedSuccess(self, test: Any) -> None:
        self.outcome = "xpass"


def _write(f: Any, record: Dict[str, Any]) -> None:
    f.write(json.dumps(record) + "\n")
    f.flush()


def main() -> int:
    """Run the named tests of the suite on this rank; one JSON line per test start and per result."""
    parser = argparse.ArgumentParser()
    parser.add_argument("tests", nargs="*")
    parser.add_argument("--suite", default="test_optim", choices=sorted(SUITES))
    parser.add_argument("--grads", default="none", choices=["none", "full", "sharded"])
    parser.add_argument("--no-overlap", action="store_true", help="ShardedOptimizer(overlap_param_gather=False)")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--port", type=int, default=29600)
    parser.add_argument("--pg-timeout", type=float, default=60.0)
    parser.add_argument("--sources", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tests-file", help="a file with more test names, one a line")
    parser.add_argument("--list", action="store_true", help="write the suite's test names to --out and exit")
    args = parser.parse_args()
    if args.tests_file:
        with open(args.tests_file) as f:
            args.tests += [line.strip() for line in f if line.strip()]

    sys.path.insert(0, HERE)
    import optim_adapter
    import torch.distributed as dist

    module = _import_suite(args.sources, args.suite)
    tests = _tests(module, args.suite)
    if args.list:
        with open(args.out, "w") as f:
            json.dump(sorted(tests), f)
        return 0
    config = optim_adapter.Config(grads=args.grads, overlap_param_gather=not args.no_overlap)
    optim_adapter.install(None if args.grads == "none" else config, module)
    store = dist.TCPStore("127.0.0.1", args.port, args.world_size, args.rank == 0, timeout=datetime.timedelta(seconds=120))
    timeout = datetime.timedelta(seconds=args.pg_timeout)
    with open(args.out, "a") as f:
        for name in args.tests:
            _write(f, {"start": name})
            t0 = time.monotonic()
            dist.init_process_group(
                "gloo", store=dist.PrefixStore(f"{name}/", store), rank=args.rank, world_size=args.world_size, timeout=timeout
            )
            result = _One()
            before = optim_adapter.built
            try:
                tests[name].run(result)
            finally:
                dist.destroy_process_group()
            _write(f, {"test": name, "outcome": result.outcome, "detail": result.detail[-6000:],
                       "seconds": round(time.monotonic() - t0, 2), "wrapped": optim_adapter.built - before})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
