"""Object collectives: send picklable objects between ranks.

Through tensors on the communication device (:func:`broadcast`,
:func:`all_gather_object_gpu`) or through files in a shared directory
(:func:`all_gather_object_cpu`, :func:`create_tmpdir`), and
:func:`collect_results`, which puts round-robin evaluation results back into
dataset order. A rank whose object cannot be pickled makes every rank raise.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ._agree import agree, all_gather_bytes, bytes_to_tensor, tensor_to_bytes
from .backends import comm_device, finish_collective, start_collective
from .process import Group, collectives_needed, get_rank, get_world_size
from .serialize import dumps

__all__ = [
    "LOCAL_TMP_ROOT",
    "all_gather_object_cpu",
    "all_gather_object_gpu",
    "broadcast",
    "collect_results",
    "create_tmpdir",
]

#: Directory (relative to the working directory) under which shared temporary
#: directories are made when the system temporary directory is not used.
LOCAL_TMP_ROOT = ".dist_tmp"


def _src_group_rank(src: int, group: Group) -> int:
    """``src``'s rank within ``group``; ValueError (before any collective) when it is not a member."""
    if group is None:
        ws = dist.get_world_size()
        if not 0 <= src < ws:
            raise ValueError(f"fastcoll.dist.broadcast: src={src} is not a rank of a world of size {ws}; pass 0..{ws - 1}")
        return src
    ranks = dist.get_process_group_ranks(group)
    if src not in ranks:
        raise ValueError(f"fastcoll.dist.broadcast: src={src} is not a member of the group (ranks {ranks}); pass one of them")
    return ranks.index(src)


def broadcast(obj: Any, src: int = 0, group: Group = None) -> Any:
    """Send a picklable object from rank ``src`` to every rank.

    Args:
        obj: The object to send (only read on ``src``).
        src: Global rank that sends.
        group: Process group; the default group when None.

    Returns:
        ``src``'s object on every rank (``obj`` itself on ``src``).

    Raises:
        TypeError: on every rank, if ``src``'s object cannot be pickled.
        ValueError: if ``src`` is not a rank of the group.
    """
    if not collectives_needed(group):
        return obj
    what = "fastcoll.dist.broadcast"
    group_src = _src_group_rank(src, group)
    device = comm_device(group)
    is_src = dist.get_rank() == src
    payload, error = b"", None
    if is_src:
        try:
            payload = dumps(obj, what)
        except TypeError as exc:
            error = exc
    size = agree(what, group=group, values=[len(payload)], error=error, device=device)[group_src][0]
    buf = bytes_to_tensor(payload, device) if is_src else torch.empty(size, dtype=torch.uint8, device=device)
    work = start_collective(lambda: dist.broadcast(buf, src=src, group=group, async_op=True), "broadcast", what, buf, group)
    finish_collective(work, group, what, device)
    return obj if is_src else pickle.loads(tensor_to_bytes(buf))


def _gather_objects(obj: Any, group: Group, what: str, to_group_rank0: bool) -> list[Any] | None:
    """Gather a picklable object from every rank (on every rank, or on group rank 0 only)."""
    device = comm_device(group)
    payload, error = b"", None
    try:
        payload = dumps(obj, what)
    except TypeError as exc:
        error = exc
    sizes = [row[0] for row in agree(what, group=group, values=[len(payload)], error=error, device=device)]
    if not to_group_rank0:
        return [pickle.loads(p) for p in all_gather_bytes(payload, sizes, group, device)]
    mine = bytes_to_tensor(payload, device, max(sizes))
    is_root = dist.get_rank(group) == 0
    parts = [torch.empty_like(mine) for _ in sizes] if is_root else None
    work = start_collective(
        lambda: dist.gather(mine, parts, group=group, group_dst=0, async_op=True), "gather", what, mine, group
    )
    finish_collective(work, group, what, device)
    if parts is None:
        return None
    return [pickle.loads(tensor_to_bytes(t, n)) for t, n in zip(parts, sizes)]


