"""Optimizers on fastcoll's buckets: :class:`ShardedOptimizer` (ZeRO-1), one concern per module.

* :mod:`.sharded`: :class:`ShardedOptimizer`: the pieces, the step, gradients and clipping;
* :mod:`.param_sync`: the parameters' all-gathers after a step, overlapped with the next forward;
* :mod:`.checkpoint`: the standard (unsharded) state dict, and per-rank sharded ones that reload at any world size;
* :mod:`.grad_guard`: what ``p.grad`` holds when the gradients are reduce-scattered;
* :mod:`.elementwise`: which optimizer classes can step pieces of parameters.

The ranges themselves are computed once, from the buckets, in :mod:`fastcoll.reducer.shards`.
"""

from .sharded import ShardedOptimizer

__all__ = ["ShardedOptimizer"]
