"""PyTorch's ZeroRedundancyOptimizer tests, run with ZeRO itself and with fastcoll.ShardedOptimizer in its place.

The tests are pytorch/pytorch's ``test/distributed/optim/test_zero_redundancy_optimizer.py``,
run unmodified from a source folder (``FASTCOLL_ZERO_SOURCES``, default
``tests/torch_suite/upstream``; not in git: ``make torch-optim-sources``).
Each test spawns its own rank processes (upstream's ``DistributedTestBase``:
gloo on CPU, world size 1 or 2, a hard timeout per test). Every spawned rank
imports this module first (as ``__mp_main__``), which replaces the test
module's ``ZeroRedundancyOptimizer`` according to ``FASTCOLL_ZERO_CONFIG``:

* ``zero``: left alone (torch's ZeroRedundancyOptimizer: the baseline);
* ``full`` / ``sharded``: :func:`zero_redundancy_optimizer`, which builds the
  same torch optimizer (``optimizer_class(params, **defaults)``) and wraps it
  in ``fastcoll.ShardedOptimizer(grads=...)`` over a ``fastcoll.DDP`` of the
  test's own tensors (``optim_adapter.wrap``: the DDP's empty forward runs at
  construction and in every ``zero_grad()``, where a loop's forward would be).

Nothing else of ZeRO's API is mapped: a test that reads ``.optim``,
``consolidate_state_dict``, ``_all_params`` or uses ZeRO as a ``Joinable``
fails on that name, and :func:`classify` says so. :data:`EXPECTED` holds
what each test does with fastcoll and why; the run exits 1 when a result
differs from it (``tests/torch_suite/test_zero_suite.py`` runs it under pytest).

Usage::

    python tests/torch_suite/zero_suite.py [--configs zero,full,sharded] [--all] [--json F] [--md F] [test ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import time
import unittest
from typing import Any, Dict, List, Optional, Tuple

os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "120")  # per test, read when torch.testing is imported

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SOURCES = os.environ.get("FASTCOLL_ZERO_SOURCES", os.path.join(HERE, "upstream"))
UPSTREAM = "test/distributed/optim/test_zero_redundancy_optimizer.py"
CONFIGS = ("zero", "full", "sharded")
KINDS = ("passed", "refused", "zero-only", "error", "skipped")
REPRO = "\\n\\nTo execute this test"  # where torch's repr of a KeyError message starts its repro hint
CONFIG = os.environ.get("FASTCOLL_ZERO_CONFIG", "zero")
MARKS = os.environ.get("FASTCOLL_ZERO_MARKS")  # a file: one line per ShardedOptimizer built (proof of the substitution)

sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.join(SOURCES, UPSTREAM)))
import optim_adapter  # noqa: E402
import test_zero_redundancy_optimizer as Z  # noqa: E402  (upstream's module, unmodified)
import torch  # noqa: E402
from recorder import Recorder  # noqa: E402

import fastcoll  # noqa: E402
from fastcoll.optim.elementwise import ELEMENTWISE  # noqa: E402


def zero_redundancy_optimizer(
    params: Any,
    optimizer_class: type,
    process_group: Optional[Any] = None,
    parameters_as_bucket_view: bool = False,
    overlap_with_ddp: bool = False,
    **defaults: Any,
) -> torch.optim.Optimizer:
    """``ZeroRedundancyOptimizer``'s signature, answered by a fastcoll.ShardedOptimizer around ``optimizer_class``.

    ``parameters_as_bucket_view`` is ZeRO's memory layout (fastcoll always
    steps views of bucket ranges) and is ignored. A subclass of a class
    fastcoll knows to be elementwise (the tests' ``SGDWithNewKey``, ...) is
    asserted elementwise, as its user would after fastcoll's error.

    Raises:
        NotImplementedError: ``overlap_with_ddp=True`` (ZeRO's DDP comm-hook step; no counterpart).
    """
    if overlap_with_ddp:
        raise NotImplementedError("ZeroRedundancyOptimizer(overlap_with_ddp=True) has no ShardedOptimizer counterpart")
    inner = optimizer_class(params, **defaults)
    config = optim_adapter.Config(grads=CONFIG)
    opt = optim_adapter.wrap(inner, config, process_group, elementwise=issubclass(optimizer_class, ELEMENTWISE))
    if MARKS:
        with open(MARKS, "a") as f:
            f.write(f"{os.getpid()} {type(opt).__name__}\n")
    return opt


if CONFIG in ("full", "sharded"):
    Z.ZeroRedundancyOptimizer = zero_redundancy_optimizer
elif CONFIG != "zero":
    raise SystemExit(f"FASTCOLL_ZERO_CONFIG must be one of {CONFIGS}, not {CONFIG!r}")


class TestZeroRedundancyOptimizerFourRanks(Z.TestZeroRedundancyOptimizerDistributed):
    """Upstream's distributed tests at 4 ranks (on CPU upstream runs them at 2: one test needs 4 to do anything).

    Its process group's FileStore counts the world's ranks as its users: upstream's ``create_pg`` counts the
    devices (1 on CPU), and at 4 CPU ranks under load one of six runs failed in gloo's connectFullMesh.
    """

    @property
    def world_size(self) -> int:
        return 4

    def create_pg(self, device: str, world_size: Optional[int] = None) -> Any:
        """Upstream's ``create_pg`` on CPU (gloo), with a FileStore sized for every rank."""
        world_size = world_size or self.world_size
        store = torch.distributed.FileStore(self.file_name, world_size)
        torch.distributed.init_process_group(self.backend(device), world_size=world_size, rank=self.rank, store=store)
        return torch.distributed.distributed_c10d._get_default_group()


#: The tests that run on CPU with gloo (the others skip on a machine without GPUs), as class and method.
CPU_TESTS: List[Tuple[type, str]] = [
    *((Z.TestZeroRedundancyOptimizerSingleRank, n) for n in (
        "test_state_dict", "test_lr_scheduler", "test_step_with_kwargs", "test_step_with_extra_inner_key",
        "test_step_without_closure", "test_zero_grad", "test_constructor", "test_same_dense_param_type")),
    *((Z.TestZeroRedundancyOptimizerDistributed, n) for n in (
        "test_sharding", "test_add_param_group", "test_nondefault_process_group", "test_zero_join_cpu")),
    (TestZeroRedundancyOptimizerFourRanks, "test_nondefault_process_group"),
]  # fmt: skip

#: ZeroRedundancyOptimizer's own members that the tests use, and why ShardedOptimizer has no counterpart.
ZERO_ONLY = {
    "optim": "ZeRO's local optimizer over the whole parameters of this rank's partition, its state keyed by them; "
    "ShardedOptimizer's per-rank optimizer steps 1-D pieces of bucket ranges (private), opt.state[p] of a model "
    "parameter is refused (the state is divided), and the whole state is in opt.state_dict()",
    "consolidate_state_dict": "ZeRO gathers the state to one rank before state_dict(); ShardedOptimizer.state_dict() "
    "is itself the collective that returns the whole state on every rank",
    "_all_params": "a private ZeRO attribute",
    "join_hook": "ZeRO is a torch Joinable (uneven inputs: its join hook shadows the step's collectives); "
    "ShardedOptimizer is not, and fastcoll.DDP.join() refuses a model whose buckets a ShardedOptimizer divides "
    "(ValueError naming fastcoll: a rank out of inputs would not update its range)",
}

#: Per test, what it does with ShardedOptimizer in both grads modes (or per mode), and why. Kinds: passed;
#: zero-only (it fails on ZeroRedundancyOptimizer's own API, :data:`ZERO_ONLY`); refused (fastcoll raises loudly).
EXPECTED: Dict[str, Dict[str, Tuple[str, str]]] = {
    "test_state_dict": {"full": ("zero-only", "the first step matches (x == 0.9); then o.optim.state[x]")},
    "test_lr_scheduler": {"full": ("passed", "StepLR built on the wrapper, 5 steps equal to torch's SGD")},
    "test_step_with_kwargs": {
        "full": ("refused", "step(closure, kwarg=...) of an SGD subclass: fastcoll steps the inner optimizer once per "
                 "bucket, so ShardedOptimizer.step takes only a closure (TypeError naming fastcoll, nothing stepped)")
    },
    "test_step_with_extra_inner_key": {"full": ("passed", "a key the inner step writes into param_groups[0] is seen")},
    "test_step_without_closure": {"full": ("passed", "an SGD subclass whose step() takes no closure")},
    "test_zero_grad": {
        "full": ("passed", "p.grad set by the backward, None after zero_grad()"),
        "sharded": ("refused", "the test reads m.weight.grad: under grads='sharded' the reduced gradient exists only "
                    "as the ranks' ranges, and reading p.grad raises naming fastcoll (the contract)"),
    },
    "test_constructor": {"full": ("zero-only", "every constructor input raises torch's error or builds (the "
                                  "wrapped optimizer validates them); then len(o.optim.param_groups)")},
    "test_same_dense_param_type": {
        "full": ("refused", "asserts ZeRO's own limits (one dense dtype, no sparse parameter; fastcoll buckets "
                 "per dtype); its tensors need no gradient, so fastcoll.DDP refuses them first (RuntimeError, "
                 "as torch DDP), not the ValueError the test expects")
    },
    "test_sharding": {"full": ("refused", "tensors that need no gradient: fastcoll.DDP refuses (as torch DDP); the "
                               "test then asserts ZeRO's greedy partition of whole tensors through o.optim")},
    "test_add_param_group": {"full": ("refused", "add_param_group after construction: refused (the pieces are fixed); "
                                      "the test then asserts ZeRO's partition through o.optim")},
    "test_nondefault_process_group": {"full": ("passed", "trivially: it returns at once below 4 ranks (upstream too)")},
    "test_zero_join_cpu": {"full": ("zero-only", "uneven inputs with ZeRO as a Joinable, gradients set by hand")},
    "test_nondefault_process_group_ws4": {
        "full": ("passed", "4 ranks, ShardedOptimizer over a fastcoll.DDP on the even ranks' subgroup: SGD with "
                 "momentum, 5 closure steps, parameters equal across the subgroup")
    },
}  # fmt: skip


def expected(test: str, config: str) -> Tuple[str, str]:
    """(kind, why) expected for ``test`` under ``config`` ("full" or "sharded")."""
    entry = EXPECTED[test]
    return entry.get(config, entry["full"])


def classify(outcome: str, detail: str) -> Tuple[str, str]:
    """(kind, the error's gist) of one result: passed, skipped, zero-only, refused, or error (anything else).

    ``refused`` when an exception in the chain names fastcoll (a refusal may be the cause of the one the test saw).
    """
    if outcome in ("passed", "skipped"):
        return outcome, detail.strip().splitlines()[-1] if detail.strip() else ""
    m = re.search(r"has no attribute '(\w+)'", detail)
    if m and m.group(1) in ZERO_ONLY:
        return "zero-only", f"{m.group(1)}: {ZERO_ONLY[m.group(1)]}"
    found = re.findall(r"^(\w+(?:Error|Exception)): (.*)$", detail, re.M)
    errors = [f"{kind}: {text.split(REPRO)[0]}" for kind, text in found]
    ours = [e for e in errors if "fastcoll" in e]
    if ours:
        return "refused", ours[0][:400]
    return "error", (errors[-1] if errors else detail.strip().splitlines()[-1])[:400]


def _suite(names: List[str], everything: bool) -> unittest.TestSuite:
    chosen = [(cls, n) for cls, n in CPU_TESTS]
    if everything:
        loader = unittest.defaultTestLoader
        for cls in (Z.TestZeroRedundancyOptimizerSingleRank, Z.TestZeroRedundancyOptimizerDistributed):
            chosen += [(cls, n) for n in loader.getTestCaseNames(cls) if (cls, n) not in chosen]
    if names:
        chosen = [(cls, n) for cls, n in chosen if n in names or _key(cls, n) in names]
    return unittest.TestSuite(cls(n) for cls, n in chosen)


def _key(cls: type, name: str) -> str:
    return f"{name}_ws4" if cls is TestZeroRedundancyOptimizerFourRanks else name


def run(config: str, names: List[str], everything: bool) -> Dict[str, Dict[str, Any]]:
    """Run the tests under ``config``; per test its outcome, error text, seconds and ShardedOptimizers built."""
    os.environ["FASTCOLL_ZERO_CONFIG"] = config  # read by the spawned ranks when they import this module
    marks = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"fastcoll_zero_marks_{os.getpid()}")
    os.environ["FASTCOLL_ZERO_MARKS"] = marks
    out: Dict[str, Dict[str, Any]] = {}
    for test in _suite(names, everything):
        open(marks, "w").close()
        runner = unittest.TextTestRunner(verbosity=2, resultclass=Recorder, stream=sys.stderr)
        result = runner.run(unittest.TestSuite([test]))
        name = test.id().rsplit(".", 1)[-1]
        with open(marks) as f:
            built = len(f.readlines())
        record = result.outcomes[name]
        record["built"] = built
        record["kind"], record["gist"] = classify(record["outcome"], record["detail"])
        record["detail"] = record["detail"][-4000:]
        out[_key(type(test), name)] = record
    os.remove(marks)
    return out


def check(results: Dict[str, Dict[str, Dict[str, Any]]]) -> List[str]:
    """Every way the results differ from :data:`EXPECTED` (and from the baseline: ZeRO must pass what it runs)."""
    problems = []
    for config, per_test in results.items():
        for test, r in per_test.items():
            if config == "zero":
                if r["kind"] != "passed":
                    problems.append(f"zero: {test} {r['kind']}: {r['gist']}")
                continue
            want, _ = expected(test, config)
            if r["kind"] != want:
                problems.append(f"{config}: {test} is {r['kind']}, expected {want}: {r['gist']}")
            elif want == "passed" and r["built"] == 0 and test != "test_nondefault_process_group":
                problems.append(f"{config}: {test} passed without building a ShardedOptimizer")
    return problems


def counts(per_test: Dict[str, Dict[str, Any]]) -> Dict[str, int]:
    """How many tests of one configuration are of each kind."""
    out: Dict[str, int] = {}
    for r in per_test.values():
        out[r["kind"]] = out.get(r["kind"], 0) + 1
    return out


def report(data: Dict[str, Any]) -> str:
    """The Markdown report: per test its result under each configuration and why; the counts."""
    from optim_run import _md_table

    results = data["results"]
    configs = list(results)
    tests = list(dict.fromkeys(t for per in results.values() for t in per))
    rows = [["test", *configs, "why (fastcoll)"]]
    for t in tests:
        cells = [results[c][t]["kind"] if t in results[c] else "" for c in configs]
        why = " / ".join(dict.fromkeys(expected(t, c)[1] for c in configs if c != "zero" and t in EXPECTED))
        rows.append([f"`{t}`", *cells, why])
    summary = [["configuration", "tests", *KINDS]]
    for c in configs:
        n = counts(results[c])
        summary.append([c, str(len(results[c])), *(str(n.get(k, 0)) for k in KINDS)])
    gists = sorted({(r["kind"], r["gist"]) for c in configs if c != "zero" for r in results[c].values() if r["gist"]})
    return "\n".join([
        "# PyTorch's ZeroRedundancyOptimizer tests with fastcoll.ShardedOptimizer",
        "",
        f"Generated by `tests/torch_suite/zero_suite.py` ({data['date']}; torch {data['torch']}; "
        f"{data['seconds'] / 60:.1f} min on 2 shared CPU cores). Sources: `{UPSTREAM}` of pytorch/pytorch, "
        f"unmodified ({_source_note()}). Each test spawns its own ranks (upstream's DistributedTestBase, gloo, "
        "CPU). `zero`: torch's ZeroRedundancyOptimizer; `full` / `sharded`: every "
        "`ZeroRedundancyOptimizer(params, optimizer_class, **kw)` builds `optimizer_class(params, **kw)` and wraps "
        "it in `fastcoll.ShardedOptimizer(grads=...)` over a `fastcoll.DDP` of the test's tensors "
        "(`zero_redundancy_optimizer` in zero_suite.py; `process_group` goes to the DDP). Nothing else of ZeRO's "
        "API is mapped. `test_nondefault_process_group_ws4` is upstream's test at 4 ranks (at 2 it returns at once).",
        "",
        "Kinds: **passed**; **refused** (fastcoll raises an error naming it: acceptable per the contract); "
        "**zero-only** (the test fails on ZeroRedundancyOptimizer's own API, see below); **error** (anything "
        "else: a bug). The other tests of the file need GPUs (they skip here, with ZeRO too).",
        "",
        _md_table(summary),
        "",
        _md_table(rows),
        "",
        "ZeroRedundancyOptimizer-only API the tests use:",
        "",
        *(f"- `{k}`: {v}" for k, v in ZERO_ONLY.items()),
        "",
        "Errors seen (first line naming fastcoll, or the last exception):",
        "",
        *(f"- {kind}: `{gist}`" for kind, gist in gists),
        "",
    ])  # fmt: skip


def _source_note() -> str:
    path = os.path.join(SOURCES, "SOURCE")
    if not os.path.exists(path):
        return "source not recorded"
    with open(path) as f:
        lines = [line.strip() for line in f if "zero_redundancy" in line]
    return lines[0] if lines else "source not recorded"


def main() -> int:
    """Run the configurations, write the JSON (and Markdown) results, exit 1 on any unexpected result."""
    parser = argparse.ArgumentParser()
    parser.add_argument("tests", nargs="*", help="test names (default: every CPU-runnable test)")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--all", action="store_true", help="also the tests that need GPUs (they skip here)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--md", help="write the Markdown report here")
    args = parser.parse_args()
    t0 = time.monotonic()
    results = {c: run(c, args.tests, args.all) for c in args.configs.split(",")}
    data = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "fastcoll": fastcoll.__file__,
        "seconds": round(time.monotonic() - t0, 1),
        "results": results,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(report(data))
    problems = check(results)
    for p in problems:
        print("UNEXPECTED", p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
