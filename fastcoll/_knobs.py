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
* ``FASTCOLL_CPU_STREAM_MIN_BYTES`` (default ``auto``: a third of the
  last-level cache this process can use, less on an oversubscribed machine,
  fastcoll/ops/stores.py): CPU kernel calls writing
  at least this many bytes use non-temporal stores. A byte count (``16777216``,
  ``16MiB``, ``512K``: binary multiples), ``always`` (0) or ``never``; read once,
  when the extension loads.
"""

from __future__ import annotations

import os
import re
from typing import Mapping, Optional

__all__ = ["EARLY_PACK_MIN_NUMEL", "cpu_stream_min_bytes", "early_pack_min_numel", "eager_direct", "force_collectives"]

#: CPU gradients with at least this many elements are packed as soon as they
#: are final, while still in cache (measured: ~25% less pack time on ResNet-50
#: shapes); smaller ones wait for their bucket's single fused pack. 16-bit
#: gradients this large (any device) go into their float32 main gradients as
#: soon as they are final, which frees them before their bucket completes, and
#: so do those of gradient_as_bucket_view buckets (any device) into their views.
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
    """``FASTCOLL_EARLY_PACK_MIN_NUMEL``: the smallest CPU gradient packed, or 16-bit gradient added into its main
    gradient, as soon as it is final."""
    value = os.environ.get("FASTCOLL_EARLY_PACK_MIN_NUMEL", "").strip()
    if not value:
        return EARLY_PACK_MIN_NUMEL
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"fastcoll: FASTCOLL_EARLY_PACK_MIN_NUMEL={value!r} is not an integer") from None


CPU_STREAM_MIN_BYTES = "FASTCOLL_CPU_STREAM_MIN_BYTES"
#: ``never``: a threshold no call reaches.
STREAM_NEVER = 1 << 62
_UNITS = {"": 0, "k": 10, "kb": 10, "kib": 10, "m": 20, "mb": 20, "mib": 20, "g": 30, "gb": 30, "gib": 30}


def cpu_stream_min_bytes(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """``FASTCOLL_CPU_STREAM_MIN_BYTES``: the streaming-store threshold it sets, or None for the machine's choice.

    Args:
        env: The environment to read (default ``os.environ``).

    Raises:
        ValueError: The value is neither ``auto``, ``always``, ``never`` nor a non-negative byte count.
    """
    value = (os.environ if env is None else env).get(CPU_STREAM_MIN_BYTES, "")
    text = value.strip().lower()
    if text in ("", "auto"):
        return None
    if text == "always":
        return 0
    if text == "never":
        return STREAM_NEVER
    m = re.fullmatch(r"(\d+)\s*([a-z]*)", text)
    if m is None or m.group(2) not in _UNITS:
        raise ValueError(
            f"fastcoll: {CPU_STREAM_MIN_BYTES}={value!r} is not a streaming-store threshold; use a byte count "
            "(16777216, 16MiB, 512K), 'always', 'never' or 'auto'"
        )
    return min(int(m.group(1)) << _UNITS[m.group(2)], STREAM_NEVER)
