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


def _mib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.1f}"


def _ratio(t: dict | None) -> str:
    if not t:
        return "-"
    ci = t.get("ci90")
    interval = f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else ""
    return f"{t['value']:.2f}x{interval} {t['verdict']}"


def render_zero(d: dict) -> str:
    """fastcoll.bench zero: step times and targets, state / peak / traffic per method, the all-gathers, the probe."""
    labels = {
        "torch": "torch DDP",
        "zero": "torch ZeRO",
        "fastcoll": "fastcoll.DDP",
        "full": "grads=full",
        "sharded": "grads=sharded",
    }
    methods = list(labels)
    out = [f"Machine: {_machine(d)}; AdamW {d['config'].get('adamw')}\n"]
    body = []
    for r in d["results"]:
        m, t = r["methods"], r["targets"]
        cells = [r["label"]] + [_ms(m[k].get("median_s")) for k in methods]
        cells += [" / ".join(f"{g['reps']}x{g['inner']}" for g in r["groups"])]
        cells += [_ratio(t.get("step full/zero")), _ratio(t.get("step sharded/zero")), _ratio(t.get("step sharded/torch"))]
        body.append(cells)
    out.append(
        _table(
            ["model", *labels.values(), "samples x inner", "full/ZeRO (<= 0.8)", "sharded/ZeRO (<= 0.8)",
             "sharded/torch DDP (<= 1.0)"],
            body,
        )
    )  # fmt: skip
    out.append("")
    body = []
    for r in d["results"]:
        m, t = r["methods"], r["targets"]
        for k in methods:
            st, pk, sent = m[k].get("state_bytes") or [], m[k].get("peak_bytes") or [], m[k].get("sent_bytes") or []
            state_t, mem_t = t.get(f"state {k}"), t.get(f"memory {k}")
            body.append(
                [
                    r["label"] if k == "torch" else "", labels[k], " / ".join(_mib(x) for x in st),
                    f"{state_t['value']:.4f} {state_t['verdict']}" if state_t else "-",
                    " / ".join(_mib(x) for x in pk),
                    f"{_mib(mem_t['value'])} {mem_t['verdict']}" if mem_t else "-",
                    " / ".join(_mib(x) for x in m[k].get("live_peak_bytes") or []),
                    _mib(r.get("live_margins", {}).get(k)),
                    " / ".join(_mib(x) for x in sent),
                    "ok" if r["checks"].get(k, {}).get("ok") else "DIFFER",
                ]
            )  # fmt: skip
    out.append(
        _table(
            ["model", "method", "state MiB (rank 0 / 1)", "state / (DDP/N) (<= 1.01)", "peak MiB (rank 0 / 1)",
             "margin MiB (>= 0)", "live MiB (rank 0 / 1)", "live margin MiB", "sent MiB/iter", "params vs torch DDP"],
            body,
        )
    )  # fmt: skip
    out.append("")
    body = []
    for r in d["results"]:
        for k in ("full", "sharded"):
            g = r["gather"].get(k)
            if not g:
                continue
            f = g.get("first_waited") or {}
            body.append(
                [
                    r["label"], k, _ms(r["methods"][k]["median_s"]), _ms(g.get("forward_s")), _ms(g.get("forward_fastcoll_s")),
                    _ms(g["issue_s"]), _ms(g["gather_s"]), _ms(g["exposed_s"]),
                    f"{_ms(g['hidden_s'])} ({(g.get('hidden_share') or 0):.0%})", _ms(g["write_s"]),
                    f"b{f['bucket']} ({f['of'] - f['bucket']}/{f['of']})" if f else "-",  # issued last bucket first
                ]
            )  # fmt: skip
    out.append(
        _table(
            ["model", "grads", "step", "forward", "forward fastcoll.DDP", "pack+issue", "all-gather span", "exposed wait",
             "hidden", "write", "first waited (issued k/n)"],
            body,
        )
    )  # fmt: skip
    probe = d.get("collectives") or []
    if probe:
        out.append("")
        body = []
        for name in probe[0]:
            rows = [p[name] for p in probe]
            body.append(
                [
                    name, _mib(rows[0]["buffer_bytes"]), _ms(max(x.get("time_s") or 0 for x in rows)),
                    _mib(max(x["peak_growth_bytes"] or 0 for x in rows)), _mib(max(x["sent_bytes"] or 0 for x in rows)),
                ]
            )  # fmt: skip
        out.append(_table(["collective", "buffer MiB", "time", "peak growth MiB", "sent MiB"], body))
    return "\n".join(out)


