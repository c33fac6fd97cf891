"""Agree across ranks, or raise the same error on every rank.

A check that depends on one rank's data (a dict with other keys, an object
that cannot be pickled, a model with other parameters) must not raise on that
rank alone: the others would wait forever in the next collective. Every such
check in fastcoll goes through :func:`agree` instead, which costs one
all-gather of a few int64 per rank when everything is fine.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any, Callable

import torch
import torch.distributed as dist

from .backends import comm_device, finish_collective, start_collective
from .process import Group, collectives_needed, get_world_size

__all__ = ["agree", "all_gather_bytes", "bytes_to_tensor", "tensor_to_bytes"]

#: Exception types an agreed failure keeps (checked in order); anything else becomes RuntimeError.
_KINDS: tuple[type, ...] = (TypeError, ValueError, OSError, RuntimeError)


def bytes_to_tensor(payload: bytes, device: torch.device, size: int | None = None) -> torch.Tensor:
    """A uint8 tensor on ``device`` holding ``payload``, zero-padded to ``size`` elements."""
    size = len(payload) if size is None else size
    out = torch.zeros(size, dtype=torch.uint8)
    if payload:
        out[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return out.to(device)


def tensor_to_bytes(tensor: torch.Tensor, size: int | None = None) -> bytes:
    """The first ``size`` bytes (all when None) of a uint8 tensor, on any device."""
    t = tensor.detach().reshape(-1)
    if size is not None:
        t = t[:size]
    return t.cpu().numpy().tobytes()


def _all_gather(parts: list[torch.Tensor], mine: torch.Tensor, group: Group) -> None:
    """``dist.all_gather`` under the group's stall protection (numbered, bounded wait)."""
    work = start_collective(
        lambda: dist.all_gather(parts, mine, group=group, async_op=True), "all_gather", "fastcoll.dist agree", mine, group
    )
    finish_collective(work, group, "fastcoll.dist agree", mine.device)


def all_gather_bytes(payload: bytes, sizes: Sequence[int], group: Group, device: torch.device) -> list[bytes]:
    """Every rank's ``payload``, in group-rank order, given every rank's length ``sizes``."""
    mine = bytes_to_tensor(payload, device, max(sizes))
    parts = [torch.empty_like(mine) for _ in sizes]
    _all_gather(parts, mine, group)
    return [tensor_to_bytes(t, n) for t, n in zip(parts, sizes)]


def _all_gather_ints(values: Sequence[int], group: Group, device: torch.device) -> list[list[int]]:
    """Every rank's ``values`` (the same count on every rank), in group-rank order."""
    mine = torch.tensor(list(values), dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(get_world_size(group))]
    _all_gather(parts, mine, group)
    return torch.stack(parts).cpu().tolist()


def _digest(desc: Any) -> list[int]:
    """A 128-bit digest of ``repr(desc)`` as two int64; zeros for None."""
    if desc is None:
        return [0, 0]
    raw = hashlib.blake2b(repr(desc).encode("utf-8", "replace"), digest_size=16).digest()
    return [int.from_bytes(raw[:8], "little", signed=True), int.from_bytes(raw[8:], "little", signed=True)]


def _error_text(error: BaseException | None, what: str) -> bytes:
    """``kind\\0message`` for a failure (the message without a leading ``what: ``); b"" for none."""
    if error is None:
        return b""
    kind = next((k.__name__ for k in _KINDS if isinstance(error, k)), "RuntimeError")
    message = str(error) or type(error).__name__
    if message.startswith(what + ": "):
        message = message[len(what) + 2 :]
    return f"{kind}\0{message}".encode("utf-8", "replace")


def _group_ranks(group: Group, world_size: int) -> list[int]:
    """Global rank of every group rank (for messages)."""
    if group is None:
        return list(range(world_size))
    return list(dist.get_process_group_ranks(group))


