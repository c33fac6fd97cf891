"""The parameters of a sharded bucket as views of one flat buffer in the bucket's layout (Megatron's param buffer).

Without it, every step copies the model twice on top of the all-gather: each
rank packs its updated range into a staging buffer, and every rank writes the
gathered bucket back into the parameters. With the parameters living in a
buffer laid out like their bucket (same offsets, the padding at its end), the
inner optimizer updates this rank's range where the all-gather sends it from,
and the all-gather writes the other ranks' ranges straight into the
parameters: no pack (unless float32 master weights are rounded into it), no
write-back.

A parameter moves into its bucket's buffer when the optimizer steps it, it
shares memory with no other parameter, and it starts at a multiple of
:data:`~fastcoll.reducer.shards.ALIGN_BYTES` in the bucket: it then keeps the
alignment an allocation of its own has (64 bytes on CPUs, more on GPUs),
which vectorized kernels and BLAS need to run as fast, and to round as they
would (a 64-byte-misaligned matrix-vector product rounds differently on
CPUs). The sharded layout puts each bucket's odd-sized parameters last
(:func:`~fastcoll.reducer.shards.aligned_first`), so one odd parameter does
not misalign the rest. A bucket gets a buffer when the parameters that cannot
move hold at most :data:`STAGED_SHARE` of it (or :data:`STAGED_MIN_ELEMENTS`):
those are packed into the buffer and written back from it, as in a bucket
without one (whose all-gather borrows its gradient bucket instead).

Code that later points a moved parameter elsewhere (``p.data = ...``) is
caught at the next ``step()``: the values move into the buffer and the
parameter points back.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

from .. import ops
from ..reducer.bucket import MainGradBucket
from ..reducer.shards import ALIGN_BYTES

__all__ = ["STAGED_MIN_ELEMENTS", "STAGED_SHARE", "ParamBuffers", "gather_stages", "movable", "shares_memory"]

#: A bucket whose unmovable parameters hold at most this share of its elements (or
#: :data:`STAGED_MIN_ELEMENTS`, whichever is larger) gets a buffer: the bound on the memory it adds.
STAGED_SHARE = 0.01
STAGED_MIN_ELEMENTS = 256


class ParamBuffers:
    """Flat parameter buffers of some sharded buckets of one reducer.

    Args:
        reducer: The model's reducer (its buckets and shard layout).
        moving: Per bucket position to give a buffer, the reducer indices of the parameters that move into it.
    """

    def __init__(self, reducer: Any, moving: Dict[int, Sequence[int]]):
        self.reducer = reducer
        #: Bucket position -> the flat buffer (``padded`` elements of the parameters' dtype).
        self.buffers: Dict[int, torch.Tensor] = {}
        #: Reducer indices of the parameters that live in a buffer.
        self.moved: Set[int] = set()
        self._views: Dict[int, List[torch.Tensor]] = {}  # bucket position -> the bucket views of every parameter
        for pos, indices in moving.items():
            self._adopt(pos, set(indices))

    def __contains__(self, pos: int) -> bool:
        return pos in self.buffers

    @torch.no_grad()
    def _adopt(self, pos: int, indices: Set[int]) -> None:
        b = self.reducer.buckets[pos]
        buf = torch.zeros(self.reducer.shards.padded(pos), dtype=b.dtype, device=b.device)  # the padding stays zero
        views = ops.bucket_views(buf[: b.numel], [p.detach() for p in b.params])
        for i, p, v in zip(b.param_indices, b.params, views):
            v.copy_(p.detach())  # every parameter's current values (those staged are sent from here too)
            if i in indices:
                p.data = v  # the parameter keeps its own version counter (set_data does not share the buffer's)
                self.moved.add(i)
        self.buffers[pos] = buf
        self._views[pos] = views

    @torch.no_grad()
    def check(self) -> None:
        """Bring back into its buffer every moved parameter that was pointed elsewhere since (its values kept).

        Raises:
            RuntimeError: a parameter changed shape, dtype or device (the bucket layout no longer holds it).
        """
        for pos, views in self._views.items():
            b = self.reducer.buckets[pos]
            for k, (i, p, v) in enumerate(zip(b.param_indices, b.params, views)):
                if i not in self.moved or (p.data_ptr() == v.data_ptr() and p.stride() == v.stride()):
                    continue
                if p.shape != v.shape or p.dtype != v.dtype or p.device != v.device:
                    raise RuntimeError(
                        f"fastcoll.ShardedOptimizer: parameter '{b.names[k]}' changed from {tuple(v.shape)} "
                        f"{v.dtype} on {v.device} to {tuple(p.shape)} {p.dtype} on {p.device} after the optimizer was "
                        "built; its bucket layout no longer fits. Move or cast the model before wrapping it"
                    )
                moved = p.detach()
                p.data = v
                p.detach().copy_(moved)  # through the parameter: its version moves, so float32 masters follow it


def movable(bucket: Any, stepped: Sequence[bool], shared: Sequence[bool]) -> List[int]:
    """The reducer indices of ``bucket``'s parameters that can live in its buffer (see the module docstring).

    Args:
        bucket: A dense :class:`~fastcoll.reducer.bucket.GradBucket` of a sharded layout.
        stepped, shared: Per reducer parameter, whether the optimizer steps it / it shares memory (:func:`shares_memory`).

    Returns:
        Those indices, or none when the rest would hold more than the staged bound.
    """
    size = bucket.params[0].element_size() if bucket.params else 1
    out = [i for i, off in zip(bucket.param_indices, bucket.offsets)
           if stepped[i] and not shared[i] and off * size % ALIGN_BYTES == 0]  # fmt: skip
    moving = set(out)
    staged = sum(p.numel() for i, p in zip(bucket.param_indices, bucket.params) if i not in moving)
    return out if out and staged <= max(int(bucket.numel * STAGED_SHARE), STAGED_MIN_ELEMENTS) else []


def shares_memory(params: List[torch.Tensor]) -> List[bool]:
    """Per parameter, whether its storage is also another parameter's (tied through views, not the same tensor)."""
    keys = [p.untyped_storage().data_ptr() if p.numel() else None for p in params]
    owners: Dict[Any, int] = {}
    for key in keys:
        owners[key] = owners.get(key, 0) + 1
    return [key is not None and owners[key] > 1 for key in keys]


