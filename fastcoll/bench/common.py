"""Shared benchmark machinery: timing, statistics, tables, JSON, charts, progress.

Every benchmark module (``fastcoll.bench.ops``, ``.ddp``, ``.dist``, ``.timeline``) uses these
helpers so their output looks the same and lands in the same place:

* :func:`measure` times a callable: on CPU with ``time.perf_counter``, on CUDA
  with ``torch.cuda.Event`` pairs on the current stream; each sample is
  ``inner`` back-to-back calls (calibrated so a sample is long enough to time),
  after ``warmup`` untimed calls. :func:`measure_interleaved` does the same for
  several callables round-robin, so that drift of a shared machine hits all of
  them alike.
* :func:`summarize` gives the median and interquartile range.
* :func:`render_table` prints a rich table (plain text without rich).
* :func:`write_json` writes ``benchmarks/out/<name>.json`` with the machine's
  description (:func:`machine_info`) attached.
* :func:`bar_chart` draws a PNG with matplotlib (skipped without it).
* :func:`progress` is a rich progress bar (silent when not on a terminal).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import queue
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

MiB = 1 << 20


# ---------------------------------------------------------------------------
# Paths and machine description
# ---------------------------------------------------------------------------


def repo_root() -> Path:
    """The checkout this package lives in (where ``benchmarks/`` is), else the working directory."""
    here = Path(__file__).resolve().parents[2]
    if (here / "benchmarks").is_dir():
        return here
    return Path.cwd()


def model_shapes() -> Dict[str, List[Tuple[str, Tuple[int, ...]]]]:
    """Parameter names and shapes, in registration order, of ResNet-50, GPT-2 small and BERT-base.

    Read from ``model_shapes.json`` shipped inside this package, so the
    benchmarks run from a clean clone or an installed wheel alike.
    """
    with open(Path(__file__).with_name("model_shapes.json")) as f:
        raw = json.load(f)
    return {k: [(name, tuple(shape)) for name, shape in v] for k, v in raw.items() if not k.startswith("_")}


def out_dir() -> Path:
    path = repo_root() / "benchmarks" / "out"
    path.mkdir(parents=True, exist_ok=True)
    return path


def resolve_json_path(args, default_name: str) -> Path:
    """``--json PATH`` if given, else ``benchmarks/out/<default_name>.json``."""
    path = getattr(args, "json", None)
    if path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        return p
    return out_dir() / f"{default_name}.json"


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover (macOS, Windows)
        return os.cpu_count() or 1


def thread_counts(args) -> List[int]:
    """The intra-op thread counts a CPU benchmark runs at: ``--threads N|all``, default 1 and all."""
    spec = getattr(args, "threads", None)
    every = available_cpus()
    if spec is None:
        return sorted({1, every})
    if str(spec) == "all":
        return [every]
    n = int(spec)
    if n < 1:
        raise SystemExit(f"--threads must be a positive integer or 'all', got {spec!r}")
    return [n]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # pragma: no cover
        pass
    return platform.processor() or platform.machine()


def machine_info(device: str = "cpu") -> Dict[str, object]:
    """What the numbers were measured on: recorded with every JSON result."""
    import fastcoll

    info: Dict[str, object] = {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpus_available": available_cpus(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "fastcoll_build": fastcoll.build_info(),
        "fastcoll_implementation": fastcoll.ops.implementation(),
    }
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["gpu_capability"] = f"{props.major}.{props.minor}"
    return info


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time_once(fn: Callable[[], object], inner: int, device: str) -> float:
    """Seconds per call over ``inner`` back-to-back calls."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / inner
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def calibrate(fn: Callable[[], object], device: str, target_s: float, max_inner: int = 10_000) -> int:
    """How many back-to-back calls make one sample last about ``target_s``."""
    synchronize(device)
    one = _time_once(fn, 1, device)
    if one >= target_s:
        return 1
    # time a few calls together: the first estimate of a very short call is mostly overhead
    probe = max(1, min(max_inner, int(target_s / max(one, 1e-7) / 4)))
    per_call = _time_once(fn, probe, device)
    return max(1, min(max_inner, int(math.ceil(target_s / max(per_call, 1e-9)))))


