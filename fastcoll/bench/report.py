"""Output of the benchmarks: terminal tables (rich), progress with the time left, JSON and PNG charts.

Every table a benchmark prints goes through :func:`table` and every summary line through :func:`say`; both are recorded,
and :func:`write_json` stores them with the results (``"tables"``, ``"notes"``), so that
``benchmarks/render_results.py`` renders the same tables as Markdown without recomputing anything.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import re
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

import fastcoll

from .stats import MET, MISSED, UNRESOLVED, count_verdicts

MiB = 1 << 20
#: Version of the JSON layout: 2 adds ``version``, ``tables`` and ``notes``, and a ``verdict`` in every target.
JSON_VERSION = 2
_RECORD: Dict[str, List[Any]] = {"tables": [], "notes": []}


# Paths and the machine
def repo_root() -> Path:
    """The checkout this package lives in (where ``benchmarks/`` is), else the working directory."""
    here = Path(__file__).resolve().parents[2]
    return here if (here / "benchmarks").is_dir() else Path.cwd()


def json_path(args: Any, name: str) -> Path:
    """``--json PATH`` if given, else ``benchmarks/out/<name>.json`` (its folder made)."""
    path = Path(args.json) if args.json else repo_root() / "benchmarks" / "out" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def section_json_path(args: Any, benchmark: str, section: str, device: str) -> Path:
    """Where a section of ``benchmark`` writes: ``benchmarks/out/<benchmark>_<section>_<device>.json``; with
    ``--json PATH``, PATH when the section runs alone (command ``<benchmark>_<section>``), else
    ``<stem>_<section>.json`` beside the benchmark's own file."""
    p = json_path(args, f"{benchmark}_{section}_{device}")
    if not args.json or args.command == f"{benchmark}_{section}":
        return p
    return p.with_name(f"{p.stem}_{section}{p.suffix or '.json'}")


def available_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover (macOS, Windows)
        return os.cpu_count() or 1


def cpu_model() -> str:
    """The CPU's model name."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_info(device: str = "cpu") -> Dict[str, object]:
    """What the numbers were measured on: recorded with every JSON result."""
    load = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None  # how busy the machine was
    info: Dict[str, object] = {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "hostname": platform.node(),
        "platform": platform.platform(), "python": platform.python_version(), "cpu": cpu_model(),
        "cpus_available": available_cpus(), "load_average": load, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "fastcoll_build": fastcoll.build_info(), "fastcoll_implementation": fastcoll.ops.implementation(),
    }  # fmt: skip
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1))
        info["gpu_capability"] = f"{props.major}.{props.minor}"
    return info


# Formatting
def fmt_time(seconds: Optional[float]) -> str:
    """``1.23 s``, ``4.56 ms`` or ``7.8 µs``; ``-`` when missing."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if abs(seconds) >= 1:
        return f"{seconds:.2f} s"
    if abs(seconds) >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"


def fmt_signed_time(seconds: Optional[float]) -> str:
    """:func:`fmt_time` with a sign."""
    return "-" if seconds is None else ("-" if seconds < 0 else "+") + fmt_time(abs(seconds))


def fmt_ratio(x: Optional[float]) -> str:
    """``1.23x``; ``-`` when missing."""
    return "-" if x is None or not math.isfinite(x) else f"{x:.2f}x"


def fmt_pct(x: Optional[float]) -> str:
    """``+1.2%``; ``-`` when missing."""
    return "-" if x is None or not math.isfinite(x) else f"{x * 100:+.1f}%"


def mib(nbytes: Optional[float]) -> str:
    """Bytes in MiB, two decimals below 10 MiB; ``-`` when missing."""
    return "-" if nbytes is None else f"{nbytes / MiB:.{1 if abs(nbytes) >= 10 * MiB or nbytes == 0 else 2}f}"


def per_rank_mib(values: Optional[Sequence[Optional[float]]]) -> str:
    """``a / b`` in MiB, one per rank; ``-`` when any is missing."""
    return "-" if not values or any(v is None for v in values) else " / ".join(mib(v) for v in values)


