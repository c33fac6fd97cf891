"""Optimizers on fastcoll's buckets: :class:`ShardedOptimizer` (ZeRO-1), one concern per module.

* :mod:`.sharded`: :class:`ShardedOptimizer`: the pieces, the step, gradients and clipping;
* :mod:`.checkpoint`: the standard (unsharded) state dict, and per-rank sharded ones that reload at any world size;
* :mod:`.elementwise`: which optimizer classes can step pieces of parameters.

The buckets, their ranges (computed once, :mod:`fastcoll.reducer.shards`), both of their exchanges (the
gradients' reduction and the parameters' all-gather, :mod:`fastcoll.reducer.param_gather`) and the gradients kept
outside ``.grad`` (:mod:`fastcoll.reducer.kept_grads`) are the reducer's; the optimizer calls that API.
"""

from .sharded import ShardedOptimizer

__all__ = ["ShardedOptimizer"]