def measure(
    fn: Callable[[], object],
    device: str = "cpu",
    warmup: int = 3,
    reps: int = 10,
    inner: Optional[int] = None,
    target_s: float = 0.005,
) -> List[float]:
    """Per-call times in seconds, one per sample (``reps`` samples)."""
    return measure_interleaved({"fn": fn}, device, warmup, reps, inner, target_s)["fn"]


def measure_interleaved(
    fns: Dict[str, Callable[[], object]],
    device: str = "cpu",
    warmup: int = 3,
    reps: int = 10,
    inner: Optional[int] = None,
    target_s: float = 0.005,
    on_sample: Optional[Callable[[], None]] = None,
) -> Dict[str, List[float]]:
    """Time several callables round-robin: sample k of every callable is taken before sample k+1.

    Round k starts at the k-th callable (:func:`rotated`), so that each takes every position equally often.
    """
    inners = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        synchronize(device)
        inners[name] = inner or calibrate(fn, device, target_s)
    samples: Dict[str, List[float]] = {name: [] for name in fns}
    for k in range(reps):
        for name in rotated(fns, k):
            samples[name].append(_time_once(fns[name], inners[name], device))
            if on_sample is not None:
                on_sample()
    return samples


def rotated(names: Sequence[str], k: int) -> List[str]:
    """Round ``k``'s order: ``names`` rotated by ``k``, so every name takes every position equally often."""
    names = list(names)
    if not names:
        return names
    k %= len(names)
    return names[k:] + names[:k]


def keep_freed_memory() -> Optional[str]:
    """Make glibc keep freed heap memory (as a caching allocator would); returns what was set, None if not glibc.

    Every step drops its gradients (``zero_grad(set_to_none=True)``) and the
    next backward allocates them again: 97.5 MiB (ResNet-50 shapes) and
    475 MiB (GPT-2) per step. With glibc's defaults the freed memory goes back
    to the kernel (heap trimming, mmap for large blocks) and every step
    page-faults it in again: on the 2-core box that system time was over 40% of
    a run's CPU time and the largest source of noise, the same for every method. With
    the heap kept and no block mapped on its own (``M_MMAP_MAX`` 0: even
    GPT-2's 154 MB embedding gradient, above the largest mmap threshold glibc
    accepts, comes from the heap and is reused), a step page-faults nothing.
    CUDA's caching allocator does this for GPU memory anyway.
    """
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # pragma: no cover (not glibc)
        return None
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
    ok = mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1 and mallopt(M_MMAP_THRESHOLD, 32 * MiB) == 1
    ok = ok and mallopt(M_MMAP_MAX, 0) == 1
    return "glibc mallopt: M_TRIM_THRESHOLD 2 GiB, M_MMAP_THRESHOLD 32 MiB, M_MMAP_MAX 0" if ok else None


def summarize(samples: Sequence[float]) -> Dict[str, float]:
    """Median and interquartile range (seconds) of timing samples."""
    xs = sorted(samples)
    if len(xs) >= 2:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    else:
        q1 = q3 = xs[0]
    return {
        "median_s": statistics.median(xs),
        "q1_s": q1,
        "q3_s": q3,
        "iqr_s": q3 - q1,
        "min_s": xs[0],
        "n": len(xs),
    }


