"""fastcoll.DDP against torch DistributedDataParallel, side by side in one run (docs/benchmarks.md, "ddp").

Per model and ``gradient_as_bucket_view`` setting, a step (zero_grad + forward + backward) of each of :data:`METHODS`,
then ``comm_dtype`` against torch DDP's compress hooks; peak memory, bytes sent, buckets, and whether the gradients
equal torch DDP's. 2 gloo ranks on CPU; one NCCL rank on a GPU, measured with ``FASTCOLL_FORCE_COLLECTIVES`` 0 and 1 (at
world size 1 fastcoll issues no collective unless forced).
"""

from __future__ import annotations

import dataclasses
import gc
import os
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from . import models, report, runner, stats
from .models import ModelSpec

CPU_TARGET = 1.0  # fastcoll step / torch DDP step (CPU, 2 gloo ranks); sync overhead also <= torch's
GPU_TARGET = 0.95  # the same on one GPU rank (NCCL)
METHODS = ("no_sync", "torch", "fastcoll")
METHOD_DESCRIPTIONS = {
    "no_sync": "torch DDP (a separate instance) inside no_sync(): the step without gradient synchronization",
    "torch": "torch.nn.parallel.DistributedDataParallel(module, gradient_as_bucket_view=...)",
    "fastcoll": "fastcoll.DDP(module, gradient_as_bucket_view=...)",
    "torch fp16 hook": "torch DDP + ddp_comm_hooks.default_hooks.fp16_compress_hook",
    "fastcoll fp16": "fastcoll.DDP(module, comm_dtype=torch.float16)",
    "torch bf16 hook": "torch DDP + default_hooks.bf16_compress_hook (through a wrapper: torch refuses it by name on CPU)",
    "fastcoll bf16": "fastcoll.DDP(module, comm_dtype=torch.bfloat16)",
}
COMM_DTYPES = (("fp16", torch.float16), ("bf16", torch.bfloat16))
COMM_METHODS = ("no_sync", "torch fp16 hook", "fastcoll fp16", "torch bf16 hook", "fastcoll bf16")
PASS_SUFFIX = {"plain": "", "forced": " [comm forced]"}
PASS_DESCRIPTIONS = {
    "plain": "FASTCOLL_FORCE_COLLECTIVES=0: at world size 1 fastcoll.DDP issues no collective, torch DDP does",
    "forced": "FASTCOLL_FORCE_COLLECTIVES=1: fastcoll.DDP issues its all-reduces and broadcasts as at any world size",
}
CONFIGS = {  # rounds: reps..max_reps, until the step target resolves
    "smoke": dict(reps=2, max_reps=2, setup_steps=3, target_s=0.0, max_inner=1),
    "default": dict(reps=5, max_reps=15, setup_steps=3, target_s=0.03, max_inner=50),
    "full": dict(reps=15, max_reps=30, setup_steps=3, target_s=0.1, max_inner=200),
}


@dataclasses.dataclass
class Case:
    """One row: a model, a gradient_as_bucket_view setting and the methods timed side by side."""

    section: str  # "fp32" or "comm_dtype"
    spec: ModelSpec
    gabv: bool
    methods: Tuple[str, ...]


def build_cases(level: str) -> List[Case]:
    """The rows: every model without and with bucket view (default: bucket view on the MLP and ResNet-50 shapes only)."""
    M = models
    if level == "smoke":  # the encoder is covered by the comm_dtype section when there is one
        specs = [M.SMOKE_MLP, M.SMOKE_CONVBN, M.SMOKE_RESNET50]
        cases = [Case("fp32", s, g, METHODS) for s in specs for g in (False, True) if not g or s.kind == "mlp"]
        comm = [M.SMOKE_ENCODER]
    else:
        specs = [M.MLP96, M.CONVBN, M.ENCODER, M.RESNET50, M.GPT2]
        view = {s.name for s in specs} if level == "full" else {"mlp96", "resnet50"}
        cases = [Case("fp32", s, g, METHODS) for s in specs for g in (False, True) if not g or s.name in view]
        comm = specs[:4] if level == "full" else [M.ENCODER, M.RESNET50]
    return cases + [Case("comm_dtype", s, False, COMM_METHODS) for s in comm]


def collective_passes(world_size: int) -> List[Optional[str]]:
    """``[None]`` with 2+ ranks; at 1 rank both passes, or the one FASTCOLL_FORCE_COLLECTIVES names."""
    if world_size > 1:
        return [None]
    value = os.environ.get("FASTCOLL_FORCE_COLLECTIVES")
    return ["plain", "forced"] if value is None else ["plain" if value.strip() in ("", "0") else "forced"]


