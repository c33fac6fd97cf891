"""Joining a job: read a launcher's environment and initialize the default process group.

Each launcher is one row of :data:`LAUNCHER_ENV`: which environment variables
give the rank, world size, local rank, rendezvous address and port (and, for
SLURM, the node list and tasks per node), which of them are required, and the
default port. :func:`resolve_launch` reads a row; :func:`init_dist` joins.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist

from .process import parse_int
from .slurm import slurm_first_host, slurm_local_id

__all__ = ["DEFAULT_PORT", "LAUNCHERS", "LAUNCHER_ENV", "LaunchInfo", "init_dist", "resolve_launch"]

#: Port used by the slurm and mpi launchers when neither ``port`` nor MASTER_PORT is given.
DEFAULT_PORT = 29500

_WHO = "fastcoll.dist.init_dist"

# When an environment variable is required.
OPTIONAL = "optional"
ALWAYS = "always"
RENDEZVOUS = "rendezvous"  # when init_dist makes the rendezvous (no store/init_method, not mpi)
RENDEZVOUS_NO_PORT = "rendezvous without port"  # ... and no ``port`` argument was given


class EnvVar(NamedTuple):
    """Where one value comes from: the first of ``names`` that is set and not blank."""

    names: tuple[str, ...] = ()
    required: str = OPTIONAL


class LauncherEnv(NamedTuple):
    """The environment one launcher provides (one row of :data:`LAUNCHER_ENV`)."""

    rank: EnvVar
    world_size: EnvVar
    local_rank: EnvVar
    master_addr: EnvVar
    master_port: EnvVar
    nodelist: EnvVar = EnvVar()  # its first host is the address when master_addr is not set
    tasks_per_node: EnvVar = EnvVar()  # gives the local rank when local_rank is not set
    default_port: int | None = DEFAULT_PORT


#: Launcher name -> the environment it provides.
LAUNCHER_ENV: dict[str, LauncherEnv] = {
    "pytorch": LauncherEnv(
        rank=EnvVar(("RANK",), ALWAYS),
        world_size=EnvVar(("WORLD_SIZE",), ALWAYS),
        local_rank=EnvVar(("LOCAL_RANK",)),
        master_addr=EnvVar(("MASTER_ADDR",), RENDEZVOUS),
        master_port=EnvVar(("MASTER_PORT",), RENDEZVOUS_NO_PORT),
        default_port=None,
    ),
    "slurm": LauncherEnv(
        rank=EnvVar(("SLURM_PROCID",), ALWAYS),
        world_size=EnvVar(("SLURM_NTASKS",), ALWAYS),
        local_rank=EnvVar(("SLURM_LOCALID",)),
        master_addr=EnvVar(("MASTER_ADDR",)),
        master_port=EnvVar(("MASTER_PORT",)),
        nodelist=EnvVar(("SLURM_NODELIST", "SLURM_JOB_NODELIST"), ALWAYS),
        tasks_per_node=EnvVar(("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")),
    ),
    "mpi": LauncherEnv(
        rank=EnvVar(("OMPI_COMM_WORLD_RANK", "PMI_RANK"), ALWAYS),
        world_size=EnvVar(("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"), ALWAYS),
        local_rank=EnvVar(("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK")),
        master_addr=EnvVar(("MASTER_ADDR",), RENDEZVOUS),
        master_port=EnvVar(("MASTER_PORT",)),
    ),
}

#: Launcher names accepted by :func:`init_dist`.
LAUNCHERS = tuple(LAUNCHER_ENV)

Found = Optional[tuple[str, str]]  # (variable name, value), or None when unset


class LaunchInfo(NamedTuple):
    """Where this process sits in the job, as read from a launcher's environment."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None


def _check_launcher(launcher: str) -> LauncherEnv:
    if launcher not in LAUNCHER_ENV:
        raise ValueError(f"{_WHO}: unknown launcher {launcher!r}; expected one of {', '.join(LAUNCHERS)}")
    return LAUNCHER_ENV[launcher]


