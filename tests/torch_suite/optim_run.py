"""Run PyTorch's optimizer tests with the plain torch optimizers and wrapped in fastcoll.ShardedOptimizer.

``make test-torch-optim-suite`` runs this. The tests are pytorch/pytorch's own
(``test/test_optim.py``: ``TestOptimRenewed``, driven by ``optim_db``), run
unmodified from a source folder (``--sources``, default
``tests/torch_suite/upstream``, which holds ``test/test_optim.py`` and is not
in git: ``make torch-optim-sources`` downloads it at the pinned torch's tag).
All adaptation lives in ``optim_adapter.py``.

Configurations: ``plain`` (torch's classes, one process), then ``ws{1,2}-{full,sharded}``:
every ``optim_db`` class wrapped (``optim_adapter``), world size 1 or 2 on
gloo, ``ShardedOptimizer(grads=...)``, float32 masters for 16-bit parameters.
A wrapped configuration runs the tests that pass plain (with ``--merge``,
plain's results in the existing JSON when ``plain`` is not run; else all).
Each test has a timeout; a hung test is killed with its ranks and the run
goes on with the next. Results: a JSON file and a Markdown report
(per configuration the pass counts, and every failure classified with its cause).

Usage::

    python tests/torch_suite/optim_run.py [--configs plain,ws1-full,...] [--only REGEX] [--timeout S]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "optim_worker.py")
ROOT = os.path.dirname(os.path.dirname(HERE))
CONFIGS = ["plain", "ws1-full", "ws1-sharded", "ws2-full", "ws2-sharded"]

sys.path.insert(0, HERE)
from optim_causes import classify, family  # noqa: E402


def _config(name: str) -> Tuple[str, int, bool]:
    """(grads, world size, overlap_param_gather) of a configuration name (ShardedOptimizer's default: no overlap)."""
    if name == "plain":
        return "none", 1, True
    m = re.fullmatch(r"ws(\d+)-(full|sharded)(-sync)?", name)
    if not m:
        raise SystemExit(f"unknown configuration {name!r}: plain or ws<N>-full / ws<N>-sharded[-sync]")
    return m.group(2), int(m.group(1)), False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> Dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTORCH_PRINT_REPRO_ON_FAILURE"] = "0"
    return env


def list_tests(suite: str, sources: str) -> List[str]:
    """The suite's test names (one worker process)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "names.json")
        cmd = [sys.executable, WORKER, "--suite", suite, "--sources", sources, "--out", out, "--list"]
        subprocess.run(cmd, env=_env(), check=True, timeout=600)
        with open(out) as f:
            return json.load(f)


def _read(path: str) -> List[Dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def _merge(per_rank: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One test's outcome over the ranks: passed/skipped when all agree, else the first rank's failure."""
    outcomes = [r["outcome"] for r in per_rank]
    seconds = max(r["seconds"] for r in per_rank)
    wrapped = per_rank[0].get("wrapped")
    if len(set(outcomes)) == 1 and outcomes[0] in ("passed", "skipped"):
        return {"outcome": outcomes[0], "detail": per_rank[0]["detail"], "seconds": seconds, "wrapped": wrapped}
    bad = next(i for i, r in enumerate(per_rank) if r["outcome"] not in ("passed", "skipped"))
    detail = per_rank[bad]["detail"]
    if len(per_rank) > 1:
        detail = f"[rank {bad}; outcomes by rank: {outcomes}]\n" + detail
    return {"outcome": "failed", "detail": detail, "seconds": seconds, "wrapped": wrapped}


def run_config(suite: str, config: str, tests: List[str], sources: str, timeout: float, log: Any) -> Dict[str, Any]:
    """Run ``tests`` in ``config``: world-size worker processes, restarted after a test that hangs or crashes."""
    grads, ws, overlap = _config(config)
    results: Dict[str, Any] = {}
    remaining = list(tests)
    with tempfile.TemporaryDirectory(prefix="fastcoll_optim_") as tmp:
        attempt = 0
        while remaining:
            attempt += 1
            names = os.path.join(tmp, f"names{attempt}.txt")
            with open(names, "w") as f:
                f.write("\n".join(remaining))
            outs = [os.path.join(tmp, f"a{attempt}r{r}.jsonl") for r in range(ws)]
            port = _free_port()
            procs = [
                subprocess.Popen(
                    [
                        sys.executable,
                        WORKER,
                        "--suite",
                        suite,
                        "--grads",
                        grads,
                        "--rank",
                        str(r),
                        "--world-size",
                        str(ws),
                        "--port",
                        str(port),
                        "--pg-timeout",
                        str(max(10.0, timeout / 2)),
                        "--sources",
                        sources,
                        "--out",
                        outs[r],
                        "--tests-file",
                        names,
                        *([] if overlap else ["--no-overlap"]),
                    ],
                    env=_env(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )  # fmt: skip
                for r in range(ws)
            ]
            last_change, sizes, stuck = time.monotonic(), [0] * ws, None
            while any(p.poll() is None for p in procs):
                time.sleep(0.5)
                now_sizes = [os.path.getsize(o) if os.path.exists(o) else 0 for o in outs]
                if now_sizes != sizes:
                    sizes, last_change = now_sizes, time.monotonic()
                elif time.monotonic() - last_change > timeout:
                    stuck = "timeout"
                    break
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
            records = [_read(o) for o in outs]
            done = [{r["test"]: r for r in recs if "test" in r} for recs in records]
            progressed = 0
            for name in remaining:
                if all(name in d for d in done):
                    results[name] = _merge([d[name] for d in done])
                    progressed += 1
                    continue
                # The first test some rank did not finish: it hung (killed) or its process died.
                why = stuck or f"crashed (exit codes {[p.returncode for p in procs]})"
                results[name] = {"outcome": "failed", "detail": f"{why}: killed after {timeout:.0f} s without progress"
                                 if why == "timeout" else why, "seconds": timeout if why == "timeout" else 0.0}  # fmt: skip
                progressed += 1
                break
            remaining = remaining[progressed:]
            print(f"[torch-optim-suite] {suite} {config}: {len(results)}/{len(tests)} done", flush=True)
    return results


#: How to read the report (printed under its title).
NOTES = [
    "How the tests see the wrapper: the optimizer a test constructs is the `ShardedOptimizer` itself (its "
    "`param_groups`, `state`, hooks, `state_dict`); the test's tensors are the DDP's parameters (same objects). "
    "A DDP reduces the backward that follows one of its forwards; the tests compute their losses from the tensors, "
    "so the adapter runs the DDP's empty forward where a loop's forward would be: at construction and in every "
    "`zero_grad()` (never after `step()`: what a test reads between `step()` and its next `zero_grad()` is what "
    "`step()` left). At world size 2 both ranks run the same test with the same seeds (same tensors, same "
    "gradients), so every result must equal the plain optimizer's bitwise.",
    "",
    "A failure whose kind is **behaviour** and whose cause starts with *stale parameters* passes when rerun with "
    "`overlap_param_gather=False` (the runner reruns every non-refused failure that way): the parameters are not "
    "current when `step()` returns (issue 30, item 2).",
    "",
    "Test sources: see *sources* above. When they are not pytorch's files at the pinned torch's tag, failures with "
    "the plain optimizer can come from the version skew (here: `Muon` is in 2.13's `optim_db` but the test file "
    "predates it; two CyclicLR tests of the older test_lrscheduler.py expect older behaviour); they are excluded "
    "from the wrapped runs. `make torch-optim-sources` downloads the files at the tag where github.com is reachable.",
    "",
    "`test/distributed/optim/test_zero_redundancy_optimizer.py` runs in its own harness (its tests spawn their "
    "own ranks): `zero_suite.py`, report in ZERO_RESULTS.md.",
]


def _built(results: Dict[str, Any]) -> str:
    """How many ShardedOptimizers the passing tests built (rank 0): 0 for plain; "?" where results predate the count."""
    counts = [r.get("wrapped") for r in results.values() if r["outcome"] == "passed"]
    return str(sum(counts)) if counts and None not in counts else "?"


def _md_table(rows: List[List[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    fmt = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join([fmt[0], "|" + "|".join("-" * (w + 2) for w in widths) + "|", *fmt[1:]])


def report(data: Dict[str, Any]) -> str:
    """The Markdown report: per suite and configuration the counts, then every failure grouped by cause."""
    lines = [
        "# PyTorch's optimizer tests with fastcoll.ShardedOptimizer",
        "",
        f"Generated by `tests/torch_suite/optim_run.py` ({data['date']}; torch {data['torch']}; sources: "
        f"{data['sources']}; {data['command']}). Wrapped: every `optim_db` optimizer class returns a "
        "`fastcoll.ShardedOptimizer` over a `fastcoll.DDP` of the test's own tensors (`optim_adapter.py`), "
        'world size 1 or 2 (gloo), `grads="full"` or `"sharded"`, float32 masters for 16-bit parameters. '
        "A wrapped configuration runs the tests that pass with the plain torch optimizer.",
        "",
        *NOTES,
        "",
        f"Run time: the seconds column of each table, on 2 CPU cores shared with other jobs; every run of the command "
        f"above together took {data.get('total_seconds', 0.0) / 60:.0f} min.",
        "",
    ]
    for suite, per_config in data["suites"].items():
        plain = per_config.get("plain", {})
        baseline = [t for t, r in plain.items() if r["outcome"] == "passed"]
        rows = [["configuration", "tests run", "passed", "failed: refused loudly", "failed: behaviour differs",
                 "failed: other error / hang", "ShardedOptimizers built", "seconds"]]  # fmt: skip
        for config, res in per_config.items():
            kinds = [classify(r, config, t)[0] for t, r in res.items() if r["outcome"] == "failed"]
            passed = sum(r["outcome"] == "passed" for r in res.values())
            skipped = sum(r["outcome"] == "skipped" for r in res.values())
            extra = f" ({skipped} skipped)" if skipped else ""
            rows.append([config, str(len(res)), f"{passed}{extra}", str(kinds.count("refused")),
                         str(kinds.count("behaviour")), str(kinds.count("error")), _built(res),
                         f"{data['seconds'][suite][config]:.0f}"])  # fmt: skip
        lines += [f"## {suite}", ""]
        if plain:
            lines += [f"Plain torch optimizers here: {len(baseline)} of {len(plain)} tests pass (the others skip: "
                      "CUDA-only, or fail with torch itself, listed below under `plain`).", ""]  # fmt: skip
        lines += [_md_table(rows), ""]
        groups: Dict[Tuple[str, str], Dict[str, List[str]]] = {}
        for config, res in per_config.items():
            for test, r in res.items():
                if r["outcome"] != "failed":
                    continue
                kind, cause = classify(r, config, test)
                groups.setdefault((kind, cause), {}).setdefault(config, []).append(test)
        order = {"behaviour": 0, "error": 1, "refused": 2}
        lines += ["### Failures by cause", "",
                  "Kinds: **behaviour** (a result differs from the plain optimizer's: a bug), **error** (an error that does "
                  "not come from a fastcoll refusal, or a hang: a bug unless explained), **refused** (fastcoll or DDP "
                  "refuses the pattern loudly: acceptable per the contract).", ""]  # fmt: skip
        for (kind, cause), by_config in sorted(groups.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])):
            total = sum(len(v) for v in by_config.values())
            lines.append(f"- **{kind}** ({total}): {cause}")
            same: Dict[Tuple[str, ...], List[str]] = {}  # configurations with the same failing tests share a line
            for config, tests in by_config.items():
                same.setdefault(tuple(sorted(tests)), []).append(config)
            for tests, configs in same.items():
                lines.append(f"  - {', '.join(configs)}: {family(list(tests))}")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    """Run the configurations; write the JSON results and the Markdown report; print the summary."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--suite", default="test_optim,test_lrscheduler", help="comma-separated suites")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {CONFIGS}")
    parser.add_argument("--only", help="run only tests whose name matches this regular expression (re.search)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a test may run without progress")
    parser.add_argument("--sources", default=os.path.join(HERE, "upstream"), help="folder holding test/test_optim.py")
    parser.add_argument("--json", default=os.path.join(HERE, "optim_results.json"))
    parser.add_argument("--md", default=os.path.join(HERE, "OPTIM_RESULTS.md"))
    parser.add_argument("--report-only", action="store_true", help="rewrite --md from the existing --json; run nothing")
    parser.add_argument("--merge", action="store_true", help="update the tests run in the existing --json, keep the rest")
    parser.add_argument("--log", default=os.path.join(tempfile.gettempdir(), "fastcoll_optim_suite.log"))
    args = parser.parse_args()
    if args.report_only:
        with open(args.json) as f:
            text = report(json.load(f))
        with open(args.md, "w") as f:
            f.write(text + "\n")
        print(text)
        return 0
    if not os.path.exists(os.path.join(args.sources, "test", "test_optim.py")):
        print(f"[torch-optim-suite] no test/test_optim.py under {args.sources}: run `make torch-optim-sources`")
        return 2
    configs = args.configs.split(",")
    for c in configs:
        _config(c)
    import torch

    suites = args.suite.split(",")
    data: Dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "sources": _describe(args.sources),
        "command": "optim_run.py " + " ".join(sys.argv[1:]),
        "suites": {s: {} for s in suites},
        "seconds": {s: {} for s in suites},
    }
    # With --merge, a wrapped configuration whose plain run is not repeated here runs the tests that passed plain in
    # the existing results.
    known_plain = {}
    if args.merge and os.path.exists(args.json):
        with open(args.json) as f:
            known_plain = {s: r["plain"] for s, r in json.load(f).get("suites", {}).items() if "plain" in r}
    t0 = time.monotonic()
    with open(args.log, "w") as log:
        for suite in suites:
            tests = list_tests(suite, args.sources)
            if args.only:
                tests = [t for t in tests if re.search(args.only, t)]
            for config in configs:
                run = tests
                plain = data["suites"][suite].get("plain", known_plain.get(suite))
                if config != "plain" and plain is not None:
                    run = [t for t in tests if plain[t]["outcome"] == "passed"]
                print(f"[torch-optim-suite] {suite} {config}: {len(run)} tests", flush=True)
                c0 = time.monotonic()
                data["suites"][suite][config] = run_config(suite, config, run, args.sources, args.timeout, log)
                data["seconds"][suite][config] = time.monotonic() - c0
    data["total_seconds"] = time.monotonic() - t0
    if args.merge and os.path.exists(args.json):
        data = _merged(args.json, data, complete=not args.only)
    _trim(data)
    with open(args.json, "w") as f:
        json.dump(data, f, indent=1)
    text = report(data)
    with open(args.md, "w") as f:
        f.write(text + "\n")
    print(text)
    print(f"[torch-optim-suite] total {data['total_seconds']:.0f} s; {args.json}, {args.md}; worker log {args.log}")
    return 0


def _trim(data: Dict[str, Any]) -> None:
    """Keep the JSON small: a skip's reason, a failure's last 600 characters, no text for a pass."""
    for per_config in data["suites"].values():
        for res in per_config.values():
            for r in res.values():
                keep = {"passed": 0, "skipped": 200}.get(r["outcome"], 600)
                r["detail"] = r["detail"][-keep:] if keep else ""


def _merged(path: str, new: Dict[str, Any], complete: bool) -> Dict[str, Any]:
    """The results in ``path`` with ``new``'s tests (and times) replacing theirs.

    ``complete``: each configuration of ``new`` ran every test it runs (no ``--only``), so its results replace the
    configuration's old ones whole (an old entry of a test it no longer runs would otherwise stay).
    """
    with open(path) as f:
        old = json.load(f)
    for suite, per_config in new["suites"].items():
        for config, res in per_config.items():
            configs = old["suites"].setdefault(suite, {})
            spent = old["seconds"].setdefault(suite, {})
            if complete:
                configs[config], spent[config] = dict(res), new["seconds"][suite][config]
                continue
            before = configs.setdefault(config, {})
            # A rerun of every test replaces the time; a rerun of some adds to it.
            spent[config] = new["seconds"][suite][config] + (0.0 if set(res) >= set(before) else spent.get(config, 0.0))
            before.update(res)
    old["command"] += "; then " + new["command"]
    old["date"] = new["date"]
    old["total_seconds"] = old.get("total_seconds", 0.0) + new["total_seconds"]
    return old


def _describe(sources: str) -> str:
    """Where the tests came from: the sources folder's SOURCE file (written by `make torch-optim-sources`)."""
    path = os.path.join(sources, "SOURCE")
    if os.path.exists(path):
        with open(path) as f:
            return f.read().strip()
    return os.path.relpath(sources, ROOT)


if __name__ == "__main__":
    sys.exit(main())
