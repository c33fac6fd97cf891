"""Fused multi-tensor ops: pack many tensors into one flat buffer and back.

These are the per-byte work of gradient synchronization. ``flatten_scale``
copies every gradient into a flat bucket, multiplied by a scale (typically
``1 / world_size``) and cast to the bucket's dtype, in one call;
``unflatten_scale`` writes a reduced bucket back into the gradients.
Both dispatch to ``torch.ops.fastcoll.*``: the C++/CUDA kernels when the
extension is built, the pure-PyTorch reference otherwise.

Gradient health comes fused into the same passes: ``flatten_scale`` can take
its factor from a device tensor (``scale_by``: no host synchronization) and
flag non-finite values (``nonfinite``); ``unflatten_scale`` can write the sum
of squares of what it wrote (``sumsq``, for a gradient norm); and
``sum_of_squares`` reads tensors that need no copy. Sums are float64 and
deterministic: the same inputs give the same bits whatever the number of
threads.

Complex tensors go into a complex flat buffer (and back) as their real views:
each element is its real and imaginary parts, two numbers of the matching
floating dtype, under the same rules.

``flatten_accumulate`` is the accumulating variant for fp32 "main
gradients" (Megatron's grad_reduce_in_fp32): it adds ``scale * tensor`` into
each tensor's slot of a wider flat buffer, one fused multiply-add per element.

A :class:`BucketPlan` passed to ``flatten_scale`` / ``unflatten_scale``
keeps a bucket's plan (and on CUDA its chunk table, resident on the device)
from one call to the next, so that a call on the same tensors costs a few
pointer comparisons per tensor instead of checking and planning them again.

In eager mode, calls on plain CPU or CUDA tensors skip torch.ops' boxed call
(about 130 ns per listed tensor) and go straight to the same backend kernel
(csrc/eager.cpp); anything else (tensor subclasses, fake tensors, dispatch or
torch function modes, ``requires_grad``, torch.compile tracing) takes
torch.ops. ``FASTCOLL_EAGER=0`` turns the direct path off;
:func:`eager_stats` counts the calls each way.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from .. import _knobs
from . import dtypes, loader, reference

__all__ = [
    "BucketPlan",
    "flatten_scale",
    "flatten_accumulate",
    "sum_chunks",
    "unflatten_scale",
    "sum_of_squares",
    "checksum",
    "bucket_views",
    "total_numel",
    "implementation",
    "eager_stats",
]

# The compiled module's direct eager entry points (csrc/eager.cpp), or None.
_direct = loader._C if loader._C is not None and _knobs.eager_direct() else None


def _listed(tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """``tensors`` as a list or tuple: an iterator must survive a direct call that defers to torch.ops."""
    return tensors if isinstance(tensors, (list, tuple)) else list(tensors)


_COMPLEX = frozenset(dtypes.COMPLEX_DTYPES)


def _real(op: str, flat: torch.Tensor, tensors: Sequence[torch.Tensor], into_flat: bool) -> tuple:
    """A complex ``flat`` and its ``tensors`` as real views (each element two floats, in the same memory), so that the
    kernels move complex values as their real and imaginary parts. Callers test ``flat.dtype in _COMPLEX`` first
    (inline: the hot path of every bucket's pack and write-back pays one set lookup).

    ``into_flat``: ``flat`` is written and ``tensors`` read (else the reverse). A lazily conjugated source is read as
    its values; a conjugated destination has no real view to write through and is refused.
    """
    for i, t in enumerate(tensors):
        if not (isinstance(t, torch.Tensor) and t.is_complex()):
            what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"fastcoll.{op}: tensors[{i}] is {what} but the flat buffer is {flat.dtype}; "
                            "complex and real tensors cannot share a flat buffer")  # fmt: skip
    dest = [("out", flat)] if into_flat else list(enumerate(tensors))
    for where, t in dest:
        if t.is_conj():
            where = f"tensors[{where}]" if isinstance(where, int) else where
            raise TypeError(f"fastcoll.{op}: {where} is a lazily conjugated view (is_conj()); it cannot be written "
                            "in place through its real view: pass a tensor without the conjugate bit")  # fmt: skip
    if into_flat:
        tensors = [t.resolve_conj() if t.is_conj() else t for t in tensors]
    elif flat.is_conj():
        flat = flat.resolve_conj()
    return dtypes.as_real(flat), [torch.view_as_real(t) for t in tensors]


def _run(op: str, *args) -> None:
    """``torch.ops.fastcoll.<op>(*args)``, through its direct eager entry point when that takes the call."""
    direct = getattr(_direct, "_" + op, None)  # None: no direct path, or an older build without this op's
    if direct is not None and not torch.compiler.is_compiling() and direct(*args):
        return
    getattr(torch.ops.fastcoll, op)(*args)


class BucketPlan:
    """The kept plan of one bucket's pack and unpack, reused while its tensors stay where they are.

    A fused call spends host time on every listed tensor: checking it,
    planning its slot, and on CUDA cutting it into chunks and writing (past
    512 chunks, uploading) their table. A bucket packs and unpacks the same
    tensors call after call, so a plan keeps, for each direction
    (:func:`flatten_scale`: tensors to buffer; :func:`unflatten_scale`: back),
    the last call's plan together with what its checks depended on: each
    tensor's data pointer, element count, dtype and density, and the buffer's.
    A call that matches runs the kept plan straight away (its table already
    resident on the device); one that does not (a gradient reallocated, a
    tensor replaced) is checked in full, with the usual errors, and replaces
    it. Results are the same bits as without a plan.

    Why an object the caller holds rather than a cache inside the extension:
    finding a cached entry would itself cost a hash of every tensor per call,
    and nothing would own, or know when to free, a bucket's device table. A
    bucket keeps its plan for as long as it lives (one plan serves both
    directions; give each bucket its own).

    A plan is used by the direct eager path only (plain CPU or CUDA tensors,
    outside torch.compile, without ``scale_by`` / ``nonfinite`` / ``sumsq``);
    any other call ignores it and runs the op as usual. Under CUDA graph
    capture a bucket of more than 512 chunks works when its plan was built
    before the capture began (one call with the plan, then capture): the
    table is resident, nothing is uploaded. Keep the plan alive for as long as
    a graph that captured a call with it may be replayed.
    """

    __slots__ = ("_impl", "__weakref__")

    def __init__(self) -> None:
        make = getattr(_direct, "_BucketPlan", None)
        self._impl = make() if make is not None else None

    def __reduce__(self):
        """A copy (or an unpickled plan) starts empty: a plan caches one process's addresses."""
        return (BucketPlan, ())

    @property
    def active(self) -> bool:
        """Whether calls can use the plan (the compiled extension's direct eager path is on)."""
        return self._impl is not None

    def stats(self) -> Dict[str, int]:
        """``{"builds": plans (re)built, "reuses": calls that reused one}``, over both directions."""
        if self._impl is None:
            return {"builds": 0, "reuses": 0}
        return self._impl.stats()

    def clear(self) -> None:
        """Forget the kept plans (and free their device tables); the next calls rebuild them."""
        if self._impl is not None:
            self._impl.clear()


def _run_planned(op: str, plan: Optional[BucketPlan], *args) -> None:
    """:func:`_run`, through ``plan`` when the direct path takes the call."""
    if plan is not None:
        if not isinstance(plan, BucketPlan):
            raise TypeError(f"fastcoll.{op}: plan must be a fastcoll.ops.BucketPlan or None, got {type(plan).__name__}")
        impl = plan._impl
        if impl is not None and not torch.compiler.is_compiling() and getattr(_direct, f"_{op}_planned")(impl, *args):
            return
    _run(op, *args)


def flatten_scale(
    tensors: Sequence[torch.Tensor],
    out: torch.Tensor,
    scale: float = 1.0,
    *,
    scale_by: Optional[torch.Tensor] = None,
    nonfinite: Optional[torch.Tensor] = None,
    plan: Optional[BucketPlan] = None,
) -> torch.Tensor:
    """Write ``tensors``, one after another, into ``out``, each multiplied by ``scale``.

    Each tensor's elements go in its own memory order (so a channels_last
    tensor round-trips through a view of ``out`` with the same strides). The
    multiply is done in float32 (float64 when either side is float64) and the
    result is cast to ``out.dtype``.

    Without ``scale_by`` and ``nonfinite`` this is ``fastcoll::flatten_scale``;
    with either, ``fastcoll::flatten_scale_ex``, which writes the same bits
    when ``scale_by`` is absent.

    Args:
        tensors: Dense tensors of float32/float16/bfloat16/float64, on ``out``'s
            device (complex64/complex128 into a complex ``out``); zero-element tensors are skipped.
        out: 1-D contiguous tensor whose numel equals the sum of the inputs'.
        scale: Factor applied to every element; 1.0 is a pure copy.
        scale_by: Optional float32 or float64 tensor of 1 element on ``out``'s
            device (e.g. a loss scale or a clipping coefficient computed on
            the GPU). The factor becomes ``scale * scale_by[0]``, read by the
            kernel on the device: no host synchronization. Multiplied in
            float32, float64 when either side or ``scale_by`` is float64.
        nonfinite: Optional int32 tensor with at least 1 element on ``out``'s
            device. Its first element is set to 1 when any value written to
            ``out`` is NaN or +-Inf: a non-finite source element, or a finite
            one whose scaled value overflows ``out``'s dtype (float32 70000 ->
            float16 inf). It is never set to 0: zero it first; one flag can
            collect many calls. A scale of 0 does not hide a NaN or Inf source
            (Inf * 0 is NaN, and NaN is written and flagged).
        plan: Optional :class:`BucketPlan` of this bucket: a call on the same
            tensors reuses its plan (used without ``scale_by`` and ``nonfinite``).

    Returns:
        ``out``.

    Raises:
        ValueError, TypeError, RuntimeError: on bad input, naming the offending
            tensor index (or ``scale_by`` / ``nonfinite``), before anything is
            written.
    """
    result, tensors = out, _listed(tensors)
    if getattr(out, "dtype", None) in _COMPLEX:
        out, tensors = _real("flatten_scale", out, tensors, True)
    if scale_by is None and nonfinite is None:
        _run_planned("flatten_scale", plan, tensors, out, float(scale))
    else:
        _run("flatten_scale_ex", tensors, out, float(scale), scale_by, nonfinite)
    return result


def flatten_accumulate(
    tensors: Sequence[torch.Tensor],
    out: torch.Tensor,
    scale: float = 1.0,
    *,
    nonfinite: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Add ``scale * tensors[i]`` into tensor ``i``'s slot of ``out``, for every tensor, in one call.

    The layout is :func:`flatten_scale`'s: each tensor's elements in its own
    memory order, tensor ``i`` at element offset ``sum(numel of tensors[:i])``
    of ``out``. ``out`` may be longer than that total (a padded buffer); its
    elements past the total are not touched. Each element of a slot becomes
    ``out + scale * x`` computed as one fused multiply-add in float32 (float64
    when ``x`` or ``out`` is float64): the exact value rounded once to that
    precision, then cast to ``out.dtype`` (for a float32 or float64 ``out``
    that is the only rounding). ``scale`` is first rounded to float32 when the
    math is float32, as in :func:`flatten_scale`. The typical use is fp32
    "main gradients": 16-bit gradients accumulated, micro-batch after
    micro-batch, into a float32 bucket that is then all-reduced, without the
    error of adding in 16 bits.

    Args:
        tensors: Dense tensors of float32/float16/bfloat16/float64, on ``out``'s
            device (complex64/complex128 into a complex ``out``); zero-element tensors are
            skipped and the list may be empty.
            A tensor may be exactly its own slot of ``out`` (same dtype; the
            slot becomes ``(1 + scale) * x``); any other overlap with ``out``
            is an error.
        out: 1-D contiguous tensor of a supported dtype with at least
            ``total_numel(tensors)`` elements, read and written in place.
        scale: Factor applied to every input element (e.g. ``1 / num_micro_batches``).
        nonfinite: Optional int32 tensor with at least 1 element on ``out``'s
            device, with :func:`flatten_scale`'s convention: its first element
            is set to 1 when any value written to ``out`` is NaN or +-Inf (a
            non-finite input, which a scale of 0 does not hide, a non-finite
            value already in ``out``, or a sum that overflows ``out.dtype``);
            it is never set to 0.

    Returns:
        ``out``.

    Raises:
        ValueError, TypeError, RuntimeError: on bad input, naming the offending
            tensor index (or ``out`` / ``nonfinite``), before anything is written.
    """
    result, tensors = out, _listed(tensors)
    if getattr(out, "dtype", None) in _COMPLEX:
        out, tensors = _real("flatten_accumulate", out, tensors, True)
    _run("flatten_accumulate", tensors, out, float(scale), nonfinite)
    return result


def sum_chunks(chunks: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Sum the 16-bit rows of ``chunks``, times ``scale``, into ``out``, rounding once to float32.

    The local half of a reduce-scatter that carries 16-bit values and
    rounds once: ``chunks`` is what an ``all_to_all_single`` of N equal
    ranges delivers to one rank (row ``r``: rank ``r``'s values of this
    rank's range). For every element ``i``, in this order and in float64:
    ``acc = chunks[0, i]``, then ``acc = acc + chunks[r, i]`` for ``r = 1 ..
    N-1`` (a fixed rank order, so every rank and every run gives the same
    bits; exact while a column's values span at most 45 - log2(N) binades,
    and for float16 up to 8192 rows), then ``acc * scale`` (one multiply,
    never fused with an add; exact for a power of two); then one rounding
    (to nearest even) to float32, so that the result is the exact scaled
    sum correctly rounded whenever the sum and the product were exact. It
    is stored as float32 or rounded once more to ``chunks``' dtype. The kernels (CPU and CUDA) and the reference
    (:mod:`fastcoll.ops.reference`) give the same bits.

    Args:
        chunks: Contiguous ``[N, n]`` float16 or bfloat16 tensor, ``N >= 1``.
        out: 1-D contiguous tensor of ``n`` elements, float32 or ``chunks``'
            dtype, on ``chunks``' device, sharing no memory with it.
        scale: The factor (typically ``1 / divisor``).

    Returns:
        ``out``.

    Raises:
        TypeError, ValueError, RuntimeError: on bad input (naming ``chunks`` or
            ``out`` and what is wrong: dtype, shape, device, overlap), before
            anything is written.
    """
    torch.ops.fastcoll.sum_chunks(chunks, out, float(scale))
    return out


def unflatten_scale(
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    scale: float = 1.0,
    *,
    sumsq: Optional[torch.Tensor] = None,
    plan: Optional[BucketPlan] = None,
) -> None:
    """Write consecutive slices of ``flat``, times ``scale``, into ``tensors`` in place.

    The inverse of :func:`flatten_scale`: slice ``i`` is cast to
    ``tensors[i].dtype`` and written in that tensor's memory order.

    Without ``sumsq`` this is ``fastcoll::unflatten_scale``; with it,
    ``fastcoll::unflatten_scale_ex``, which writes the same bits.

    Args:
        flat: 1-D contiguous source tensor.
        tensors: Dense, mutually non-overlapping destinations on ``flat``'s device (complex
            ones from a complex ``flat``).
        scale: Factor applied to every element; 1.0 is a pure copy.
        sumsq: Optional float64 tensor of 1 element on ``flat``'s device. It is
            overwritten with the sum of ``x * x`` over every element written,
            ``x`` being the value as stored (after the cast to the
            destination's dtype) converted to float64: the squared L2 norm of
            the unpacked gradients. Deterministic: the same inputs give the
            same bits whatever the number of CPU threads, run after run (CPU
            and CUDA results may differ in the last bits).
        plan: Optional :class:`BucketPlan` of this bucket: a call on the same
            tensors reuses its plan (used without ``sumsq``).

    Raises:
        ValueError, TypeError, RuntimeError: on bad input, naming the offending
            tensor index (or ``sumsq``), before anything is written.
    """
    tensors = _listed(tensors)
    if getattr(flat, "dtype", None) in _COMPLEX:
        flat, tensors = _real("unflatten_scale", flat, tensors, False)
    if sumsq is None:
        _run_planned("unflatten_scale", plan, flat, tensors, float(scale))
    else:
        _run("unflatten_scale_ex", flat, tensors, float(scale), sumsq)


def sum_of_squares(tensors: Sequence[torch.Tensor], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sum of ``x * x`` over every element of every tensor, in float64.

    For gradients that already live in a flat buffer (no write-back to fuse
    the sum into); reads each tensor once and writes nothing else. Each
    element is converted exactly to float64 before it is squared.
    Deterministic like ``unflatten_scale``'s ``sumsq``.

    Args:
        tensors: Dense tensors of float32/float16/bfloat16/float64, all on one
            device (complex ones: both parts); they may alias one another.
        out: Optional float64 tensor of 1 element on that device, overwritten
            with the sum. By default a new 0-d tensor.

    Returns:
        ``out`` (or the new 0-d float64 tensor). Take ``.sqrt()`` for the L2 norm.

    Raises:
        ValueError, TypeError, RuntimeError: on bad input (including an empty
            list), naming the offending tensor index or ``out``.
    """
    tensors = [torch.view_as_real(t.resolve_conj()) if getattr(t, "dtype", None) in _COMPLEX else t for t in tensors]
    if out is None:
        device = tensors[0].device if tensors and isinstance(tensors[0], torch.Tensor) else torch.device("cpu")
        out = torch.empty((), dtype=torch.float64, device=device)
    _run("sum_of_squares", tensors, out)
    return out


def checksum(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One 64-bit hash per tensor of the bytes it holds, in one fused pass (replica verification).

    A tensor's bytes are the ``L = numel * element_size`` bytes from
    ``data_ptr()``, in memory order; any dtype (floating, integer, bool
    buffers such as ``num_batches_tracked``). The hash, with all arithmetic
    mod 2^64::

        mix(x) = splitmix64's finalizer:
                 x ^= x >> 30; x *= 0xBF58476D1CE4E5B9; x ^= x >> 27;
                 x *= 0x94D049BB133111EB; x ^= x >> 31
        K      = 0x9E3779B97F4A7C15
        w_i    = bytes [8i, 8i + 8) as a little-endian uint64, bytes past L
                 read as 0, for i = 0 .. ceil(L / 8) - 1
        S      = sum over i of mix(w_i ^ ((i + 1) * K))
        h      = mix(S ^ mix(L + K))

    returned as the int64 with the same 64 bits.

    Guarantees: every step of ``mix`` is a bijection of 64-bit words, so
    changing the bytes of any one word (in particular flipping any single bit)
    changes exactly one term of ``S`` by a nonzero amount, and ``h`` is a
    bijection of ``S`` for a given length: the hash always changes. Changes
    to several words go unnoticed only if their terms happen to cancel mod
    2^64 (about a 2^-64 chance for unrelated changes; it is not a
    cryptographic hash, so no defence against crafted ones). The sum does not depend on the order of its terms, so the value is
    the same bits for any number of CPU threads and on CUDA as on the CPU.
    Equal bytes give equal values whatever the dtype (``t`` and
    ``t.view(torch.int32)``).

    Args:
        tensors: Strided, dense (non-overlapping) tensors, all on one device;
            zero-element tensors are allowed. Not differentiated.

    Returns:
        A new int64 tensor of ``len(tensors)`` values on the tensors' device
        (an empty CPU tensor for an empty list).

    Raises:
        ValueError, TypeError, RuntimeError: a non-dense or non-strided tensor,
            or tensors on several devices, naming the offending index.
    """
    tensors = [t.detach() if isinstance(t, torch.Tensor) and t.requires_grad else t for t in tensors]
    if not tensors:
        return torch.empty(0, dtype=torch.int64)
    return torch.ops.fastcoll.checksum(tensors)


def total_numel(tensors: Sequence[torch.Tensor]) -> int:
    """Number of elements a flat buffer needs to hold ``tensors``."""
    return sum(t.numel() for t in tensors)


def bucket_views(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Views of ``flat`` shaped and strided like each tensor of ``like``, back to back.

    View ``i`` covers the same elements of ``flat`` that :func:`flatten_scale`
    writes tensor ``i`` to, so gradients can live inside a bucket.

    Args:
        flat: 1-D contiguous buffer with exactly ``total_numel(like)`` elements.
        like: Dense tensors whose shapes and strides the views take.

    Returns:
        One view per tensor of ``like``.
    """
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(
            f"fastcoll.bucket_views: flat must be 1-D contiguous, got shape {tuple(flat.shape)} "
            f"with strides {tuple(flat.stride())}; pass a 1-D contiguous buffer"
        )
    views: List[torch.Tensor] = []
    offset = flat.storage_offset()
    for i, t in enumerate(like):
        if not reference.is_dense(t):
            raise ValueError(
                f"fastcoll.bucket_views: like[{i}] (shape {tuple(t.shape)}, strides {tuple(t.stride())}) "
                "is not dense and non-overlapping; make it .contiguous() first"
            )
        stride = t.stride() if t.numel() > 0 else torch.empty(t.shape).stride()
        views.append(flat.as_strided(t.shape, stride, offset))
        offset += t.numel()
    used = offset - flat.storage_offset()
    if used != flat.numel():
        raise ValueError(
            f"fastcoll.bucket_views: like holds {used} elements in total but flat has {flat.numel()}; "
            "size flat with fastcoll.ops.total_numel(like)"
        )
    return views


def eager_stats() -> dict:
    """Calls of the fused ops taken by the direct eager path, and calls it deferred to torch.ops.

    Returns:
        ``{"enabled": bool, "direct": int, "deferred": int}``, counted since the
        process started (all zero without the compiled extension). Calls made
        while tracing with torch.compile, or with ``FASTCOLL_EAGER=0``, are in
        neither count.
    """
    counts = loader._C._eager_stats() if loader._C is not None else {"direct": 0, "deferred": 0}
    return {"enabled": _direct is not None, **counts}


def implementation() -> str:
    """'extension' when the compiled kernels are loaded, else 'reference'."""
    return "extension" if loader._C is not None else "reference"