def bootstrap_ci(
    statistic: Callable[[Dict[str, List[float]]], Optional[float]],
    samples: Dict[str, Sequence[float]],
    level: float = 0.9,
    resamples: int = 2000,
    seed: int = 0,
    paired: bool = False,
) -> Optional[Tuple[float, float]]:
    """Percentile bootstrap interval of ``statistic`` over per-method timing samples.

    Each resample draws every method's samples with replacement (as many as it
    has) and evaluates ``statistic`` on them; the interval is the central
    ``level`` of those values. Seeded: the same samples give the same interval.
    ``paired``: the samples are rounds (sample k of every method taken in the
    same round, as :func:`measure_interleaved` takes them), and a resample
    draws rounds, keeping each round's samples together.

    Args:
        statistic: Maps ``{method: samples}`` to a number (for example a ratio of medians); None is skipped.
        samples: Timing samples per method (as many for each method when ``paired``).
        level: Coverage of the interval.
        resamples: Number of bootstrap resamples.
        seed: Seed of the resampling.
        paired: Resample whole rounds.

    Returns:
        ``(low, high)``, or None when ``statistic`` gave no value.
    """
    import random

    rng = random.Random(seed)
    rounds = {len(xs) for xs in samples.values()}
    if paired and len(rounds) > 1:
        raise ValueError(f"bootstrap_ci(paired=True): the methods have different sample counts {sorted(rounds)}")
    values = []
    for _ in range(resamples):
        if paired:
            picks = [rng.randrange(n) for n in rounds for _ in range(n)]
            drawn = {m: [xs[k] for k in picks] for m, xs in samples.items()}
        else:
            drawn = {m: [xs[rng.randrange(len(xs))] for _ in xs] for m, xs in samples.items()}
        v = statistic(drawn)
        if v is not None:
            values.append(v)
    if not values:
        return None
    values.sort()
    tail = (1.0 - level) / 2
    return values[int(tail * (len(values) - 1))], values[int(math.ceil((1.0 - tail) * (len(values) - 1)))]


def interval_fields(ci: Optional[Tuple[float, float]], threshold: float) -> Dict[str, Any]:
    """A "lower is better" target's ``ci90`` and ``resolved`` (the interval lies on one side of the threshold)."""
    if ci is None:
        return {"ci90": None, "resolved": False}
    return {"ci90": list(ci), "resolved": ci[1] <= threshold or ci[0] > threshold}