def _raise_failures(what: str, texts: list[bytes], ranks: list[int], local: BaseException | None) -> None:
    """Raise the one exception every rank raises when some rank failed."""
    kinds: list[str] = []
    by_message: dict[str, list[int]] = {}
    for rank, text in zip(ranks, texts):
        if text:
            kind, _, message = text.decode("utf-8", "replace").partition("\0")
            kinds.append(kind)
            by_message.setdefault(message, []).append(rank)
    parts = [f"rank {rs[0]}: {m}" if len(rs) == 1 else f"ranks {', '.join(map(str, rs))}: {m}" for m, rs in by_message.items()]
    exc_type = next((k for k in _KINDS if k.__name__ == kinds[0]), RuntimeError)
    raise exc_type(f"{what}: failed on {len(kinds)} rank(s): " + "; ".join(parts)) from local


def _default_explain(descs: list[Any]) -> str:
    return "the arguments differ across ranks: " + "; ".join(f"rank {r}: {d!r}" for r, d in enumerate(descs))


def _gather_descs(desc: Any, group: Group, device: torch.device) -> list[Any]:
    """Every rank's ``desc`` (its repr where it cannot be pickled), in group-rank order."""
    try:
        payload = pickle.dumps(desc, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - any pickling failure: fall back to the text
        payload = pickle.dumps(repr(desc))
    sizes = [row[0] for row in _all_gather_ints([len(payload)], group, device)]
    return [pickle.loads(p) for p in all_gather_bytes(payload, sizes, group, device)]


def agree(
    what: str,
    *,
    group: Group = None,
    values: Sequence[int] = (),
    error: BaseException | None = None,
    desc: Any = None,
    explain: Callable[[list[Any]], str] | None = None,
    mismatch: type = ValueError,
    device: torch.device | None = None,
) -> list[list[int]]:
    """Share a few ints across ranks, or raise the same exception on every rank.

    Every rank of ``group`` must call it (``values`` of the same length on
    every rank). One all-gather of ``[len(error text), digest of repr(desc)
    (two int64), *values]`` per rank decides:

    * some rank passed ``error``: the error texts are gathered and every rank
      raises the same exception, of the type of the lowest failing rank's
      error (TypeError, ValueError, OSError or RuntimeError, checked with
      isinstance; anything else becomes RuntimeError), with the message
      ``"{what}: failed on {n} rank(s): rank {r}: {msg}; ranks {r2}, {r3}: {msg2}"``
      (ranks with the same message share an entry; ranks are global ranks; a
      ``what: `` prefix of a message is dropped). On a failing rank the
      exception's cause is its own error;
    * else the digests differ: every rank's ``desc`` is gathered and every
      rank raises ``mismatch(f"{what}: {explain(descs)}")``, ``descs`` in
      group-rank order;
    * else it returns every rank's ``values``.

    Without a process group or in a group of one it communicates nothing: it
    raises ``error`` itself if given, else returns ``[list(values)]``.

    Args:
        what: Public name of the caller, the message prefix (``"fastcoll.DDP"``,
            ``"fastcoll.dist.all_reduce_dict"``).
        group: Process group; the default group when None.
        values: Small integers to share (sizes, flags).
        error: This rank's failure, if any.
        desc: What must be equal on every rank (compared by ``repr``); None
            compares equal only to None.
        explain: Builds the mismatch message from every rank's ``desc``; the
            default lists them all.
        mismatch: Exception type raised on a mismatch.
        device: Where the records travel; :func:`~fastcoll.distributed.backends.comm_device`
            of the group when None.

    Returns:
        Every rank's ``values``, in group-rank order.

    Raises:
        TypeError, ValueError, OSError, RuntimeError: on every rank, when some rank failed.
        mismatch: on every rank, when the ``desc`` differ.
    """
    if not collectives_needed(group):
        if error is not None:
            raise error
        return [list(values)]
    device = comm_device(group) if device is None else device
    text = _error_text(error, what)
    rows = _all_gather_ints([len(text), *_digest(desc), *values], group, device)
    sizes = [row[0] for row in rows]
    if any(sizes):
        texts = all_gather_bytes(text, sizes, group, device)
        _raise_failures(what, texts, _group_ranks(group, len(rows)), error)
    if any(row[1:3] != rows[0][1:3] for row in rows):
        descs = _gather_descs(desc, group, device)
        raise mismatch(f"{what}: {(explain or _default_explain)(descs)}")
    return [row[3:] for row in rows]
