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
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

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
PASS_DESCRIPTIONS = {
    "plain": "FASTCOLL_FORCE_COLLECTIVES=0: at world size 1 fastcoll.DDP issues no collective, torch DDP does",
    "forced": "FASTCOLL_FORCE_COLLECTIVES=1: fastcoll.DDP issues its all-reduces and broadcasts as at any world size",
}
CONFIGS = {  # rounds: reps..max_reps, until the step target resolves
    "smoke": dict(reps=2, max_reps=2, setup_steps=3, target_s=0.0, max_inner=1),
    "default": dict(reps=5, max_reps=15, setup_steps=3, target_s=0.03, max_inner=50),
    "full": dict(reps=15, max_reps=30, setup_steps=3, target_s=0.1, max_inner=200),
}
#: One row: its section ("fp32" or "comm_dtype"), a model, a gradient_as_bucket_view setting and the methods timed side by side.
Case = NamedTuple("Case", [("section", str), ("spec", ModelSpec), ("gabv", bool), ("methods", Tuple[str, ...])])


def build_cases(level: str) -> List[Case]:
    """The rows: every model without and with bucket view (default: bucket view on the MLP and ResNet-50 shapes only)."""
    M = models
    if level == "smoke":  # the encoder is covered by the comm_dtype section when there is one
        specs, view, comm = [M.SMOKE_MLP, M.SMOKE_CONVBN, M.SMOKE_RESNET50], {M.SMOKE_MLP.name}, [M.SMOKE_ENCODER]
    else:
        specs = [M.MLP96, M.CONVBN, M.ENCODER, M.RESNET50, M.GPT2]
        view = {s.name for s in specs} if level == "full" else {"mlp96", "resnet50"}
        comm = specs[:4] if level == "full" else [M.ENCODER, M.RESNET50]
    cases = [Case("fp32", s, g, METHODS) for s in specs for g in (False, True) if not g or s.name in view]
    return cases + [Case("comm_dtype", s, False, COMM_METHODS) for s in comm]


def collective_passes(world_size: int) -> List[Optional[str]]:
    """``[None]`` with 2+ ranks; at 1 rank both passes, or the one FASTCOLL_FORCE_COLLECTIVES names."""
    if world_size > 1:
        return [None]
    value = os.environ.get("FASTCOLL_FORCE_COLLECTIVES")
    return ["plain", "forced"] if value is None else ["plain" if value.strip() in ("", "0") else "forced"]


# Inside the ranks
def make_wrapper(method: str, module: nn.Module, gabv: bool, device: str) -> nn.Module:
    """The wrapper of ``method`` (torch DDP for no_sync, with a compress hook for "torch fp16 hook" and the like)."""
    kind, name = (method.split() + [""])[:2]
    if method == "no_sync" or kind == "torch":
        wrapper = runner.wrap("torch", module, device, gradient_as_bucket_view=gabv)
        if name:  # renamed: torch refuses bf16 by name on CPU
            hook = default_hooks.fp16_compress_hook if name == "fp16" else default_hooks.bf16_compress_hook
            wrapper.register_comm_hook(None, lambda state, bucket: hook(state, bucket))
        return wrapper
    comm = {"comm_dtype": dict(COMM_DTYPES)[name]} if name else {}
    return runner.wrap("fastcoll", module, device, gradient_as_bucket_view=gabv, **comm)


def sync_ratio(samples: stats.Samples) -> Optional[float]:
    """fastcoll's sync overhead (median step - no_sync's) over torch DDP's; None unless torch's is positive."""
    floor, torch_step, mine = (stats.summarize(samples[m])["median_s"] for m in ("no_sync", "torch", "fastcoll"))
    return (mine - floor) / (torch_step - floor) if torch_step - floor > 0 else None


