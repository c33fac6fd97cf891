"""Distributed helpers for training and evaluation loops, built on the fused ops.

Detection and training frameworks (the OpenMMLab family, vis4d, ...) each
carry a module of the same dozen helpers: who am I, how many of us are there,
average this loss dict, average these gradients, gather these evaluation
results. This module provides them once, with the names and signatures those
projects use, so switching is a change of import:

* process information: :func:`get_rank`, :func:`get_world_size`,
  :func:`get_local_rank`, :func:`distributed_available`, :func:`is_distributed`,
  :func:`synchronize`, :func:`rank_zero_only`, :func:`is_module_wrapper`;
* launching: :func:`init_dist` for ``torchrun``, SLURM and MPI launchers;
* tensor collectives: :func:`reduce_mean`, :func:`all_reduce_dict`,
  :func:`allreduce_grads`, which pack every tensor of a dtype/device group
  into one flat buffer with :func:`fastcoll.ops.flatten_scale`, reduce it with
  one ``all_reduce`` and scatter it back with :func:`fastcoll.ops.unflatten_scale`;
* object collectives: :func:`obj2tensor`, :func:`tensor2obj`,
  :func:`serialize_to_tensor`, :func:`pad_to_largest_tensor`,
  :func:`broadcast`, :func:`all_gather_object_gpu`,
  :func:`all_gather_object_cpu`, :func:`create_tmpdir`, :func:`collect_results`.

Every function also works in a plain single process where no process group
has been initialized: it behaves as a world of size one (identity results,
no-op barriers), so one script runs unchanged on a laptop and under a launcher.

Errors that depend on one rank's data (a dict with other keys, an object that
cannot be pickled) are agreed on through a small collective, so they raise on
*every* rank instead of leaving the others waiting in a collective that never
completes.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import itertools
import os
import pickle
import re
import shutil
import tempfile
import threading
import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple, TypeVar, Union

import torch
import torch.distributed as dist

from . import ops
from ._reference import SUPPORTED_DTYPES, is_dense
from ._sparse import all_reduce_sparse

__all__ = [
    "get_rank",
    "get_world_size",
    "get_local_rank",
    "distributed_available",
    "is_distributed",
    "synchronize",
    "rank_zero_only",
    "is_module_wrapper",
    "init_dist",
    "reduce_mean",
    "all_reduce_dict",
    "allreduce_grads",
    "obj2tensor",
    "tensor2obj",
    "serialize_to_tensor",
    "pad_to_largest_tensor",
    "broadcast",
    "all_gather_object_gpu",
    "all_gather_object_cpu",
    "create_tmpdir",
    "collect_results",
    "release_buffers",
]

F = TypeVar("F", bound=Callable[..., Any])
Group = Optional["dist.ProcessGroup"]

#: Serialized objects larger than this trigger a warning (1 GiB).
LARGE_PAYLOAD_BYTES = 1 << 30
#: Launcher names accepted by :func:`init_dist`.
LAUNCHERS = ("pytorch", "slurm", "mpi")
#: Port used by the slurm and mpi launchers when neither ``port`` nor MASTER_PORT is given.
DEFAULT_PORT = 29500
#: Directory (relative to the working directory) under which shared temporary
#: directories are made when the system temporary directory is not used.
LOCAL_TMP_ROOT = ".dist_tmp"

_CPU = torch.device("cpu")


# --------------------------------------------------------------------------- #
# Process information
# --------------------------------------------------------------------------- #


def distributed_available() -> bool:
    """Whether torch.distributed is usable right now.

    Returns:
        True when PyTorch was built with distributed support and the default
        process group has been initialized.
    """
    return dist.is_available() and dist.is_initialized()


def is_distributed() -> bool:
    """Whether this process is part of an initialized default process group.

    Returns:
        True when torch.distributed is available and initialized (also for a
        world of size one).
    """
    return distributed_available()


def get_rank(group: Group = None) -> int:
    """Rank of this process.

    Args:
        group: Process group to query; the default group when None.

    Returns:
        The rank within ``group``, or 0 when no process group is initialized.
    """
    if not is_distributed():
        return 0
    return dist.get_rank(group)


def get_world_size(group: Group = None) -> int:
    """Number of processes.

    Args:
        group: Process group to query; the default group when None.

    Returns:
        The size of ``group``, or 1 when no process group is initialized.
    """
    if not is_distributed():
        return 1
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """Rank of this process among the processes on its machine.

    Read from the ``LOCAL_RANK`` environment variable, which ``torchrun`` sets
    and :func:`init_dist` sets for every launcher.

    Returns:
        The local rank, or 0 when ``LOCAL_RANK`` is not set.

    Raises:
        ValueError: if ``LOCAL_RANK`` is set but is not an integer.
    """
    value = os.environ.get("LOCAL_RANK")
    if value is None or value.strip() == "":
        return 0
    return _parse_int("LOCAL_RANK", value)


def synchronize(group: Group = None) -> None:
    """Block until every process of the group has reached this call (a barrier).

    A no-op when not distributed or when the group has a single process.

    Args:
        group: Process group to synchronize; the default group when None.
    """
    if get_world_size(group) <= 1:
        return
    if _backend_name(group) == "nccl" and torch.cuda.is_available():
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier(group=group)


def rank_zero_only(func: F) -> F:
    """Decorator: run ``func`` on global rank 0 only.

    On every other rank the decorated function does nothing and returns None.
    The rank is looked up at call time, so decorating before
    :func:`init_dist` is fine. In a single process the function always runs.

    Args:
        func: The function to guard.

    Returns:
        The wrapped function.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if get_rank() == 0:
            return func(*args, **kwargs)
        return None

    return wrapper  # type: ignore[return-value]


