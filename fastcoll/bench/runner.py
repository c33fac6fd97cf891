"""Running the benchmarks: timing, memory and traffic probes, and the multi-rank runner (:func:`run_ranks`).

Inside a rank process, :class:`Rank` has the configuration and reports progress; :func:`all_max` makes a sample the
slowest rank's, :func:`gather` collects every rank's result and :func:`timed_rounds` takes the samples; a training
method (:class:`Built`) has its memory measured by :func:`memory_phase` and its step timed by :func:`optimizer_rounds`.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import gc
import json
import math
import multiprocessing as mp
import os
import queue
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from torch.nn.parallel import DistributedDataParallel

import fastcoll

from .. import ops
from . import report
from .stats import enough_rounds, rotated


# Timing
def synchronize(device: str) -> None:
    """Wait for the GPU's queued work (a no-op on CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


def time_calls(fn: Callable[[], object], inner: int, device: str, wall: bool = False) -> float:
    """Seconds per call over ``inner`` back-to-back calls (CUDA: events on the current stream; ``wall``: the clock)."""
    if device == "cuda" and not wall:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / inner
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    synchronize(device)
    return (time.perf_counter() - t0) / inner


def inner_for(per_call_s: float, target_s: float, max_inner: int) -> int:
    """Back-to-back calls that make a sample last about ``target_s`` (1 when ``target_s`` is 0)."""
    return 1 if target_s <= 0 else max(1, min(max_inner, int(math.ceil(target_s / max(per_call_s, 1e-9)))))


def calibrate(fn: Callable[[], object], device: str, target_s: float, max_inner: int = 10_000) -> int:
    """How many back-to-back calls make one sample last about ``target_s``."""
    synchronize(device)
    one = time_calls(fn, 1, device)
    if one >= target_s:
        return 1
    probe = inner_for(one * 4, target_s, max_inner)  # a few calls together: one short call is mostly overhead
    return inner_for(time_calls(fn, probe, device), target_s, max_inner)


def measure_interleaved(
    fns: Dict[str, Callable[[], object]], device: str = "cpu", warmup: int = 3, reps: int = 10, inner: Optional[int] = None,
    target_s: float = 0.005, on_sample: Optional[Callable[[], None]] = None,
    stop: Optional[Callable[[Dict[str, List[float]], int], bool]] = None, before: Optional[Callable[[str], None]] = None,
    after: Optional[Callable[[str], None]] = None, cpu: Optional[Dict[str, List[float]]] = None, wall: bool = False,
) -> Dict[str, List[float]]:  # fmt: skip
    """Per-call seconds of several callables, taken round-robin (round k starts at the k-th callable).

    Args:
        fns: The callables by name; each first runs ``warmup`` untimed calls.
        reps: Rounds (the most, with ``stop(samples, rounds_done)``, asked after every round: True ends early).
        inner: Calls per sample (default: calibrated to last ``target_s``).
        on_sample: Called after every sample (progress); ``before(name)``, ``after(name)`` around it, untimed.
        cpu: Filled with the calling thread's CPU seconds per call (``time.thread_time``), per callable.
        wall: Time by the clock on CUDA too (:func:`time_calls`).
    """
    inners = {}
    for name, fn in fns.items():
        run_steps(fn, warmup)
        synchronize(device)
        inners[name] = inner or calibrate(fn, device, target_s)
    samples: Dict[str, List[float]] = {name: [] for name in fns}
    for k in range(reps):
        for name in rotated(fns, k):
            if before is not None:
                before(name)
            c0 = time.thread_time()
            samples[name].append(time_calls(fns[name], inners[name], device, wall))
            if cpu is not None:
                cpu.setdefault(name, []).append((time.thread_time() - c0) / inners[name])
            if after is not None:
                after(name)
            if on_sample is not None:
                on_sample()
        if stop is not None and stop(samples, k + 1):
            break
    return samples


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    """Run a block with ``torch.set_num_threads(n)``, restoring the previous count."""
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def thread_counts(args: Any) -> List[int]:
    """The intra-op thread counts a one-process CPU benchmark runs at: ``--threads N|all``, default 1 and all."""
    spec, every = args.threads, report.available_cpus()
    return sorted({1, every}) if spec is None else [every] if str(spec) == "all" else [int(spec)]