# The wrappers and their steps (inside the ranks)
def count_buckets(method: str, wrapper: nn.Module) -> Optional[int]:
    """Buckets of the wrapper's current layout (torch DDP: from its logging data, after the rebuild)."""
    if method.startswith("fastcoll"):
        return len(wrapper.bucket_info())
    return len(runner.torch_bucket_sizes(wrapper, "rebuilt_bucket_sizes", "bucket_sizes") or []) or None


def make_wrapper(method: str, module: nn.Module, gabv: bool, device: str) -> nn.Module:
    kind, name = (method.split() + [""])[:2]
    if method == "no_sync" or kind == "torch":
        wrapper = runner.wrap("torch", module, device, gradient_as_bucket_view=gabv)
        if name:  # renamed: torch refuses bf16 by name on CPU
            hook = default_hooks.fp16_compress_hook if name == "fp16" else default_hooks.bf16_compress_hook
            wrapper.register_comm_hook(None, lambda state, bucket: hook(state, bucket))
        return wrapper
    comm = {"comm_dtype": dict(COMM_DTYPES)[name]} if name else {}
    return runner.wrap("fastcoll", module, device, gradient_as_bucket_view=gabv, **comm)


def bench_case(case: Case, me: runner.Rank) -> Dict[str, Any]:
    """Set up every method of ``case`` on shared weights (memory, traffic, buckets), check the gradients, time them."""
    cfg, device, spec = me.cfg, me.device, case.spec
    storage = models.build_storage(spec, device)
    x = models.make_input(spec, me.rank, device)
    wrappers, steps, info = {}, {}, {}
    probe = runner.MemoryProbe(device)
    for method in case.methods:
        module = models.build_model(spec, device, storage)
        probe.start()
        wrapper = make_wrapper(method, module, case.gabv, device)
        step = models.backward_step(spec, wrapper, x, no_sync=method == "no_sync")
        runner.run_steps(step, cfg["setup_steps"] - 1)  # bucket rebuilds happen here
        one, sent = runner.bytes_sent(lambda: runner.time_calls(step, 1, device))
        info[method] = {"peak_mem_bytes": probe.peak(), "sent_bytes_per_step": sent if device == "cpu" else None,
                        "buckets": count_buckets(method, wrapper), "setup_step_s": one}  # fmt: skip
        wrappers[method], steps[method] = wrapper, step
    # every instance ran the same steps from the same state on the same inputs
    pairs = [("fastcoll", "torch")] if case.section == "fp32" else [(f"fastcoll {d}", f"torch {d} hook") for d, _ in COMM_DTYPES]
    rtol = 1e-5 if case.section == "fp32" else 1e-2
    checks = {a: models.compare_grads(wrappers[a].module, wrappers[b].module, rtol) for a, b in pairs}
    inner = me.inner(max(i["setup_step_s"] for i in info.values()))
    goal = [(stats.median_ratio("fastcoll", "torch"), cfg["target"], "le")] if case.section == "fp32" else []
    samples, _ = runner.timed_rounds(steps, inner, cfg["reps"], cfg["max_reps"], goal, device, me.tick)
    for k in ("peak_mem_bytes", "sent_bytes_per_step"):  # the most of any rank
        for m, v in zip(case.methods, runner.all_max([float(info[m][k] or 0) for m in case.methods], device)):
            info[m][k] = None if info[m][k] is None else int(v)
    params = [p for p in wrappers[case.methods[-1]].module.parameters() if p.requires_grad]
    del wrappers, steps, storage
    gc.collect()
    row = {"section": case.section, "model": spec.name, "label": spec.label, "synthetic": spec.synthetic,
           "gradient_as_bucket_view": case.gabv, "params": len(params), "numel": sum(p.numel() for p in params),
           "inner": inner, "samples": samples, "grads": checks}  # fmt: skip
    return analyze(row, info, cfg)


