"""torch.compile support for :class:`fastcoll.DDP`.

Two things make a compiled model inside fastcoll.DDP behave like one inside
torch's DistributedDataParallel:

* **Graph splitting.** Dynamo's DDPOptimizer (``torch/_dynamo/backends/distributed.py``)
  splits a compiled graph at bucket boundaries, so that each bucket's
  gradients are ready (and its all-reduce can start) while the rest of the
  backward still runs. Dynamo only does so while
  ``DistributedDataParallel._get_active_ddp_module()`` returns a module, and it
  reads that module's ``bucket_bytes_cap``. :func:`activate` / :func:`restore`
  set torch's private class attribute ``_active_ddp_module`` around the wrapped
  module's call, to a :class:`DynamoView` of the fastcoll wrapper. That is
  private torch API: when it is missing (or cannot be set) nothing is
  activated, and a compiled model still trains correctly, as one graph whose
  gradients are all reduced after its backward.
* **Tracing the wrapper.** Under ``torch.compile(fastcoll.DDP(model))``, dynamo
  must not trace the wrapper's own forward steps (bucket rebuild, buffer
  broadcast, arming the reducer: collectives and Python bookkeeping). As for
  torch's DDP, the wrapper's forward frame runs eagerly (:func:`skip_frame`,
  dynamo still compiles the frames it calls, i.e. the wrapped module), and its
  steps run with dynamo off (:func:`call_eagerly`).

Nothing here imports ``torch._dynamo`` unless dynamo is already in use.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch

from ..bucketing import MIB

__all__ = ["DynamoView", "activate", "call", "call_eagerly", "is_compiled", "is_compiling", "restore", "skip_frame"]

_NOTHING = object()  # token of an activation that did not take place


def _is_compiling_fallback() -> bool:
    return False


#: True while dynamo traces the calling frame (constant-folded by dynamo).
is_compiling: Callable[[], bool] = getattr(getattr(torch, "compiler", None), "is_compiling", None) or _is_compiling_fallback


def _first_bucket_bytes() -> int:
    """The first-bucket cap DDPOptimizer uses (it asserts ``bucket_bytes_cap`` is at least this)."""
    try:
        import torch.distributed as dist

        return int(getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", MIB))
    except Exception:  # pragma: no cover - torch built without distributed
        return MIB


_FIRST_BUCKET_BYTES = _first_bucket_bytes()


class DynamoView:
    """What dynamo sees of an active :class:`fastcoll.DDP`.

    Every attribute is the wrapper's, except ``bucket_bytes_cap``, which is
    raised to at least the 1 MiB first bucket: DDPOptimizer asserts
    ``first_bucket_cap <= bucket_bytes_cap`` and takes its first-bucket cap
    from torch (not from the module), so a smaller cap would make compilation
    fail. Below 1 MiB the graph is then split more coarsely than the reducer
    buckets; gradients are unaffected.
    """

    __slots__ = ("ddp", "bucket_bytes_cap")

    def __init__(self, ddp: Any):
        self.ddp = ddp
        self.bucket_bytes_cap = max(int(ddp.bucket_bytes_cap), _FIRST_BUCKET_BYTES)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ddp, name)

    def __bool__(self) -> bool:
        return True


def _import_torch_ddp() -> Any:
    try:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel
    except Exception:  # pragma: no cover - torch built without distributed
        return None


_TORCH_DDP = _import_torch_ddp()


def _torch_ddp_class() -> Any:
    """torch's DistributedDataParallel, if it has the private activation API dynamo reads; else None.

    Checked at every call (cheap), so that the API's absence is honoured whenever it happens.
    """
    cls = _TORCH_DDP
    if cls is None or not callable(getattr(cls, "_get_active_ddp_module", None)) or not hasattr(cls, "_active_ddp_module"):
        return None
    return cls


def activate(ddp: Any) -> Any:
    """Make dynamo see ``ddp`` as the active DDP module; returns the token for :func:`restore`.

    A no-op (returning a token :func:`restore` ignores) on torch versions
    without ``DistributedDataParallel._active_ddp_module``.
    """
    cls = _torch_ddp_class()
    if cls is None:
        return _NOTHING
    try:
        prev = getattr(cls, "_active_ddp_module", None)
        cls._active_ddp_module = DynamoView(ddp)
    except Exception:
        return _NOTHING
    return prev


def restore(token: Any) -> None:
    """Undo :func:`activate` (restores the previously active module, for nesting)."""
    if token is _NOTHING:
        return
    cls = _torch_ddp_class()
    if cls is not None:
        try:
            cls._active_ddp_module = token
        except Exception:  # pragma: no cover
            pass


def is_compiled(module: Any) -> bool:
    """Whether ``module`` is what ``torch.compile(module)`` returns (dynamo's OptimizedModule)."""
    dynamo = sys.modules.get("torch._dynamo")
    cls = getattr(getattr(dynamo, "eval_frame", None), "OptimizedModule", None)
    return cls is not None and isinstance(module, cls)


def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``: the eager counterpart of :func:`call_eagerly`."""
    return fn(*args, **kwargs)


def _call_eagerly(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


_disable = getattr(torch, "_disable_dynamo", None)  # lazy: imports torch._dynamo on first call only

#: ``fn(*args, **kwargs)`` with dynamo off for it and everything it calls (used only while dynamo is in use).
call_eagerly: Callable[..., Any] = _disable(_call_eagerly) if _disable is not None else _call_eagerly


def skip_frame(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` whose own frame dynamo does not trace; the frames it calls are still compiled.

    Returns ``fn`` unchanged on torch versions without ``torch._disable_dynamo``.
    """
    if _disable is None:
        return fn
    try:
        return _disable(fn, recursive=False)
    except Exception:  # pragma: no cover
        return fn