def threads_per_rank(args: Any, world_size: int) -> int:
    """Intra-op threads of each rank: ``--threads N``, ``all`` (the CPUs shared out), default 1."""
    spec = args.threads
    return 1 if spec is None else max(1, report.available_cpus() // world_size if str(spec) == "all" else int(spec))


def level_config(args: Any, configs: Dict[str, Dict[str, Any]], world_size: int, **extra: Any) -> Dict[str, Any]:
    """A multi-rank benchmark's configuration: ``configs[args.level]``, the level, device, ranks, backend and threads."""
    level, device = args.level, args.device
    return {**configs[level], "level": level, "smoke": level == "smoke", "quick": level != "full", "device": device,
            "world_size": world_size, "backend": "nccl" if device == "cuda" else "gloo",
            "threads": threads_per_rank(args, world_size), **extra}  # fmt: skip


def wrap(kind: str, module: Any, device: str, **kw: Any) -> Any:
    """``torch`` DDP or (any other ``kind``) ``fastcoll.DDP`` around ``module``, on the current GPU with CUDA."""
    if device == "cuda":
        kw["device_ids"] = [torch.cuda.current_device()]
    return (DistributedDataParallel if kind == "torch" else fastcoll.DDP)(module, **kw)


def torch_bucket_sizes(wrapper: Any, *keys: str) -> Optional[List[int]]:
    """Bytes per bucket of a torch DDP wrapper, from its logging data (the first of ``keys`` present), or None.

    ``_get_ddp_logging_data`` is private torch API: informative only.
    """
    try:
        data = wrapper._get_ddp_logging_data()
    except Exception:  # pragma: no cover (another torch)
        return None
    sizes = next((data[k] for k in keys if data.get(k)), None)
    return [int(s) for s in sizes.split(",") if s.strip()] if isinstance(sizes, str) else sizes


def settle(opt: Any) -> None:
    """Wait for a ShardedOptimizer's pending all-gathers (its public ``finish_param_sync``); a no-op otherwise."""
    getattr(opt, "finish_param_sync", lambda: None)()


def run_steps(step: Callable[[], object], n: int, opt: Any = None) -> None:
    """``n`` calls of ``step``, then the pending all-gathers of ``opt`` (a ShardedOptimizer) waited for."""
    for _ in range(n):
        step()
    settle(opt)


# Memory and traffic
try:
    _LIBC: Any = ctypes.CDLL("libc.so.6")
except OSError:  # pragma: no cover (not glibc)
    _LIBC = None

#: glibc allocator settings a rank can start with (``cfg["malloc"]``): mallopt's (parameter, value) pairs and their line.
#: "keep": freed heap memory stays with the process, as a caching allocator's would. Every step drops its gradients and
#: the next backward allocates them again; with glibc's defaults that memory goes back to the kernel and is
#: page-faulted in every step (on the 2-core box, over 40% of a run's CPU time and its largest source of noise, the
#: same for every method). "return": a fixed 128 KiB mmap threshold, so a freed tensor's pages go back to the kernel
#: at once (a control for resident memory: what glibc's heap keeps of freed tensors is left out).
MALLOC = {
    "keep": (((-1, 2**31 - 1), (-3, 32 * report.MiB), (-4, 0)), "M_TRIM_THRESHOLD 2 GiB, M_MMAP_THRESHOLD 32 MiB, M_MMAP_MAX 0"),
    "return": (((-3, 128 * 1024),), "M_MMAP_THRESHOLD 128 KiB (fixed)"),
}


def set_malloc(name: str) -> Optional[str]:
    """Apply :data:`MALLOC` ``[name]`` to glibc in this process; returns what was set, None if not glibc."""
    if not hasattr(_LIBC, "mallopt"):  # pragma: no cover
        return None
    pairs, text = MALLOC[name]
    return f"glibc mallopt: {text}" if all(_LIBC.mallopt(k, v) == 1 for k, v in pairs) else None


def _proc_field(path: str, field: str) -> Optional[int]:
    with contextlib.suppress(OSError), open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def bytes_sent(fn: Callable[[], Any]) -> Tuple[Any, Optional[int]]:
    """``fn()``'s result, and the bytes this process wrote through write()/send() while it ran (None if unknown).

    From ``/proc/self/io``'s wchar: gloo's sockets included.
    """
    w0 = _proc_field("/proc/self/io", "wchar")
    out = fn()
    w1 = _proc_field("/proc/self/io", "wchar")
    return out, None if w0 is None or w1 is None else w1 - w0


class MemoryProbe:
    """Peak memory growth of a block: resident high-water mark on CPU (reset first), allocator peak on CUDA.

    With ``tensors``, on CPU also the peak of the bytes torch's tensors hold (:meth:`tensor_peak`): what
    ``max_memory_allocated`` is on CUDA, free of what the C allocator keeps resident.
    """

    def __init__(self, device: str, tensors: bool = False):
        self.device, self.base, self.ok = device, 0, True
        self._profile: Optional[torch.profiler.profile] = None
        self._tensors = tensors and device == "cpu"

    def start(self) -> None:
        gc.collect()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        if self._tensors:
            _count_every_thread()
            self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
            with _kineto_quiet():
                self._profile.__enter__()
        if _LIBC is not None:
            _LIBC.malloc_trim(0)  # free heap goes back to the OS, so reusing it shows in the RSS again
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
        except OSError:  # pragma: no cover
            self.ok = False
        self.base = (_proc_field("/proc/self/status", "VmRSS") or 0) * 1024

    def peak(self) -> Optional[int]:
        if self.device == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        hwm = _proc_field("/proc/self/status", "VmHWM")
        return None if not self.ok or hwm is None else max(0, hwm * 1024 - self.base)

    def tensor_peak(self) -> Optional[int]:
        """The most bytes torch's tensors held at once since :meth:`start`, above what they held then (stops the
        recording). CPU: the running total of c10's CPU allocator as torch.profiler records it; CUDA: :meth:`peak`."""
        if self.device == "cuda":
            return self.peak()
        prof, self._profile = self._profile, None
        if prof is None:
            return None
        with _kineto_quiet():
            prof.__exit__(None, None, None)
        from torch._C._profiler import _EventType

        stack, totals = list(prof.profiler.kineto_results.experimental_event_tree())[::-1], []
        while stack:  # the event tree in pre-order: each CPU allocation's running total and block size
            node = stack.pop()
            stack.extend(node.children[::-1])
            if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
                totals.append((node.extra_fields.total_allocated, node.extra_fields.alloc_size))
        return max(t for t, _ in totals) - (totals[0][0] - totals[0][1]) if totals else 0


@contextlib.contextmanager
def _kineto_quiet() -> Iterator[None]:
    """Standard error closed while the profiler starts or stops: its library prints two lines each time, at any
    log level, into every benchmark's progress."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _count_every_thread() -> None:
    """Make c10's CPU allocator keep its running total of tensor bytes in every thread, not only a profiled one (its
    ``caffe2_report_cpu_memory_usage`` flag): a block freed by another thread (a gloo worker dropping the last
    reference to a message) then leaves the total the profiler records."""
    with contextlib.suppress(OSError, ValueError):
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage").value = True


class LiveBytes:
    """Bytes the C heap has handed out and not taken back (glibc ``mallinfo2``), sampled between the phases of a step.

    Unlike the resident set it leaves out freed memory the allocator keeps, so the two together tell retention from live
    data. Off glibc (< 2.33) every reading is None.
    """

    class _Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                   "uordblks", "fordblks", "keepcost")]  # fmt: skip

    def __init__(self) -> None:
        self._fn = getattr(_LIBC, "mallinfo2", None)
        self.available = self._fn is not None
        if self._fn is not None:
            self._fn.restype = LiveBytes._Info
        self.base, self.peak, self.by_phase = self.read() or 0, 0, {}

    def read(self) -> Optional[int]:
        """Bytes alive in the C heap now (None off glibc)."""
        info = self._fn() if self._fn is not None else None
        return None if info is None else int(info.uordblks + info.hblkhd)

    def sample(self, phase: Optional[str] = None) -> None:
        """Note the bytes alive now above the base, if the most so far (in all, and in ``by_phase[phase]``)."""
        now = self.read()
        if now is not None:
            self.peak = max(self.peak, now - self.base)
            if phase is not None:
                self.by_phase[phase] = max(self.by_phase.get(phase, 0), now - self.base)


# Inside a rank process
def all_max(values: Sequence[float], device: str = "cpu") -> List[float]:
    """Element-wise maximum over the ranks (a sample's time is the slowest rank's)."""
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def gather(obj: Any) -> List[Any]:
    """Every rank's ``obj``, in rank order."""
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def timed_rounds(
    fns: Dict[str, Callable[[], object]], inner: int, lo: int, hi: int, checks: Sequence[Any] = (), device: str = "cpu",
    tick: Optional[Callable[[], None]] = None, before: Optional[Callable[[str], None]] = None,
    after: Optional[Callable[[str], None]] = None,
) -> Tuple[Dict[str, List[float]], Dict[str, List[float]]]:  # fmt: skip
    """Rounds of ``inner`` calls of every callable (rotating order) on every rank, until the targets resolve.

    Each sample is the slowest rank's (:func:`all_max` after every round), so every rank sees the same samples and stops
    after the same round: :func:`fastcoll.bench.stats.enough_rounds` with ``checks``, between ``lo`` and ``hi`` rounds.
    ``before(name)`` and ``after(name)`` run around each sample, untimed (a lead-in step, dropping gradients);
    ``tick()`` after each sample, and once for every sample of the rounds not taken.

    Returns:
        Wall-clock seconds per call, and the calling thread's CPU seconds per call (``time.thread_time``: what other
        processes on the cores inflate less), per callable.
    """
    cpu: Dict[str, List[float]] = {}

    def slowest_rank(samples: Dict[str, List[float]], done: int) -> bool:  # the round's samples become the slowest rank's
        last = all_max([samples[n][-1] for n in samples] + [cpu[n][-1] for n in samples], device)
        for i, n in enumerate(samples):
            samples[n][-1], cpu[n][-1] = last[i], last[len(samples) + i]
        return enough_rounds(samples, done, lo, hi, checks)

    wall = measure_interleaved(fns, device, 0, hi, inner, on_sample=tick, stop=slowest_rank, before=before, after=after,
                               cpu=cpu, wall=True)  # fmt: skip
    if tick is not None:  # the rounds not taken
        tick(len(fns) * (hi - len(next(iter(wall.values())))))
    return wall, cpu