def bench_case(case: Case, me: runner.Rank) -> Dict[str, Any]:
    """Set up every method of ``case`` on shared weights (memory, traffic, buckets), check the gradients, time them;
    the row with per-method summaries, sync overheads, ratios and (fp32 rows) the targets."""
    cfg, device, spec, fp32 = me.cfg, me.device, case.spec, case.section == "fp32"
    storage, x = models.build_storage(spec, device), models.make_input(spec, me.rank, device)
    wrappers, steps, info, probe = {}, {}, {}, runner.MemoryProbe(device)
    for method in case.methods:
        module = models.build_model(spec, device, storage)
        probe.start()
        wrappers[method] = wrapper = make_wrapper(method, module, case.gabv, device)
        steps[method] = step = models.backward_step(spec, wrapper, x, no_sync=method == "no_sync")
        runner.run_steps(step, cfg["setup_steps"] - 1)  # bucket rebuilds happen here
        one, sent = runner.bytes_sent(lambda: runner.time_calls(step, 1, device))
        # torch DDP's buckets: from its logging data, after the rebuild
        info[method] = {"peak_mem_bytes": probe.peak(), "sent_bytes_per_step": sent if device == "cpu" else None,
                        "buckets": len(wrapper.bucket_info()) if method.startswith("fastcoll") else
                        len(runner.torch_bucket_sizes(wrapper, "rebuilt_bucket_sizes", "bucket_sizes") or []) or None,
                        "setup_step_s": one}  # fmt: skip
    # every instance ran the same steps from the same state on the same inputs
    pairs = [("fastcoll", "torch")] if fp32 else [(f"fastcoll {d}", f"torch {d} hook") for d, _ in COMM_DTYPES]
    checks = {a: models.compare_grads(wrappers[a].module, wrappers[b].module, 1e-5 if fp32 else 1e-2) for a, b in pairs}
    inner = me.inner(max(i["setup_step_s"] for i in info.values()))
    goal = [(stats.median_ratio("fastcoll", "torch"), cfg["target"], "le")] if fp32 else []
    samples, _ = runner.timed_rounds(steps, inner, cfg["reps"], cfg["max_reps"], goal, device, me.tick)
    for k in ("peak_mem_bytes", "sent_bytes_per_step"):  # the most of any rank
        for m, v in zip(case.methods, runner.all_max([float(info[m][k] or 0) for m in case.methods], device)):
            info[m][k] = None if info[m][k] is None else int(v)
    params = [p for p in wrappers[case.methods[-1]].module.parameters() if p.requires_grad]
    del wrappers, steps, storage
    gc.collect()
    med = {m: stats.summarize(s)["median_s"] for m, s in samples.items()}
    sync = {m: None if m == "no_sync" else med[m] - med["no_sync"] for m in samples}
    row = {"section": case.section, "model": spec.name, "label": spec.label, "synthetic": spec.synthetic,
           "gradient_as_bucket_view": case.gabv, "params": len(params), "numel": sum(p.numel() for p in params),
           "inner": inner, "samples": samples, "grads": checks,
           "methods": {m: {**stats.summarize(s), **info[m], "sync_overhead_s": sync[m]} for m, s in samples.items()}}  # fmt: skip
    if not fp32:
        row["ratios"] = {f"fastcoll {d}/torch {d} hook": stats.ratio(med[f"fastcoll {d}"], med[f"torch {d} hook"])
                         for d, _ in COMM_DTYPES}  # fmt: skip
        return row
    step_target = stats.ratio_target(samples, "fastcoll", "torch", cfg["target"])
    row["ratios"] = {"fastcoll/torch": step_target["value"], "sync fastcoll/torch": sync_ratio(samples),
                     "no_sync/torch": stats.ratio(med["no_sync"], med["torch"])}  # fmt: skip
    row["targets"] = {"step": step_target}
    if cfg["device"] == "cpu":
        ci = stats.bootstrap_ci(sync_ratio, samples, paired=True) if len(samples["torch"]) > 2 else None
        row["targets"]["sync"] = stats.target(sync_ratio(samples), 1.0, ci, "le", "90% bootstrap (rounds)")
    return row


def _ranks(me: runner.Rank, cases: List[Case]) -> Dict[str, Any]:
    if me.cfg["level"] != "smoke":  # one-time costs of every wrapper, on a tiny model
        x = models.make_input(models.WARMUP, me.rank, me.device)
        for method in METHODS:
            wrapper = make_wrapper(method, models.build_model(models.WARMUP, me.device), False, me.device)
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
    verdict = "[green]close[/green]" if check["close"] else "[red]DIFFER[/red]"
    return "[green]equal[/green]" if check["equal"] else f"{verdict} ({check['max_abs_diff']:.1e})"


def _comm_cells(row: Dict[str, Any], d: str) -> List[str]:
    torch_hook, mine = row["methods"][f"torch {d} hook"], row["methods"][f"fastcoll {d}"]
    return [report.fmt_time(torch_hook["median_s"]), report.fmt_time(mine["median_s"]),
            report.fmt_ratio(row["ratios"][f"fastcoll {d}/torch {d} hook"]),
            f"{report.mib(torch_hook['sent_bytes_per_step'])}/{report.mib(mine['sent_bytes_per_step'])}",
            _grads_cell(row["grads"][f"fastcoll {d}"])]  # fmt: skip


