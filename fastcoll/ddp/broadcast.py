"""Broadcast a fixed set of tensors in place from one rank, coalesced into few messages.

Used by :class:`fastcoll.DDP` for its buffers (before every forward), for the
parameters at construction (``init_sync``) and for the final model state of
``join()``.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import ops
from .._knobs import force_collectives
from ..bucketing import split_by_bytes
from ..ops.dtypes import is_fusable
from ..stall import run_collective

__all__ = ["CoalescedBroadcast", "broadcast_coalesced"]

#: torch DDP's broadcast_bucket_size: the largest message.
DEFAULT_CAP_BYTES = 250 * 1024 * 1024
_ALIGN = 16


class _Message(NamedTuple):
    nbytes: int
    message: torch.Tensor  #: the first ``nbytes`` of the shared staging buffer
    fused: List[Tuple[torch.Tensor, List[torch.Tensor]]]  #: (section view, tensors packed with one fused call)
    copied: List[Tuple[torch.Tensor, torch.Tensor]]  #: (section view, tensor copied on its own)


def _sections(chunk: List[torch.Tensor]) -> Tuple[List[Tuple[int, torch.dtype, List[torch.Tensor], bool]], int]:
    """The byte layout of one message: (offset, dtype, tensors, fused) per section, and the total bytes.

    One 16-byte-aligned section per dtype, in order of first appearance;
    tensors the fused ops cannot pack get a section each.
    """
    by_kind: Dict[Tuple[torch.dtype, bool], List[torch.Tensor]] = {}
    for t in chunk:
        by_kind.setdefault((t.dtype, is_fusable(t)), []).append(t)
    layout = []
    offset = 0
    for (dtype, fused), ts in by_kind.items():
        offset = -(-offset // _ALIGN) * _ALIGN
        for group in [ts] if fused else [[t] for t in ts]:
            layout.append((offset, dtype, group, fused))
            offset += sum(t.numel() for t in group) * dtype.itemsize
    return layout, offset


class CoalescedBroadcast:
    """A fixed set of tensors broadcast in place from one rank, one message per device (split past a cap).

    Planned once, at construction: every device's tensors travel as one byte
    message (split only past ``cap_bytes``), so a model's buffers cost one
    collective per call whatever their dtypes; inside a message each dtype
    has its own 16-byte-aligned section. Dense floating-point tensors are
    packed into their section with one fused :func:`fastcoll.ops.flatten_scale`
    on the source rank and unpacked with one :func:`fastcoll.ops.unflatten_scale`
    on the others; the rest (``num_batches_tracked`` and the like) are copied
    one by one. The messages of a device go one after another through one
    staging buffer, the size of the largest message (at most ``cap_bytes``
    unless a single tensor is larger): broadcasting a whole model never needs
    a second copy of it. Every rank must build it from tensors of the same
    shapes and dtypes in the same order.

    Args:
        tensors: Tensors to overwrite with the source rank's values (mutually
            non-overlapping; pass ``param.detach()`` for parameters).
        cap_bytes: Largest message size in bytes (a single larger tensor gets
            a message of its own).
    """

    def __init__(self, tensors: Sequence[torch.Tensor], cap_bytes: int = DEFAULT_CAP_BYTES):
        per_device: Dict[torch.device, List[torch.Tensor]] = {}
        for t in tensors:
            if t.numel():
                per_device.setdefault(t.device, []).append(t)
        self.messages: List[_Message] = []
        self._staging: List[torch.Tensor] = []
        for device, ts in per_device.items():
            runs = split_by_bytes([t.numel() * t.element_size() for t in ts], cap_bytes)
            plans = [_sections([ts[i] for i in run]) for run in runs]
            staging = torch.empty(max(nbytes for _, nbytes in plans), dtype=torch.uint8, device=device)
            self._staging.append(staging)
            for layout, nbytes in plans:
                self.messages.append(self._views(staging, layout, nbytes))

    @staticmethod
    def _views(staging: torch.Tensor, layout, nbytes: int) -> _Message:
        fused: List[Tuple[torch.Tensor, List[torch.Tensor]]] = []
        copied: List[Tuple[torch.Tensor, torch.Tensor]] = []
        for offset, dtype, group, is_fused in layout:
            section = staging[offset : offset + sum(t.numel() for t in group) * dtype.itemsize].view(dtype)
            if is_fused:
                fused.append((section, group))
            else:
                copied.append((section.view(group[0].shape), group[0]))
        return _Message(nbytes, staging[:nbytes], fused, copied)

    @property
    def staging_bytes(self) -> int:
        """Bytes of staging memory held (one buffer per device, the size of its largest message)."""
        return sum(s.numel() for s in self._staging)

    def __call__(self, group: Optional[dist.ProcessGroup], group_src: int = 0, stall_timeout: Optional[float] = 0) -> None:
        """Broadcast from group rank ``group_src`` of ``group`` (None: the default group).

        ``stall_timeout``: as :class:`fastcoll.DDP`'s (0: unprotected, None: the default rule).
        """
        if not self.messages or (dist.get_world_size(group) == 1 and not force_collectives()):
            return
        is_src = dist.get_rank(group) == group_src
        with torch.no_grad():
            for m in self.messages:
                if is_src:
                    for section, ts in m.fused:
                        ops.flatten_scale(ts, section, 1.0)
                    for section, t in m.copied:
                        section.copy_(t)
                run_collective(
                    lambda m=m: dist.broadcast(m.message, group=group, group_src=group_src, async_op=True),
                    "broadcast", "buffers/parameters", m.message, group, stall_timeout,
                )  # fmt: skip
                if not is_src:
                    for section, ts in m.fused:
                        ops.unflatten_scale(section, ts, 1.0)
                    for section, t in m.copied:
                        t.copy_(section)


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor],
    group: Optional[dist.ProcessGroup],
    group_src: int = 0,
    cap_bytes: int = DEFAULT_CAP_BYTES,
    stall_timeout: Optional[float] = 0,
) -> None:
    """Broadcast ``tensors`` in place from group rank ``group_src``, coalesced (see :class:`CoalescedBroadcast`)."""
    CoalescedBroadcast(tensors, cap_bytes)(group, group_src, stall_timeout)