def _read_env(env: Mapping[str, str], launcher: str, need_master: bool, port_given: bool) -> dict[str, Found]:
    """Every variable of the launcher's row that is set; ValueError listing every required one that is not."""
    row = LAUNCHER_ENV[launcher]
    needed = {ALWAYS: True, RENDEZVOUS: need_master, RENDEZVOUS_NO_PORT: need_master and not port_given}
    found: dict[str, Found] = {}
    missing: list[str] = []
    for field, var in zip(row._fields, row):
        if not isinstance(var, EnvVar):
            continue
        found[field] = next(((n, env[n]) for n in var.names if env.get(n) is not None and env[n].strip() != ""), None)
        if found[field] is None and needed.get(var.required, False):
            missing.append(" or ".join(var.names))
    if missing:
        raise ValueError(
            f"{_WHO}: launcher {launcher!r} needs environment variable(s) that are not set: {', '.join(missing)}; "
            "run under that launcher, or pass init_method= or store="
        )
    return found


def _parse(found: Found) -> int:
    assert found is not None
    return parse_int(*found, who=_WHO)


def _master_addr(found: dict[str, Found]) -> str | None:
    """MASTER_ADDR if set, else the first host of the node list, else None."""
    addr, nodes = found["master_addr"], found["nodelist"]
    if addr is not None:
        return addr[1].strip()
    if nodes is None:
        return None
    try:
        return slurm_first_host(nodes[1])
    except ValueError as exc:
        raise ValueError(f"{_WHO}: {nodes[0]}: {exc}") from None


def resolve_launch(
    launcher: str,
    environ: Mapping[str, str] | None = None,
    port: int | None = None,
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
            MASTER_ADDR); see :data:`LAUNCHER_ENV`.
        environ: Environment to read; ``os.environ`` when None.
        port: Rendezvous port overriding MASTER_PORT.
        need_master: Whether a rendezvous address is required.

    Returns:
        The resolved :class:`LaunchInfo`.

    Raises:
        ValueError: for an unknown launcher (listing the valid ones), missing
            variables (listing all of them) or malformed values.
    """
    row = _check_launcher(launcher)
    found = _read_env(os.environ if environ is None else environ, launcher, need_master, port is not None)
    rank, world_size = _parse(found["rank"]), _parse(found["world_size"])
    if world_size < 1:
        raise ValueError(f"{_WHO}: {found['world_size'][0]}={world_size} must be at least 1")  # type: ignore[index]
    if not 0 <= rank < world_size:
        raise ValueError(f"{_WHO}: {found['rank'][0]}={rank} is not in [0, {world_size})")  # type: ignore[index]
    if found["local_rank"] is not None:
        local_rank = _parse(found["local_rank"])
    elif found["tasks_per_node"] is not None:
        local_rank = slurm_local_id(rank, found["tasks_per_node"][1])
    else:
        local_rank = 0
    if local_rank < 0:
        raise ValueError(f"{_WHO}: negative local rank {local_rank}")
    master_addr = _master_addr(found)
    if port is None:
        port = _parse(found["master_port"]) if found["master_port"] is not None else row.default_port
    if port is not None and not 0 < int(port) < 65536:
        raise ValueError(f"{_WHO}: port {port} is out of range; use 1..65535")
    return LaunchInfo(rank, world_size, local_rank, master_addr, None if port is None else int(port))


def init_dist(
    launcher: str,
    backend: str | None = None,
    *,
    port: int | None = None,
    timeout: float | datetime.timedelta | None = None,
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
    _check_launcher(launcher)
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(f"{_WHO}: the default process group is already initialized; call it once per process")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    backend = str(backend).lower()
    uses_cuda = "nccl" in backend
    if uses_cuda and not torch.cuda.is_available():
        raise ValueError(f"{_WHO}: backend {backend!r} needs CUDA, which is not available; use backend='gloo'")
    own_rendezvous = "store" in kwargs or "init_method" in kwargs
    info = resolve_launch(launcher, port=port, need_master=not own_rendezvous and backend != "mpi")
    os.environ.update(RANK=str(info.rank), WORLD_SIZE=str(info.world_size), LOCAL_RANK=str(info.local_rank))
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
