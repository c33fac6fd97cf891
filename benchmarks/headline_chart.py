"""Render the README's headline chart (docs/img/headline.png) from measured numbers in benchmarks/RESULTS.md.

Every bar is a number copied from a table of RESULTS.md, found by its section
heading and its row and column labels; nothing is typed in here. By default the
file is read as committed at ``RESULTS_REV`` (``git show``), so the chart stays
reproducible when RESULTS.md is regenerated; ``--results PATH`` reads another
copy (the labels must still be there). Four panels:

* one 25 MiB gradient bucket packed and unpacked on one NVIDIA H200 (the
  ops section, from ops_cuda.json);
* a DDP step at 1 rank on NCCL with the collectives forced, same H200;
* a step with AdamW on 2 gloo ranks of the 2-core CPU box, torch DDP vs
  torch's ZeroRedundancyOptimizer vs ``ShardedOptimizer(grads="sharded")``;
* peak memory per rank of a bfloat16 GPT-2-shaped model trained at float32
  quality, CPU box.

Usage: ``python benchmarks/headline_chart.py [--results PATH] [--out docs/img/headline.png]``
(needs matplotlib, which ``make setup`` installs).
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path
from typing import Dict, List, Sequence

ROOT = Path(__file__).resolve().parents[1]
# The commit whose benchmarks/RESULTS.md the chart was drawn from.
RESULTS_REV = "bee8c9d"
DEFAULT_OUT = ROOT / "docs" / "img" / "headline.png"

H200 = "NVIDIA H200, 1 GPU, torch 2.11.0+cu130 (2026-11-27)"
CPU_BOX = "CPU box: AMD EPYC, 2 cores, torch 2.13.0+cpu"

Row = Dict[str, str]


def read_results(path: "Path | None") -> str:
    """RESULTS.md's text: ``path``, or the file at ``RESULTS_REV`` in this repository."""
    if path is not None:
        return path.read_text()
    return subprocess.run(
        ["git", "show", f"{RESULTS_REV}:benchmarks/RESULTS.md"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout


def table(text: str, heading: str, first_column: str, needs: Sequence[str] = ()) -> List[Row]:
    """The rows of the first table under the heading starting with ``heading`` whose first column is ``first_column``
    and which has every column in ``needs``."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("#") and line.lstrip("#").strip().startswith(heading)]
    if not starts:
        raise LookupError(f"RESULTS.md has no section {heading!r}")
    level = len(lines[starts[0]]) - len(lines[starts[0]].lstrip("#"))
    for i in range(starts[0] + 1, len(lines)):
        line = lines[i]
        if line.startswith("#") and len(line) - len(line.lstrip("#")) <= level:
            break  # the section ended
        cells = _cells(line)
        if (
            cells
            and cells[0] == first_column
            and set(needs) <= set(cells)
            and i + 1 < len(lines)
            and set(lines[i + 1]) <= set("|-: ")
        ):
            rows = []
            for body in lines[i + 2 :]:
                if not body.startswith("|"):
                    break
                rows.append(dict(zip(cells, _cells(body))))
            return rows
    raise LookupError(f"RESULTS.md's section {heading!r} has no table starting with column {first_column!r}")


def _cells(line: str) -> List[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []


def row(rows: Sequence[Row], **match: str) -> Row:
    """The one row whose columns equal ``match`` (column names with spaces given with underscores)."""
    wanted = {k.replace("_", " "): v for k, v in match.items()}
    found = [r for r in rows if all(r.get(k) == v for k, v in wanted.items())]
    if len(found) != 1:
        raise LookupError(f"expected one row with {wanted}, found {len(found)}")
    return found[0]


def number(cell: str, unit: str = "") -> float:
    """The first number of a cell, converted to ``unit`` ("us" or "ms") when the cell carries a time unit."""
    m = re.search(r"([0-9]+(?:\.[0-9]+)?)\s*(µs|us|ms|s)?", cell)
    if m is None:
        raise ValueError(f"no number in {cell!r}")
    value, cell_unit = float(m.group(1)), m.group(2)
    if unit and cell_unit:
        to_us = {"µs": 1.0, "us": 1.0, "ms": 1e3, "s": 1e6}
        value = value * to_us[cell_unit] / to_us["ms" if unit == "ms" else "us"]
    return value


def panel(
    rows: Sequence[Row], key: str, groups: Dict[str, str], series: Dict[str, str], unit: str, **fixed: str
) -> Dict[str, List[float]]:
    """{"groups": group labels, series label: the column's number in each group's row} for one panel.

    ``groups`` maps a group label to the value of column ``key`` that selects its row (with ``fixed``'s
    columns too); ``series`` maps a series label to its column.
    """
    out: Dict[str, List[float]] = {"groups": list(groups)}  # type: ignore[dict-item]
    for label, column in series.items():
        out[label] = [number(row(rows, **{key: value}, **fixed)[column], unit) for value in groups.values()]
    return out


# The bar panels: (title, section heading, the table's first column (it picks the rows), group label -> that
# column's value in the group's row, series label -> the column holding its number, unit, other columns to match).
BAR_PANELS = [
    (
        f"GPU: pack + unpack of one 25 MiB bucket (µs, log)\n{H200}",
        "ops: the fused flatten/unflatten round trip (cuda)",
        "layout",
        {"ResNet-50 bucket": "resnet50 b3", "GPT-2 bucket": "gpt2_small b1"},
        {
            "per-parameter copies": "per-param",
            "torch _foreach_copy_": "foreach_copy",
            "fastcoll (one fused kernel)": "fused",
            "two plain copies (floor)": "floor",
        },
        "us",
        {},
    ),
    (
        f"GPU: DDP step, 1 rank on NCCL, collectives forced (ms)\n{H200}",
        "ddp: fastcoll.DDP vs torch DDP (cuda)",
        "model",
        {"ResNet-50 shapes": "ResNet-50 shapes  *", "GPT-2 shapes": "GPT-2 small shapes  *", "MLP": "MLP 96x(32x32)"},
        {"torch DDP": "torch DDP", "fastcoll.DDP": "fastcoll"},
        "ms",
        {},
    ),
    (
        f"CPU: step with AdamW, 2 gloo ranks (ms)\n{CPU_BOX}",
        "zero: ShardedOptimizer vs ZeroRedundancyOptimizer vs DDP (cpu)",
        "model",
        {"ResNet-50 shapes": "ResNet-50 shapes *", "MLP": "MLP 96x(32x32)"},
        {
            "torch DDP + AdamW": "torch DDP",
            "torch ZeroRedundancyOptimizer": "torch ZeRO",
            'ShardedOptimizer(grads="sharded")': "grads=sharded",
        },
        "ms",
        {},
    ),
]


def headline_numbers(text: str) -> Dict[str, Dict[str, List[float]]]:
    """Panel title -> {series label: values per group}, plus each panel's group labels under "groups"."""
    panels = {
        title: panel(table(text, heading, key, list(series.values())), key, groups, series, unit, **fixed)
        for title, heading, key, groups, series, unit, fixed in BAR_PANELS
    }
    column = "tensor peak (r0 / r1)"  # the bytes tensors held at once (exact; the resident peak moves from run to run)
    mem = table(text, "zero bf16: main gradients + sharded float32 masters (cpu)", "method", [column])

    def peak(method: str) -> float:  # the larger of the two ranks' peaks
        return max(float(v) for v in row(mem, method=method)[column].split("/"))

    cpu_mem = {
        "groups": ["GPT-2 shapes, width 256 (22.6 M)"],
        "torch DDP fp32 + autocast(bf16)": [peak("torch fp32+autocast")],
        "fastcoll: bf16 + fp32 main grads + sharded fp32 masters": [peak("fastcoll sharded")],
    }
    panels[f"CPU: bf16 model at fp32 quality, peak tensor MiB per rank\n{CPU_BOX}"] = cpu_mem
    return panels


def draw(panels: Dict[str, Dict[str, List[float]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5))
    for ax, (title, data) in zip(axes.flat, panels.items()):
        groups = data["groups"]
        series = [(k, v) for k, v in data.items() if k != "groups"]
        width = 0.8 / len(series)
        for s, (label, values) in enumerate(series):
            xs = [g + (s - (len(series) - 1) / 2) * width for g in range(len(groups))]
            bars = ax.bar(xs, values, width, label=label)
            ax.bar_label(bars, labels=[f"{v:.0f}" if v >= 100 else f"{v:.3g}" for v in values], fontsize=7, padding=1)
        top = max(max(v) for _, v in series)
        if "log" in title:  # room above the bars for the legend
            ax.set_yscale("log")
            ax.set_ylim(top=top * 12)
        else:
            ax.set_ylim(0, top * 1.45)
        ax.set_xticks(range(len(groups)), groups)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7, loc="upper right", ncol=2 if len(series) > 3 else 1)
    fig.suptitle("fastcoll vs PyTorch's own paths (lower is better); numbers from benchmarks/RESULTS.md", fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=None, help=f"RESULTS.md to read (default: git {RESULTS_REV})")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    panels = headline_numbers(read_results(args.results))
    for title, data in panels.items():
        print(title.replace("\n", " | "))
        for label, values in data.items():
            if label != "groups":
                print(f"  {label}: {', '.join(f'{g} {v:g}' for g, v in zip(data['groups'], values))}")
    draw(panels, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
