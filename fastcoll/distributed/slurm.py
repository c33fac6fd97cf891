"""SLURM's compressed host and task lists, parsed without ``scontrol``."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable

__all__ = ["expand_slurm_nodelist", "slurm_first_host", "slurm_local_id"]


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' in SLURM node list {text!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in SLURM node list {text!r}")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced '[' in SLURM node list {text!r}")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _range_values(spec: str, text: str) -> list[str]:
    """The values of one bracket's contents, ``01-03,07``, zero padding kept."""
    values: list[str] = []
    for part in spec.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range [{spec}] in SLURM node list {text!r}")
        if not sep:
            values.append(lo)
            continue
        a, b = int(lo), int(hi)
        if a > b:
            raise ValueError(f"descending range {part} in SLURM node list {text!r}")
        values.extend(f"{i:0{len(lo)}d}" for i in range(a, b + 1))
    return values


def _expand_host(item: str, text: str) -> Iterable[str]:
    """The host names of one top-level item such as ``a[1-2]b[3-4]`` (lazily)."""
    pieces: list[list[str]] = []
    pos = 0
    for m in re.finditer(r"\[([^\[\]]*)\]", item):
        pieces.append([item[pos : m.start()]])
        pieces.append(_range_values(m.group(1), text))
        pos = m.end()
    pieces.append([item[pos:]])
    if any("[" in p[0] or "]" in p[0] for p in pieces[::2]):
        raise ValueError(f"malformed brackets in SLURM node list {text!r}")
    return ("".join(combo) for combo in itertools.product(*pieces))


def _items(nodelist: str) -> list[str]:
    items = _split_top_level(nodelist.strip())
    if not items:
        raise ValueError(f"empty SLURM node list {nodelist!r}")
    return items


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM node list such as ``node[01-04,07],gpu1`` into host names.

    Supports comma-separated items, bracketed ranges and lists with zero
    padding kept (``node[01-03]`` gives node01, node02, node03), text after the
    brackets (``a[1-2]b``) and several bracket groups per item.

    Args:
        nodelist: The value of SLURM_NODELIST / SLURM_JOB_NODELIST.

    Returns:
        Every host name, in SLURM's order.

    Raises:
        ValueError: on an empty or malformed list.
    """
    return [host for item in _items(nodelist) for host in _expand_host(item, nodelist)]


def slurm_first_host(nodelist: str) -> str:
    """The first host of a SLURM node list, without expanding the rest.

    Args:
        nodelist: The value of SLURM_NODELIST, e.g. ``node[01-04,07]``.

    Returns:
        The first host name, e.g. ``node01``.

    Raises:
        ValueError: on an empty or malformed list.
    """
    return next(iter(_expand_host(_items(nodelist)[0], nodelist)))


def _tasks_per_node(value: str) -> list[int]:
    """Parse SLURM's compressed tasks-per-node list, e.g. ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in value.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(f"cannot parse a SLURM tasks-per-node value {value!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def slurm_local_id(procid: int, tasks_per_node: str) -> int:
    """The local rank of task ``procid`` under SLURM's block distribution.

    Args:
        procid: The task's global rank (SLURM_PROCID).
        tasks_per_node: SLURM_NTASKS_PER_NODE or SLURM_TASKS_PER_NODE, e.g. ``4`` or ``2(x2),4``.

    Returns:
        The rank among the tasks of its node (consecutive ranks fill a node).
    """
    counts = _tasks_per_node(tasks_per_node)
    if len(counts) == 1 or sum(counts) <= procid:
        return procid % max(counts[-1], 1)
    start = 0
    for n in counts:
        if procid < start + n:
            return procid - start
        start += n
    return 0  # pragma: no cover
