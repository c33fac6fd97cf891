"""Distributed helpers for training and evaluation loops, built on the fused ops.

Detection and training frameworks (the OpenMMLab family, vis4d, ...) each
carry a module of the same dozen helpers: who am I, how many of us are there,
average this loss dict, average these gradients, gather these evaluation
results. This package provides them once, with the names and signatures those
projects use, so switching is a change of import:

* process information (:mod:`.process`): :func:`get_rank`,
  :func:`get_world_size`, :func:`get_local_rank`, :func:`distributed_available`,
  :func:`is_distributed`, :func:`synchronize`, :func:`rank_zero_only`,
  :func:`is_module_wrapper`;
* launching (:mod:`.launch`, :mod:`.slurm`): :func:`init_dist` for
  ``torchrun``, SLURM and MPI launchers;
* tensor collectives (:mod:`.tensors`): :func:`reduce_mean`,
  :func:`all_reduce_dict`, :func:`allreduce_grads`, which pack every tensor of
  a dtype/device group into one flat buffer with
  :func:`fastcoll.ops.flatten_scale`, reduce it with one ``all_reduce`` and
  scatter it back with :func:`fastcoll.ops.unflatten_scale`;
  :func:`release_buffers` frees the buffer ``allreduce_grads`` keeps;
* object collectives (:mod:`.serialize`, :mod:`.objects`): :func:`obj2tensor`,
  :func:`tensor2obj`, :func:`serialize_to_tensor`, :func:`pad_to_largest_tensor`,
  :func:`broadcast`, :func:`all_gather_object_gpu`,
  :func:`all_gather_object_cpu`, :func:`create_tmpdir`, :func:`collect_results`.

Every function also works in a plain single process where no process group
has been initialized: it behaves as a world of size one (identity results,
no-op barriers), so one script runs unchanged on a laptop and under a launcher.

Which device collectives run on (:mod:`.backends`): CPU for backends that
handle CPU tensors (gloo, mpi); for NCCL, the device of the CUDA tensors
passed to the helper, else the group's bound device
(``init_process_group(device_id=...)``), else ``torch.cuda.current_device()``.
Tensors on a device the backend cannot use are staged through that device.

Errors that depend on one rank's data (a dict with other keys, an object that
cannot be pickled) are agreed on through one small collective
(:func:`fastcoll.distributed._agree.agree`), so they raise the same exception on
*every* rank instead of leaving the others waiting in a collective that never
completes. Messages read ``fastcoll.dist.<function>: what went wrong; how to
fix it`` and name the ranks, keys or gradient indices at fault.
"""

from __future__ import annotations

from .backends import release_buffers
from .launch import DEFAULT_PORT as DEFAULT_PORT
from .launch import LAUNCHERS as LAUNCHERS
from .launch import LaunchInfo as LaunchInfo
from .launch import init_dist
from .launch import resolve_launch as resolve_launch
from .objects import LOCAL_TMP_ROOT as LOCAL_TMP_ROOT
from .objects import (
    all_gather_object_cpu,
    all_gather_object_gpu,
    broadcast,
    collect_results,
    create_tmpdir,
)
from .process import (
    distributed_available,
    get_local_rank,
    get_rank,
    get_world_size,
    is_distributed,
    is_module_wrapper,
    rank_zero_only,
    synchronize,
)
from .serialize import LARGE_PAYLOAD_BYTES as LARGE_PAYLOAD_BYTES
from .serialize import (
    obj2tensor,
    pad_to_largest_tensor,
    serialize_to_tensor,
    tensor2obj,
)
from .slurm import expand_slurm_nodelist as expand_slurm_nodelist
from .slurm import slurm_first_host as slurm_first_host
from .tensors import all_reduce_dict, allreduce_grads, reduce_mean

# ``from .x import NAME as NAME``: attributes users and tests reach as fastcoll.dist.NAME, not in __all__.
__all__ = [  # noqa: RUF022 - the order of fastcoll.dist's original module
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
