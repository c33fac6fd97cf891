"""One gradient bucket: its fixed layout, the GradBucket API comm hooks see, and its pack / write-back.

A :class:`GradBucket` is built once per layout and never changes shape: the
parameters, their offsets in the flat buffer, the views of that buffer, the
buffer the collective carries (the wire buffer) and its dtype. What changes
per iteration (how many gradients are still missing, what is in flight) lives
in the reducer, not here.

Moving gradients in and out is the fused ops' job: when every gradient of
the bucket takes part, one :func:`fastcoll.ops.flatten_scale` packs them all
(one :func:`fastcoll.ops.unflatten_scale` writes them back); otherwise one
call per run of consecutive taking-part gradients (:func:`for_each_run`).
"""

from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .. import ops
from ..ops.dtypes import as_real, is_dense

__all__ = ["GradBucket", "PackArgs", "for_each_run", "pack_range"]


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


def for_each_run(present: Sequence[bool], offsets: Sequence[int], numel: int, fn: Callable[[int, int, int, int], None]) -> None:
    """Call ``fn(start, stop, lo, hi)`` for each run of present slots [start, stop) covering elements [lo, hi)."""
    for start, stop in _runs(present):
        lo = offsets[start]
        hi = offsets[stop] if stop < len(offsets) else numel
        if hi > lo:
            fn(start, stop, lo, hi)


def check_set_buffer(buffer: Any, numel: int, pos: int) -> None:
    """Check the argument of ``GradBucket.set_buffer`` for bucket ``pos`` of ``numel`` elements."""
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"fastcoll.DDP: GradBucket.set_buffer expects a tensor, got {type(buffer).__name__}")
    if buffer.dim() != 1 or buffer.numel() != numel or not buffer.is_contiguous():
        raise ValueError(
            f"fastcoll.DDP: GradBucket.set_buffer expects a 1-D contiguous tensor of {numel} elements "
            f"(bucket {pos}), got shape {tuple(buffer.shape)} strides {tuple(buffer.stride())}"
        )