class Built(NamedTuple):
    """A training method built on a model: what :func:`memory_phase` and :func:`optimizer_rounds` run."""

    module: Any
    wrapper: Any
    opt: Any
    step: Callable[[], None]


def optimizer_rounds(
    me: "Rank", methods: Sequence[str], make: Callable[[str], Built], lo: int, hi: int, checks: Sequence[Any],
    inner: Optional[int] = None,
) -> Dict[str, Any]:  # fmt: skip
    """:func:`timed_rounds` of the training steps of ``make(method)``, in steady state.

    Each method first runs ``setup_steps`` steps, the last one timed (they bring the bucket rebuilds and the optimizer
    state; without ``inner``, the slowest sets the calls per sample). Each sample follows an untimed lead-in step; after
    it the step's all-gathers are drained and the gradients dropped, untimed, so the next sample starts with none
    pending.

    Returns:
        ``{"methods", "inner": calls per sample, "reps": rounds taken, "samples": wall-clock samples per method}``.
    """
    runs, setup = {}, {}
    for m in methods:
        _, _, opt, step = runs[m] = make(m)
        run_steps(step, me.cfg["setup_steps"] - 1, opt)
        setup[m] = time_calls(lambda: (step(), settle(opt)), 1, me.device)
        opt.zero_grad(set_to_none=True)
        me.tick()
    inner = inner or me.inner(max(setup.values()))

    def after(m: str) -> None:
        settle(runs[m].opt)
        runs[m].opt.zero_grad(set_to_none=True)

    steps = {m: r.step for m, r in runs.items()}
    samples = timed_rounds(steps, inner, lo, hi, checks, me.device, me.tick, before=lambda m: steps[m](), after=after)[0]
    runs.clear()
    return {"methods": list(methods), "inner": inner, "reps": len(samples[methods[0]]), "samples": samples}


