"""Which CPU calls use non-temporal (streaming) stores: decided from the machine.

The CPU kernels write their destination either with ordinary stores (each
line is read into the cache first, then written back when evicted) or with
non-temporal stores (written straight to memory, no read, no cache line
taken). Streaming wins when the call's data cannot stay in the last-level
cache anyway: it saves the read of the destination and does not evict what
the cache holds. It loses when source and destination would have fit: the
next reader (the all-reduce, the optimizer) then finds them in memory rather
than in cache, and on some CPUs (a 2-vCPU Intel Xeon VM measured in issue 32)
a single core's streaming bandwidth is below its cached-store bandwidth.

The rule: a call streams when it writes at least a third
(:data:`LLC_DIVISOR`) of the last-level cache this process can use
(:func:`usable_llc`). A bucket's round trip cycles three buffers of its size
through the cache (the gradients packed, the bucket, the tensors unpacked
into; in DDP the all-reduce's buffers take the third place): once they
together exceed the cache, cached stores only add reads of lines about to be
overwritten. That cache is read from sysfs (what the kernel, or a VM's
hypervisor, reports for the CPUs this process may run on, one instance
counted per distinct cache), counting no more instances than the CPUs the
process may use (its affinity, and a cgroup CPU quota); glibc's ``sysconf``
is the fallback where sysfs has nothing. A machine that reports no cache
keeps the old constant (:data:`FALLBACK_MIN_BYTES`).

A machine running more tasks than it has CPUs (the load average at import)
shares that cache with them: the threshold is then divided by the
oversubscription, down to :data:`BUSY_FLOOR_BYTES`.
``FASTCOLL_CPU_STREAM_MIN_BYTES`` overrides the rule (fastcoll._knobs).

The extension's loader calls :func:`apply` once, at import; :func:`current`
says what was chosen and why (``fastcoll.build_info()["cpu_stream_choice"]``).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

from .. import _knobs

MiB = 1 << 20
#: Calls writing at least the usable last-level cache divided by this stream.
LLC_DIVISOR = 3
#: The threshold where the machine reports no cache sizes (the value before the rule, tuned on an AMD EPYC).
FALLBACK_MIN_BYTES = 16 * MiB
#: The oversubscription rule's lowest threshold: 2 MiB round trips ran faster cached even on the
#: 2-core box at load 24, 4 MiB ones faster streaming.
BUSY_FLOOR_BYTES = 4 * MiB
SYSFS_CPU = "/sys/devices/system/cpu"
LOADAVG = "/proc/loadavg"
CGROUP_ROOT = "/sys/fs/cgroup"
# glibc's sysconf names (bits/confname.h); Python's os.sysconf_names does not list them.
_SC_LEVEL2_CACHE_SIZE = 191
_SC_LEVEL3_CACHE_SIZE = 194
_SC_LEVEL4_CACHE_SIZE = 197


@dataclass(frozen=True)
class LastLevelCache:
    """The last-level cache of the CPUs this process may run on.

    Attributes:
        level: Cache level (3 on most servers).
        sizes: Size in bytes of each distinct instance the process's CPUs share (one per CCX or socket).
        source: Where the sizes came from: "sysfs" or "sysconf".
    """

    level: int
    sizes: Tuple[int, ...]
    source: str


@dataclass(frozen=True)
class StoreChoice:
    """The streaming-store threshold in use and why.

    Attributes:
        min_bytes: CPU calls writing at least this many bytes use non-temporal stores.
        rule: "override" (the environment variable), "llc" (the cache rule) or "fallback" (no cache reported).
        reason: One line saying how ``min_bytes`` was reached.
        llc_bytes: The usable last-level cache the rule used (None unless ``rule == "llc"``).
    """

    min_bytes: int
    rule: str
    reason: str
    llc_bytes: Optional[int] = None


def parse_size(text: str) -> int:
    """Bytes of a sysfs cache size ("32768K", "1M", "512").

    Raises:
        ValueError: ``text`` is not such a size.
    """
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)\s*", text, re.IGNORECASE)
    if m is None:
        raise ValueError(f"not a cache size: {text!r}")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def sysfs_llc(cpus: Iterable[int], root: str = SYSFS_CPU) -> Optional[LastLevelCache]:
    """The last-level data cache of ``cpus`` as sysfs describes it, or None where sysfs has none.

    Each CPU's highest-level data or unified cache is found under
    ``cpu<N>/cache/index*``; CPUs listing the same ``shared_cpu_list`` share one
    instance, counted once.
    """
    best_level, instances = 0, {}
    for cpu in sorted(cpus):
        base = os.path.join(root, f"cpu{cpu}", "cache")
        try:
            indexes = sorted(n for n in os.listdir(base) if n.startswith("index"))
        except OSError:
            continue
        for name in indexes:
            d = os.path.join(base, name)
            level, kind, size = _read(os.path.join(d, "level")), _read(os.path.join(d, "type")), _read(os.path.join(d, "size"))
            if level is None or size is None or kind not in ("Data", "Unified") or not level.isdigit():
                continue
            try:
                nbytes = parse_size(size)
            except ValueError:
                continue
            shared = _read(os.path.join(d, "shared_cpu_list")) or f"cpu{cpu}"
            lvl = int(level)
            if lvl > best_level:
                best_level, instances = lvl, {}
            if lvl == best_level and nbytes > 0:
                instances[shared] = nbytes
    if not instances:
        return None
    return LastLevelCache(best_level, tuple(sorted(instances.values(), reverse=True)), "sysfs")


def sysconf_llc() -> Optional[LastLevelCache]:
    """glibc's ``sysconf`` view of the last-level cache (one instance), or None.

    A fallback only: glibc reads CPUID, which on AMD reports the whole package's
    L3 rather than the part one core can use (256 MiB against the 32 MiB of
    one CCX on the EPYC this was written on).
    """
    try:
        import ctypes

        sysconf = ctypes.CDLL(None).sysconf
    except (OSError, AttributeError):  # pragma: no cover (not glibc)
        return None
    for level, name in ((4, _SC_LEVEL4_CACHE_SIZE), (3, _SC_LEVEL3_CACHE_SIZE), (2, _SC_LEVEL2_CACHE_SIZE)):
        size = sysconf(name)
        if size > 0:
            return LastLevelCache(level, (int(size),), "sysconf")
    return None


def cgroup_cpu_limit(root: str = CGROUP_ROOT) -> Optional[float]:
    """CPUs' worth of time the cgroup quota allows (cgroup v2 ``cpu.max``, v1 ``cfs_quota_us``), None if unlimited."""
    v2 = _read(os.path.join(root, "cpu.max"))
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        if quota != "max" and quota.isdigit() and period.isdigit() and int(period) > 0:
            return int(quota) / int(period)
        return None
    for sub in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        quota, period = _read(os.path.join(root, sub, "cpu.cfs_quota_us")), _read(os.path.join(root, sub, "cpu.cfs_period_us"))
        if quota is not None and period is not None:
            if quota.lstrip("-").isdigit() and int(quota) > 0 and period.isdigit() and int(period) > 0:
                return int(quota) / int(period)
            return None
    return None