def all_gather_object_gpu(data: Any, rank_zero_return_only: bool = True, group: Group = None) -> list[Any] | None:
    """Gather a picklable object from every rank through tensors on the communication device.

    Objects may have different sizes on different ranks. The bytes travel on
    CUDA for an NCCL group and on CPU for gloo, whichever the name suggests.

    Args:
        data: Any picklable object.
        rank_zero_return_only: Return the list on rank 0 only (the others get
            None, and only rank 0 receives the data).
        group: Process group; the default group when None.

    Returns:
        Every rank's object in rank order, or None on ranks other than 0 when
        ``rank_zero_return_only``. ``[data]`` in a single process.

    Raises:
        TypeError: on every rank, if any rank's object cannot be pickled
            (naming the rank and the type).
    """
    if not collectives_needed(group):
        return [data]
    return _gather_objects(data, group, "fastcoll.dist.all_gather_object_gpu", to_group_rank0=rank_zero_return_only)


def create_tmpdir(rank: int, tmpdir: str | None = None, use_system_tmp: bool = True) -> str:
    """Create a temporary directory and share its path with every rank.

    Must be called by every rank. With ``tmpdir=None`` rank 0 makes a fresh
    directory and broadcasts its path; otherwise every rank makes ``tmpdir``
    (if missing) and uses it.

    Args:
        rank: The calling process's global rank.
        tmpdir: A directory to use instead of a fresh one.
        use_system_tmp: Make the fresh directory under the system temporary
            directory (node-local). When False it is made under ``./.dist_tmp``
            in the working directory, which a shared file system can make
            visible to every node.

    Returns:
        The directory's path (the same on every rank).

    Raises:
        OSError: on every rank, if rank 0 could not create the directory.
    """
    if tmpdir is None:
        path, error = None, None
        if rank == 0:
            try:
                if use_system_tmp:
                    path = tempfile.mkdtemp(prefix="fastcoll_")
                else:
                    os.makedirs(LOCAL_TMP_ROOT, exist_ok=True)
                    path = tempfile.mkdtemp(prefix="fastcoll_", dir=LOCAL_TMP_ROOT)
                path = os.path.abspath(path)
            except OSError as exc:
                error = f"rank 0 could not create a temporary directory ({exc}); pass tmpdir= a writable directory"
        if get_world_size() > 1:
            path, error = broadcast((path, error), src=0)
        if error is not None:
            raise OSError(f"fastcoll.dist.create_tmpdir: {error}")
        tmpdir = path
    os.makedirs(tmpdir, exist_ok=True)
    return tmpdir


def _part_file(tmpdir: str, rank: int) -> str:
    return os.path.join(tmpdir, f"part_{rank}.pkl")


def _write_part(data: Any, path: str, rank: int, what: str) -> BaseException | None:
    """Pickle ``data`` into this rank's part file (atomically); the error instead of raising it."""
    try:
        payload = dumps(data, what)
        staging = _part_file(path, rank) + ".tmp"
        with open(staging, "wb") as fh:
            fh.write(payload)
        os.replace(staging, _part_file(path, rank))
    except (TypeError, OSError) as exc:
        return exc
    return None


