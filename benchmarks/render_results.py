"""Render benchmarks/RESULTS.md from the JSON that `python -m fastcoll.bench ...` writes; it computes nothing.

    python benchmarks/render_results.py [JSON ...] [--out benchmarks/RESULTS.md]

Default input: every ``benchmarks/out/<benchmark>_<device>.json`` (ops, ddp,
dist, timeline, health, zero, zero_bf16, zero_one_rounding, zero_pool). Per benchmark: its machine line, the
tables it printed (JSON version 2 records them) and its notes; first, every
target of every file in one summary table; last, benchmarks/gpu_sessions.md (what a
GPU session measured outside the JSON, written by hand). Files of the first layout (no
``version``) give their targets only. A (benchmark, device) with no file here (a GPU
session's JSON stays on the checkout that ran it) keeps its summary rows and section from
the previous RESULTS.md. History lives in git, not in the file.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Sequence, Tuple

HERE = Path(__file__).resolve().parent
# What a GPU session measured outside the benchmarks' JSON (the CUDA tests, crashes, plan timings), by hand.
SESSIONS = HERE / "gpu_sessions.md"
ORDER = ("ops", "ddp", "dist", "timeline", "health", "zero", "zero_bf16", "zero_one_rounding", "zero_pool")
TITLES = {
    "ops": "ops: the fused flatten/unflatten round trip",
    "ddp": "ddp: fastcoll.DDP vs torch DDP",
    "dist": "dist: fastcoll.dist's collectives",
    "timeline": "timeline: bucket caps, auto and torch DDP",
    "health": "health: clipping, the fused norm, the non-finite check",
    "zero": "zero: ShardedOptimizer vs ZeroRedundancyOptimizer vs DDP",
    "zero_bf16": "zero bf16: main gradients + sharded float32 masters",
    "zero_one_rounding": "zero one rounding: bf16 on the wire, rounded once",
    "zero_pool": "zero pool: gradient buffers from a pool (ZeRO-2)",
}


def cell(text: Any) -> str:
    """One Markdown table cell (``|`` escaped, one line)."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def line(cells: Sequence[Any]) -> str:
    """One row of a GitHub Markdown table."""
    return "| " + " | ".join(map(cell, cells)) + " |"


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table."""
    return "\n".join([line(columns), "|" + "|".join("---" for _ in columns) + "|"] + [line(r) for r in rows])


def machine(d: Dict[str, Any]) -> str:
    """The line saying what a file was measured on, and when."""
    m = d.get("machine", {})
    cfg = d.get("config", {})
    load = m.get("load_average")
    gpu = f", {m['gpu']}" if m.get("gpu") else ""
    how = f"`--{cfg['level']}` run" if cfg.get("level") in ("full", "smoke") else "default run"
    return (
        f"{m.get('timestamp', '?')}, {how}: {m.get('cpu', '?')} ({m.get('cpus_available', '?')} CPUs{gpu}), "
        f"Python {m.get('python', '?')}, torch {m.get('torch', '?')}, ops: {m.get('fastcoll_implementation', '?')}"
        + (f", load average at the end {' / '.join(map(str, load))}" if load else "")
    )


def _number(v: Any, unit: Any = None) -> str:
    """A value as the summary shows it: 3 significant digits; byte counts in MiB."""
    if unit == "bytes" and isinstance(v, (int, float)):
        return f"{v / 2**20:.3g} MiB"
    if isinstance(v, float):
        return f"{v:.3g}"
    return "-" if v is None else str(v)


def targets(d: Dict[str, Any]) -> Iterator[Tuple[str, str, Dict[str, Any]]]:
    """(row, target name, target) for every target in a file, whichever benchmark wrote it."""
    rows: List[Dict[str, Any]] = list(d.get("results", [])) + list(d.get("dtype_pairs", [])) + list(d.get("ops", []))
    for r in rows:
        name = r.get("label") or r.get("layout") or r.get("model") or r.get("op") or "?"
        ranks = f"{r['world_size']} rank(s)" if "world_size" in r and d.get("benchmark") == "health" else ""
        extra = [f"{r['threads']} thread(s)" if r.get("threads") else "", r.get("pair", ""),
                 "+view" if r.get("gradient_as_bucket_view") else "", ranks]  # fmt: skip
        where = " ".join([name, *(e for e in extra if e)])
        for key, t in (r.get("targets") or {}).items():
            if d.get("benchmark") == "zero" and key.startswith("memory ") and "unit" not in t:
                t = {**t, "unit": "bytes"}  # files written before targets carried their unit
            yield where, key, t


def verdict(t: Dict[str, Any]) -> str:
    """MET / MISSED / not resolved; first-layout targets (pass only) as PASS / MISS."""
    if "verdict" in t:
        return {"MET": "**met**", "MISSED": "**missed**"}.get(t["verdict"], t["verdict"])
    return "PASS" if t.get("pass") else "MISS" if t.get("pass") is False else "-"


SUMMARY_COLUMNS = ["benchmark", "row", "target", "value", "90% interval", "target", "verdict"]


def key_of(d: Dict[str, Any]) -> Tuple[str, str]:
    """A result file's (benchmark, device)."""
    return d["benchmark"], d.get("config", {}).get("device", "cpu")


