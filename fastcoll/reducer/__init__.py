"""The bucketed gradient reducer behind :class:`fastcoll.DDP`, one concern per module.

* :mod:`.core`: :class:`Reducer`: hooks, readiness and launch order, finalize,
  layout rebuild, join replay (the collective order is documented there);
* :mod:`.bucket`: :class:`GradBucket`: a bucket's fixed layout, the GradBucket
  API comm hooks see, pack and write-back through the fused ops;
* :mod:`.layout`: building buckets for a layout, learning the layout from the
  gradient-ready order;
* :mod:`.local_accumulation`: the hooks between synchronized backwards
  (``no_sync``), main gradients included;
* :mod:`.usage`: which parameters take part (unused-parameter search, the
  used-parameter all-reduce, static graphs), and the end of an iteration;
* :mod:`.reduction`: the ways a bucket is reduced (all-reduce, comm hook,
  sparse sum), each with its join replay;
* :mod:`.comm`: the one door to the process group (numbered, observable,
  skipped at world size 1 unless forced).
"""

from .bucket import GradBucket
from .core import Phase, Reducer

__all__ = ["GradBucket", "Phase", "Reducer"]