def count_cuda_kernels(fn: Callable[[], object]) -> List[str]:
    """Names of the CUDA kernels one call of ``fn`` launches (memcpy/memset excluded)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [
        e.name
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))
    ]


# ---------------------------------------------------------------------------
# Formatting and output
# ---------------------------------------------------------------------------


def fmt_time(seconds: Optional[float]) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"


def fmt_ratio(x: Optional[float]) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.2f}x"


def pass_miss(ok: Optional[bool]) -> str:
    if ok is None:
        return ""
    return "[green]PASS[/green]" if ok else "[red]MISS[/red]"


def _console():
    try:
        from rich.console import Console
    except ImportError:
        return None
    console = Console()
    if not console.is_terminal:  # piped or captured: do not squeeze wide tables into 80 columns
        console = Console(width=max(console.width, 200))
    return console


def render_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[str]], caption: str = "") -> None:
    """Print a table with rich (markup such as ``[green]PASS[/green]`` allowed), or as plain text."""
    rows = [list(map(str, r)) for r in rows]
    console = _console()
    if console is not None:
        from rich.table import Table

        table = Table(title=title, caption=caption or None, show_lines=False)
        for i, c in enumerate(columns):
            table.add_column(c, justify="left" if i == 0 else "right", no_wrap=True)
        for r in rows:
            table.add_row(*r)
        console.print(table)
        return
    import re

    strip = lambda s: re.sub(r"\[/?[a-z ]+\]", "", s)  # noqa: E731
    rows = [[strip(c) for c in r] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
    print(title)
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    if caption:
        print(caption)


def say(message: str) -> None:
    """Print a line (rich markup allowed)."""
    console = _console()
    if console is not None:
        console.print(message)
    else:  # pragma: no cover
        import re

        print(re.sub(r"\[/?[a-z ]+\]", "", message))


def write_json(path: Path, payload: Dict[str, object], device: str = "cpu") -> Path:
    """Write ``payload`` plus a ``machine`` description as indented JSON; return the path."""
    data = {"machine": machine_info(device), **payload}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.write("\n")
    return path


def bar_chart(
    path: Path,
    title: str,
    panels: Dict[str, Dict[str, Dict[str, float]]],
    ylabel: str,
    reference_line: Optional[float] = None,
) -> Optional[Path]:
    """Grouped bars: ``panels[panel][group][series] = value``, one subplot per panel.

    Returns the PNG path, or None when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    n = len(panels)
    if n == 0:
        return None
    groups_max = max(len(p) for p in panels.values())
    fig, axes = plt.subplots(n, 1, figsize=(max(8, 0.9 * groups_max + 3), 3.6 * n), squeeze=False)
    for ax, (panel, groups) in zip(axes[:, 0], panels.items()):
        names = list(groups)
        series = []
        for g in groups.values():
            for s in g:
                if s not in series:
                    series.append(s)
        width = 0.8 / max(1, len(series))
        for k, s in enumerate(series):
            xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(names))]
            ys = [groups[g].get(s, float("nan")) for g in names]
            ax.bar(xs, ys, width=width, label=s.lstrip("_"))  # matplotlib hides labels starting with "_"
        if reference_line is not None:
            ax.axhline(reference_line, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_yscale("log")
        ax.set_title(panel, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.suptitle(title)
    fig.legend(handles, labels, loc="center right", fontsize=8)
    fig.tight_layout(rect=(0, 0, 0.86, 0.97))
    return save_figure(fig, path)


def save_figure(fig: Any, path: Path) -> Path:
    """Write a matplotlib figure as a PNG at ``path`` (its folder made), close it, and return the path."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


class _NoProgress:
    def advance(self, n: int = 1) -> None:
        pass

    def describe(self, text: str) -> None:
        pass


class _RichProgress:
    def __init__(self, progress, task):
        self._progress, self._task = progress, task

    def advance(self, n: int = 1) -> None:
        self._progress.advance(self._task, n)

    def describe(self, text: str) -> None:
        self._progress.update(self._task, description=text)


@contextlib.contextmanager
def progress(total: int, description: str) -> Iterator[object]:
    """A rich progress bar with ``advance()`` and ``describe(text)``; a no-op off a terminal."""
    console = _console()
    if console is None or not console.is_terminal or total <= 0:
        yield _NoProgress()
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task(description, total=total)
        yield _RichProgress(bar, task)


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    """Run a block with ``torch.set_num_threads(n)``, restoring the previous count."""
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


# ---------------------------------------------------------------------------
# Rank processes of the multi-rank benchmarks (ddp, dist, timeline)
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def rank_process_group(rank: int, world_size: int, store_path: str, threads: int, backend: str = "gloo", timeout_s: int = 600):
    """Inside a spawned benchmark rank: set its threads, join the group over a FileStore, tear it down after."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield
    finally:
        dist.destroy_process_group()


def save_rank_rows(rank: int, out_path: str, rows: List[Dict[str, Any]]) -> None:
    """Rank 0 writes the measured rows (and which op implementation ran) for the parent to read."""
    if rank != 0:
        return
    from .. import ops

    with open(out_path, "w") as f:
        json.dump({"rows": rows, "implementation": ops.implementation()}, f)


def rank_ticker(rank: int, progress_q: Any) -> Callable[[int], None]:
    """A rank worker's progress callback: rank 0 reports ``n`` finished units to the parent's bar (:func:`follow_ranks`)."""

    def tick(n: int) -> None:
        if rank == 0 and progress_q is not None:
            progress_q.put(("advance", n))

    return tick


def follow_ranks(ctx: Any, progress_q: Any, bar: Any) -> None:
    """Wait for the rank processes of ``ctx`` (``torch.multiprocessing.spawn(join=False)``), moving ``bar`` as they report.

    Ranks put ``("advance", n)`` or ``("describe", text)`` on ``progress_q``.
    """
    done = False
    while not done:
        done = ctx.join(timeout=0.2)
        drain_progress(progress_q, bar)


def drain_progress(progress_q: Any, bar: Any) -> None:
    """Apply every report the ranks have queued so far (``("advance", n)`` or ``("describe", text)``) to ``bar``."""
    while True:
        try:
            what, value = progress_q.get_nowait()
        except queue.Empty:
            return
        if what == "advance":
            bar.advance(value)
        else:
            bar.describe(value)


def ddp_supports(arguments: Sequence[str] = (), methods: Sequence[str] = ()) -> bool:
    """Whether this checkout's ``fastcoll.DDP`` takes ``arguments`` and has ``methods`` (newer benchmarks skip otherwise)."""
    import inspect

    import fastcoll

    try:
        params = inspect.signature(fastcoll.DDP).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False
    return all(a in params for a in arguments) and all(hasattr(fastcoll.DDP, m) for m in methods)