class GradBucket:
    """A group of same-(device, dtype) parameters reduced with one collective.

    Comm hooks receive this object; it has torch's ``GradBucket`` interface.

    Attributes:
        pos: Index of the bucket in reduction order.
        count: Number of buckets in the layout (for :meth:`is_last`).
        param_indices: Reducer parameter indices, in bucket (packing) order.
        params: The parameters, in bucket order.
        names: Their qualified names.
        device, dtype: Of every parameter (and of ``flat``, unless it is the wire buffer).
        numel: Total elements; ``offsets[i]`` is parameter i's first element in ``flat``.
        flat: The 1-D contiguous bucket buffer.
        views: Views of ``flat`` shaped like each parameter, strided like its gradient (:func:`gradient_layouts`).
        view_ptrs: ``data_ptr()`` of each view (is a gradient its bucket view?).
        comm: The wire buffer the collective carries: ``flat`` itself, or (with
            a narrower wire dtype and gradients as bucket views) a separate buffer.
        as_view: Gradients live in ``views`` (gradient_as_bucket_view).
        sparse: The bucket holds one parameter with sparse gradients, reduced
            as a sparse tensor (``flat`` and ``views`` are empty).

    ``buffer``, when given, becomes ``flat`` (``numel`` elements of the
    parameters' dtype) instead of a new allocation. ``padded`` (at least
    ``numel``): when the bucket is divided among ranks
    (:mod:`fastcoll.reducer.shards`), ``flat_padded`` and ``comm_padded`` are
    that long (the padding zeros) and ``flat``/``comm`` their first ``numel``
    elements; otherwise they are the same tensors. ``lazy``: the buffers are
    allocated by :meth:`materialize`, not now (``flat``, ``comm`` and ``views``
    are empty until then).
    """

    __slots__ = (
        "pos", "count", "param_indices", "params", "names", "device", "dtype", "numel", "offsets",
        "flat", "views", "view_ptrs", "comm", "as_view", "sparse", "_hook_buffer", "_hook_views", "padded",
        "flat_padded", "comm_padded", "plan", "pooled", "_dtypes", "lazy", "_wire", "grad_layouts",
    )  # fmt: skip

    def __init__(
        self,
        pos: int,
        count: int,
        param_indices: List[int],
        params: List[torch.Tensor],
        names: List[str],
        wire_dtype: Optional[torch.dtype] = None,
        as_view: bool = False,
        sparse: bool = False,
        buffer: Optional[torch.Tensor] = None,
        padded: Optional[int] = None,
        pooled: bool = False,
        lazy: bool = False,
    ):
        self.pos = pos
        self.count = count
        self.param_indices = param_indices
        self.params = params
        #: What the views take their shapes and strides from (:func:`gradient_layouts`).
        self.grad_layouts = gradient_layouts(params)
        self.names = names
        self.as_view = as_view
        self.sparse = sparse
        self.device = params[0].device
        self.dtype = params[0].dtype
        self.offsets: List[int] = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        self.padded = total if padded is None or sparse else max(int(padded), total)
        #: The full-size buffers exist only while :meth:`attach` lent them (a pool's, :mod:`.pool`).
        self.pooled = bool(pooled) and not sparse
        #: The buffers are allocated on first need (:meth:`materialize`), not now.
        self.lazy = bool(lazy) and not self.pooled and not sparse and buffer is None
        self._wire = wire_dtype
        self._dtypes: Tuple[torch.dtype, Optional[torch.dtype]] = (self.dtype, None)
        self._allocate(wire_dtype, buffer)
        if self.pooled or self.lazy:
            self.detach()
        self._hook_buffer: Optional[torch.Tensor] = None
        self._hook_views: Optional[List[torch.Tensor]] = None
        self.plan = ops.BucketPlan()  # the whole bucket's pack and write-back, planned once (fastcoll.ops.BucketPlan)

    def _allocate(self, wire_dtype: Optional[torch.dtype], buffer: Optional[torch.Tensor]) -> None:
        """The buffers: ``flat`` (and ``views`` of it), ``comm`` (what the collective carries), padded versions."""
        total, sparse = self.numel, self.sparse
        # Gradients as views need a buffer of their own dtype, so a narrower
        # wire dtype then gets a separate wire buffer; otherwise the flat buffer
        # itself is in the wire dtype (gradients are cast into it by the pack).
        separate_wire = wire_dtype is not None and self.as_view and not sparse
        flat_dtype = self.dtype if wire_dtype is None or separate_wire or sparse else wire_dtype
        self._dtypes = (flat_dtype, wire_dtype if separate_wire else None)
        if self.pooled or self.lazy:
            return  # no buffer until one is attached (or materialized)
        if buffer is not None:
            self.flat_padded = buffer
        else:
            self.flat_padded = _padded_empty(0 if sparse else total, 0 if sparse else self.padded, flat_dtype, self.device)
        self.flat = self.flat_padded[:total] if self.padded > total else self.flat_padded
        self.views = [] if sparse else ops.bucket_views(self.flat, self.grad_layouts)
        self.view_ptrs = [v.data_ptr() for v in self.views]
        self.comm_padded = _padded_empty(total, self.padded, wire_dtype, self.device) if separate_wire else self.flat_padded
        self.comm = self.comm_padded[:total] if self.padded > total else self.comm_padded

    # ------------------------------------------------------- pooled buffers

    @property
    def pool_nbytes(self) -> int:
        """Bytes :meth:`attach` needs: the padded flat buffer, then (64-byte aligned) the padded wire buffer if separate."""
        flat_dtype, wire = self._dtypes
        n = self.padded * flat_dtype.itemsize
        return n if wire is None else _aligned(n) + self.padded * wire.itemsize

    def pool_views(self, storage: torch.Tensor, numel: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``numel`` elements of the flat dtype at the start of ``storage`` (1-D uint8) and, when the wire buffer is
        separate, ``numel`` of the wire dtype after them (64-byte aligned; else None)."""
        flat_dtype, wire = self._dtypes
        nb = numel * flat_dtype.itemsize
        flat = storage[:nb].view(flat_dtype)
        return flat, None if wire is None else storage[_aligned(nb) : _aligned(nb) + numel * wire.itemsize].view(wire)

    def attach(self, storage: torch.Tensor) -> None:
        """Make the first :attr:`pool_nbytes` bytes of ``storage`` (1-D uint8) this pooled bucket's buffers.

        ``flat`` (and ``comm`` when separate) are views of it, their padding zeroed; nothing else is initialized.
        """
        n, total = self.padded, self.numel
        self.flat_padded, wire = self.pool_views(storage, n)
        self.comm_padded = self.flat_padded if wire is None else wire
        if n > total:
            self.flat_padded[total:].zero_()
            self.comm_padded[total:].zero_()
        self.flat = self.flat_padded[:total]
        self.comm = self.comm_padded[:total]
        self.views = ops.bucket_views(self.flat, self.grad_layouts)
        self.view_ptrs = [v.data_ptr() for v in self.views]

    def detach(self) -> None:
        """Drop the buffers of a pooled bucket: empty placeholders of their dtypes remain (``comm.dtype`` still says the wire)."""
        flat_dtype, wire = self._dtypes
        self.flat_padded = self.flat = torch.empty(0, dtype=flat_dtype, device=self.device)
        self.comm_padded = self.comm = self.flat if wire is None else torch.empty(0, dtype=wire, device=self.device)
        self.views = []
        self.view_ptrs = []

    @property
    def wire_dtype(self) -> torch.dtype:
        """The dtype the collective carries."""
        return self._dtypes[1] or self._dtypes[0]

    @property
    def elem_bytes(self) -> int:
        """Bytes per element of the pooled buffers (flat, plus the wire buffer when separate)."""
        flat_dtype, wire = self._dtypes
        return flat_dtype.itemsize + (0 if wire is None else wire.itemsize)

    def grad_slices(self, lo: int, hi: int) -> List[Tuple[int, Optional[torch.Tensor]]]:
        """Elements ``[lo, hi)`` of the bucket's layout as ``(length, the gradient's 1-D slice or None)`` runs.

        None: a missing gradient, or the padding past :attr:`numel` (zeros in the bucket).
        """
        out: List[Tuple[int, Optional[torch.Tensor]]] = []
        for p, off in zip(self.params, self.offsets):
            a, b = max(lo, off), min(hi, off + p.numel())
            if a < b:
                g = p.grad
                out.append((b - a, None if g is None else _memory_order(p, g)[a - off : b - off]))
        if hi > max(lo, self.numel):
            out.append((hi - max(lo, self.numel), None))
        return out

    @property
    def attached(self) -> bool:
        """The bucket has its full-size buffers (always, unless pooled or not materialized yet)."""
        return not (self.pooled or self.lazy) or self.flat_padded.numel() == self.padded

    def materialize(self) -> bool:
        """Allocate the buffers of a bucket built ``lazy`` (its own, as if built eagerly); True if it did."""
        if not self.lazy:
            return False
        self.lazy = False
        self._allocate(self._wire, None)
        return True

    # ------------------------------------------------ torch's GradBucket API

    def index(self) -> int:
        """Position of this bucket in reduction order."""
        return self.pos

    def is_last(self) -> bool:
        """True for the last bucket reduced in an iteration."""
        return self.pos == self.count - 1

    def buffer(self) -> torch.Tensor:
        """The flat 1-D bucket buffer (the one given to :meth:`set_buffer`, if any, in the current hook call).

        A bucket of complex parameters shows it as torch DDP does: the floats it holds (twice as many).
        """
        hb = self._hook_buffer
        return as_real(self.flat) if hb is None else hb

    def gradients(self) -> List[torch.Tensor]:
        """Parameter-shaped views of :meth:`buffer`, in :meth:`parameters` order (complex ones as their real views).

        Writing into them writes into :meth:`buffer` (PowerSGD relies on this).
        """
        hb = self._hook_buffer
        if hb is None:
            views = self.views
        else:
            if self._hook_views is None:
                flat = torch.view_as_complex(hb.view(-1, 2)) if self.dtype.is_complex else hb
                self._hook_views = ops.bucket_views(flat, self.grad_layouts)
            views = self._hook_views
        return [torch.view_as_real(v) for v in views] if self.dtype.is_complex else views

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
        check_set_buffer(buffer, self.numel * (2 if self.dtype.is_complex else 1), self.pos)
        self._hook_buffer = buffer
        self._hook_views = None

    def reset_hook_buffer(self) -> None:
        """Forget a buffer set by a previous hook call."""
        self._hook_buffer = None
        self._hook_views = None

    @property
    def nbytes(self) -> int:
        """Size of the bucket's gradients in bytes (in the parameters' dtype)."""
        return self.numel * self.params[0].element_size()

    @property
    def comm_nbytes(self) -> int:
        """Bytes each collective of this bucket carries (in the wire dtype)."""
        return self.numel * self.comm.element_size()

    # ------------------------------------------------------ pack / write-back

    def _to_view(self, k: int, g: torch.Tensor) -> torch.Tensor:
        """With gradients as bucket views: make parameter ``k``'s gradient ``g`` (not its view yet) its view.

        Returns what is left to pack into the slot: ``g`` when it has the
        parameter's layout, or the view itself when ``g`` had another layout
        and was copied into it elementwise.
        """
        v = self.views[k]
        self.params[k].grad = v
        if g.stride() != v.stride() and g.numel() > 1:
            with torch.no_grad():
                v.copy_(g)
            return v
        return g

    def accumulate_one(self, k: int, slot: torch.Tensor, nonfinite: Optional[torch.Tensor] = None) -> bool:
        """Only main-gradient buckets accumulate between synchronized backwards: nothing here."""
        return False

    def pack_one(self, k: int, slot: torch.Tensor, how: "PackArgs") -> bool:
        """Pack parameter ``k``'s final gradient into ``slot``, its part of the wire buffer (see :class:`PackArgs`).

        Returns:
            True when packed; False when there is no gradient, or it is left
            to :meth:`pack` (a bucket-view gradient with another layout).
        """
        g = self.params[k].grad
        if g is None:
            return False
        if self.as_view:
            if g.data_ptr() != self.view_ptrs[k]:
                v = self.views[k]
                if g.stride() != v.stride() and g.numel() > 1:
                    return False
                self.params[k].grad = v
            elif how.is_copy and self.comm is self.flat:
                return True  # already in place and nothing to scale or check
        how.flatten([g], slot)
        return True

    def pack(self, how: "PackArgs", done: Optional[Sequence[int]] = None) -> None:
        """Write the gradients into the wire buffer as ``how`` says (missing gradients as zeros), casting to its dtype.

        Args:
            how: The factor (and device factor, non-finite flag) of the pack.
            done: Per bucket slot, 1 when that gradient was already packed (:meth:`pack_one`).
        """
        params = self.params
        grads = [p.grad for p in params]
        in_place = False  # every gradient already is its view of the wire buffer, and nothing to do to it
        if self.as_view:
            in_place = how.is_copy and self.comm is self.flat
            for k, g in enumerate(grads):
                if g is not None and g.data_ptr() != self.view_ptrs[k] and not (done and done[k]):
                    grads[k] = self._to_view(k, g)
                    if grads[k] is g:
                        in_place = False  # g is copied into its view below
        if done is None and all(g is not None for g in grads):
            if self.numel and not in_place:
                how.flatten(grads, self.comm, self.plan)
            return
        comm = self.comm
        todo = [g is not None and not (done and done[k]) for k, g in enumerate(grads)]
        with torch.no_grad():
            for k, g in enumerate(grads):
                if g is None and not (done and done[k]):
                    comm[self.offsets[k] : self.offsets[k] + params[k].numel()].zero_()
            if not in_place:
                for_each_run(todo, self.offsets, self.numel, lambda a, b, lo, hi: how.flatten(grads[a:b], comm[lo:hi]))

    def write_back(
        self, src: torch.Tensor, used: Optional[Sequence[bool]] = None, scale: float = 1.0, sumsq: Optional[torch.Tensor] = None
    ) -> None:
        """Write the reduced flat ``src`` (times ``scale``) into the gradients, casting on the way.

        Args:
            src: ``numel`` elements of any supported dtype (``flat``, ``comm`` or a hook's result).
            used: Per bucket slot, False for parameters unused on every rank:
                their gradients are left as they are. None: all used.
            scale: Factor folded into the copy.
            sumsq: A 1-element float64 tensor that receives the sum of squares
                of the values written (fused into the write-back; with
                gradients as bucket views reduced in place there is no
                write-back, and one read pass of the bucket computes it).
        """
        if self.numel == 0:
            if sumsq is not None:
                sumsq.zero_()
            return
        params = self.params
        if self.as_view:
            if src is not self.flat:
                _unflatten(src, [self.flat], scale, sumsq)
            else:
                if scale != 1.0:
                    ops.flatten_scale([self.flat], self.flat, scale)
                if sumsq is not None:
                    ops.sum_of_squares([self.flat], out=sumsq)
            for k, p in enumerate(params):
                if p.grad is None and (used is None or used[k]):
                    p.grad = self.views[k]
            return
        grads = [p.grad for p in params]
        if used is None and all(g is not None for g in grads):
            _unflatten(src, grads, scale, sumsq, self.plan)
            return
        keep = []
        for k, p in enumerate(params):
            u = used is None or used[k]
            if u and grads[k] is None:
                p.grad = grads[k] = torch.empty_like(p, memory_format=torch.preserve_format, requires_grad=False)
            keep.append(u)
        if sumsq is not None:
            sumsq.zero_()
        part = None if sumsq is None else torch.empty_like(sumsq)

        def run(a: int, b: int, lo: int, hi: int) -> None:
            _unflatten(src[lo:hi], grads[a:b], scale, part)
            if part is not None:
                sumsq.add_(part)

        for_each_run(keep, self.offsets, self.numel, run)


def gradient_layouts(params: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Tensors laid out as autograd lays out each parameter's gradient, for the bucket views to copy.

    A dense parameter's gradient takes its strides (channels_last stays
    channels_last); any other parameter's (a strided slice, say) is
    contiguous. That is AccumulateGrad's layout contract, which torch DDP's
    bucket views follow too. Other parameters stand in as meta tensors.
    """
    return [p if is_dense(p) else torch.empty(p.shape, dtype=p.dtype, device="meta") for p in params]


def _memory_order(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``g`` (a gradient of ``p``) as a 1-D tensor in ``p``'s memory order."""
    if g.stride() != p.stride() and g.numel() > 1:
        g = torch.empty_like(p).copy_(g)
    if g.is_contiguous():
        return g.view(-1)
    return g.as_strided((g.numel(),), (1,), g.storage_offset())


def pack_range(b: "GradBucket", lo: int, hi: int, out: torch.Tensor, how: "PackArgs", wire: Optional[torch.Tensor]) -> None:
    """Pack elements ``[lo, hi)`` of bucket ``b`` into ``out`` (``hi - lo`` elements) as its whole pack would.

    A :class:`MainGradBucket`: ``out`` (float32) receives 0 + the 16-bit gradients, times the factor, then
    ``wire`` (when given) that cast to the wire dtype; another bucket: the gradients times the factor, cast
    to ``out``'s dtype. Missing gradients and padding are zeros. The arithmetic per element is the whole
    pack's, so a bucket packed range by range holds the same values: without a wire buffer or a divisor
    tensor each gradient is added into the zeros times the factor (``0 + g * factor``, one pass, the bits of
    the sum scaled after, as :meth:`MainGradBucket.pack` adds into zeroed buckets).
    """
    at = 0
    main = isinstance(b, MainGradBucket)
    scaled = main and wire is None and how.scale_by is None
    with torch.no_grad():
        if main:
            out.zero_()
        for n, g in b.grad_slices(lo, hi):
            part = out[at : at + n]
            if g is not None:
                if main:
                    ops.flatten_accumulate([g], part, how.scale if scaled else 1.0, nonfinite=how.nonfinite)
                else:
                    how.flatten([g], part)
            elif not main:
                part.zero_()
            at += n
        if main and not scaled:
            if wire is not None:
                how.flatten([out], wire)
            else:
                out.mul_(how.scale_by.reshape(()).to(torch.float64) * how.scale)


def _aligned(nbytes: int, to: int = 64) -> int:
    return -(-nbytes // to) * to


def _padded_empty(numel: int, padded: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A buffer of ``padded`` elements whose first ``numel`` are left uninitialized and the rest zeroed."""
    buf = torch.empty(padded, dtype=dtype, device=device)
    if padded > numel:
        buf[numel:].zero_()
    return buf


def _unflatten(
    src: torch.Tensor,
    dests: List[torch.Tensor],
    scale: float,
    sumsq: Optional[torch.Tensor],
    plan: Optional[ops.BucketPlan] = None,
) -> None:
    if sumsq is None:
        ops.unflatten_scale(src, dests, scale, plan=plan)
    else:
        ops.unflatten_scale(src, dests, scale, sumsq=sumsq)


class PackArgs(NamedTuple):
    """How one iteration packs: ``scale`` (a float), times ``scale_by[0]`` on the device when given.

    ``nonfinite``: a flag the pack raises on NaN/Inf.
    """

    scale: float = 1.0
    scale_by: Optional[torch.Tensor] = None
    nonfinite: Optional[torch.Tensor] = None

    @property
    def is_copy(self) -> bool:
        """A plain copy: nothing to scale, nothing to check."""
        return self.scale == 1.0 and self.scale_by is None and self.nonfinite is None

    def flatten(self, tensors: List[torch.Tensor], out: torch.Tensor, plan: Optional[ops.BucketPlan] = None) -> None:
        if self.scale_by is None and self.nonfinite is None:
            ops.flatten_scale(tensors, out, self.scale, plan=plan)
        else:
            ops.flatten_scale(tensors, out, self.scale, scale_by=self.scale_by, nonfinite=self.nonfinite)

    def with_flag(self, flag: Optional[torch.Tensor]) -> "PackArgs":
        return self if flag is None else self._replace(nonfinite=flag)


class MainGradBucket(GradBucket):
    """A bucket of 16-bit parameters whose gradients are accumulated in float32: the "main gradients".

    ``flat`` is float32 and keeps every backward's gradients, micro-batch
    after micro-batch (``no_sync`` ones too), added in float32 by one fused
    call (:func:`fastcoll.ops.flatten_accumulate`) that also releases each
    16-bit ``.grad``; the synchronized backward scales the sum once by
    1/divisor and reduces it (in float32, or through a narrower wire buffer
    ``comm``), and the reduced values stay in ``flat`` (``views`` are float32
    and shaped like the parameters). Nothing is written into ``.grad``.
    ``zero()`` starts a new accumulation.
    """

    __slots__ = ("main_dtype", "consumed", "_zeroed_at", "_scaled")

    def __init__(self, *args: Any, main_dtype: torch.dtype = torch.float32, **kwargs: Any):
        self.main_dtype = main_dtype
        #: A sharded optimizer stepped with them and reused their memory (zeroed by ``zero()``).
        self.consumed = False
        #: The buffer's version counter right after it was zeroed, while nothing was added since (else None).
        self._zeroed_at: Optional[int] = None
        #: This synchronized backward adds its gradients times this factor (1/divisor), having begun on zeros, and
        #: the buffer's version counter then (fastcoll's kernels move none: another write would be missed by the factor).
        self._scaled: Optional[Tuple[float, int]] = None
        super().__init__(*args, **kwargs)

    def _allocate(self, wire_dtype: Optional[torch.dtype], buffer: Optional[torch.Tensor]) -> None:
        total, dev = self.numel, self.device
        narrower = wire_dtype is not None and wire_dtype.itemsize < self.main_dtype.itemsize
        self._dtypes = (self.main_dtype, wire_dtype if narrower else None)
        if self.pooled or self.lazy:
            return  # no buffer until one is attached (or materialized)
        self.flat_padded = torch.zeros(self.padded, dtype=self.main_dtype, device=dev)  # the accumulation starts at 0
        self.flat = self.flat_padded[:total] if self.padded > total else self.flat_padded
        self.views = ops.bucket_views(self.flat, self.grad_layouts)
        self.view_ptrs = [v.data_ptr() for v in self.views]
        self.comm_padded = _padded_empty(total, self.padded, wire_dtype, dev) if narrower else self.flat_padded
        self.comm = self.comm_padded[:total] if self.padded > total else self.comm_padded
        self._zeroed()

    def zero(self) -> None:
        """Forget the accumulated gradients (nothing to do for a pooled bucket without its buffer)."""
        self.flat_padded.zero_()
        self.consumed = False
        self._zeroed()

    def _zeroed(self) -> None:
        self._scaled = None
        self._zeroed_at = None if self.flat_padded.is_inference() else self.flat_padded._version

    def _wire_is_flat(self) -> bool:
        """The reduction sends ``flat`` itself (no narrower wire buffer)."""
        return self.comm is self.flat or (self.comm.dtype == self.flat.dtype and self.comm.data_ptr() == self.flat.data_ptr())

    def _not_zeros(self) -> None:
        """The buffer no longer holds zeros (gradients added outside a synchronized backward, or its pack done)."""
        self._zeroed_at = self._scaled = None

    def _factor(self, how: "PackArgs") -> Optional[float]:
        """In a synchronized backward, the factor its gradients are added with: 1/divisor when the buffer held zeros
        at its start (then ``0 + x / divisor`` is the scaled sum, bit for bit, and :meth:`pack` scales nothing);
        None: they are added as they are, and the sum is scaled at :meth:`pack`.

        Zeros are known by the buffer's version counter, unchanged since :meth:`zero` (a write through a
        view of it, e.g. ``main_grad(p).add_``, moves it) with nothing added since by this bucket.
        """
        if self._scaled is None and self._zeroed_at is not None:
            zeros = self.flat_padded._version == self._zeroed_at
            self._zeroed_at = None
            if zeros and how.scale_by is None and self._wire_is_flat():
                self._scaled = (how.scale, self.flat_padded._version)
        return None if self._scaled is None else self._scaled[0]

    def _check_scaled(self, how: "PackArgs") -> None:
        """Before the pack of a backward whose gradients were added times their factor: nothing else wrote the buffer."""
        factor, version = self._scaled  # type: ignore[misc]
        if self.flat_padded._version != version:
            self._not_zeros()
            raise RuntimeError(
                f"fastcoll.DDP: the float32 main gradients of bucket {self.pos} were written during a synchronized "
                "backward (e.g. through model.main_grad(p)): they are reduced as the backward adds them, so write them "
                "between iterations, not while a backward is under way"
            )
        if factor != how.scale:
            raise RuntimeError(f"fastcoll internal error: bucket {self.pos} added gradients times {factor}, packs {how.scale}")

    def accumulate(self, nonfinite: Optional[torch.Tensor] = None, scale: Optional[float] = None) -> List[int]:
        """Add the present 16-bit gradients into their float32 slots (one fused call per run) and release them.

        ``scale``: in a synchronized backward, the factor from :meth:`_factor` (None: added as they are).

        Returns:
            The reducer indices of the parameters whose gradients were added.
        """
        if scale is None:
            self._not_zeros()
        grads = [p.grad for p in self.params]
        present = [g is not None for g in grads]
        if not any(present):
            return []
        s = 1.0 if scale is None else scale
        with torch.no_grad():
            for_each_run(
                present, self.offsets, self.numel,
                lambda a, b, lo, hi: ops.flatten_accumulate(grads[a:b], self.flat[lo:hi], s, nonfinite=nonfinite),
            )  # fmt: skip
        for p, has in zip(self.params, present):
            if has:
                p.grad = None
        return [i for i, has in zip(self.param_indices, present) if has]

    def accumulate_one(
        self, k: int, slot: torch.Tensor, nonfinite: Optional[torch.Tensor] = None, scale: Optional[float] = None
    ) -> bool:
        """Add parameter ``k``'s final 16-bit gradient into ``slot`` (its float32 slice of ``flat``) and release it.

        :meth:`accumulate` then adds only the gradients not added yet. Returns True when there was one to add.
        ``scale``: as :meth:`accumulate`'s.
        """
        if scale is None:
            self._not_zeros()
        p = self.params[k]
        if p.grad is None:
            return False
        with torch.no_grad():
            ops.flatten_accumulate([p.grad], slot, 1.0 if scale is None else scale, nonfinite=nonfinite)
        p.grad = None
        return True

    def pack_one(self, k: int, slot: torch.Tensor, how: "PackArgs") -> bool:
        """:meth:`accumulate_one` in a synchronized backward (the scale by 1/divisor applies to the whole sum at
        :meth:`pack`, or to each gradient as it is added into zeros: :meth:`_factor`)."""
        return self.accumulate_one(k, slot, how.nonfinite, self._factor(how))

    def pack(self, how: "PackArgs", done: Optional[Sequence[int]] = None) -> None:
        """Accumulate this backward's gradients, then scale the sum by 1/divisor into the wire buffer (in place in float32)."""
        factor = self._factor(how)
        if factor is not None:
            self._check_scaled(how)
        self.accumulate(how.nonfinite, factor)
        self._not_zeros()  # it holds the scaled sum
        if not self.numel or factor is not None:
            return
        with torch.no_grad():
            if self.comm is not self.flat:
                how.flatten([self.flat], self.comm)
            elif how.scale_by is not None:
                self.flat.mul_(how.scale_by.reshape(()).to(torch.float64) * how.scale)
            elif how.scale != 1.0:
                self.flat.mul_(how.scale)

    def write_back(
        self, src: torch.Tensor, used: Optional[Sequence[bool]] = None, scale: float = 1.0, sumsq: Optional[torch.Tensor] = None
    ) -> None:
        """The reduced sum lands in the float32 slots (from the wire buffer when it is another one); ``.grad`` stays."""
        if self.numel == 0:
            if sumsq is not None:
                sumsq.zero_()
            return
        if src is not self.flat:
            _unflatten(src, [self.flat], scale, sumsq)
            return
        if scale != 1.0:
            self.flat.mul_(scale)
        if sumsq is not None:
            ops.sum_of_squares([self.flat], out=sumsq)