def _wrapper_types() -> Tuple[type, ...]:
    types: List[type] = [torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel]
    try:  # fastcoll's own DDP lives in an optional module; look it up at call time.
        from fastcoll.ddp import DDP  # type: ignore[import-not-found]
    except ImportError:
        pass
    else:
        types.append(DDP)
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - distributed-less builds
        pass
    else:
        types.append(FullyShardedDataParallel)
    return tuple(types)


def is_module_wrapper(module: Any) -> bool:
    """Whether ``module`` is a data-parallel wrapper around another module.

    Recognised wrappers are :class:`torch.nn.DataParallel`,
    :class:`torch.nn.parallel.DistributedDataParallel`,
    ``FullyShardedDataParallel``, ``fastcoll.DDP`` and subclasses of any of
    them. Modules that only forward to an inner module (the result of
    ``torch.compile``) are looked through, so ``torch.compile(DDP(model))``
    is a wrapper too, however deeply such layers nest.

    Args:
        module: The object to check.

    Returns:
        True when ``module`` is (or transparently wraps) a data-parallel wrapper.
    """
    wrappers = _wrapper_types()
    seen = set()
    while isinstance(module, torch.nn.Module) and id(module) not in seen:
        seen.add(id(module))
        if isinstance(module, wrappers):
            return True
        inner = module.__dict__.get("_orig_mod")  # torch.compile's OptimizedModule
        if inner is None:
            inner = module.__dict__.get("_modules", {}).get("_orig_mod")
        if inner is None:
            return False
        module = inner
    return False


# --------------------------------------------------------------------------- #
# Backends and devices
# --------------------------------------------------------------------------- #


def _backend_name(group: Group = None) -> str:
    if not is_distributed():
        return ""
    return str(dist.get_backend(group)).lower()


def _backend_handles(device: torch.device, group: Group = None) -> bool:
    """Whether the group's backend can run collectives on tensors of ``device``."""
    backend = _backend_name(group)
    if ":" in backend:  # a per-device mapping such as "cpu:gloo,cuda:nccl"
        return any(part.split(":")[0].strip() == device.type for part in backend.split(","))
    if backend == "nccl":
        return device.type == "cuda"
    if backend == "gloo":
        return device.type in ("cpu", "cuda")
    if backend == "mpi":
        return device.type == "cpu"
    return True  # an unknown backend: let torch decide


def _comm_device(group: Group = None) -> torch.device:
    """The device object tensors must live on for the group's backend."""
    backend = _backend_name(group)
    if ":" in backend:
        types = [part.split(":")[0].strip() for part in backend.split(",")]
        if "cpu" in types:
            return _CPU
        if "cuda" in types and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return _CPU
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return _CPU


_BUFFERS = threading.local()


def _flat_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D buffer for :func:`allreduce_grads`; on CPU reused between calls of the same thread.

    Fresh multi-megabyte CPU allocations are returned to the OS when freed, so
    every call would pay for page-faulting them in again (more than the copy
    itself). CUDA memory comes from torch's caching allocator and is not kept.
    """
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    cache = getattr(_BUFFERS, "cache", None)
    if cache is None:
        cache = _BUFFERS.cache = {}
    buf = cache.get(dtype)
    if buf is None or buf.numel() < numel:
        cache.pop(dtype, None)  # free the old one before allocating the new one
        buf = cache[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


def release_buffers() -> None:
    """Free the CPU buffers :func:`allreduce_grads` keeps between calls (in this thread)."""
    _BUFFERS.cache = {}


def _all_reduce_flat(flat: torch.Tensor, group: Group, async_op: bool = False) -> Optional[Any]:
    """SUM-all-reduce ``flat`` in place, staging it through the backend's device if needed."""
    if _backend_handles(flat.device, group):
        return dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    staged = flat.to(_comm_device(group), copy=True)
    dist.all_reduce(staged, op=dist.ReduceOp.SUM, group=group)
    flat.copy_(staged)
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _type_name(obj: Any) -> str:
    cls = type(obj)
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def _fusable(t: torch.Tensor) -> bool:
    """Whether the fused ops can pack ``t`` directly."""
    return t.layout == torch.strided and t.dtype in SUPPORTED_DTYPES and is_dense(t)


# --------------------------------------------------------------------------- #
# Serialization helpers
# --------------------------------------------------------------------------- #


def _dumps(obj: Any, what: str) -> bytes:
    """Pickle ``obj``; TypeError naming its type on failure; warn when huge."""
    try:
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # PicklingError, TypeError, AttributeError (local objects), ...
        raise TypeError(f"fastcoll.dist.{what}: cannot pickle an object of type {_type_name(obj)}: {exc}") from exc
    if len(payload) > LARGE_PAYLOAD_BYTES:
        warnings.warn(
            f"fastcoll.dist.{what}: the serialized {_type_name(obj)} is {len(payload) / (1 << 30):.2f} GiB; "
            "sending it through a collective needs that much memory on every rank and may be slow",
            RuntimeWarning,
            stacklevel=3,
        )
    return payload