def pass_miss(ok: Optional[bool]) -> str:
    """PASS / MISS in colour (empty when not measured)."""
    return "" if ok is None else "[green]PASS[/green]" if ok else "[red]MISS[/red]"


def verdict_cell(t: Optional[Dict[str, Any]]) -> str:
    """A target's verdict in colour (``-`` without a target)."""
    if t is None:
        return "-"
    colour = {MET: "green", MISSED: "red", UNRESOLVED: "yellow"}.get(t["verdict"], "dim")
    return f"[{colour}]{t['verdict']}[/{colour}]"


def target_cell(t: Optional[Dict[str, Any]], fmt: Any = fmt_ratio) -> str:
    """A target's value, its interval and its verdict in one cell."""
    if t is None:
        return "-"
    ci = t.get("ci90")
    span = f" ({fmt(ci[0])}..{fmt(ci[1])})" if ci else ""
    return f"{fmt(t['value'])}{span} {verdict_cell(t)}"


def strip_markup(text: str) -> str:
    """``text`` without rich's ``[green]...[/green]`` markup."""
    return re.sub(r"\[/?[a-z ]+\]", "", text)


# Terminal output (recorded for the JSON)
def _console() -> Any:
    try:
        from rich.console import Console
    except ImportError:  # pragma: no cover
        return None
    console = Console()
    if not console.is_terminal:  # piped or captured: do not squeeze wide tables into 80 columns
        console = Console(width=max(console.width, 200))
    return console


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], caption: str = "") -> None:
    """Print a table with rich (markup such as ``[green]PASS[/green]`` allowed) and record it for the JSON."""
    rows = [[str(c) for c in r] for r in rows]
    _RECORD["tables"].append(
        {"title": title, "columns": list(columns), "rows": [[strip_markup(c) for c in r] for r in rows], "caption": caption}
    )
    console = _console()
    if console is None:  # pragma: no cover
        print(title, *("  ".join(strip_markup(c) for c in r) for r in [list(columns), *rows]), caption, sep="\n")
        return
    from rich.table import Table

    out = Table(title=title, caption=caption or None)
    for i, c in enumerate(columns):
        out.add_column(c, justify="left" if i == 0 else "right", no_wrap=True)
    for r in rows:
        out.add_row(*r)
    console.print(out)


def say(message: str, record: bool = True) -> None:
    """Print a line (rich markup allowed); recorded for the JSON unless ``record`` is False."""
    if record:
        _RECORD["notes"].append(strip_markup(message))
    console = _console()
    console.print(message) if console is not None else print(strip_markup(message))  # pragma: no branch


def targets_table(title: str, targets: Sequence[Dict[str, Any]], caption: str = "") -> None:
    """A table of targets that carry ``what`` (:func:`fastcoll.bench.stats.target`): value, interval, verdict."""
    fmt = lambda v: "-" if v is None else f"{v:.4g}"  # noqa: E731
    body = [[t["what"], target_cell(t, fmt), f"{'<=' if t['op'] == 'le' else '>='} {t['threshold']:.4g}", t["interval"]]
            for t in targets]  # fmt: skip
    table(title, ["target", "value (interval) verdict", "target", "interval"], body, caption)


def conclude(name: str, path: Path, payload: Dict[str, Any], named: Sequence[Tuple[str, Dict[str, Any]]] = ()) -> Path:
    """The end of a benchmark: a line of the verdict counts of ``named`` ((where, target) pairs) and one per target not
    met; the JSON at ``path`` (``payload`` with the machine, the layout version, and the tables and notes printed since
    the last one); the targets' chart beside it."""
    counts = count_verdicts(t for _, t in named)
    if named:
        say(f"[bold]{name} targets (reported, never asserted):[/bold] {counts[MET]} met, {counts[MISSED]} missed, "
            f"{counts[UNRESOLVED]} not resolved")  # fmt: skip
    for w, t in named:
        if t["verdict"] != MET:
            say(f"  {w}: {target_cell(t, lambda v: '-' if v is None else f'{v:.3g}')} (target {t['op']} {t['threshold']})")
    device = payload.get("config", {}).get("device", "cpu")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": JSON_VERSION, "machine": machine_info(device), **payload, **_RECORD}, indent=1,
                               default=str) + "\n")  # fmt: skip
    _RECORD["tables"], _RECORD["notes"] = [], []
    png = targets_chart(path.with_suffix(".png"), f"fastcoll {name} ({device}): targets", named)
    say(f"wrote {path}" + (f" and {png}" if png else ""), record=False)
    return path