def warm_up(build: Callable[[], Built]) -> None:
    """3 steps of a method on a tiny model (``build()``), so that the measured one pays no one-time costs."""
    _, _, opt, step = build()
    run_steps(step, 3, opt)


def memory_phase(me: "Rank", build: Callable[[Optional[LiveBytes]], Built], steps: int, read: Callable[..., Dict[str, Any]],
                 warm: Optional[Callable[[], Built]] = None, live: bool = False,
                 tensors: bool = False) -> Dict[str, Any]:  # fmt: skip
    """One method's memory on this rank, in the order every memory phase keeps; every rank's fields, ``{"ranks": [...]}``.

    :func:`warm_up` on ``warm()`` if given, the probe started (``tensors``: recording tensor bytes too; and, with
    ``live``, on the CPU a :class:`LiveBytes`), the method built (``build(heap)``: its step samples the heap) and
    ``steps`` steps taken; then ``read(probe, heap, built)`` returns this rank's fields, ``probe.peak()`` among them.
    """
    if warm is not None:
        warm_up(warm)
        gc.collect()
    probe = MemoryProbe(me.device, tensors)
    probe.start()
    heap = LiveBytes() if live and me.device == "cpu" else None
    built = build(heap)
    run_steps(built.step, steps, built.opt)
    info = {"rank": me.rank, **read(probe, heap, built)}
    me.tick()
    return {"ranks": gather(info)}  # the wrappers go in Rank's exit, while their process group is alive