def print_results(payload: Dict[str, Any]) -> None:
    """The step-time table, the memory/traffic table and the comm_dtype table, per pass."""
    cfg, fmt_time, mib = payload["config"], report.fmt_time, report.mib
    cpu = cfg["device"] == "cpu"
    for p in cfg.get("collective_passes") or [None]:
        rows = [r for r in payload["results"] if r.get("collectives") == p and r["section"] == "fp32"]
        comm = [r for r in payload["results"] if r.get("collectives") == p and r["section"] == "comm_dtype"]
        where = f" ({cfg['device']}{'' if p is None else ', ' + p})"
        name = lambda r: r["label"] + (" *" if r["synthetic"] else "") + (" +view" if r["gradient_as_bucket_view"] else "")  # noqa: E731
        body = [[name(r), *(fmt_time(r["methods"][k]["median_s"]) for k in METHODS),
                 *(report.fmt_signed_time(r["methods"][k]["sync_overhead_s"]) for k in METHODS[1:]),
                 _grads_cell(r["grads"]["fastcoll"]), report.target_cell(r["targets"]["step"]),
                 report.target_cell(r["targets"].get("sync"))] for r in rows]  # fmt: skip
        report.table("fastcoll ddp: fastcoll.DDP vs torch DDP, step time" + where,
                     ["model", "no_sync", "torch DDP", "fastcoll", "sync torch", "sync fastcoll", "grads",
                      f"step fastcoll/torch (≤{cfg['target']}x)", "sync fastcoll/torch (≤1x)"], body,
                     f"{cfg['world_size']} {cfg['backend']} rank(s), {cfg['threads']} thread(s) each; median step of the slowest "
                     "rank (zero_grad + forward + backward, no optimizer), rounds interleaved; 90% paired bootstrap intervals. "
                     "no_sync: the compute floor; sync = step - no_sync; +view: gradient_as_bucket_view. * synthetic: parameters "
                     "of the model's shapes, one read each, so the step is mostly gradient synchronization.")  # fmt: skip
        keys = ("buckets", "peak_mem_bytes") + (("sent_bytes_per_step",) if cpu else ())
        body = [[name(r), r["params"], mib(4 * r["numel"]),
                 *((r["methods"][m][k] or "-") if k == "buckets" else mib(r["methods"][m][k]) for k in keys for m in METHODS[1:])]
                for r in rows]  # fmt: skip
        report.table("fastcoll ddp: memory and traffic" + where,
                     ["model", "params", "grad MiB", "buckets torch", "buckets fastcoll", "peak MiB torch", "peak MiB fastcoll",
                      *(("sent MiB torch", "sent MiB fastcoll") if cpu else ())], body,
                     "peak: growth of the resident set (CUDA: max_memory_allocated) while the wrapper is built and runs its "
                     "first steps, max over ranks; sent: bytes a rank wrote to its sockets in one step (/proc/self/io "
                     "wchar)")  # fmt: skip
        if comm:
            body = [[name(r), fmt_time(r["methods"]["no_sync"]["median_s"]),
                     *(c for d, _ in COMM_DTYPES for c in _comm_cells(r, d))] for r in comm]  # fmt: skip
            cols = [f"{c} {d}" for d, _ in COMM_DTYPES for c in ("torch hook", "fastcoll", "ratio", "sent MiB t/f", "grads")]
            report.table("fastcoll ddp: comm_dtype vs torch DDP + compress hooks" + where, ["model", "no_sync", *cols], body,
                         "ratio = fastcoll comm_dtype step / torch DDP + the same-dtype compress hook's (<1: fastcoll "
                         "faster); grads compared with a half-precision tolerance")  # fmt: skip


def run(args: Any) -> int:
    """``python -m fastcoll.bench ddp``: tables, ``benchmarks/out/ddp_<device>.json``, a chart; 1 if gradients differ."""
    device, ws = args.device, 1 if args.device == "cuda" else 2
    cfg = runner.level_config(args, CONFIGS, ws, target=GPU_TARGET if device == "cuda" else CPU_TARGET)
    cases, passes = build_cases(args.level), collective_passes(ws)
    rows, status, implementation = [], {}, None
    config = {**cfg, "models": [dataclasses.asdict(c.spec) for c in cases if c.section == "fp32" and not c.gabv],
              "methods": METHOD_DESCRIPTIONS,
              "step": "module.zero_grad(set_to_none=True); loss(wrapper(x)).backward()  (no optimizer step)",
              "targets": {"cpu": f"step <= {CPU_TARGET}x torch DDP and sync overhead <= torch DDP's",
                          "cuda": f"step <= {GPU_TARGET}x torch DDP"}}  # fmt: skip
    if passes != [None]:
        config.update(collective_passes=passes, passes=status, pass_descriptions={p: PASS_DESCRIPTIONS[p] for p in passes})
    with report.progress("ddp", sum(len(c.methods) * cfg["max_reps"] for c in cases) * len(passes)) as prog:
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
                    r.update(collectives=p, label=r["label"] + (" [comm forced]" if p == "forced" else ""))
    payload = {"benchmark": "ddp", "config": config, "implementation": implementation,
               "comm_dtype": {"supported": True, "measured": True}, "results": rows}  # fmt: skip
    print_results(payload)
    named = [(f"{r['label']}{' +view' if r['gradient_as_bucket_view'] else ''}: {k}", t)
             for r in rows for k, t in r.get("targets", {}).items()]  # fmt: skip
    bad = [r["label"] for r in rows for c in r["grads"].values() if not c["close"]]
    for label in bad:
        report.say(f"[red]warning: {label}: fastcoll's gradients differ from torch DDP's[/red]")
    report.conclude("ddp", report.json_path(args, f"ddp_{device}"), payload, named)
    return 0 if not bad and all(s["ok"] for s in status.values()) else 1
