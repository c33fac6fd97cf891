"""fastcoll: fused multi-tensor gradient synchronization for PyTorch data parallelism."""

from __future__ import annotations

import torch

from . import dist, ops
from .ddp import DDP, DistributedDataParallel
from .dist import (
    all_reduce_dict,
    allreduce_grads,
    collect_results,
    get_local_rank,
    get_rank,
    get_world_size,
    init_dist,
    is_distributed,
    is_module_wrapper,
    rank_zero_only,
    reduce_mean,
    synchronize,
)
from .errors import NonFiniteGradError, ReplicaMismatchError
from .ops import loader
from .optim import ShardedOptimizer
from .reducer import GradBucket
from .stall import StallError

__version__ = "0.1.0"


def build_info() -> dict:
    """How this fastcoll was built and what it is running on.

    Returns:
        A dict with the torch version, whether the C++ extension and its CUDA
        kernels are compiled in, the compiler, the CUDA version and arch list
        the kernels were built for, the build of the CPU inner loops in use
        (``cpu_isa``: default, avx2 or avx512bf16; ``FASTCOLL_CPU_ISA``
        picks a lower one), the CPU kernels' streaming-store threshold
        (``cpu_stream_min_bytes``) with how it was chosen
        (``cpu_stream_choice``: docs/performance-cpu-stores.md), and why the
        fallback is in use (if it is). Also
        how the extension was obtained (``extension_origin``: "ahead of time",
        "compiled at import", "cache hit", or None for the reference), the
        loaded library (``extension_path``), the build cache (``cache_dir``,
        and ``cache_key`` when the library came from it), and why a CUDA torch
        has no CUDA kernels (``cuda_kernels_missing``, e.g. nvcc was not found).
    """
    from .extension import cache

    info = {
        "fastcoll": __version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "extension": loader._C is not None,
        "cuda_kernels": False,
        "compiler": None,
        "cuda_version": None,
        "cuda_arch_list": [],
        "fallback_reason": loader.FALLBACK_REASON,
        "extension_origin": loader.ORIGIN,
        "extension_path": loader.EXT_PATH,
        "cache_dir": cache.root(),
        "cache_key": loader.CACHE_KEY,
        "cuda_kernels_missing": loader.CUDA_MISSING,
    }
    if loader._C is not None:
        info.update(loader._C.build_info())
        info.update(ops.stores.describe())
    return info


__all__ = [
    "DDP",
    "DistributedDataParallel",
    "GradBucket",
    "NonFiniteGradError",
    "ReplicaMismatchError",
    "ShardedOptimizer",
    "StallError",
    "__version__",
    "all_reduce_dict",
    "allreduce_grads",
    "build_info",
    "collect_results",
    "dist",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_dist",
    "is_distributed",
    "is_module_wrapper",
    "ops",
    "rank_zero_only",
    "reduce_mean",
    "synchronize",
]