class Rank:
    """One rank of a measurement (the first argument of the function :func:`run_ranks` runs).

    As a context manager it sets the device and intra-op threads, joins the process group over the FileStore, and tears
    it down after (collecting garbage first, so that wrappers go while their process group is alive). Rank 0 reports
    progress to the parent: ``tick(n)`` (units of work done), ``describe(text)`` (the bar's text) and ``row(label,
    rows)`` (a row finished: the parent prints a line with the time left).
    """

    def __init__(self, rank: int, ws: int, store_path: str, out_path: str, progress_q: Any, cfg: Dict[str, Any]):
        self.rank, self.ws, self.cfg = rank, ws, cfg
        self.device: str = cfg.get("device", "cpu")
        self._store, self._out, self._q = store_path, out_path, progress_q
        self.malloc = set_malloc(cfg["malloc"]) if cfg.get("malloc") and self.device == "cpu" else None

    def __enter__(self) -> "Rank":
        if self.device == "cuda":
            torch.cuda.set_device(self.rank % torch.cuda.device_count())
        torch.set_num_threads(self.cfg.get("threads", 1))
        store, timeout = dist.FileStore(self._store, self.ws), datetime.timedelta(seconds=600)
        dist.init_process_group(self.cfg.get("backend", "gloo"), store=store, rank=self.rank, world_size=self.ws, timeout=timeout)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.collect()
        dist.destroy_process_group()

    def inner(self, seconds: float) -> int:
        """Calls per sample that make it last ``cfg["target_s"]`` at the slowest rank's ``seconds`` per call."""
        return inner_for(all_max([seconds], self.device)[0], self.cfg["target_s"], self.cfg["max_inner"])

    def _put(self, what: str, value: Any) -> None:
        if self.rank == 0 and self._q is not None:
            self._q.put((what, value))

    def tick(self, n: int = 1) -> None:
        self._put("advance", n)

    def describe(self, text: str) -> None:
        self._put("describe", text)

    def row(self, label: str, rows: Optional[int] = None) -> None:
        self._put("row", (label, rows))

    def save(self, result: Dict[str, Any]) -> None:
        """Rank 0 writes its result (with the op implementation and allocator settings) for the parent."""
        if self.rank == 0:
            with open(self._out, "w") as f:
                json.dump({**result, "implementation": ops.implementation(), "malloc": self.malloc}, f)