def summary_rows(d: Dict[str, Any]) -> List[str]:
    """The summary table's rows of one file's targets (Markdown lines)."""
    body = []
    for where, key, t in targets(d):
        ci = t.get("ci90")
        unit = t.get("unit")
        interval = f"{_number(ci[0], unit)} .. {_number(ci[1], unit)}" if ci else t.get("interval", "exact")
        bench = "{} ({})".format(*key_of(d))
        body.append([bench, where, key, _number(t.get("value"), unit), interval,
                     f"{t.get('op', '')} {_number(t.get('threshold'), unit)}", verdict(t)])  # fmt: skip
    return [line(r) for r in body]


def kept(previous: str, present: Sequence[Tuple[str, str]]) -> Dict[Tuple[str, str], Tuple[List[str], str]]:
    """From the previous RESULTS.md, the summary rows and the section of every (benchmark, device) that no file here
    has (a GPU session's, whose JSON stayed on that machine's checkout): kept as they were, until a new file of it."""
    out: Dict[Tuple[str, str], Tuple[List[str], str]] = {}
    titles = {f"## {title} ({device})": (name, device) for name, title in TITLES.items() for device in ("cpu", "cuda")}
    blocks = re.split(r"(?m)^(?=## )", previous)
    for block in blocks:
        key = titles.get(block.split("\n", 1)[0].strip())
        if key is not None and key not in present:
            rows = [row for row in previous.splitlines() if row.startswith("| {} ({}) |".format(*key))]
            out[key] = (rows, block.rstrip() + "\n")
    return out


def section(d: Dict[str, Any]) -> str:
    name, device = key_of(d)
    out = [f"## {TITLES.get(name, name)} ({device})", "", f"Measured {machine(d)}.", ""]
    if not d.get("tables"):
        out += ["(This file predates the recorded tables: its targets are in the summary above.)", ""]
    for t in d.get("tables", []):
        out += [f"**{t['title']}**", "", table(t["columns"], t["rows"]), ""]
        if t.get("caption"):
            out += [t["caption"].replace("\n", "  \n"), ""]
    notes = [n for n in d.get("notes", []) if n.strip()]
    if notes:
        out += ["```text", *notes, "```", ""]
    return "\n".join(out)


def render(paths: Sequence[Path], previous: str = "") -> str:
    """RESULTS.md from the result files at ``paths``, keeping ``previous``'s parts of what none of them measured."""
    files = [json.loads(p.read_text()) for p in paths]
    parts = {key_of(d): (summary_rows(d), section(d)) for d in files}
    for key, part in kept(previous, list(parts)).items():
        parts[key] = part
    order = sorted(parts, key=lambda k: (ORDER.index(k[0]) if k[0] in ORDER else len(ORDER), k[1]))
    head = [
        "# Benchmark results",
        "",
        "Generated by `python benchmarks/render_results.py` from the JSON of the latest `make bench` "
        "(`python -m fastcoll.bench all`); do not edit by hand. How to run and read these, and why some targets "
        "cannot be met on this machine: docs/benchmarks.md. Targets are reported, never asserted; a verdict is "
        "MET or MISSED when the 90% interval lies on one side of the threshold, else not resolved.",
        "",
        "## Every target",
        "",
        "\n".join(table(SUMMARY_COLUMNS, []).splitlines() + [row for k in order for row in parts[k][0]]),
        "",
    ]
    sessions = [SESSIONS.read_text().strip(), ""] if SESSIONS.exists() else []
    return "\n".join(head + [parts[k][1] for k in order] + sessions).rstrip() + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="*", type=Path, help="result files (default: benchmarks/out/*.json)")
    parser.add_argument("--out", type=Path, default=HERE / "RESULTS.md", help="where to write ('-': standard output)")
    args = parser.parse_args(argv)
    paths = args.json or sorted(p for p in (HERE / "out").glob("*.json") if p.stem.rsplit("_", 1)[0] in ORDER)
    if not paths:
        print("render_results: no JSON results (run `make bench` first)", file=sys.stderr)
        return 1
    previous = args.out.read_text() if str(args.out) != "-" and args.out.exists() else ""
    text = render(paths, previous)
    if str(args.out) == "-":
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
        print(f"wrote {args.out} from {len(paths)} file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
