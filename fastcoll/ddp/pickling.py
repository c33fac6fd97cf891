"""Pickling and deep-copying a whole :class:`fastcoll.DDP`, as torch DDP allows (``torch.save(model)``, ``copy.deepcopy``)."""

from __future__ import annotations

from typing import Any, Dict

import torch.distributed as dist
from torch import nn

from .join import JoinState

__all__ = ["PicklingSupport"]


class PicklingSupport:
    """The pickled state leaves out the process group, the reducer and its hooks; loading rebuilds them.

    Expects the wrapper's ``_build()`` (the reducer and the buffer broadcast) and ``static_graph``.
    """

    _UNPICKLED = ("process_group", "reducer", "_buffer_sync", "_join", "_slots")

    def __getstate__(self) -> Dict[str, Any]:
        """The picklable state, as torch DDP's: without the process group, the reducer and its hooks, or a comm hook."""
        state = self.__dict__.copy()
        for key in self._UNPICKLED:
            state.pop(key, None)
        if state.get("_comm_hook_desc") is not None and state.get("comm_dtype") is None:
            state["_comm_hook_desc"] = None  # a registered comm hook is not carried over (torch DDP drops it too)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        """Rebuild against the default process group: the loaded model trains and synchronizes at once."""
        nn.Module.__setstate__(self, state)  # not torch DDP's: it would build a torch reducer
        if "broadcast_buffers" in self.__dict__:  # pickled before forward_sync_buffers
            self.forward_sync_buffers = self.__dict__.pop("broadcast_buffers")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "fastcoll.DDP: unpickling needs the default process group; call "
                "torch.distributed.init_process_group(...) before torch.load / copy.deepcopy"
            )
        self.process_group = dist.distributed_c10d._get_default_group()
        self._join = JoinState(self)
        self._build()
        if self.static_graph:
            self.reducer.set_static_graph()