def affinity() -> List[int]:
    """The CPUs this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover (macOS, Windows)
        return list(range(os.cpu_count() or 1))


def usable_llc(
    cpus: Optional[Iterable[int]] = None, sysfs_root: str = SYSFS_CPU, cgroup_root: str = CGROUP_ROOT, use_sysconf: bool = True
) -> Tuple[Optional[int], str]:
    """Bytes of last-level cache this process can use, and how that was found.

    The sum of the largest ``k`` distinct instances among the process's CPUs,
    with ``k`` at most the CPUs it may use (affinity, then the cgroup quota
    rounded up): a container allowed 2 CPUs' time on a 96-core host with a
    32 MiB L3 per 8 cores can use 32 or 64 MiB of it, not all twelve.

    Args:
        cpus: The CPUs to consider (default: this process's affinity).
        sysfs_root: sysfs's CPU folder (tests pass a fake tree).
        cgroup_root: The cgroup mount (tests pass a fake one).
        use_sysconf: Fall back on glibc's sysconf where sysfs reports nothing.

    Returns:
        ``(bytes, description)``; bytes is None when no cache size is known.
    """
    cpus = list(affinity() if cpus is None else cpus)
    llc = sysfs_llc(cpus, sysfs_root) or (sysconf_llc() if use_sysconf else None)
    if llc is None:
        return None, "no cache size reported (sysfs, sysconf)"
    usable = len(cpus)
    limit = cgroup_cpu_limit(cgroup_root)
    if limit is not None:
        usable = min(usable, max(1, math.ceil(limit)))
    counted = llc.sizes[: max(1, usable)]
    how = f"L{llc.level} {_mib(counted[0])}" + (f" x {len(counted)}" if len(counted) > 1 else "")
    how += f" ({llc.source}; {len(llc.sizes)} instance(s) on {len(cpus)} CPU(s)"
    how += f", cgroup quota {limit:g} CPUs)" if limit is not None else ")"
    return sum(counted), how


def _mib(n: int) -> str:
    return f"{n / MiB:.4g} MiB"


def oversubscription(loadavg: str = LOADAVG, cpus_online: Optional[int] = None) -> Tuple[float, str]:
    """Runnable tasks per online CPU over the last minute (``/proc/loadavg``), and a description; 1.0 if unknown.

    Above 1, other processes time-share the CPUs, and with them the cache.
    """
    text = _read(loadavg)
    ncpu = cpus_online or os.cpu_count() or 1
    try:
        load = float(text.split()[0]) if text else None
    except ValueError:
        load = None
    if load is None:
        return 1.0, "load unknown"
    return max(1.0, load / ncpu), f"load {load:g} on {ncpu} CPU(s)"


def choose(
    env: Optional[Mapping[str, str]] = None,
    llc: Optional[Tuple[Optional[int], str]] = None,
    busy: Optional[Tuple[float, str]] = None,
) -> StoreChoice:
    """The threshold for this machine: the environment override, else the cache rule.

    The rule: a third of the usable last-level cache; divided by the
    machine's oversubscription (:func:`oversubscription`) when more tasks are
    runnable than there are CPUs, since those tasks evict this process's
    lines, but not below :data:`BUSY_FLOOR_BYTES`.

    Args:
        env: The environment (default ``os.environ``).
        llc: ``usable_llc()``'s answer (default: asked here; tests pass fake ones).
        busy: ``oversubscription()``'s answer (default: asked here).

    Raises:
        ValueError: ``FASTCOLL_CPU_STREAM_MIN_BYTES`` is set to something that is not a threshold.
    """
    override = _knobs.cpu_stream_min_bytes(env)
    if override is not None:
        value = os.environ.get(_knobs.CPU_STREAM_MIN_BYTES) if env is None else env.get(_knobs.CPU_STREAM_MIN_BYTES)
        return StoreChoice(override, "override", f"{_knobs.CPU_STREAM_MIN_BYTES}={value}")
    nbytes, how = usable_llc() if llc is None else llc
    if nbytes is None:
        return StoreChoice(FALLBACK_MIN_BYTES, "fallback", f"{_mib(FALLBACK_MIN_BYTES)}: {how}")
    base = nbytes // LLC_DIVISOR
    reason = f"{_mib(nbytes)} / {LLC_DIVISOR}: {how}"
    factor, load_how = oversubscription() if busy is None else busy
    if factor <= 1.0:
        return StoreChoice(base, "llc", f"{_mib(base)} = {reason}", nbytes)
    min_bytes = max(min(base, BUSY_FLOOR_BYTES), int(base / factor))
    reason = f"{_mib(min_bytes)} = {reason}; / {factor:.3g} for {load_how}, not below {_mib(min(base, BUSY_FLOOR_BYTES))}"
    return StoreChoice(min_bytes, "llc", reason, nbytes)


_CURRENT: Optional[StoreChoice] = None


def apply(ext) -> Optional[StoreChoice]:
    """Choose the threshold (:func:`choose`) and set it in the extension ``ext`` (fastcoll._C), once at load.

    Without the extension (``ext`` None) only the override is checked, so a
    bad value is an error wherever fastcoll is imported.

    Raises:
        ValueError: ``FASTCOLL_CPU_STREAM_MIN_BYTES`` is not a threshold.
    """
    global _CURRENT
    if ext is None:
        _knobs.cpu_stream_min_bytes()
        return None
    choice = choose()
    ext._set_cpu_stream_min_bytes(choice.min_bytes)
    _CURRENT = choice
    return choice


def current() -> Optional[StoreChoice]:
    """The choice :func:`apply` made, or None (no extension loaded)."""
    return _CURRENT


def describe() -> Dict[str, object]:
    """The choice as ``build_info()`` reports it: ``{}`` without the extension."""
    c = _CURRENT
    return {} if c is None else {"cpu_stream_choice": {"min_bytes": c.min_bytes, "rule": c.rule, "reason": c.reason}}
