"""The module's buffers that DDP broadcasts, followed when the module replaces them.

A module may put a new tensor where a buffer was: ``self.count = self.count + 1``
in a forward, ``module.double()`` (a new tensor per buffer), a buffer set by
hand. torch DDP reads the module's buffers again before every broadcast; a
broadcast planned over the old tensors would write into tensors the module no
longer holds, and the ranks' buffers would drift apart without a word.
:class:`ModuleBuffers` keeps where each buffer lives (its module and name), so
a forward checks the buffers by identity at a dictionary lookup each, and
plans the broadcast again only when one of them was replaced.
"""

from __future__ import annotations

from typing import Collection, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .broadcast import CoalescedBroadcast
from .module_changes import tensor_slots

__all__ = ["ModuleBuffers"]


class ModuleBuffers:
    """The buffers of ``module`` not named in ``ignored``, and their coalesced broadcast.

    Args:
        module: The wrapped module.
        ignored: Qualified names left out (``_ddp_params_and_buffers_to_ignore``).
        cap_bytes: The broadcast's largest message (:class:`CoalescedBroadcast`).
    """

    def __init__(self, module: nn.Module, ignored: Collection[str], cap_bytes: int):
        self._module = module
        self._ignored = ignored
        self._cap_bytes = cap_bytes
        self._read()

    def _read(self) -> None:
        """Where the buffers are (module, attribute) and which tensors they hold now, and a broadcast planned over them."""
        slots: List[Tuple[nn.Module, str]] = []
        tensors: List[torch.Tensor] = []
        seen = set()
        for full, owner, name, t in tensor_slots(self._module, "_buffers"):
            if full in self._ignored or id(t) in seen:  # named_buffers()' rules
                continue
            seen.add(id(t))
            slots.append((owner, name))
            tensors.append(t)
        self._slots, self._tensors = slots, tensors
        self._broadcast = CoalescedBroadcast(tensors, self._cap_bytes)

    def current(self) -> List[torch.Tensor]:
        """The buffers as the module holds them now (the broadcast planned again if any was replaced)."""
        if any(owner._buffers.get(name) is not t for (owner, name), t in zip(self._slots, self._tensors)):
            self._read()
        return self._tensors

    def __bool__(self) -> bool:
        return bool(self._tensors)

    @property
    def broadcast(self) -> CoalescedBroadcast:
        """The broadcast of the buffers last read (:meth:`current` reads them)."""
        return self._broadcast

    def __call__(self, group: Optional[dist.ProcessGroup], group_src: int, stall_timeout: Optional[float]) -> None:
        """Broadcast the current buffers from group rank ``group_src`` (see :class:`CoalescedBroadcast`)."""
        self.current()
        self._broadcast(group, group_src, stall_timeout)