def render_zero_bf16(d: dict) -> str:
    """fastcoll.bench zero's bfloat16 section: step times, bytes per rank by kind, live heap by phase, quality, targets."""
    labels = {"bf16": "torch DDP bf16", "autocast": "torch DDP fp32 + autocast", "sharded": "fastcoll sharded",
              "full": "fastcoll full"}  # fmt: skip
    (r,) = d["results"]
    m, t, ratios = r["methods"], r["targets"], r["ratios"]
    out = [f"Machine: {_machine(d)}; AdamW {d['config'].get('adamw')}\n"]

    def step_ratio(k: str) -> str:
        x = ratios.get(f"step {k}/autocast") or {}
        ci = x.get("ci90")
        return "-" if x.get("value") is None else f"{x['value']:.2f}x" + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else "")

    g = r["groups"][0]
    cells = [f"{r['label']} ({r['numel'] / 1e6:.1f} M)"] + [_ms(m[k].get("median_s")) if k != "full" else "-" for k in labels]
    cells += [step_ratio("bf16"), _ratio(t.get("step sharded/autocast")), f"{g['reps']}x{g['inner']}"]
    out.append(_table(["model", *labels.values(), "bf16/autocast", "sharded/autocast (<= 1.1)", "samples x inner"], [cells]))
    out.append("")
    body = []
    for k, label in labels.items():
        held = m[k].get("held") or []
        h = max(held, key=lambda x: x["total"]) if held else {}
        bpp = m[k].get("bytes_per_param") or {}
        peak = ratios.get(f"peak_bytes {k}/autocast")
        body.append(
            [
                label, _mib(h.get("params")), _mib(h.get("grads")), _mib(h.get("buckets")),
                f"{_mib(h.get('state', 0) + h.get('masters', 0))}" + (f" ({_mib(h['masters'])})" if h.get("masters") else ""),
                _mib(h.get("total")), f"{bpp.get('held', 0):.2f} ({m[k].get('readme_bytes_per_param', 0):.0f})",
                " / ".join(_mib(x) for x in m[k].get("peak_bytes") or []),
                "-" if bpp.get("peak") is None else f"{bpp['peak']:.2f}",
                " / ".join(_mib(x) for x in m[k].get("live_peak_bytes") or []),
                "-" if peak is None else f"{peak:.3f}x",
            ]
        )  # fmt: skip
    out.append(
        _table(
            ["method", "params MiB", ".grad MiB", "buckets MiB", "state (masters) MiB", "held MiB", "held B/param (README)",
             "peak MiB (rank 0 / 1)", "peak B/param", "live MiB (rank 0 / 1)", "peak / autocast's"],
            body,
        )
    )  # fmt: skip
    phases = [(k, [p for p in (m[k].get("live_by_phase") or []) if p]) for k in labels]
    phases = [(k, ps) for k, ps in phases if ps]
    if phases:
        names = list(phases[0][1][0])
        out.append("")
        out.append(
            _table(
                ["live MiB (worst rank)", *(f"after {n}" for n in names)],
                [[labels[k], *(_mib(max(p[n] for p in ps)) for n in names)] for k, ps in phases],
            )
        )
    q = d.get("quality")
    if q:
        qlabels = {"fp32": "(a) float32", "torch_bf16": "(b) bf16, torch DDP + AdamW",
                   "sharded": "(c) bf16, main grads + fp32 masters, sharded", "full": "(c') the same, grads=full"}  # fmt: skip
        body = []
        for name, label in qlabels.items():
            x = q["runs"].get(name)
            if x is None:
                continue
            body.append(
                [
                    label, f"{x['final_loss']:.4f}", f"{x['loss_gap']:+.3%}", f"{x['weight_distance']:.2e}",
                    "-" if x.get("master_distance") is None else f"{x['master_distance']:.2e}",
                    "-" if x.get("distance_vs_bf16") is None else f"{x['distance_vs_bf16']:.4f}",
                ]
            )  # fmt: skip
        out.append("")
        out.append(f"Quality: {q['steps']} AdamW steps ({d['config'].get('quality_model', '')})\n")
        out.append(_table(["run", "final loss", "gap vs (a)", "weight distance", "master distance", "distance / (b)'s"], body))
    body = []
    for x in t.values():
        ci = x.get("ci90")
        if x["interval"] == "exact":
            value, interval = f"{x['value']:.4f}", "exact"
        else:
            value, interval = f"{x['value']:.3f}x", f"{ci[0]:.3f}-{ci[1]:.3f}" if ci else "-"
        body.append([x["what"], value, interval, f"<= {x['threshold']}", x["verdict"]])
    out.append("")
    out.append(_table(["target", "value", "interval", "target", "verdict"], body))
    return "\n".join(out)


def main(paths: list[str]) -> None:
    renderers = {"ops": render_ops, "ddp": render_ddp, "dist": render_dist, "zero": render_zero, "zero_bf16": render_zero_bf16}
    for p in paths:
        d = json.loads(Path(p).read_text())
        kind = d.get("benchmark") or Path(p).stem.split("_")[0]
        if kind not in renderers:
            print(f"<!-- {Path(p).name}: no renderer for '{kind}' -->\n")
            continue
        print(f"### {kind} ({Path(p).name})\n")
        print(renderers[kind](d))
        print()


if __name__ == "__main__":
    main(sys.argv[1:] or [str(p) for p in sorted(Path("benchmarks/out").glob("*.json"))])
