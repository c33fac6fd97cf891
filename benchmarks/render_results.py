"""Render the JSON written by `python -m fastcoll.bench ...` as Markdown tables.

Usage: python benchmarks/render_results.py [benchmarks/out/ops_cpu.json ...] > tables.md
Used to paste measured tables into benchmarks/RESULTS.md; it computes nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} µs"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _machine(d: dict) -> str:
    m = d["machine"]
    b = m.get("fastcoll_build", {})
    return (
        f"{m.get('timestamp', '?')}, {m.get('cpu', '?')} ({m.get('cpus_available', '?')} CPUs), "
        f"Python {m.get('python', '?')}, torch {m.get('torch', '?')}, CUDA {m.get('torch_cuda') or 'none'}, "
        f"ops: {'extension' if b.get('extension', True) else 'reference'}"
    )


def render_ops(d: dict) -> str:
    out = [f"Machine: {_machine(d)}\n"]
    by_threads: dict = {}
    for r in d["results"]:
        by_threads.setdefault((r["device"], r.get("threads")), []).append(r)
    for (device, threads), rows in by_threads.items():
        out.append(f"**{device}, {threads} thread(s)**: median round trip (pack x 1/ws, unpack)\n")
        body = []
        for r in rows:
            m = r["methods"]
            body.append(
                [
                    r["layout"], str(r["tensors"]), f"{r['bytes'] / 2**20:.1f}",
                    _ms(m["floor"]["median_s"]), _ms(m["fused"]["median_s"]), _ms(m["per_param"]["median_s"]),
                    _ms(m["torch_utils"]["median_s"]), _ms(m["foreach"]["median_s"]),
                    f"{r['ratios']['fused/floor']:.2f}x", f"{r['ratios']['per-param/fused']:.2f}x",
                    str(r.get("kernels_per_direction") or "-"),
                ]
            )  # fmt: skip
        out.append(
            _table(
                ["layout", "tensors", "MiB", "floor (2 copies)", "fused", "per-param", "utils.flatten", "foreach",
                 "fused/floor", "per-param/fused", "kernels/dir"],
                body,
            )
        )  # fmt: skip
        out.append("")
    return "\n".join(out)


def render_ddp(d: dict) -> str:
    out = [f"Machine: {_machine(d)}\n"]
    fp32 = [r for r in d["results"] if r.get("section") == "fp32"]
    body = []
    for r in fp32:
        m = r["methods"]
        body.append(
            [
                r["label"], "yes" if r["gradient_as_bucket_view"] else "no",
                _ms(m["no_sync"]["median_s"]), _ms(m["torch"]["median_s"]), _ms(m["fastcoll"]["median_s"]),
                f"{r['ratios']['fastcoll/torch']:.2f}x",
                _ms(m["torch"].get("sync_overhead_s")), _ms(m["fastcoll"].get("sync_overhead_s")),
                " / ".join(f"{(m[k].get('peak_mem_bytes') or 0) / 2**20:.1f}" for k in ("torch", "fastcoll")),
                "equal" if r["grads"]["fastcoll"]["equal"] else ("close" if r["grads"]["fastcoll"]["close"] else "DIFFER"),
            ]
        )  # fmt: skip
    out.append(
        _table(
            ["model", "bucket view", "no_sync floor", "torch DDP", "fastcoll.DDP", "fastcoll/torch", "sync torch",
             "sync fastcoll", "peak MiB torch / fastcoll", "grads"],
            body,
        )
    )  # fmt: skip
    comm = [r for r in d["results"] if r.get("section") != "fp32"]
    if comm:
        out.append("\n**comm_dtype vs torch DDP + the same-dtype compress hook**\n")
        body = []
        for r in comm:
            m = r["methods"]
            names = [k for k in m if k != "no_sync"]
            cells = [r["label"], r.get("section", "")]
            for k in names:
                cells.append(f"{k}: {_ms(m[k]['median_s'])}, sent {(m[k].get('sent_bytes_per_step') or 0) / 2**20:.1f} MiB")
            ratio = {k: v for k, v in r.get("ratios", {}).items()}
            cells.append(", ".join(f"{k} {v:.2f}x" for k, v in ratio.items()))
            body.append(cells)
        width = max(len(c) for c in body)
        body = [c + [""] * (width - len(c)) for c in body]
        out.append(_table(["model", "dtype"] + ["method"] * (width - 3) + ["ratios"], body))
    return "\n".join(out)


def render_dist(d: dict) -> str:
    out = [f"Machine: {_machine(d)}\n"]
    body = []
    for r in d["results"]:
        m = r["methods"]
        cells = [r["function"], r["case"]]
        cells += [f"{k}: {_ms(v['median_s'])} ({v.get('time_vs_fastcoll', 1.0):.2f}x)" for k, v in m.items()]
        body.append(cells)
    width = max(len(c) for c in body)
    body = [c + [""] * (width - len(c)) for c in body]
    out.append(_table(["function", "case"] + ["method: median (time vs fastcoll)"] * (width - 2), body))
    return "\n".join(out)


def main(paths: list[str]) -> None:
    renderers = {"ops": render_ops, "ddp": render_ddp, "dist": render_dist}
    for p in paths:
        d = json.loads(Path(p).read_text())
        kind = d.get("benchmark") or Path(p).stem.split("_")[0]
        print(f"### {kind} ({Path(p).name})\n")
        print(renderers[kind](d))
        print()


if __name__ == "__main__":
    main(sys.argv[1:] or [str(p) for p in sorted(Path("benchmarks/out").glob("*.json"))])