def all_gather_object_cpu(
    data: Any, tmpdir: str | None = None, rank_zero_return_only: bool = True, use_system_tmp: bool = False
) -> list[Any] | None:
    """Gather a picklable object from every rank through a shared directory.

    Each rank pickles its object into a file of a directory every rank can
    read; rank 0 (or every rank) then loads all of them. Only small control
    messages go through the process group, so large results never occupy
    device memory.

    Args:
        data: Any picklable object.
        tmpdir: Directory to exchange the files in. When None a fresh one is
            made (see :func:`create_tmpdir`) and removed afterwards; a given
            directory is kept and only the files written into it are removed.
        rank_zero_return_only: Return the list on rank 0 only (the others get None).
        use_system_tmp: Make the fresh directory in the system temporary
            directory (single-node only) instead of under ``./.dist_tmp``.

    Returns:
        Every rank's object in rank order, or None on ranks other than 0 when
        ``rank_zero_return_only``. ``[data]`` in a single process.

    Raises:
        TypeError: on every rank, if any rank's object cannot be pickled. The
            temporary files are removed in this case too.
        OSError: on every rank, if any rank could not write its file.
    """
    ws = get_world_size()
    if not collectives_needed():
        return [data]
    what = "fastcoll.dist.all_gather_object_cpu"
    rank = get_rank()
    created = tmpdir is None
    path = create_tmpdir(rank, tmpdir, use_system_tmp)
    try:
        # Doubles as the barrier after which every part file exists.
        agree(what, error=_write_part(data, path, rank, what))
        if rank_zero_return_only and rank != 0:
            return None
        results: list[Any] = []
        load_error = None
        try:
            for r in range(ws):
                with open(_part_file(path, r), "rb") as fh:
                    results.append(pickle.load(fh))
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            load_error = exc
        if not rank_zero_return_only:
            # Rank 0 must not delete the files while another rank still reads them.
            agree(what, error=load_error)
        elif load_error is not None:
            raise load_error
        return results
    finally:
        if rank == 0:
            _remove_exchange_dir(path, created, ws)


def _remove_exchange_dir(path: str, created: bool, world_size: int) -> None:
    """Remove a directory :func:`all_gather_object_cpu` made, or only its part files from a given one."""
    if created:
        shutil.rmtree(path, ignore_errors=True)
        parent = os.path.dirname(path)
        if os.path.basename(parent) == LOCAL_TMP_ROOT:
            try:
                os.rmdir(parent)  # only succeeds when nothing else is in it
            except OSError:
                pass
        return
    for r in range(world_size):
        for name in (_part_file(path, r), _part_file(path, r) + ".tmp"):
            try:
                os.remove(name)
            except FileNotFoundError:
                pass


def collect_results(results: Sequence[Any], size: int, device: str = "cpu", tmpdir: str | None = None) -> list[Any] | None:
    """Gather per-rank evaluation results into dataset order on rank 0.

    Assumes the results were produced by a sampler that deals samples out
    round-robin (rank ``r`` processes samples ``r, r + world_size, ...``, as
    ``torch.utils.data.DistributedSampler`` without shuffling does), so the
    parts are interleaved back into dataset order. The padding such a sampler
    adds to make every rank's share equal lands at the end and is cut off at
    ``size``. Results that are None are kept.

    Args:
        results: This rank's results, in the order it processed its samples.
        size: Number of samples in the dataset.
        device: 'cpu' to exchange through a shared directory
            (:func:`all_gather_object_cpu`), 'gpu' to exchange through tensors
            on the communication device (:func:`all_gather_object_gpu`).
        tmpdir: Directory for the 'cpu' exchange; a fresh one when None.

    Returns:
        The first ``size`` results in dataset order on rank 0; None on the
        other ranks. In a single process, ``results[:size]``.

    Raises:
        ValueError: if ``device`` is neither 'cpu' nor 'gpu', or ``size`` is negative.
        TypeError: on every rank, if any rank's results cannot be pickled.
    """
    if device not in ("cpu", "gpu"):
        raise ValueError(f"fastcoll.dist.collect_results: device must be 'cpu' or 'gpu', got {device!r}")
    if int(size) != size or size < 0:
        raise ValueError(f"fastcoll.dist.collect_results: size must be a non-negative integer, got {size!r}")
    size = int(size)
    results = list(results)
    if not collectives_needed():
        parts: list[Any] | None = [results]
    elif device == "gpu":
        parts = all_gather_object_gpu(results, rank_zero_return_only=True)
    else:
        parts = all_gather_object_cpu(results, tmpdir=tmpdir, rank_zero_return_only=True)
    if parts is None:
        return None
    ordered: list[Any] = []
    for i in range(max(len(p) for p in parts)):
        ordered.extend(part[i] for part in parts if i < len(part))
    if len(ordered) < size:
        warnings.warn(
            f"fastcoll.dist.collect_results: gathered {len(ordered)} results but size is {size}; "
            "the ranks' results do not cover the dataset",
            RuntimeWarning,
            stacklevel=2,
        )
    return ordered[:size]
