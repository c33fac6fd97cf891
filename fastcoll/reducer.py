"""The gradient reducer behind :class:`fastcoll.DDP`.

Life of one synchronized iteration::

    forward (DDP)   prepare_for_forward()   raise if the previous backward left
                                            buckets unreduced; rebuild the
                                            layout once (rank 0's order wins)
                    prepare_for_backward()  arm the hooks; find unused params
    backward        post-accumulate-grad hook per parameter -> _on_grad()
                      large CPU gradient final -> _pack_early() writes it
                      into its slot while it is still in cache
                      first hook: queue _on_backward_end on the engine, mark
                      the unused parameters ready
                      bucket complete -> _advance() launches every complete
                      bucket in index order: _launch() packs it with one fused
                      flatten_scale (scale = 1/divisor, cast to the wire dtype
                      with comm_dtype) and starts an async all-reduce; with a
                      comm hook it packs with scale 1 and calls the hook
    end of backward _on_backward_end() -> _finalize(): wait for each bucket
                    (or its hook's future), one fused unflatten_scale per
                    bucket into the gradients (casting from the wire dtype)

Collectives are issued in exactly this order on every rank: [layout broadcast
(once)], then per backward: bucket 0, 1, ..., B-1 (or whatever the comm hook
issues for each, in that order), then the used-parameter all-reduce (only when
unused parameters are tracked). The buffer broadcast of the forward (and,
under ``join()``, the join protocol's all-reduces) is issued by
:class:`fastcoll.DDP` before the module runs. All bucket collectives go
through :meth:`Reducer._launch`; all their results come back through
:meth:`Reducer._finalize` -> :meth:`Reducer._unpack`. A rank that has joined
(run out of inputs) issues the same backward collectives with zeros through
:meth:`Reducer.replay_joined_backward`.

Extension points (for comm hooks, join and low-precision communication):

* ``Reducer.divisor``: the run-time divisor folded into the pack (default: the
  process group's size).
* :meth:`Reducer._pack` takes the scale explicitly, so a scale-free pack is
  ``self._pack(bucket, 1.0)``.
* :meth:`Reducer._communicate` turns a packed bucket into a handle whose
  ``wait()`` completes the reduction; :meth:`Reducer._collect` turns the
  handle into the reduced flat tensor (any floating dtype, bucket numel) that
  :meth:`Reducer._unpack` writes back, casting on the way.
* :class:`Bucket` carries the flat buffer, the parameter-shaped views of it
  and GradBucket-style accessors; it is the bucket object comm hooks get.

Low-precision communication (``comm_dtype``): the division by ``divisor``
happens in the pack, in float32, before the single rounding to the 16-bit
wire dtype; the all-reduce then sums per-rank shares of the mean, so the
result and every partial sum are bounded by the largest per-rank gradient
magnitude: nothing overflows float16 while every rank's gradients are within
its range (a naive sum-then-divide overflows at 65504 / world_size).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import ops
from ._reference import SUPPORTED_DTYPES, is_dense
from ._sparse import SparseExchange
from .bucketing import ParamSpec, assign_buckets, order_from_ready, reverse_registration_order

__all__ = ["Bucket", "CoalescedBroadcast", "Reducer", "broadcast_coalesced", "find_tensors"]

#: CPU gradients with at least this many elements are packed as soon as they
#: are final, while still in cache (measured: ~25% less pack time on ResNet-50
#: shapes); smaller ones wait for their bucket's single fused pack. The
#: environment variable FASTCOLL_EARLY_PACK_MIN_NUMEL overrides it (read when
#: buckets are built; a huge value turns early packing off).
EARLY_PACK_MIN_NUMEL = 1 << 16


class Bucket:
    """A group of same-(device, dtype) parameters reduced with one collective.

    Attributes:
        pos: Index of the bucket in reduction order.
        count: Number of buckets in the layout (for :meth:`is_last`).
        param_indices: Reducer parameter indices, in bucket (packing) order.
        params: The parameters, in bucket order.
        names: Their qualified names.
        device, dtype: Of every parameter and of ``flat``.
        numel: Total elements; ``offsets[i]`` is parameter i's first element in ``flat``.
        flat: The 1-D contiguous bucket buffer (in the wire dtype when comm_dtype
            narrows the bucket and gradients are not bucket views).
        views: Views of ``flat`` shaped and strided like each parameter.
        comm: The buffer the all-reduce carries: ``flat`` itself, or (with
            comm_dtype and gradient_as_bucket_view) a separate 16-bit buffer.
        view_ptrs: ``data_ptr()`` of each view (alias test for gradient_as_bucket_view).
        expected: Hook firings that complete the bucket in one iteration.
        pending: Hook firings still missing in the current iteration.
        work: Handle of the in-flight reduction, or None.
        sparse: The bucket holds one parameter with sparse gradients; its
            gradient is all-reduced as it is (``flat`` is empty, ``views`` too).
    """

    __slots__ = (
        "pos", "count", "param_indices", "params", "names", "device", "dtype", "numel", "offsets",
        "flat", "views", "view_ptrs", "comm", "expected", "pending", "work", "_hook_buffer", "_hook_views",
        "n_packed", "sparse",
    )  # fmt: skip

    def __init__(
        self,
        pos: int,
        count: int,
        param_indices: List[int],
        params: List[torch.Tensor],
        names: List[str],
        wire_dtype: Optional[torch.dtype] = None,
        separate_wire: bool = False,
        sparse: bool = False,
    ):
        self.pos = pos
        self.sparse = sparse
        self.count = count
        self.param_indices = param_indices
        self.params = params
        self.names = names
        self.device = params[0].device
        self.dtype = params[0].dtype
        self.offsets: List[int] = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        # Without a separate wire buffer the flat buffer itself travels, in
        # ``wire_dtype`` (gradients are packed into it with a cast). A sparse
        # bucket (one parameter with sparse gradients) has no flat buffer: its
        # gradient itself is all-reduced, in its own dtype.
        flat_dtype = self.dtype if wire_dtype is None or separate_wire or sparse else wire_dtype
        self.flat = torch.empty(0 if sparse else total, dtype=flat_dtype, device=self.device)
        self.views = [] if sparse else ops.bucket_views(self.flat, params)
        self.view_ptrs = [v.data_ptr() for v in self.views]
        self.comm = self.flat
        if wire_dtype is not None and separate_wire and not sparse:
            self.comm = torch.empty(total, dtype=wire_dtype, device=self.device)
        self.expected = len(params)
        self.pending = 0
        self.n_packed = 0  # gradients packed early (CPU, large) in the current iteration
        self.work: Any = None
        self._hook_buffer: Optional[torch.Tensor] = None
        self._hook_views: Optional[List[torch.Tensor]] = None

    # GradBucket-style accessors (torch's comm hooks duck-type these).
    def index(self) -> int:
        """Position of this bucket in reduction order."""
        return self.pos

    def is_last(self) -> bool:
        """True for the last bucket reduced in an iteration."""
        return self.pos == self.count - 1

    def buffer(self) -> torch.Tensor:
        """The flat 1-D bucket buffer (the one given to :meth:`set_buffer`, if any, in the current hook call)."""
        hb = self._hook_buffer
        return self.flat if hb is None else hb

    def gradients(self) -> List[torch.Tensor]:
        """Parameter-shaped views of :meth:`buffer`, in :meth:`parameters` order.

        Writing into them writes into :meth:`buffer` (PowerSGD relies on this).
        """
        hb = self._hook_buffer
        if hb is None:
            return self.views
        if self._hook_views is None:
            self._hook_views = ops.bucket_views(hb, self.params)
        return self._hook_views

    def parameters(self) -> List[torch.Tensor]:
        """The bucket's parameters."""
        return self.params

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace :meth:`buffer` (and the tensors :meth:`gradients` views) for the rest of this hook call.

        As in torch's GradBucket, this changes what the accessors return; the
        reduced gradients are whatever the hook's future returns.

        Raises:
            TypeError: ``buffer`` is not a tensor.
            ValueError: ``buffer`` is not 1-D contiguous with the bucket's element count.
        """
        if not isinstance(buffer, torch.Tensor):
            raise TypeError(f"fastcoll.DDP: GradBucket.set_buffer expects a tensor, got {type(buffer).__name__}")
        if buffer.dim() != 1 or buffer.numel() != self.numel or not buffer.is_contiguous():
            raise ValueError(
                f"fastcoll.DDP: GradBucket.set_buffer expects a 1-D contiguous tensor of {self.numel} elements "
                f"(bucket {self.pos}), got shape {tuple(buffer.shape)} strides {tuple(buffer.stride())}"
            )
        self._hook_buffer = buffer
        self._hook_views = None

    @property
    def nbytes(self) -> int:
        """Size of the bucket's gradients in bytes (in the parameters' dtype)."""
        return self.numel * self.params[0].element_size()

    @property
    def comm_nbytes(self) -> int:
        """Bytes each all-reduce of this bucket carries (in the wire dtype)."""
        return self.numel * self.comm.element_size()


def find_tensors(obj: Any) -> List[torch.Tensor]:
    """All tensors inside ``obj``: nested lists, tuples (incl. namedtuples), dicts, sets and dataclasses."""
    out: List[torch.Tensor] = []
    stack = [obj]
    seen = set()
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif hasattr(o, "__dataclass_fields__") and not isinstance(o, type):
            if id(o) in seen:
                continue
            seen.add(id(o))
            stack.extend(getattr(o, f) for f in o.__dataclass_fields__)
    return out


def _runs(present: Sequence[bool]) -> List[Tuple[int, int]]:
    """Maximal [start, stop) index ranges where ``present`` is true."""
    runs = []
    start = None
    for i, ok in enumerate(present):
        if ok and start is None:
            start = i
        elif not ok and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(present)))
    return runs


class CoalescedBroadcast:
    """A fixed set of tensors broadcast in place from one rank: one message per device.

    Worked out once, at construction: every device's tensors travel as one
    byte buffer (split only past ``cap_bytes``), so a model's buffers cost one
    collective per forward whatever their dtypes; inside a message each dtype
    has its own 16-byte-aligned section. Dense floating-point tensors are
    packed into their section with one fused :func:`fastcoll.ops.flatten_scale`
    on the source rank and unpacked with one :func:`fastcoll.ops.unflatten_scale`
    on the others; the rest (``num_batches_tracked`` and the like) are copied
    one by one. Every rank must build it from tensors of the same shapes and
    dtypes in the same order. :class:`fastcoll.DDP` builds one for its buffers
    at construction and runs it before every forward, reusing the messages.

    Args:
        tensors: Tensors to overwrite with the source rank's values (mutually
            non-overlapping; pass ``param.detach()`` for parameters).
        cap_bytes: Largest message size in bytes (a single larger tensor gets
            a message of its own).
    """

    _ALIGN = 16

    def __init__(self, tensors: Sequence[torch.Tensor], cap_bytes: int = 250 * 1024 * 1024):
        per_device: Dict[torch.device, List[torch.Tensor]] = {}
        for t in tensors:
            if t.numel():
                per_device.setdefault(t.device, []).append(t)
        #: Per message: (byte buffer, [(section view, tensors) packed with one fused call], [(section view, tensor) copied]).
        self.messages: List[Tuple[torch.Tensor, List[Tuple[torch.Tensor, List[torch.Tensor]]], List[Tuple[torch.Tensor, torch.Tensor]]]] = []
        for device, ts in per_device.items():
            chunk: List[torch.Tensor] = []
            size = 0
            for t in ts:
                nbytes = t.numel() * t.element_size()
                if chunk and size + nbytes > cap_bytes:
                    self.messages.append(self._message(device, chunk))
                    chunk, size = [], 0
                chunk.append(t)
                size += nbytes
            if chunk:
                self.messages.append(self._message(device, chunk))

    @classmethod
    def _message(cls, device: torch.device, chunk: List[torch.Tensor]):
        # Sections in order of first appearance: (dtype, fused) -> tensors.
        sections: Dict[Tuple[torch.dtype, bool], List[torch.Tensor]] = {}
        for t in chunk:
            sections.setdefault((t.dtype, t.dtype in SUPPORTED_DTYPES and is_dense(t)), []).append(t)
        layout: List[Tuple[int, torch.dtype, List[torch.Tensor], bool]] = []  # (byte offset, dtype, tensors, fused)
        offset = 0
        for (dtype, is_fused), ts in sections.items():
            offset = -(-offset // cls._ALIGN) * cls._ALIGN
            for group in [ts] if is_fused else [[t] for t in ts]:
                layout.append((offset, dtype, group, is_fused))
                offset += sum(t.numel() for t in group) * dtype.itemsize
        buf = torch.empty(offset, dtype=torch.uint8, device=device)
        fused: List[Tuple[torch.Tensor, List[torch.Tensor]]] = []
        copied: List[Tuple[torch.Tensor, torch.Tensor]] = []
        for o, dtype, group, is_fused in layout:
            section = buf[o : o + sum(t.numel() for t in group) * dtype.itemsize].view(dtype)
            if is_fused:
                fused.append((section, group))
            else:
                copied.append((section.view(group[0].shape), group[0]))
        return buf, fused, copied

    def __call__(self, group: Optional[dist.ProcessGroup], group_src: int = 0) -> None:
        """Broadcast from group rank ``group_src`` of ``group`` (None: the default group)."""
        if not self.messages or dist.get_world_size(group) == 1:
            return
        is_src = dist.get_rank(group) == group_src
        with torch.no_grad():
            for buf, fused, copied in self.messages:
                if is_src:
                    for section, ts in fused:
                        ops.flatten_scale(ts, section, 1.0)
                    for section, t in copied:
                        section.copy_(t)
                dist.broadcast(buf, group=group, group_src=group_src)
                if not is_src:
                    for section, ts in fused:
                        ops.unflatten_scale(section, ts, 1.0)
                    for section, t in copied:
                        t.copy_(section)


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor],
    group: Optional[dist.ProcessGroup],
    group_src: int = 0,
    cap_bytes: int = 250 * 1024 * 1024,
) -> None:
    """Broadcast ``tensors`` in place from group rank ``group_src``, coalesced (see :class:`CoalescedBroadcast`)."""
    CoalescedBroadcast(tensors, cap_bytes)(group, group_src)


_COMM_DTYPES = (None, torch.float16, torch.bfloat16)


def _check_comm_dtype(comm_dtype: Any) -> None:
    if not any(comm_dtype is d for d in _COMM_DTYPES):
        raise ValueError(f"fastcoll.DDP: comm_dtype must be None, torch.float16 or torch.bfloat16, got {comm_dtype!r}")


def _empty_sparse_grad(p: torch.Tensor) -> torch.Tensor:
    """A sparse gradient of ``p`` with no rows (an embedding's layout: one sparse dimension)."""
    indices = torch.empty((1, 0), dtype=torch.long, device=p.device)
    values = torch.empty((0, *p.shape[1:]), dtype=p.dtype, device=p.device)
    return torch.sparse_coo_tensor(indices, values, p.shape, check_invariants=False)


def _hook_name(hook: Any) -> str:
    name = getattr(hook, "__qualname__", None) or getattr(hook, "__name__", None)
    if name is None and hasattr(hook, "func"):  # functools.partial
        name = f"partial({_hook_name(hook.func)})"
    return repr(name or type(hook).__name__)


def _describe_value(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a Tensor (shape {tuple(v.shape)}, dtype {v.dtype}, device {v.device})"
    if isinstance(v, (list, tuple)):
        return f"a {type(v).__name__} of {len(v)} element(s) ({', '.join(type(x).__name__ for x in v[:4])})"
    return "None" if v is None else f"a {type(v).__module__}.{type(v).__qualname__}"


def _remove_handles(handles: List[Any]) -> None:
    for h in handles:
        h.remove()
    handles.clear()


def _make_hook(ref: "weakref.ReferenceType[Reducer]", idx: int, lock: Optional[threading.Lock]) -> Callable:
    # The hook holds the reducer weakly so a dropped DDP wrapper does not keep
    # reducing gradients of a module that has been re-wrapped.
    if lock is None:

        def hook(_param: torch.Tensor) -> None:
            r = ref()
            if r is not None and r._expect_hooks:
                r._on_grad(idx)

    else:

        def hook(_param: torch.Tensor) -> None:
            r = ref()
            if r is not None and r._expect_hooks:
                with lock:
                    r._on_grad(idx)

    return hook


class Reducer:
    """Bucketed, overlapped gradient averaging for a list of parameters.

    Args:
        params: Parameters to reduce (requires_grad, dense, floating, one device type).
        names: Qualified name of each parameter, for messages and :meth:`bucket_info`.
        process_group: Group to reduce over (None: default group).
        bucket_cap_bytes: Byte cap of every bucket but the first of each (device, dtype).
        first_bucket_bytes: Byte cap of the first bucket of each (device, dtype).
        find_unused_parameters: Traverse the autograd graph from the outputs
            each iteration and mark unreached parameters ready.
        gradient_as_bucket_view: Make ``param.grad`` a view into its bucket.
        static_graph: The set of used parameters and the number of times each
            one's gradient is accumulated never change: learn them in the first
            iteration (reduced at the end of backward) and skip the traversal
            afterwards.
        comm_dtype: None, ``torch.float16`` or ``torch.bfloat16``: buckets of a
            wider dtype are packed (cast and scaled in one pass) into a buffer of
            this dtype, all-reduced in it and unpacked (upcast) in one pass.
            The 1/divisor scale is applied before the all-reduce, so the sum
            of the ranks' contributions is the mean and cannot overflow
            where the mean itself is representable.
        sparse_params: Indices of parameters whose gradients are sparse
            (``nn.Embedding(sparse=True)`` weights): each gets a bucket of its
            own and its gradient is scaled and summed as a sparse tensor
            (see :class:`SparseExchange`).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        process_group: Optional[dist.ProcessGroup] = None,
        *,
        bucket_cap_bytes: int = 25 * 1024 * 1024,
        first_bucket_bytes: int = 1024 * 1024,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        comm_dtype: Optional[torch.dtype] = None,
        sparse_params: Sequence[int] = (),
    ):
        self.params: List[torch.Tensor] = list(params)
        self.names: List[str] = list(names)
        n = len(self.params)
        if n == 0:
            raise ValueError("fastcoll.Reducer: no parameters to reduce")
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        #: Run-time divisor folded into the pack: gradients are averaged over this many ranks.
        self.divisor: float = float(self.world_size)
        self.bucket_cap_bytes = int(bucket_cap_bytes)
        self.first_bucket_bytes = int(first_bucket_bytes)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.static_graph = bool(static_graph)
        _check_comm_dtype(comm_dtype)
        self.comm_dtype: Optional[torch.dtype] = comm_dtype
        # Comm hook (torch's contract): called once per bucket per iteration, in index order.
        self._hook: Optional[Callable] = None
        self._hook_state: Any = None
        self._sparse = bytearray(n)
        for i in sparse_params:
            self._sparse[i] = 1
        self._specs = [ParamSpec.of(p, bool(self._sparse[i])) for i, p in enumerate(self.params)]
        self._index_of_id = {id(p): i for i, p in enumerate(self.params)}
        self._comm_device = self.params[0].device

        # Per-iteration state.
        self._expect_hooks = False
        self._callback_queued = False
        self._require_finalize = False
        self._unused_marked = False
        self._next_bucket = 0
        self._num_iterations = 0  # completed synchronized backwards
        self._static_first = self.static_graph
        self._expected_counts: List[int] = [1] * n
        self._remaining: List[int] = [1] * n
        self._unused: List[int] = []
        self._track_used = False
        self._local_used = bytearray(n)
        self._used_work: Any = None
        self._used_tensor: Optional[torch.Tensor] = None
        self._global_used: Optional[List[bool]] = None
        self._static_used: Optional[List[bool]] = None  # static_graph: global use learned in iteration 1
        self._hook_counts: List[int] = [0] * n
        self._learn_static_use = False

        # Layout rebuild bookkeeping: record the ready order of the first
        # synchronized backward, rebuild once at the next forward.
        self._record_order = self._may_rebuild()
        self._order: List[int] = []
        self._pending_order: Optional[List[int]] = None
        self._rebuilt = False

        self.buckets: List[Bucket] = []
        self._packed = bytearray(n)  # per parameter: packed early in the current iteration
        self._param_bucket: List[Optional[Bucket]] = [None] * n
        self._install_layout(assign_buckets(self._specs, reverse_registration_order(n), self.first_bucket_bytes, self.bucket_cap_bytes))

        devices = {p.device for p in self.params}
        lock = threading.Lock() if len(devices) > 1 else None  # hooks of several devices run on several threads
        ref = weakref.ref(self)
        self._handles: List[Any] = [p.register_post_accumulate_grad_hook(_make_hook(ref, i, lock)) for i, p in enumerate(self.params)]
        self._finalizer = weakref.finalize(self, _remove_handles, self._handles)

    # ------------------------------------------------------------------ layout

    def _may_rebuild(self) -> bool:
        # A dynamic graph (find_unused without static_graph) does not have one
        # ready order to learn from.
        return self.static_graph or not self.find_unused_parameters

    def _install_layout(self, layout: List[List[int]]) -> None:
        """Allocate buckets for ``layout`` (lists of parameter indices, in reduction order)."""
        old_buckets = self.buckets
        buckets = [self._new_bucket(pos, len(layout), idxs) for pos, idxs in enumerate(layout)]
        for b in buckets:
            b.expected = sum(self._expected_counts[i] for i in b.param_indices)
            b.pending = b.expected
            for i in b.param_indices:
                self._param_bucket[i] = b
        if self.gradient_as_bucket_view:
            # Gradients move into the new bucket storage (also on construction).
            with torch.no_grad():
                for b in buckets:
                    for p, v in zip(b.params, b.views):  # none for a sparse bucket
                        g = p.grad
                        if g is not None and g.data_ptr() != v.data_ptr():
                            v.copy_(g)
                            p.grad = v
        self.buckets = buckets
        self._index_eager_slots()
        del old_buckets

    def _index_eager_slots(self) -> None:
        """Where each large CPU gradient goes when it is packed as soon as it is final.

        On CPU a gradient just written by backward is still in cache; packing it
        right away (one fused call for that tensor) costs less than re-reading it
        from memory when its bucket completes. Small gradients wait for the
        bucket's single fused pack; CUDA buckets always pack in one launch.
        """
        n = len(self.params)
        min_numel = int(os.environ.get("FASTCOLL_EARLY_PACK_MIN_NUMEL", EARLY_PACK_MIN_NUMEL))
        self._eager_slots: List[Optional[torch.Tensor]] = [None] * n
        self._slot_pos: List[int] = [0] * n
        for b in self.buckets:
            eligible = b.device.type == "cpu" and not b.sparse
            for k, i in enumerate(b.param_indices):
                self._slot_pos[i] = k
                numel = b.params[k].numel()
                if eligible and numel >= min_numel:
                    self._eager_slots[i] = b.comm[b.offsets[k] : b.offsets[k] + numel]

    def _new_bucket(self, pos: int, count: int, idxs: List[int]) -> Bucket:
        params = [self.params[i] for i in idxs]
        return Bucket(
            pos, count, idxs, params, [self.names[i] for i in idxs],
            wire_dtype=self._wire_dtype(params[0].dtype), separate_wire=self.gradient_as_bucket_view,
            sparse=bool(self._sparse[idxs[0]]),
        )  # fmt: skip

    def _wire_dtype(self, dtype: torch.dtype) -> Optional[torch.dtype]:
        """The all-reduce dtype of a bucket of ``dtype`` gradients (None: its own).

        comm_dtype only ever narrows: buckets already 16-bit travel as they are.
        """
        c = self.comm_dtype
        if c is None or dtype.itemsize <= c.itemsize:
            return None
        return c

    def layout(self) -> List[List[int]]:
        """The current buckets as lists of parameter indices, in reduction order."""
        return [list(b.param_indices) for b in self.buckets]

    def bucket_info(self) -> List[Dict[str, Any]]:
        """Each bucket's index, parameter names, dtype, device, numel and bytes, in reduction order."""
        return [
            {
                "index": b.pos,
                "names": list(b.names),
                "dtype": b.dtype,
                "device": b.device,
                "numel": b.numel,
                "bytes": b.nbytes,
                "comm_dtype": b.comm.dtype,
                "comm_bytes": b.nbytes if b.sparse else b.comm_nbytes,  # sparse: the values when every row is sent (each rank also sends 8 bytes of index per row)
                "sparse": b.sparse,
            }
            for b in self.buckets
        ]

    def rebuild_buckets(self) -> bool:
        """Rebuild the layout from the recorded ready order, once; rank 0's order wins.

        Collective (a broadcast) when a rebuild is pending; every rank has one
        pending after the same iteration, since the order is recorded during
        the first synchronized backward.

        Returns:
            True if a rebuild took place (even one that kept the layout).
        """
        if self._rebuilt or self._pending_order is None:
            return False
        n = len(self.params)
        order = order_from_ready(self._pending_order, n)
        self._pending_order = None
        self._rebuilt = True
        if self.world_size > 1:
            t = torch.tensor(order, dtype=torch.int64, device=self._comm_device)
            dist.broadcast(t, group=self.process_group, group_src=0)
            order = t.tolist()
        layout = assign_buckets(self._specs, order, self.first_bucket_bytes, self.bucket_cap_bytes)
        if layout != self.layout():
            self._install_layout(layout)
        return True

    # ---------------------------------------------------------------- forward

    def set_static_graph(self) -> None:
        """Switch to static-graph mode; only before the first synchronized iteration."""
        if self._num_iterations > 0:
            raise RuntimeError("fastcoll.DDP: static_graph can only be enabled before the first iteration")
        self.static_graph = True
        self._static_first = True
        self._record_order = self._may_rebuild()

    def prepare_for_forward(self) -> None:
        """Start of a forward that may be followed by a synchronized backward.

        Raises:
            RuntimeError: if the previous synchronized backward left some
                parameters without gradients, naming them.
        """
        if self._require_finalize:
            self._raise_unfinished()
        self.rebuild_buckets()

    def prepare_for_backward(self, outputs: Optional[Any] = None) -> None:
        """Arm the hooks for the next backward.

        Args:
            outputs: The forward's output (any nesting); searched for
                parameters that cannot receive a gradient when unused
                parameters are being found dynamically; ignored otherwise.
        """
        if self.closed:
            return
        n = len(self.params)
        self._expect_hooks = True
        self._callback_queued = False  # a backward that raised never ran its callback
        self._unused_marked = False
        self._next_bucket = 0
        for b in self.buckets:
            b.pending = b.expected
            b.work = None
            b.n_packed = 0
        self._packed = bytearray(n)
        self._remaining = self._expected_counts[:]
        self._track_used = self.find_unused_parameters and not self.static_graph or self._static_first
        if self._track_used:
            self._local_used = bytearray(n)
        self._used_work = None
        self._global_used = self._static_used
        if self._static_first:
            self._hook_counts = [0] * n
        if self._record_order:
            self._order = []
        if self.find_unused_parameters and not self.static_graph:
            self._unused = self._search_unused(outputs)
        else:
            self._unused = []

    def _search_unused(self, outputs: Any) -> List[int]:
        """Indices of parameters not reachable from ``outputs`` through the autograd graph."""
        index = self._index_of_id
        n = len(self.params)
        used = bytearray(n)
        found = 0
        stack = []
        for t in find_tensors(outputs):
            if t.grad_fn is not None:
                stack.append(t.grad_fn)
            elif t.requires_grad:
                i = index.get(id(t))
                if i is not None and not used[i]:
                    used[i] = 1
                    found += 1
        seen = set()
        while stack and found < n:
            fn = stack.pop()
            if fn in seen:
                continue
            seen.add(fn)
            var = getattr(fn, "variable", None)
            if var is not None:
                i = index.get(id(var))
                if i is not None and not used[i]:
                    used[i] = 1
                    found += 1
                continue
            for nxt, _ in fn.next_functions:
                if nxt is not None and nxt not in seen:
                    stack.append(nxt)
        return [i for i in range(n) if not used[i]]

    # --------------------------------------------------------------- backward

    def _on_grad(self, idx: int) -> None:
        """Hook body: parameter ``idx``'s gradient has been accumulated."""
        if not self._callback_queued:
            self._start_backward()
        if self._static_first:
            self._hook_counts[idx] += 1
            if self._record_order:
                self._order.append(idx)
            return
        rem = self._remaining[idx]
        if rem <= 0:
            self._raise_marked_twice(idx)
        self._remaining[idx] = rem - 1
        if self._track_used:
            self._local_used[idx] = 1
        if self._record_order and rem == 1:
            self._order.append(idx)
        b = self._param_bucket[idx]
        if rem == 1 and self._eager_slots[idx] is not None:
            self._pack_early(idx, b)
        b.pending -= 1
        if b.pending == 0 and b.pos == self._next_bucket:
            self._advance()

    def _start_backward(self) -> None:
        self._callback_queued = True
        self._require_finalize = True
        torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        if not self._unused_marked:
            self._unused_marked = True
            for idx in self._unused:
                self._remaining[idx] = 0
                self._param_bucket[idx].pending -= 1
            if not self._static_first:
                self._advance()

    def _advance(self) -> None:
        """Launch, in index order, every complete bucket not launched yet."""
        buckets = self.buckets
        i = self._next_bucket
        nb = len(buckets)
        while i < nb and buckets[i].pending == 0:
            self._next_bucket = i + 1
            self._launch(buckets[i])
            i += 1
        if i == nb and self._track_used and self._used_work is None:
            self._launch_used_map()

    def _launch(self, b: Bucket) -> None:
        """Pack bucket ``b`` and start its reduction: the only place bucket collectives are issued.

        Without a comm hook the pack folds in 1/divisor (and the cast to the
        wire dtype); with one, the pack is scale-free and the hook divides.
        """
        if b.sparse:
            b.work = self._launch_sparse(b)
            return
        self._pack(b, self._pack_scale())
        if self._hook is None:
            b.work = self._communicate(b) if b.numel > 0 else None
        else:
            b.work = self._run_hook(b)

    def _pack_scale(self) -> float:
        """The factor folded into the pack: 1/divisor, or 1 when a comm hook divides."""
        return 1.0 / self.divisor if self._hook is None else 1.0

    def _communicate(self, b: Bucket) -> Any:
        """Start reducing the packed ``b.comm``; returns a handle with ``wait()``."""
        if self.world_size == 1:
            return None
        return dist.all_reduce(b.comm, group=self.process_group, async_op=True)

    def _run_hook(self, b: Any) -> Any:
        """Call the comm hook on bucket ``b``; returns its future (checked)."""
        b._hook_buffer = None
        b._hook_views = None
        fut = self._hook(self._hook_state, b)
        if not isinstance(fut, torch._C.Future):
            raise TypeError(
                f"fastcoll.DDP: the comm hook {_hook_name(self._hook)} returned {_describe_value(fut)} for bucket "
                f"{b.pos}; a comm hook must return a torch.futures.Future whose value is the reduced bucket "
                "(one tensor with the bucket's number of elements), e.g. "
                "dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])"
            )
        return fut

    def _collect(self, b: Bucket) -> torch.Tensor:
        """Wait for ``b``'s reduction; returns the reduced flat tensor."""
        w = b.work
        if w is None:
            return b.comm
        b.work = None
        if self._hook is None:
            w.wait()
            return b.comm
        return self._hook_result(b, w.wait())

    def _hook_result(self, b: Bucket, value: Any) -> torch.Tensor:
        """The comm hook's future value as a flat tensor for :meth:`_unpack`, checked."""
        if isinstance(value, (list, tuple)) and len(value) == 1:
            value = value[0]
        if (
            not isinstance(value, torch.Tensor)
            or not value.is_floating_point()
            or value.numel() != b.numel
            or value.device != b.device
        ):
            raise TypeError(
                f"fastcoll.DDP: the comm hook {_hook_name(self._hook)} completed bucket {b.pos} with "
                f"{_describe_value(value)}; expected one floating-point tensor of {b.numel} elements on {b.device} "
                "(or a list holding exactly one)"
            )
        flat = b.flat
        if value is flat or (value.dtype == flat.dtype and value.data_ptr() == flat.data_ptr() and value.is_contiguous()):
            return flat
        return value.reshape(-1) if value.is_contiguous() else value.contiguous().reshape(-1)

    # -------------------------------------------------------- configuration

    def _check_idle(self, what: str) -> None:
        if self._callback_queued or self._require_finalize:
            raise RuntimeError(f"fastcoll.DDP: cannot {what} while a backward pass is being reduced; do it between iterations")

    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        """Install ``hook`` (already validated by :class:`fastcoll.DDP`); between iterations only."""
        self._check_idle("register a comm hook")
        if self.comm_dtype is not None:
            raise RuntimeError("fastcoll.DDP: a comm hook cannot be combined with comm_dtype")
        sparse = [self.names[i] for i in range(len(self.params)) if self._sparse[i]]
        if sparse:
            raise RuntimeError(
                f"fastcoll.DDP: comm hooks are not supported with sparse gradients (parameter '{sparse[0]}' belongs "
                "to an nn.Embedding/EmbeddingBag with sparse=True); use sparse=False or no comm hook"
            )
        self._hook = hook
        self._hook_state = state

    def set_comm_dtype(self, comm_dtype: Optional[torch.dtype]) -> None:
        """Change the wire dtype (reallocates the bucket buffers, keeping the layout); between iterations only."""
        _check_comm_dtype(comm_dtype)
        self._check_idle("change comm_dtype")
        if comm_dtype is not None and self._hook is not None:
            raise RuntimeError("fastcoll.DDP: comm_dtype cannot be combined with a comm hook")
        if comm_dtype == self.comm_dtype:
            return
        self.comm_dtype = comm_dtype
        if not self.closed:
            self._install_layout(self.layout())

    # ----------------------------------------------------------------- join

    def replay_joined_backward(self) -> None:
        """On a rank that has run out of inputs: issue one synchronized backward's collectives with zeros.

        Same collectives, same order as :meth:`_advance` on the ranks still
        training: one per bucket in index order (an all-reduce of zeros in the
        wire dtype, skipping empty buckets, or the comm hook called on a
        bucket of zeros), then the used-parameter all-reduce when this
        iteration tracks it. This rank's gradients are left untouched. The
        per-iteration state advances as after a real synchronized backward
        (static-graph learning, the ready order for the one-time rebuild), so
        every rank agrees on what the next iteration issues.
        """
        pending = []
        exchanges = []
        for b in self.buckets:
            if b.sparse:
                if self.world_size > 1:
                    exchanges.append(SparseExchange(_empty_sparse_grad(b.params[0]), self.process_group, self.world_size))
            elif self._hook is not None:
                z = Bucket(b.pos, b.count, b.param_indices, b.params, b.names)
                z.flat.zero_()
                pending.append(self._run_hook(z))
            elif b.numel > 0 and self.world_size > 1:
                z = torch.zeros(b.numel, dtype=b.comm.dtype, device=b.device)
                pending.append(dist.all_reduce(z, group=self.process_group, async_op=True))
        track_used = self.find_unused_parameters and not self.static_graph or self._static_first
        used = None
        if track_used:
            used = torch.zeros(len(self.params), dtype=torch.int32, device=self._comm_device)
            if self.world_size > 1:
                pending.append(dist.all_reduce(used, group=self.process_group, async_op=True))
        for w in pending:
            w.wait()
        for x in exchanges:  # the row all-gathers come after the used-parameter all-reduce, as in _finalize
            x.start_gather()
        for x in exchanges:
            x.result()
        if self._static_first:
            self._static_first = False
            global_used = [c > 0 for c in used.tolist()] if used is not None else [True] * len(self.params)
            self._static_used = None if all(global_used) else global_used
            self._expected_counts = [1 if u else 0 for u in global_used]
            for b in self.buckets:
                b.expected = sum(self._expected_counts[i] for i in b.param_indices)
        self._num_iterations += 1
        if self._record_order:
            # No gradients arrived here: this rank's "ready order" is the default
            # one (rank 0's order wins at the rebuild anyway).
            self._record_order = False
            self._pending_order = []
            self._order = []

    def _launch_sparse(self, b: Bucket) -> Any:
        """Scale the sparse gradient of ``b``'s parameter by 1/divisor and start its reduction.

        A parameter that got no gradient contributes an empty sparse tensor, so
        every rank still issues the collectives. Returns a :class:`SparseExchange`,
        or the scaled gradient itself on one rank.
        """
        p, name = b.params[0], b.names[0]
        g = p.grad
        if g is None:
            g = _empty_sparse_grad(p)
        elif not g.is_sparse:
            raise RuntimeError(
                f"fastcoll.DDP: parameter '{name}' belongs to an nn.Embedding/EmbeddingBag with sparse=True but its "
                f"gradient has layout {g.layout}; keep sparse=True for the module's lifetime or wrap it again"
            )
        with torch.no_grad():
            scaled = g.coalesce() * (1.0 / self.divisor)
        if self.world_size == 1:
            return scaled
        return SparseExchange(scaled, self.process_group, self.world_size)

    def _finish_sparse(self, b: Bucket) -> None:
        """Make the reduced sparse gradient (see :meth:`_launch_sparse`) the parameter's gradient."""
        pending = b.work
        b.work = None
        reduced = pending.result() if isinstance(pending, SparseExchange) else pending
        if self._global_used is not None and not self._global_used[b.param_indices[0]]:
            return  # unused on every rank: the gradient stays as it was
        b.params[0].grad = reduced

    def _launch_used_map(self) -> None:
        used = torch.frombuffer(self._local_used, dtype=torch.uint8) if len(self._local_used) else torch.zeros(0, dtype=torch.uint8)
        self._used_tensor = used.to(device=self._comm_device, dtype=torch.int32)
        if self.world_size > 1:
            self._used_work = dist.all_reduce(self._used_tensor, group=self.process_group, async_op=True)
        else:
            self._used_work = True

    def _pack_early(self, idx: int, b: Bucket) -> None:
        """Pack parameter ``idx``'s final gradient into its slot now (see :meth:`_index_eager_slots`)."""
        p = self.params[idx]
        g = p.grad
        if g is None:
            return
        k = self._slot_pos[idx]
        scale = self._pack_scale()
        if self.gradient_as_bucket_view:
            v = b.views[k]
            if g.data_ptr() != b.view_ptrs[k]:
                if g.stride() != v.stride() and g.numel() > 1:
                    return  # layout differs from the parameter's: left to the bucket pack
                p.grad = v
            elif scale == 1.0 and b.comm is b.flat:
                g = None  # already in place and nothing to scale
        if g is not None:
            ops.flatten_scale([g], self._eager_slots[idx], scale)
        self._packed[idx] = 1
        b.n_packed += 1

    def _pack(self, b: Bucket, scale: float) -> None:
        """Write the bucket's gradients times ``scale`` into ``b.comm`` (missing gradients as zeros), casting to its dtype.

        Gradients already packed early (:meth:`_pack_early`) are skipped.
        """
        params = b.params
        grads = [p.grad for p in params]
        done = [self._packed[i] for i in b.param_indices] if b.n_packed else None
        in_place = False  # every gradient already is its view of b.comm, and scale 1: nothing to write
        if self.gradient_as_bucket_view:
            ptrs = b.view_ptrs
            views = b.views
            in_place = scale == 1.0 and b.comm is b.flat
            for i, g in enumerate(grads):
                if g is not None and g.data_ptr() != ptrs[i] and not (done and done[i]):
                    v = views[i]
                    if g.stride() != v.stride() and g.numel() > 1:
                        with torch.no_grad():
                            v.copy_(g)  # layout differs from the parameter's: copy elementwise
                        grads[i] = v
                    else:
                        in_place = False  # the pack below copies g into its view
                    params[i].grad = v
        if done is None:
            complete = True
            for g in grads:
                if g is None:
                    complete = False
                    break
            if complete:
                if b.numel and not in_place:
                    ops.flatten_scale(grads, b.comm, scale)
                return
        flat = b.comm
        offsets = b.offsets
        todo = [g is not None and not (done and done[i]) for i, g in enumerate(grads)]
        with torch.no_grad():
            for i, g in enumerate(grads):
                if g is None and not (done and done[i]):
                    flat[offsets[i] : offsets[i] + params[i].numel()].zero_()
            if in_place:
                return
            for start, stop in _runs(todo):
                lo = offsets[start]
                hi = offsets[stop] if stop < len(offsets) else b.numel
                if hi > lo:
                    ops.flatten_scale(grads[start:stop], flat[lo:hi], scale)

    def _unpack(self, b: Bucket, src: torch.Tensor, scale: float = 1.0) -> None:
        """Write the reduced flat ``src`` (times ``scale``) back into the bucket's gradients.

        Gradients of parameters unused on every rank are left as they are.
        ``src`` may be ``b.flat`` or another tensor with ``b.numel`` elements
        of any supported dtype.
        """
        if b.numel == 0:
            return
        params = b.params
        gused = self._global_used
        if self.gradient_as_bucket_view:
            if src is not b.flat:
                ops.unflatten_scale(src, [b.flat], scale)
            elif scale != 1.0:
                ops.flatten_scale([b.flat], b.flat, scale)
            for i, p in enumerate(params):
                if p.grad is None and (gused is None or gused[b.param_indices[i]]):
                    p.grad = b.views[i]
            return
        grads = [p.grad for p in params]
        complete = gused is None
        if complete:
            for g in grads:
                if g is None:
                    complete = False
                    break
        if complete:
            ops.unflatten_scale(src, grads, scale)
            return
        keep = []
        for i, p in enumerate(params):
            used = gused is None or gused[b.param_indices[i]]
            if used and grads[i] is None:
                p.grad = grads[i] = torch.empty_like(p, memory_format=torch.preserve_format, requires_grad=False)
            keep.append(used)
        offsets = b.offsets
        for start, stop in _runs(keep):
            lo = offsets[start]
            hi = offsets[stop] if stop < len(offsets) else b.numel
            if hi > lo:
                ops.unflatten_scale(src[lo:hi], grads[start:stop], scale)

    def _on_backward_end(self) -> None:
        """Engine callback at the end of a backward in which hooks fired."""
        self._callback_queued = False
        if self._static_first:
            self._finish_static_first_iteration()
        if self._next_bucket < len(self.buckets):
            return  # some gradients are missing: reported at the next forward
        self._finalize()

    def _finish_static_first_iteration(self) -> None:
        counts = self._hook_counts
        self._static_first = False
        self._expected_counts = list(counts)
        for i, c in enumerate(counts):
            if c:
                self._local_used[i] = 1
        for b in self.buckets:
            b.pending = 0
        self._advance()
        for b in self.buckets:
            b.expected = sum(counts[i] for i in b.param_indices)
        self._learn_static_use = True

    def _finalize(self) -> None:
        if self._used_work is not None:
            if self._used_work is not True:
                self._used_work.wait()
            self._global_used = [c > 0 for c in self._used_tensor.tolist()]
            if self._learn_static_use:
                self._learn_static_use = False
                self._static_used = None if all(self._global_used) else self._global_used
        for b in self.buckets:  # the row all-gathers of sparse buckets, in bucket order on every rank
            if b.sparse and isinstance(b.work, SparseExchange):
                b.work.start_gather()
        for b in self.buckets:
            if b.sparse:
                self._finish_sparse(b)
            else:
                self._unpack(b, self._collect(b))
        self._used_work = None
        self._expect_hooks = False
        self._require_finalize = False
        self._num_iterations += 1
        if self._record_order:
            self._record_order = False
            self._pending_order = self._order
            self._order = []

    # ----------------------------------------------------------------- errors

    def _raise_marked_twice(self, idx: int) -> None:
        if idx in self._unused:
            why = (
                "it was not reachable from the forward outputs (find_unused_parameters marked it unused), "
                "yet it received a gradient: return every tensor the loss depends on from forward"
            )
        else:
            why = (
                "its gradient was accumulated more than once in one backward (a parameter used in several "
                "reentrant backward passes, e.g. activation checkpointing with use_reentrant=True, or "
                "several backward calls per iteration); use static_graph=True if the pattern is the same "
                "every iteration, or no_sync() for all but the last backward"
            )
        raise RuntimeError(f"fastcoll.DDP: parameter '{self.names[idx]}' was marked ready twice in one iteration: {why}.")

    def unfinished_names(self) -> List[str]:
        """Names of parameters whose gradients are still missing in the current iteration."""
        if self._static_first:
            return []
        return [self.names[i] for i, r in enumerate(self._remaining) if r > 0]

    def _raise_unfinished(self) -> None:
        names = self.unfinished_names()
        shown = ", ".join(names[:50]) + (f", ... ({len(names)} in all)" if len(names) > 50 else "")
        raise RuntimeError(
            "fastcoll.DDP: the previous iteration's gradient reduction did not finish, because these "
            f"parameters received no gradient in its backward: {shown}. Either pass "
            "find_unused_parameters=True to DDP (parameters that take no part in some forward passes are "
            "then handled, at the cost of a graph traversal per iteration), or make sure every parameter "
            "contributes to the loss in every iteration (all forward outputs used in the loss)."
        )

    # ---------------------------------------------------------------- teardown

    def close(self) -> None:
        """Remove the autograd hooks and release the bucket buffers.

        Gradients that are views of a bucket keep that storage alive; they stay valid.
        """
        self._finalizer()
        self._expect_hooks = False
        self._require_finalize = False
        self._record_order = False
        self._pending_order = None
        self._rebuilt = True
        self.buckets = []
        self._index_eager_slots()  # drops the slot views that keep bucket storage alive
        self._param_bucket = [None] * len(self.params)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return not self._finalizer.alive