def _rank_main(rank: int, ws: int, store_path: str, out_path: str, progress_q: Any, fn: Callable[..., Any],
               cfg: Dict[str, Any], args: Tuple[Any, ...]) -> None:  # fmt: skip
    os.environ.update(cfg.get("env") or {})  # before any wrapper reads it
    with Rank(rank, ws, store_path, out_path, progress_q, cfg) as me:
        if cfg.get("freeze"):  # later collections skip torch's many long-lived objects: ms instead of 0.3 s
            gc.collect()
            gc.freeze()
        result = fn(me, *args)
        if result is not None:
            me.save(result)


# In the parent
#: What forkserver rank processes import once (a start then costs a fork, not seconds of imports).
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.distributed.optim", "fastcoll", "fastcoll.bench.models")
#: Ranks still alive this long after rank 0 wrote its result are killed (:func:`run_ranks`).
GRACE_S = 60.0
_QUEUE: List[Any] = []  # the progress queue, made with the forkserver context once


def run_ranks(
    fn: Callable[..., Optional[Dict[str, Any]]], cfg: Dict[str, Any], args: Tuple[Any, ...] = (), ws: int = 2, prog: Any = None
) -> Dict[str, Any]:
    """Run ``fn(rank, *args)`` on ``ws`` processes, each a :class:`Rank` of ``cfg``; return rank 0's result.

    ``fn`` is a module-level function; rank 0's return value is saved (:meth:`Rank.save`). ``cfg["env"]`` is set in each
    process first; ``cfg["freeze"]`` freezes the garbage collector's objects before ``fn``. Progress reports go to
    ``prog`` (:class:`fastcoll.bench.report.Progress`). Ranks still alive :data:`GRACE_S` after rank 0 wrote its result
    are killed: their work is done, and a process stuck in its exit (a gloo destructor once deadlocked there) must not
    hang the benchmark.
    """
    if not _QUEUE:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        _QUEUE.append(ctx.Queue())

    def drain() -> None:  # the progress reports so far, to ``prog``
        with contextlib.suppress(queue.Empty):
            while True:
                what, value = _QUEUE[0].get_nowait()
                if prog is not None:
                    prog.apply(what, value)

    with tempfile.TemporaryDirectory(prefix="fastcoll_bench_") as tmpdir:
        out_path = os.path.join(tmpdir, "result.json")
        procs = tmp.start_processes(_rank_main, args=(ws, os.path.join(tmpdir, "store"), out_path, _QUEUE[0], fn, cfg, args),
                                    nprocs=ws, join=False, start_method="forkserver")  # fmt: skip
        written_at: Optional[float] = None
        while not procs.join(timeout=0.2):
            drain()
            if written_at is None and os.path.exists(out_path):
                written_at = time.perf_counter()
            if written_at is not None and time.perf_counter() - written_at > GRACE_S:
                for p in procs.processes:
                    if p.is_alive():
                        p.kill()
                report.say(f"[yellow]rank processes still alive {GRACE_S:.0f} s after their result: killed[/yellow]")
                break
        drain()
        with open(out_path) as f:
            return json.load(f)