# Progress, with the time left
class Progress:
    """Units of work done out of ``total``; a line per finished row with the time left in this benchmark.

    The estimate is the elapsed time per unit so far times the units left. On a terminal a rich bar shows the same (with
    its own estimate) between rows.
    """

    def __init__(self, name: str, total: int, bar: Any = None, task: Any = None):
        self.name, self.total, self.done, self.rows = name, max(1, total), 0, 0
        self.started, self._bar, self._task = time.perf_counter(), bar, task

    def advance(self, n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)

    def describe(self, text: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=text)

    def left_s(self) -> Optional[float]:
        """Seconds left by the rate so far (None before any unit is done)."""
        spent = time.perf_counter() - self.started
        return spent / self.done * (self.total - self.done) if self.done else None

    def row(self, label: str, rows: Optional[int] = None) -> None:
        """Report a finished row: its number, the time so far, and the estimate of the time left."""
        self.rows += 1
        left = self.left_s()
        of = f"/{rows}" if rows else ""
        say(f"[dim]{self.name}: row {self.rows}{of} done ({label}); {time.perf_counter() - self.started:.0f} s so far, "
            f"about {'?' if left is None else f'{left:.0f} s'} left[/dim]", record=False)  # fmt: skip

    def apply(self, what: str, value: Any) -> None:
        """A report from a rank process (:meth:`fastcoll.bench.runner.Rank.tick` and the like)."""
        {"advance": self.advance, "describe": self.describe, "row": lambda v: self.row(*v)}[what](value)


@contextlib.contextmanager
def progress(name: str, total: int) -> Iterator[Progress]:
    """A :class:`Progress` for one benchmark, with a rich bar (estimated time left) on a terminal."""
    console = _console()
    if console is None or not console.is_terminal:
        yield Progress(name, total)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    from rich.progress import Progress as Bar

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn())
    with Bar(*columns, console=console, transient=True) as bar:
        yield Progress(name, total, bar, bar.add_task(name, total=max(1, total)))


# Charts
def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return None
    return plt


def save_figure(fig: Any, path: Path) -> Path:
    """Write a matplotlib figure as a PNG at ``path`` (its folder made), close it, and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def targets_chart(path: Path, title: str, named: Sequence[Tuple[str, Dict[str, Any]]]) -> Optional[Path]:
    """A bar per target: its value over its threshold (the dashed line), its 90% interval, its verdict's colour.

    Targets without a numeric non-zero threshold (a margin against 0, a launch count) are left out. Returns the PNG
    path, or None without matplotlib or such targets.
    """
    plt = pyplot()
    rows = [(w, t) for w, t in named if isinstance(t["value"], (int, float)) and isinstance(t["threshold"], (int, float))
            and t["threshold"]]  # fmt: skip
    if plt is None or not rows:
        return None
    fig, ax = plt.subplots(figsize=(10, 0.28 * len(rows) + 1.4))
    for i, (_, t) in enumerate(rows):
        v, ci = t["value"] / t["threshold"], [c / t["threshold"] for c in t.get("ci90") or ()]
        err = [[max(0.0, v - min(ci))], [max(0.0, max(ci) - v)]] if ci else None
        colour = {MET: "tab:green", MISSED: "tab:red", UNRESOLVED: "tab:orange"}.get(t["verdict"], "tab:gray")
        ax.barh(i, v, color=colour, xerr=err, capsize=2)
    ax.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{w} ({'≤' if t['op'] == 'le' else '≥'})" for w, t in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("value / threshold (green: met, red: missed, orange: not resolved; whiskers: 90% interval)")
    ax.grid(axis="x", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)