def analyze(row: Dict[str, Any], info: Dict[str, Dict[str, Any]], cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Per-method summaries, sync overheads, ratios and (fp32 rows) the targets with their paired intervals."""
    samples = row["samples"]
    floor = stats.summarize(samples["no_sync"])["median_s"]
    row["methods"] = {}
    for m, s in samples.items():
        st = stats.summarize(s)
        row["methods"][m] = {**st, **info[m], "sync_overhead_s": None if m == "no_sync" else st["median_s"] - floor}
    med = {m: st["median_s"] for m, st in row["methods"].items()}
    if row["section"] != "fp32":
        row["ratios"] = {
            f"fastcoll {d}/torch {d} hook": stats.ratio(med[f"fastcoll {d}"], med[f"torch {d} hook"]) for d, _ in COMM_DTYPES
        }
        return row

    def sync_ratio(s: stats.Samples) -> Optional[float]:
        ns = stats.summarize(s["no_sync"])["median_s"]
        t = stats.summarize(s["torch"])["median_s"] - ns
        return (stats.summarize(s["fastcoll"])["median_s"] - ns) / t if t > 0 else None

    step = stats.ratio_target(samples, "fastcoll", "torch", cfg["target"])
    row["ratios"] = {"fastcoll/torch": step["value"], "sync fastcoll/torch": sync_ratio(samples),
                     "no_sync/torch": stats.ratio(floor, med["torch"])}  # fmt: skip
    row["targets"] = {"step": step}
    if cfg["device"] == "cpu":
        ci = stats.bootstrap_ci(sync_ratio, samples, paired=True) if len(samples["torch"]) > 2 else None
        row["targets"]["sync"] = stats.target(sync_ratio(samples), 1.0, ci, "le", "90% bootstrap (rounds)")
    return row


def _ranks(me: runner.Rank, cases: List[Case]) -> Dict[str, Any]:
    if me.cfg["level"] != "smoke":  # one-time costs of every wrapper, on a tiny model
        for method in METHODS:
            wrapper = make_wrapper(method, models.build_model(models.WARMUP, me.device), False, me.device)
            x = models.make_input(models.WARMUP, me.rank, me.device)
            runner.run_steps(models.backward_step(models.WARMUP, wrapper, x, no_sync=method == "no_sync"), 3)
    gc.collect()
    gc.freeze()  # later collections skip torch's many long-lived objects: ms instead of 0.3 s
    rows = []
    for case in cases:
        what = case.spec.label + (", bucket view" if case.gabv else "") + f" ({case.section})"
        me.describe(f"ddp: {what}")
        rows.append(bench_case(case, me))
        me.row(what, len(cases))
    return {"rows": rows}


# Output and entry
def _grads_cell(check: Dict[str, Any]) -> str:
    if check["equal"]:
        return "[green]equal[/green]"
    return f"{'[green]close[/green]' if check['close'] else '[red]DIFFER[/red]'} ({check['max_abs_diff']:.1e})"


def print_results(payload: Dict[str, Any]) -> None:
    """The step-time table, the memory/traffic table and the comm_dtype table, per pass."""
    cfg = payload["config"]
    cpu = cfg["device"] == "cpu"
    for p in cfg.get("collective_passes") or [None]:
        rows = [r for r in payload["results"] if r.get("collectives") == p and r["section"] == "fp32"]
        where = f" ({cfg['device']}{'' if p is None else ', ' + p})"
        name = lambda r: r["label"] + (" *" if r["synthetic"] else "") + (" +view" if r["gradient_as_bucket_view"] else "")  # noqa: E731
        body = []
        for r in rows:
            m = r["methods"]
            line = [name(r), *(report.fmt_time(m[k]["median_s"]) for k in METHODS)]
            line += [report.fmt_signed_time(m[k]["sync_overhead_s"]) for k in METHODS[1:]]
            line += [_grads_cell(r["grads"]["fastcoll"]), report.target_cell(r["targets"]["step"])]
            body.append(line + [report.target_cell(r["targets"].get("sync"))])
        report.table(
            "fastcoll ddp: fastcoll.DDP vs torch DDP, step time" + where,
            ["model", "no_sync", "torch DDP", "fastcoll", "sync torch", "sync fastcoll", "grads",
             f"step fastcoll/torch (≤{cfg['target']}x)", "sync fastcoll/torch (≤1x)"],
            body,
            f"{cfg['world_size']} {cfg['backend']} rank(s), {cfg['threads']} thread(s) each; median step of the slowest rank "
            "(zero_grad + forward + backward, no optimizer), rounds interleaved; 90% paired bootstrap intervals. no_sync: "
            "the compute floor; sync = step - no_sync; +view: gradient_as_bucket_view. * synthetic: parameters of the "
            "model's shapes, one read each, so the step is mostly gradient synchronization.",
        )  # fmt: skip
        body = []
        for r in rows:
            m = r["methods"]
            line = [name(r), r["params"], report.mib(4 * r["numel"]), *(m[k]["buckets"] or "-" for k in METHODS[1:])]
            line += [report.mib(m[k]["peak_mem_bytes"]) for k in METHODS[1:]]
            body.append(line + ([report.mib(m[k]["sent_bytes_per_step"]) for k in METHODS[1:]] if cpu else []))
        report.table(
            "fastcoll ddp: memory and traffic" + where,
            ["model", "params", "grad MiB", "buckets torch", "buckets fastcoll", "peak MiB torch", "peak MiB fastcoll",
             *(("sent MiB torch", "sent MiB fastcoll") if cpu else ())],
            body,
            "peak: growth of the resident set (CUDA: max_memory_allocated) while the wrapper is built and runs its first "
            "steps, max over ranks; sent: bytes a rank wrote to its sockets in one step (/proc/self/io wchar)",
        )  # fmt: skip
        comm = [r for r in payload["results"] if r.get("collectives") == p and r["section"] == "comm_dtype"]
        if comm:
            body = []
            for r in comm:
                m, line = r["methods"], [name(r), report.fmt_time(r["methods"]["no_sync"]["median_s"])]
                for d, _ in COMM_DTYPES:
                    t, f = m[f"torch {d} hook"], m[f"fastcoll {d}"]
                    line += [report.fmt_time(t["median_s"]), report.fmt_time(f["median_s"]),
                             report.fmt_ratio(r["ratios"][f"fastcoll {d}/torch {d} hook"]),
                             f"{report.mib(t['sent_bytes_per_step'])}/{report.mib(f['sent_bytes_per_step'])}",
                             _grads_cell(r["grads"][f"fastcoll {d}"])]  # fmt: skip
                body.append(line)
            cols = ["model", "no_sync"] + [
                f"{c} {d}" for d, _ in COMM_DTYPES for c in ("torch hook", "fastcoll", "ratio", "sent MiB t/f", "grads")
            ]
            report.table("fastcoll ddp: comm_dtype vs torch DDP + compress hooks" + where, cols, body,
                         "ratio = fastcoll comm_dtype step / torch DDP + the same-dtype compress hook's (<1: fastcoll "
                         "faster); grads compared with a half-precision tolerance")  # fmt: skip


def run(args: Any) -> int:
    """``python -m fastcoll.bench ddp``: tables, ``benchmarks/out/ddp_<device>.json``, a chart; 1 if gradients differ."""
    device = args.device
    ws = 1 if device == "cuda" else 2
    cfg = runner.level_config(args, CONFIGS, ws, target=GPU_TARGET if device == "cuda" else CPU_TARGET)
    cases = build_cases(args.level)
    passes = collective_passes(ws)
    path = report.json_path(args, f"ddp_{device}")
    rows: List[Dict[str, Any]] = []
    status: Dict[str, Dict[str, Any]] = {}
    implementation = None
    units = sum(len(c.methods) * cfg["max_reps"] for c in cases) * len(passes)
    config = {**cfg, "models": [dataclasses.asdict(c.spec) for c in cases if c.section == "fp32" and not c.gabv],
              "methods": METHOD_DESCRIPTIONS,
              "step": "module.zero_grad(set_to_none=True); loss(wrapper(x)).backward()  (no optimizer step)",
              "targets": {"cpu": f"step <= {CPU_TARGET}x torch DDP and sync overhead <= torch DDP's",
                          "cuda": f"step <= {GPU_TARGET}x torch DDP"}}  # fmt: skip
    if passes != [None]:
        config.update(collective_passes=passes, passes=status, pass_descriptions={p: PASS_DESCRIPTIONS[p] for p in passes})
    with report.progress("ddp", units) as prog:
        for p in passes:
            try:
                env = {} if p is None else {"FASTCOLL_FORCE_COLLECTIVES": "1" if p == "forced" else "0"}
                result = runner.run_ranks(_ranks, {**cfg, "collectives": p, "env": env}, (cases,), ws, prog)
            except Exception as exc:
                if p is None:
                    raise
                status[p] = {"ok": False, "error": f"{type(exc).__name__}: {' '.join(str(exc).split())}"}
                report.say(f"[red]fastcoll.bench ddp: the '{p}' pass failed: {status[p]['error']}[/red]")
                continue
            implementation, rows = result["implementation"], rows + result["rows"]
            if p is not None:
                status[p] = {"ok": True}
                for r in result["rows"]:
                    r.update(collectives=p, label=r["label"] + PASS_SUFFIX[p])
    payload = {"benchmark": "ddp", "config": config, "implementation": implementation,
               "comm_dtype": {"supported": True, "measured": True}, "results": rows}  # fmt: skip
    print_results(payload)
    named = [(f"{r['label']}{' +view' if r['gradient_as_bucket_view'] else ''}: {k}", t)
             for r in rows for k, t in r.get("targets", {}).items()]  # fmt: skip
    bad = [r["label"] for r in rows for c in r["grads"].values() if not c["close"]]
    for label in bad:
        report.say(f"[red]warning: {label}: fastcoll's gradients differ from torch DDP's[/red]")
    report.conclude("ddp", path, payload, named)
    return 0 if not bad and all(s["ok"] for s in status.values()) else 1
