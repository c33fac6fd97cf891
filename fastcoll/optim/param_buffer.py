"""The parameters of a sharded bucket as views of one flat buffer in the bucket's layout (Megatron's param buffer).

Without it, every step copies the model twice on top of the all-gather: each
rank packs its updated range into a staging buffer, and every rank writes the
gathered bucket back into the parameters. With the parameters living in a
buffer laid out like their bucket (same offsets, the padding at its end), the
inner optimizer updates this rank's range where the all-gather sends it from,
and the all-gather writes the other ranks' ranges straight into the
parameters: no pack (unless float32 master weights are rounded into it), no
write-back.

A bucket gets a buffer when the optimizer steps every parameter in it, no
parameter shares memory with another, and every parameter starts at a
multiple of :data:`ALIGN_BYTES` in the bucket: the buffer then keeps the
alignment the allocator gives a parameter of its own (64 bytes on CPUs, more
on GPUs), which vectorized kernels and BLAS need to run as fast, and to
round as they would on a parameter of its own (a 64-byte-misaligned
matrix-vector product rounds differently on CPUs). Buckets of odd-sized
parameters keep the staging path; aligning every parameter start in the bucket
layout (Megatron pads them) would let them in too.

Code that later points a parameter elsewhere (``p.data = ...``) is caught at
the next ``step()``: the values move into the buffer and the parameter points
back.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List

import torch

from .. import ops

__all__ = ["ALIGN_BYTES", "ParamBuffers", "movable", "shares_memory"]

#: Every parameter's offset in a bucket with a buffer is a multiple of this many bytes.
ALIGN_BYTES = 128


class ParamBuffers:
    """Flat parameter buffers of some sharded buckets of one reducer.

    Args:
        reducer: The model's reducer (its buckets and shard layout).
        positions: The bucket positions to give a buffer (sharded, every parameter stepped).
    """

    def __init__(self, reducer: Any, positions: Iterable[int]):
        self.reducer = reducer
        #: Bucket position -> the flat buffer (``padded`` elements of the parameters' dtype) the parameters view.
        self.buffers: Dict[int, torch.Tensor] = {}
        self._views: Dict[int, List[torch.Tensor]] = {}
        for pos in positions:
            self._adopt(pos)

    def __contains__(self, pos: int) -> bool:
        return pos in self.buffers

    @torch.no_grad()
    def _adopt(self, pos: int) -> None:
        b = self.reducer.buckets[pos]
        padded = self.reducer.shards.padded(pos)
        buf = torch.zeros(padded, dtype=b.dtype, device=b.device)  # the padding stays zero
        views = ops.bucket_views(buf[: b.numel], [p.detach() for p in b.params])
        for p, v in zip(b.params, views):
            v.copy_(p.detach())
            p.data = v  # the parameter keeps its own version counter (set_data does not share the buffer's)
        self.buffers[pos] = buf
        self._views[pos] = views

    @torch.no_grad()
    def check(self) -> None:
        """Bring back into its buffer every parameter that was pointed elsewhere since (its values kept).

        Raises:
            RuntimeError: a parameter changed shape, dtype or device (the bucket layout no longer holds it).
        """
        for pos, views in self._views.items():
            b = self.reducer.buckets[pos]
            for k, (p, v) in enumerate(zip(b.params, views)):
                if p.data_ptr() == v.data_ptr() and p.stride() == v.stride():
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


def shares_memory(params: List[torch.Tensor]) -> List[bool]:
    """Per parameter, whether its storage is also another parameter's (tied through views, not the same tensor)."""
    keys = [p.untyped_storage().data_ptr() if p.numel() else None for p in params]
    owners: Dict[Any, int] = {}
    for key in keys:
        owners[key] = owners.get(key, 0) + 1
    return [key is not None and owners[key] > 1 for key in keys]


def movable(bucket: Any, stepped: List[bool], shared: List[bool]) -> bool:
    """Whether ``bucket``'s parameters can move into a buffer (see the module docstring).

    Args:
        bucket: A dense :class:`~fastcoll.reducer.bucket.GradBucket`.
        stepped, shared: Per reducer parameter, whether the optimizer steps it / it shares memory (:func:`shares_memory`).
    """
    size = bucket.params[0].element_size()
    return all(stepped[i] and not shared[i] for i in bucket.param_indices) and all(
        off * size % ALIGN_BYTES == 0 for off in bucket.offsets
    )