def gather_stages(
    reducer: Any, layout: Any, buffers: ParamBuffers, pooled: bool, grads: str
) -> Tuple[Dict[int, Optional[torch.Tensor]], Dict[int, torch.Tensor]]:
    """Per sharded bucket, where its parameters are all-gathered, and which gradient buffers that borrows.

    The parameters' own buffer when they have one (:class:`ParamBuffers`). With gradient buffers from a pool
    (``pooled``): None, a slot of the pool drawn at the bucket's pack. Else the bucket's own buffer when it is
    free after the step: the gradient bucket itself (or its float32 main-gradient bucket, whose bytes hold
    the 16-bit parameters: consumed by the step, zeroed after the all-gather); else a buffer of its own
    (gradients as bucket views, kept by ``grads="full"``).

    Args:
        reducer: The sharded reducer.
        layout: Its :class:`~fastcoll.reducer.shards.ShardLayout`.
        buffers: The flat parameter buffers.
        pooled: ``grad_buffers="pool"``.
        grads: ``"full"`` or ``"sharded"``.
    """
    stages: Dict[int, Optional[torch.Tensor]] = {}
    borrowed: Dict[int, torch.Tensor] = {}
    for bs in layout.buckets:
        b = reducer.buckets[bs.pos]
        if bs.pos in buffers:
            stages[bs.pos] = buffers.buffers[bs.pos]
        elif pooled:
            stages[bs.pos] = None
        elif isinstance(b, MainGradBucket):
            stages[bs.pos] = b.flat_padded.view(b.dtype)[: b.padded]
            borrowed[bs.pos] = b.flat_padded
        else:
            free = b.flat.dtype == b.dtype and (grads == "sharded" or not b.as_view)
            stages[bs.pos] = b.flat_padded if free else torch.empty(b.padded, dtype=b.dtype, device=b.device)
    return stages, borrowed
