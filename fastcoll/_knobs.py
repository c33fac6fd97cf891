"""fastcoll's run-time knobs (environment variables), read in one place.

* ``FASTCOLL_FORCE_COLLECTIVES=1``: issue every collective at world size 1 as
  at any other size (fastcoll.DDP reads it at construction, fastcoll.dist at
  each call). Lets one GPU exercise the NCCL paths and makes one-GPU
  benchmarks compare like with like.
* ``FASTCOLL_EARLY_PACK_MIN_NUMEL`` (default 65536): CPU gradients with at
  least this many elements are packed into their bucket as soon as they are
  final (read when buckets are built; a huge value turns it off).
* ``FASTCOLL_EAGER=0``: the fused ops always go through torch.ops, never
  their direct eager entry points (read when fastcoll.ops is imported).
* ``FASTCOLL_CPU_STREAM_MIN_BYTES`` (default 16 MiB): read by the C++ CPU
  kernels at load time (calls writing this much use non-temporal stores).
"""

from __future__ import annotations

import os

__all__ = ["EARLY_PACK_MIN_NUMEL", "early_pack_min_numel", "eager_direct", "force_collectives"]

#: CPU gradients with at least this many elements are packed as soon as they
#: are final, while still in cache (measured: ~25% less pack time on ResNet-50
#: shapes); smaller ones wait for their bucket's single fused pack.
EARLY_PACK_MIN_NUMEL = 1 << 16


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip() not in ("", "0")


def force_collectives() -> bool:
    """``FASTCOLL_FORCE_COLLECTIVES``: collectives even at world size 1."""
    return _flag("FASTCOLL_FORCE_COLLECTIVES")


def eager_direct() -> bool:
    """``FASTCOLL_EAGER`` (default on): eager calls of the fused ops on plain tensors skip torch.ops."""
    return os.environ.get("FASTCOLL_EAGER", "1").strip() != "0"


def early_pack_min_numel() -> int:
    """``FASTCOLL_EARLY_PACK_MIN_NUMEL``: the smallest CPU gradient packed as soon as it is final."""
    value = os.environ.get("FASTCOLL_EARLY_PACK_MIN_NUMEL", "").strip()
    if not value:
        return EARLY_PACK_MIN_NUMEL
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"fastcoll: FASTCOLL_EARLY_PACK_MIN_NUMEL={value!r} is not an integer") from None