def _bytes_to_tensor(payload: bytes, device: torch.device, size: Optional[int] = None) -> torch.Tensor:
    """uint8 tensor holding ``payload``, zero-padded to ``size`` elements."""
    size = len(payload) if size is None else size
    out = torch.zeros(size, dtype=torch.uint8)
    if payload:
        out[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return out.to(device)


def _tensor_to_bytes(tensor: torch.Tensor, size: Optional[int] = None) -> bytes:
    t = tensor.detach().reshape(-1)
    if size is not None:
        t = t[:size]
    return t.cpu().numpy().tobytes()


def _pack_error(exc: BaseException) -> bytes:
    return f"{type(exc).__name__}\0{exc}".encode("utf-8", "replace")


_ERROR_TYPES = {"TypeError": TypeError, "ValueError": ValueError, "OSError": OSError}


def _exchange_header(
    values: Sequence[int], error: Optional[bytes], group: Group, what: str
) -> List[List[int]]:
    """All-gather ``values`` (small ints) plus an error flag; raise everywhere if any rank failed.

    Every rank of ``group`` must call this. When some rank passed an error,
    the error texts are gathered too and every rank raises the same
    exception, of the type the lowest failing rank hit, listing each
    failing rank's message.

    Returns:
        Per group rank, the ``values`` that rank passed.
    """
    ws = get_world_size(group)
    device = _comm_device(group)
    err = error or b""
    record = torch.tensor([len(err), *values], dtype=torch.int64, device=device)
    records = [torch.empty_like(record) for _ in range(ws)]
    dist.all_gather(records, record, group=group)
    rows = torch.stack(records).cpu().tolist()
    err_sizes = [row[0] for row in rows]
    if any(err_sizes):
        longest = max(err_sizes)
        mine = _bytes_to_tensor(err, device, longest)
        texts = [torch.empty_like(mine) for _ in range(ws)]
        dist.all_gather(texts, mine, group=group)
        failures = []
        kinds = []
        for r, (t, n) in enumerate(zip(texts, err_sizes)):
            if n:
                kind, _, msg = _tensor_to_bytes(t, n).decode("utf-8", "replace").partition("\0")
                kinds.append(kind)
                failures.append(f"rank {r}: {msg}")
        exc_type = _ERROR_TYPES.get(kinds[0], RuntimeError)
        raise exc_type(f"fastcoll.dist.{what} failed on {len(failures)} rank(s): " + "; ".join(failures))
    return [row[1:] for row in rows]


def _gather_objects(obj: Any, group: Group, what: str, to_group_rank0: bool) -> Optional[List[Any]]:
    """Gather a picklable object from every rank (on every rank, or on group rank 0 only)."""
    ws = get_world_size(group)
    device = _comm_device(group)
    payload = b""
    error = None
    try:
        payload = _dumps(obj, what)
    except TypeError as exc:
        error = _pack_error(exc)
    sizes = [row[0] for row in _exchange_header([len(payload)], error, group, what)]
    longest = max(sizes)
    mine = _bytes_to_tensor(payload, device, longest)
    if to_group_rank0:
        is_root = dist.get_rank(group) == 0
        parts = [torch.empty_like(mine) for _ in range(ws)] if is_root else None
        dist.gather(mine, parts, group=group, group_dst=0)
        if not is_root:
            return None
    else:
        parts = [torch.empty_like(mine) for _ in range(ws)]
        dist.all_gather(parts, mine, group=group)
    return [pickle.loads(_tensor_to_bytes(t, n)) for t, n in zip(parts, sizes)]


def obj2tensor(pyobj: Any, device: Union[str, torch.device, None] = None) -> torch.Tensor:
    """Serialize a picklable object into a 1-D uint8 tensor.

    Args:
        pyobj: Any picklable object.
        device: Where to put the tensor. None picks the device the default
            process group's backend communicates on (CUDA for NCCL, else CPU;
            CPU when not distributed).

    Returns:
        The pickled bytes as a uint8 tensor.

    Raises:
        TypeError: if ``pyobj`` cannot be pickled (the message names its type).
    """
    payload = _dumps(pyobj, "obj2tensor")
    return _bytes_to_tensor(payload, _comm_device() if device is None else torch.device(device))


def tensor2obj(tensor: torch.Tensor) -> Any:
    """Deserialize an object from a tensor made by :func:`obj2tensor`.

    Args:
        tensor: The serialized bytes, on any device (non-uint8 tensors are read
            as their raw bytes).

    Returns:
        The unpickled object.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"fastcoll.dist.tensor2obj: expected a tensor, got {_type_name(tensor)}")
    t = tensor.detach().cpu().contiguous().reshape(-1)
    if t.dtype != torch.uint8:
        t = t.view(torch.uint8)
    return pickle.loads(t.numpy().tobytes())


def serialize_to_tensor(data: Any) -> torch.Tensor:
    """Serialize a picklable object into a uint8 tensor on the backend's device.

    Args:
        data: Any picklable object.

    Returns:
        A 1-D uint8 tensor on CUDA for an NCCL default group, else on CPU.

    Raises:
        TypeError: if ``data`` cannot be pickled (the message names its type).
    """
    return _bytes_to_tensor(_dumps(data, "serialize_to_tensor"), _comm_device())


def pad_to_largest_tensor(tensor: torch.Tensor, group: Group = None) -> Tuple[List[int], torch.Tensor]:
    """Zero-pad a 1-D tensor to the largest length any rank has.

    Args:
        tensor: The local tensor (flattened if not 1-D), typically from
            :func:`serialize_to_tensor`. Ranks may pass different lengths.
        group: Process group; the default group when None.

    Returns:
        Every rank's original length, in group-rank order, and the local tensor
        zero-padded to the largest of them, on the backend's device.
    """
    flat = tensor.reshape(-1)
    ws = get_world_size(group)
    if ws == 1:
        return [flat.numel()], flat
    device = _comm_device(group)
    flat = flat.to(device)
    size = torch.tensor([flat.numel()], dtype=torch.int64, device=device)
    sizes_t = [torch.empty_like(size) for _ in range(ws)]
    dist.all_gather(sizes_t, size, group=group)
    sizes = [int(s.item()) for s in sizes_t]
    longest = max(sizes)
    if flat.numel() < longest:
        flat = torch.cat([flat, flat.new_zeros(longest - flat.numel())])
    return sizes, flat


# --------------------------------------------------------------------------- #
# Object collectives
# --------------------------------------------------------------------------- #


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
    if get_world_size(group) == 1:
        return obj
    if group is None:
        if not 0 <= src < dist.get_world_size():
            raise ValueError(f"fastcoll.dist.broadcast: src={src} is not a rank of a world of size {dist.get_world_size()}")
    elif src not in dist.get_process_group_ranks(group):
        raise ValueError(f"fastcoll.dist.broadcast: src={src} is not a member of the group")
    device = _comm_device(group)
    is_src = dist.get_rank() == src
    payload = b""
    failed = 0
    if is_src:
        try:
            payload = _dumps(obj, "broadcast")
        except TypeError as exc:
            payload, failed = str(exc).encode("utf-8", "replace"), 1
    header = torch.tensor([len(payload), failed], dtype=torch.int64, device=device)
    dist.broadcast(header, src=src, group=group)
    size, failed = (int(v) for v in header.tolist())
    buf = _bytes_to_tensor(payload, device) if is_src else torch.empty(size, dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=src, group=group)
    if failed:
        raise TypeError(f"fastcoll.dist.broadcast: rank {src} could not send its object: " + _tensor_to_bytes(buf).decode("utf-8", "replace"))
    if is_src:
        return obj
    return pickle.loads(_tensor_to_bytes(buf))


def all_gather_object_gpu(data: Any, rank_zero_return_only: bool = True, group: Group = None) -> Optional[List[Any]]:
    """Gather a picklable object from every rank through tensors on the backend's device.

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
    if get_world_size(group) == 1:
        return [data]
    return _gather_objects(data, group, "all_gather_object_gpu", to_group_rank0=rank_zero_return_only)


def create_tmpdir(rank: int, tmpdir: Optional[str] = None, use_system_tmp: bool = True) -> str:
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
                error = f"rank 0 could not create a temporary directory: {exc}"
        if get_world_size() > 1:
            path, error = broadcast((path, error), src=0)
        if error is not None:
            raise OSError(f"fastcoll.dist.create_tmpdir: {error}")
        tmpdir = path
    os.makedirs(tmpdir, exist_ok=True)
    return tmpdir


def _part_file(tmpdir: str, rank: int) -> str:
    return os.path.join(tmpdir, f"part_{rank}.pkl")


def all_gather_object_cpu(
    data: Any, tmpdir: Optional[str] = None, rank_zero_return_only: bool = True, use_system_tmp: bool = False
) -> Optional[List[Any]]:
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
    if ws == 1:
        return [data]
    rank = get_rank()
    created = tmpdir is None
    path = create_tmpdir(rank, tmpdir, use_system_tmp)
    try:
        error = None
        try:
            payload = _dumps(data, "all_gather_object_cpu")
            staging = _part_file(path, rank) + ".tmp"
            with open(staging, "wb") as fh:
                fh.write(payload)
            os.replace(staging, _part_file(path, rank))
        except (TypeError, OSError) as exc:
            error = _pack_error(exc)
        # Doubles as the barrier after which every part file exists.
        _exchange_header([], error, None, "all_gather_object_cpu")
        if rank_zero_return_only and rank != 0:
            return None
        results: List[Any] = []
        load_error = None
        try:
            for r in range(ws):
                with open(_part_file(path, r), "rb") as fh:
                    results.append(pickle.load(fh))
        except Exception as exc:
            load_error = exc
        if not rank_zero_return_only:
            # Rank 0 must not delete the files while another rank still reads them.
            _exchange_header([], None if load_error is None else _pack_error(load_error), None, "all_gather_object_cpu")
        if load_error is not None:
            raise load_error
        return results
    finally:
        if rank == 0:
            _remove_exchange_dir(path, created, ws)


def _remove_exchange_dir(path: str, created: bool, world_size: int) -> None:
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


def collect_results(
    results: Sequence[Any], size: int, device: str = "cpu", tmpdir: Optional[str] = None
) -> Optional[List[Any]]:
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
            on the backend's device (:func:`all_gather_object_gpu`).
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
    if get_world_size() == 1:
        parts: Optional[List[Any]] = [results]
    elif device == "gpu":
        parts = all_gather_object_gpu(results, rank_zero_return_only=True)
    else:
        parts = all_gather_object_cpu(results, tmpdir=tmpdir, rank_zero_return_only=True)
    if parts is None:
        return None
    ordered: List[Any] = []
    longest = max(len(p) for p in parts)
    for i in range(longest):
        for part in parts:
            if i < len(part):
                ordered.append(part[i])
    if len(ordered) < size:
        warnings.warn(
            f"fastcoll.dist.collect_results: gathered {len(ordered)} results but size is {size}",
            RuntimeWarning,
            stacklevel=2,
        )
    return ordered[:size]


# --------------------------------------------------------------------------- #
# Tensor collectives
# --------------------------------------------------------------------------- #


def _check_consistent(desc: Any, group: Group, what: str, explain: Callable[[List[Any]], str]) -> None:
    """Raise ValueError on every rank unless ``desc`` is the same on every rank.

    Costs one all-gather of a 16-byte digest; only on a mismatch are the full
    descriptions gathered, to build a message naming what differs.
    """
    digest = hashlib.blake2b(repr(desc).encode("utf-8"), digest_size=16).digest()
    device = _comm_device(group)
    mine = _bytes_to_tensor(digest, device)
    gathered = [torch.empty_like(mine) for _ in range(get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    rows = torch.stack(gathered).cpu()
    if bool((rows == rows[0]).all()):
        return
    descs = _gather_objects(desc, group, what, to_group_rank0=False)
    assert descs is not None
    raise ValueError(f"fastcoll.dist.{what}: {explain(descs)}")


def _spec(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"{_dtype_name(t.dtype)}{list(t.shape)} on {t.device.type}"
    return f"a {_type_name(t)}"


def reduce_mean(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Mean of a tensor over all ranks, as a new tensor.

    The input is never modified. Floating-point tensors are copied and scaled
    by ``1 / world_size`` in one fused pass, all-reduced, and returned with the
    input's shape and strides; integer and bool tensors return a float32 mean.
    The result does not track gradients.

    Args:
        tensor: The local tensor; same shape and dtype on every rank.
        group: Process group; the default group when None.

    Returns:
        A new tensor holding the element-wise mean (a copy of ``tensor`` in a
        single process).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"fastcoll.dist.reduce_mean: expected a tensor, got {_type_name(tensor)}")
    ws = get_world_size(group)
    with torch.no_grad():
        src = tensor.detach()
        if src.layout == torch.strided and src.dtype in SUPPORTED_DTYPES:
            if not is_dense(src):
                src = src.contiguous()
            flat = torch.empty(src.numel(), dtype=src.dtype, device=src.device)
            if src.numel() > 0:
                ops.flatten_scale([src], flat, 1.0 / ws)
                if ws > 1:
                    _all_reduce_flat(flat, group)
            return ops.bucket_views(flat, [src])[0]
        if src.is_complex():
            out = src.clone(memory_format=torch.contiguous_format)
            if ws > 1:
                _all_reduce_flat(out.reshape(-1), group)
            return out / ws
        acc = src.to(torch.int64 if src.dtype == torch.bool else src.dtype).clone(memory_format=torch.contiguous_format)
        if ws > 1 and acc.numel() > 0:
            _all_reduce_flat(acc.reshape(-1), group)
        return acc.to(torch.float32) / ws


def _as_tensor(value: Any) -> Optional[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (bool, int, float)):
        return torch.tensor(value)
    return None


def _explain_dict_mismatch(descs: List[Any]) -> str:
    problems = []
    settings = [d[0] for d in descs]
    if any(s != settings[0] for s in settings):
        problems.append(
            "the arguments differ: "
            + ", ".join(f"rank {r} op={s[0]!r} to_float={s[1]}" for r, s in enumerate(settings))
        )
    per_rank = [dict((key, spec) for key, spec in d[1]) for d in descs]
    keys = sorted(set().union(*per_rank))
    for key in keys:
        missing = [r for r, d in enumerate(per_rank) if key not in d]
        present = [(r, d[key]) for r, d in enumerate(per_rank) if key in d]
        if missing:
            problems.append(f"key {key} is missing on rank(s) {missing}")
        elif any(spec != present[0][1] for _, spec in present):
            problems.append(f"key {key} differs: " + ", ".join(f"rank {r} {spec}" for r, spec in present))
    return "the dicts differ across ranks; " + "; ".join(problems)


def all_reduce_dict(
    py_dict: Mapping[Any, Any],
    op: str = "sum",
    group: Group = None,
    to_float: bool = True,
    *,
    reduce_op: Optional[str] = None,
) -> "OrderedDict[Any, torch.Tensor]":
    """Sum or average every value of a dict of tensors over all ranks.

    Ranks may build the dict in different key orders. Before reducing, one
    all-gather of a 16-byte digest of every rank's keys, shapes, dtypes and
    device types (and of ``op``/``to_float``) checks that they agree; if not,
    every rank raises a ValueError naming the keys that differ. The values are
    then packed in sorted-key order, per dtype/device group, with one fused
    :func:`fastcoll.ops.flatten_scale` (which also applies the ``1 / world_size``
    of a mean), reduced with one all-reduce and unpacked with one fused
    :func:`fastcoll.ops.unflatten_scale` into new tensors. The input tensors
    are not modified.

    Args:
        py_dict: Mapping of keys to tensors (Python numbers are accepted and
            become 0-d tensors).
        op: 'sum' or 'mean'.
        group: Process group; the default group when None.
        to_float: Convert every value to float32 first. When False, floating
            dtypes are kept; integer and bool values are summed exactly in
            int64 and cast back (bool sums are a logical or), and their mean
            is float32.
        reduce_op: Alias of ``op`` (the keyword vis4d uses); overrides it when given.

    Returns:
        A new ordered dict with the caller's keys in the caller's order.

    Raises:
        ValueError: on every rank, if the dicts or arguments differ across
            ranks; if ``op`` is not 'sum' or 'mean'.
        TypeError: on every rank, for values that are not tensors or numbers,
            or are complex.
    """
    if reduce_op is not None:
        op = reduce_op
    if op not in ("sum", "mean"):
        raise ValueError(f"fastcoll.dist.all_reduce_dict: op must be 'sum' or 'mean', got {op!r}")
    if not isinstance(py_dict, Mapping):
        raise TypeError(f"fastcoll.dist.all_reduce_dict: expected a dict, got {_type_name(py_dict)}")
    ws = get_world_size(group)
    keys = list(py_dict.keys())
    values = {k: _as_tensor(py_dict[k]) for k in keys}
    order = sorted(range(len(keys)), key=lambda i: repr(keys[i]))
    canonical = [keys[i] for i in order]
    if ws > 1:
        desc = (
            (op, bool(to_float)),
            [(repr(k), _spec(py_dict[k] if values[k] is None else values[k])) for k in canonical],
        )
        _check_consistent(desc, group, "all_reduce_dict", _explain_dict_mismatch)
    bad = [repr(k) for k in canonical if values[k] is None]
    if bad:
        raise TypeError(
            "fastcoll.dist.all_reduce_dict: values must be tensors or numbers; not so for key(s) " + ", ".join(bad)
        )
    complex_keys = [repr(k) for k in canonical if values[k].is_complex()]  # type: ignore[union-attr]
    if complex_keys:
        raise TypeError("fastcoll.dist.all_reduce_dict: complex values are not supported (key(s) " + ", ".join(complex_keys) + ")")

    # Group in canonical order so every rank builds the same buffers.
    fused: "OrderedDict[Tuple[torch.dtype, torch.device], List[Any]]" = OrderedDict()
    exact: "OrderedDict[torch.device, List[Any]]" = OrderedDict()
    for k in canonical:
        t = values[k]
        assert t is not None
        if to_float:
            if t.dtype not in SUPPORTED_DTYPES:
                t = t.float()
            fused.setdefault((torch.float32, t.device), []).append(k)
            values[k] = t
        elif t.dtype in SUPPORTED_DTYPES:
            fused.setdefault((t.dtype, t.device), []).append(k)
        else:
            exact.setdefault(t.device, []).append(k)

    out: Dict[Any, torch.Tensor] = {}
    scale = 1.0 / ws if op == "mean" else 1.0
    pending = []
    with torch.no_grad():
        for (dtype, device), group_keys in fused.items():
            srcs = [values[k] if values[k].is_contiguous() else values[k].contiguous() for k in group_keys]  # type: ignore[union-attr]
            flat = torch.empty(ops.total_numel(srcs), dtype=dtype, device=device)
            ops.flatten_scale(srcs, flat, scale)
            handle = _all_reduce_flat(flat, group, async_op=True) if ws > 1 and flat.numel() > 0 else None
            dests = [torch.empty(s.shape, dtype=dtype, device=device) for s in srcs]
            pending.append((handle, flat, group_keys, dests))
        for device, group_keys in exact.items():
            srcs = [values[k] for k in group_keys]
            flat = torch.cat([s.reshape(-1).to(torch.int64) for s in srcs])  # type: ignore[union-attr]
            if ws > 1 and flat.numel() > 0:
                _all_reduce_flat(flat, group)
            pieces = torch.split(flat, [s.numel() for s in srcs])  # type: ignore[union-attr]
            for k, s, piece in zip(group_keys, srcs, pieces):
                piece = piece.reshape(s.shape)  # type: ignore[union-attr]
                out[k] = piece.to(torch.float32) / ws if op == "mean" else piece.to(s.dtype)  # type: ignore[union-attr]
        for handle, flat, group_keys, dests in pending:
            if handle is not None:
                handle.wait()
            ops.unflatten_scale(flat, dests, 1.0)
            out.update(zip(group_keys, dests))
    return OrderedDict((k, out[k]) for k in keys)


def _explain_grads_mismatch(descs: List[Any]) -> str:
    parts = []
    settings = [d[0] for d in descs]
    if any(s != settings[0] for s in settings):
        parts.append(
            "the arguments differ: "
            + ", ".join(f"rank {r} coalesce={s[0]} bucket_size_mb={s[1]}" for r, s in enumerate(settings))
        )
    specs = [d[1] for d in descs]
    counts = [len(s) for s in specs]
    if any(c != counts[0] for c in counts):
        parts.append("the number of gradients differs: " + ", ".join(f"rank {r} has {c}" for r, c in enumerate(counts)))
    for i in range(max(counts)):
        column = [s[i] if i < len(s) else None for s in specs]
        if any(c != column[0] for c in column):
            parts.append(
                f"gradient {i} is the first to differ: "
                + ", ".join(f"rank {r} {c if c is not None else '(none)'}" for r, c in enumerate(column))
            )
            break
    return "the gradients differ across ranks (parameters without .grad differ?); " + "; ".join(parts)


def _take_buckets(tensors: List[torch.Tensor], limit_bytes: float) -> List[List[torch.Tensor]]:
    if limit_bytes <= 0:
        return [tensors]
    buckets: List[List[torch.Tensor]] = []
    current: List[torch.Tensor] = []
    used = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if current and used + nbytes > limit_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(t)
        used += nbytes
    if current:
        buckets.append(current)
    return buckets


def _mean_one(t: torch.Tensor, ws: int, group: Group) -> Optional[Tuple[Any, torch.Tensor, torch.Tensor]]:
    """Average one tensor in place; returns work to finish when the reduce is async."""
    if t.layout == torch.sparse_coo:  # summed from all-gathers (see fastcoll._sparse), then written back
        t.copy_(all_reduce_sparse(t, group, ws) / ws)
        return None
    if t.is_contiguous() and _backend_handles(t.device, group):
        t.div_(ws)
        return (dist.all_reduce(t, group=group, async_op=True), t, t)
    staged = t.contiguous().to(_comm_device(group) if not _backend_handles(t.device, group) else t.device)
    staged.div_(ws)
    dist.all_reduce(staged, group=group)
    t.copy_(staged)
    return None


def allreduce_grads(
    params: Iterable[torch.Tensor],
    coalesce: bool = True,
    bucket_size_mb: float = -1,
    group: Group = None,
    *,
    check: bool = True,
) -> None:
    """Average, in place, the ``.grad`` of every parameter that has one over all ranks.

    With ``coalesce`` the gradients are grouped by dtype and device (in
    parameter order) and, when ``bucket_size_mb > 0``, split into buckets of at
    most that many MiB (a larger gradient gets a bucket of its own). Each
    bucket is packed and scaled by ``1 / world_size`` with one fused
    :func:`fastcoll.ops.flatten_scale`, all-reduced asynchronously (the next
    bucket is packed meanwhile) and written back with one fused
    :func:`fastcoll.ops.unflatten_scale`. Gradients the fused ops cannot pack
    (sparse, non-dense, other dtypes) are reduced one by one, as is everything
    with ``coalesce=False``. Gradients are packed in memory order, so a
    gradient must have the same memory layout on every rank (as with DDP).
    On CPU the flat buffer is kept between calls (per thread), since faulting
    in fresh memory every step costs more than the copies; free it with
    :func:`release_buffers`.

    Args:
        params: Parameters (or any tensors with ``.grad``); those whose
            ``.grad`` is None are skipped.
        coalesce: Reduce in flat buckets instead of tensor by tensor.
        bucket_size_mb: Bucket size in MiB; one bucket per dtype/device group
            when <= 0.
        group: Process group; the default group when None.
        check: First verify, with one all-gather of a 16-byte digest, that
            every rank reduces the same number of gradients with the same
            shapes and dtypes; a mismatch raises ValueError on every rank
            instead of corrupting the gradients or hanging.

    Raises:
        ValueError: on every rank, if ``check`` finds the gradients differ.
    """
    seen = set()
    grads: List[torch.Tensor] = []
    for p in params:
        g = p.grad
        if g is None or id(p) in seen or id(g) in seen:
            continue
        seen.update((id(p), id(g)))
        grads.append(g)
    for i, g in enumerate(grads):
        if g.layout not in (torch.strided, torch.sparse_coo):
            raise TypeError(
                f"fastcoll.dist.allreduce_grads: gradient {i} ({_dtype_name(g.dtype)}{list(g.shape)}) has layout "
                f"{g.layout}; only dense (strided) and sparse COO gradients can be reduced"
            )
    ws = get_world_size(group)
    if ws == 1:
        return
    if check:
        desc = (
            (bool(coalesce), float(bucket_size_mb)),
            [f"{_dtype_name(g.dtype)}{list(g.shape)} {g.layout} on {g.device.type}" for g in grads],
        )
        _check_consistent(desc, group, "allreduce_grads", _explain_grads_mismatch)
    if not grads:
        return
    with torch.no_grad():
        if not coalesce:
            waits = [w for w in (_mean_one(g, ws, group) for g in grads) if w is not None]
            for handle, _, _ in waits:
                handle.wait()
            return
        groups: "OrderedDict[Tuple[torch.dtype, torch.device], List[torch.Tensor]]" = OrderedDict()
        singles: List[torch.Tensor] = []
        for g in grads:
            if _fusable(g):
                if g.numel() > 0:
                    groups.setdefault((g.dtype, g.device), []).append(g)
            else:
                singles.append(g)
        limit = float(bucket_size_mb) * 1024 * 1024
        pending = []
        for (dtype, device), members in groups.items():
            storage = _flat_buffer(ops.total_numel(members), dtype, device)
            offset = 0
            for bucket in _take_buckets(members, limit):
                n = ops.total_numel(bucket)
                flat = storage[offset : offset + n]
                offset += n
                ops.flatten_scale(bucket, flat, 1.0 / ws)
                pending.append((_all_reduce_flat(flat, group, async_op=True), flat, bucket))
        waits = [w for w in (_mean_one(g, ws, group) for g in singles) if w is not None]
        for handle, flat, bucket in pending:
            if handle is not None:
                handle.wait()
            ops.unflatten_scale(flat, bucket, 1.0)
        for handle, _, _ in waits:
            handle.wait()


# --------------------------------------------------------------------------- #
# Launching
# --------------------------------------------------------------------------- #


class LaunchInfo(NamedTuple):
    """Where this process sits in the job, as read from a launcher's environment."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: Optional[str]
    master_port: Optional[int]


def _parse_int(name: str, value: str) -> int:
    try:
        return int(str(value).strip())
    except ValueError:
        raise ValueError(f"fastcoll.dist: environment variable {name}={value!r} is not an integer") from None


def _split_top_level(text: str) -> List[str]:
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


def _range_values(spec: str, text: str) -> List[str]:
    values: List[str] = []
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
    pieces: List[List[str]] = []
    pos = 0
    for m in re.finditer(r"\[([^\[\]]*)\]", item):
        pieces.append([item[pos : m.start()]])
        pieces.append(_range_values(m.group(1), text))
        pos = m.end()
    pieces.append([item[pos:]])
    if any("[" in p[0] or "]" in p[0] for p in pieces[::2]):
        raise ValueError(f"malformed brackets in SLURM node list {text!r}")
    return ("".join(combo) for combo in itertools.product(*pieces))


def expand_slurm_nodelist(nodelist: str) -> List[str]:
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
    items = _split_top_level(nodelist.strip())
    if not items:
        raise ValueError(f"empty SLURM node list {nodelist!r}")
    return [host for item in items for host in _expand_host(item, nodelist)]


def slurm_first_host(nodelist: str) -> str:
    """The first host of a SLURM node list, without expanding the rest.

    Args:
        nodelist: The value of SLURM_NODELIST, e.g. ``node[01-04,07]``.

    Returns:
        The first host name, e.g. ``node01``.

    Raises:
        ValueError: on an empty or malformed list.
    """
    items = _split_top_level(nodelist.strip())
    if not items:
        raise ValueError(f"empty SLURM node list {nodelist!r}")
    return next(iter(_expand_host(items[0], nodelist)))


def _tasks_per_node(value: str) -> List[int]:
    """Parse SLURM's compressed tasks-per-node list, e.g. ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts: List[int] = []
    for part in value.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(f"cannot parse a SLURM tasks-per-node value {value!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def _slurm_local_id(procid: int, value: str) -> int:
    counts = _tasks_per_node(value)
    if len(counts) == 1 or sum(counts) <= procid:
        return procid % max(counts[-1], 1)
    start = 0
    for n in counts:  # block distribution: consecutive ranks fill a node
        if procid < start + n:
            return procid - start
        start += n
    return 0  # pragma: no cover


def _env_first(environ: Mapping[str, str], names: Sequence[str]) -> Optional[Tuple[str, str]]:
    for name in names:
        value = environ.get(name)
        if value is not None and value.strip() != "":
            return name, value
    return None


def resolve_launch(
    launcher: str,
    environ: Optional[Mapping[str, str]] = None,
    port: Optional[int] = None,
    need_master: bool = True,
) -> LaunchInfo:
    """Read rank, world size, local rank and rendezvous address from a launcher's environment.

    The part of :func:`init_dist` that only reads; useful to inspect a job's
    environment without joining a process group.

    Args:
        launcher: 'pytorch' (torchrun: RANK, WORLD_SIZE, LOCAL_RANK,
            MASTER_ADDR, MASTER_PORT), 'slurm' (SLURM_PROCID, SLURM_NTASKS,
            SLURM_NODELIST, optional SLURM_LOCALID) or 'mpi'
            (OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK or PMI_RANK/PMI_SIZE, plus
            MASTER_ADDR).
        environ: Environment to read; ``os.environ`` when None.
        port: Rendezvous port overriding MASTER_PORT.
        need_master: Whether a rendezvous address is required.

    Returns:
        The resolved :class:`LaunchInfo`.

    Raises:
        ValueError: for an unknown launcher (listing the valid ones), missing
            variables (listing all of them) or malformed values.
    """
    env = os.environ if environ is None else environ
    if launcher not in LAUNCHERS:
        raise ValueError(f"fastcoll.dist.init_dist: unknown launcher {launcher!r}; expected one of {', '.join(LAUNCHERS)}")
    missing: List[str] = []

    def need(*names: str) -> Optional[Tuple[str, str]]:
        found = _env_first(env, names)
        if found is None:
            missing.append(" or ".join(names))
        return found

    def optional(*names: str) -> Optional[Tuple[str, str]]:
        return _env_first(env, names)

    master_port = port
    master_addr: Optional[str] = None
    if launcher == "pytorch":
        rank_v, size_v = need("RANK"), need("WORLD_SIZE")
        local_v = optional("LOCAL_RANK")
        if need_master:
            addr_v = need("MASTER_ADDR")
            port_v = need("MASTER_PORT") if port is None else None
        else:
            addr_v, port_v = optional("MASTER_ADDR"), optional("MASTER_PORT")
        nodes_v = None
    elif launcher == "slurm":
        rank_v, size_v = need("SLURM_PROCID"), need("SLURM_NTASKS")
        local_v = optional("SLURM_LOCALID")
        nodes_v = need("SLURM_NODELIST", "SLURM_JOB_NODELIST")
        addr_v, port_v = optional("MASTER_ADDR"), optional("MASTER_PORT")
    else:
        rank_v = need("OMPI_COMM_WORLD_RANK", "PMI_RANK")
        size_v = need("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
        local_v = optional("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK")
        addr_v = need("MASTER_ADDR") if need_master else optional("MASTER_ADDR")
        port_v = optional("MASTER_PORT")
        nodes_v = None
    if missing:
        raise ValueError(
            f"fastcoll.dist.init_dist: launcher {launcher!r} needs environment variable(s) that are not set: "
            + ", ".join(missing)
        )
    assert rank_v is not None and size_v is not None
    rank = _parse_int(*rank_v)
    world_size = _parse_int(*size_v)
    if world_size < 1:
        raise ValueError(f"fastcoll.dist.init_dist: {size_v[0]}={world_size} must be at least 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"fastcoll.dist.init_dist: {rank_v[0]}={rank} is not in [0, {world_size})")
    if local_v is not None:
        local_rank = _parse_int(*local_v)
    elif launcher == "slurm":
        per_node = optional("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
        local_rank = _slurm_local_id(rank, per_node[1]) if per_node is not None else 0
    else:
        local_rank = 0
    if local_rank < 0:
        raise ValueError(f"fastcoll.dist.init_dist: negative local rank {local_rank}")
    if addr_v is not None:
        master_addr = addr_v[1].strip()
    elif nodes_v is not None:
        try:
            master_addr = slurm_first_host(nodes_v[1])
        except ValueError as exc:
            raise ValueError(f"fastcoll.dist.init_dist: {nodes_v[0]}: {exc}") from None
    if master_port is None:
        if port_v is not None:
            master_port = _parse_int(*port_v)
        elif launcher != "pytorch":
            master_port = DEFAULT_PORT
    if master_port is not None and not 0 < int(master_port) < 65536:
        raise ValueError(f"fastcoll.dist.init_dist: port {master_port} is out of range")
    return LaunchInfo(rank, world_size, local_rank, master_addr, None if master_port is None else int(master_port))


def init_dist(
    launcher: str,
    backend: Optional[str] = None,
    *,
    port: Optional[int] = None,
    timeout: Union[float, datetime.timedelta, None] = None,
    **kwargs: Any,
) -> None:
    """Initialize the default process group from a launcher's environment.

    Reads rank, world size and local rank as :func:`resolve_launch` does,
    exports RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (so
    later code sees torchrun-style variables whatever the launcher), selects
    the CUDA device of the local rank when the backend uses CUDA (NCCL), and
    calls :func:`torch.distributed.init_process_group`. For SLURM the
    rendezvous host is MASTER_ADDR if set, else the first host of the node
    list (parsed here, no ``scontrol`` needed); the port is ``port``, else
    MASTER_PORT, else 29500.

    Args:
        launcher: 'pytorch', 'slurm' or 'mpi'.
        backend: Process-group backend; 'nccl' when CUDA is available, else 'gloo'.
        port: Rendezvous port, overriding MASTER_PORT.
        timeout: Collective timeout, in seconds or as a timedelta.
        **kwargs: Passed on to ``init_process_group`` (e.g. ``store``,
            ``init_method``; then no rendezvous variables are needed).

    Raises:
        ValueError: for an unknown launcher or missing/malformed variables (all
            missing ones are listed), or NCCL without CUDA.
        RuntimeError: if the default process group is already initialized.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"fastcoll.dist.init_dist: unknown launcher {launcher!r}; expected one of {', '.join(LAUNCHERS)}")
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("fastcoll.dist.init_dist: the default process group is already initialized")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    backend = str(backend).lower()
    uses_cuda = "nccl" in backend
    if uses_cuda and not torch.cuda.is_available():
        raise ValueError(f"fastcoll.dist.init_dist: backend {backend!r} needs CUDA, which is not available")
    own_rendezvous = "store" in kwargs or "init_method" in kwargs
    need_master = not own_rendezvous and backend != "mpi"
    info = resolve_launch(launcher, port=port, need_master=need_master)
    os.environ["RANK"] = str(info.rank)
    os.environ["WORLD_SIZE"] = str(info.world_size)
    os.environ["LOCAL_RANK"] = str(info.local_rank)
    if info.master_addr is not None:
        os.environ["MASTER_ADDR"] = info.master_addr
    if info.master_port is not None:
        os.environ["MASTER_PORT"] = str(info.master_port)
    if uses_cuda:
        torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
    if timeout is not None:
        kwargs["timeout"] = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)
    if backend == "mpi":
        dist.init_process_group(backend, **kwargs)
        return
    if not own_rendezvous:
        kwargs["init_method"] = "env://"
    dist.init_process_group(backend, rank=info.rank, world_size=info.world_size, **kwargs)
