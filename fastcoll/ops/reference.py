"""Pure-PyTorch implementation of the fused ops.

This module is the oracle the tests compare the C++/CUDA kernels against, and
the implementation ``torch.ops.fastcoll.*`` falls back to when the compiled
extension is not available. It mirrors the C++ argument checks (same exception
types, same culprit named in the message) so that error behaviour does not
depend on which implementation is loaded.

Layout rule shared with the kernels: a dense, non-overlapping tensor occupies
exactly ``numel`` consecutive elements of memory starting at ``data_ptr()``;
its elements are packed into the flat buffer in that memory order. A view of
the flat buffer with the same sizes and strides (see ``ops.bucket_views``)
therefore round-trips.

Messages start with the public op's name, ``fastcoll.flatten_scale: `` or
``fastcoll.unflatten_scale: ``, then say what is wrong and how to fix it, in
the same words as csrc/ops.cpp.

``flatten_accumulate`` (fp32 "main gradients") is here too: out's slots are
a prefix of ``out`` (it may be longer; an empty list is allowed) and each
element becomes ``out + scale * x`` as one correctly rounded fused
multiply-add in float32 (float64 when either side is float64), cast to
``out.dtype`` (:func:`_fma`).

The gradient-health ops (``flatten_scale_ex``, ``unflatten_scale_ex``,
``sum_of_squares``) are here too, with the same semantics as the kernels:

* the factor of ``flatten_scale_ex`` is ``scale * scale_by[0]``, read from the
  device (no host synchronization), multiplied in float32 (float64 when either
  side of the copy or ``scale_by`` is float64);
* ``nonfinite[0]`` is set to 1 (never to 0) when a value written to ``out`` is
  NaN or +-Inf: a non-finite source, or a finite one that overflowed on the
  cast (a scale of 0 does not hide a NaN or Inf source: Inf * 0 is NaN);
* sums of squares are float64 sums of the squares of the values as stored
  (after the cast), added in a fixed order that does not depend on the number
  of threads (:func:`_ordered_sum`): deterministic, though not bitwise equal to
  the kernels', whose fixed order is their own.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch

from .dtypes import SUPPORTED_DTYPES, SUPPORTED_NAMES, dtype_name, is_dense

# ``is_dense`` is also imported from here by fastcoll.ops (bucket_views).
__all__ = [
    "flatten_scale",
    "unflatten_scale",
    "flatten_scale_ex",
    "unflatten_scale_ex",
    "sum_of_squares",
    "flatten_accumulate",
    "check_health_args",
    "checksum",
    "sum_chunks",
    "check_sum_chunks",
    "is_dense",
]


def _check_dtype(op: str, t: torch.Tensor, what: str) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: {what} has dtype {dtype_name(t.dtype)}; supported dtypes are {SUPPORTED_NAMES}")


def _check_strided(op: str, t: torch.Tensor, what: str) -> None:
    if t.layout != torch.strided:
        raise TypeError(f"{op}: {what} has layout {t.layout}; only strided (dense) tensors are supported")


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _check_flat(op: str, flat: torch.Tensor, name: str) -> None:
    _check_strided(op, flat, name)
    _check_dtype(op, flat, name)
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(
            f"{op}: {name} must be a 1-D contiguous tensor, got shape {tuple(flat.shape)} "
            f"with strides {tuple(flat.stride())}; pass a 1-D contiguous buffer"
        )


def _check_member(op: str, t: Any, what: str, other: torch.Tensor, other_name: str) -> None:
    """One listed tensor: a strided, dense tensor of a supported dtype on ``other``'s device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {what} is a {type(t).__name__}, not a tensor")
    _check_strided(op, t, what)
    if t.device != other.device:
        raise RuntimeError(f"{op}: {what} is on {t.device} but {other_name} is on {other.device}; move them to one device")
    _check_dtype(op, t, what)
    if not is_dense(t):
        raise ValueError(
            f"{op}: {what} (shape {tuple(t.shape)}, strides {tuple(t.stride())}) is not dense and "
            "non-overlapping; make it .contiguous() first"
        )


def _validate(
    op: str,
    tensors: Sequence[torch.Tensor],
    flat: torch.Tensor,
    flat_name: str,
    list_name: str,
    writes_list: bool,
    prefix: bool = False,
) -> list[int]:
    """Check arguments of either op; return each tensor's element offset in ``flat``.

    Raises before anything is written; ``op`` ("fastcoll.flatten_scale" or
    "fastcoll.unflatten_scale") starts every message. ``writes_list`` is True
    for the unflatten direction, where the listed tensors are destinations and
    must not overlap one another. ``prefix`` (flatten_accumulate): the tensors
    fill a prefix of ``flat``, which may be longer, and the list may be empty
    (csrc/fastcoll.h FlatFit::kPrefix).
    """
    if len(tensors) == 0 and not prefix:
        raise ValueError(f"{op}: {list_name} is empty; pass at least one tensor")
    _check_flat(op, flat, flat_name)
    offsets: list[int] = []
    total = 0
    for i, t in enumerate(tensors):
        _check_member(op, t, f"{list_name}[{i}]", flat, flat_name)
        offsets.append(total)
        total += t.numel()
    if total > flat.numel() if prefix else total != flat.numel():
        raise ValueError(
            f"{op}: the {list_name} hold {total} elements in total but {flat_name} has {flat.numel()}; "
            f"{flat_name} must have {'at least' if prefix else 'exactly'} as many"
        )
    # Aliasing: a tensor may sit exactly in its own slot of the flat buffer (an
    # in-place scale, as with gradient_as_bucket_view); any other overlap with the
    # flat buffer would read data the op has already overwritten.
    flat_lo, flat_hi = _byte_range(flat)
    fsize = flat.element_size()
    ranges = []
    for i, t in enumerate(tensors):
        if t.numel() == 0:
            continue
        lo, hi = _byte_range(t)
        if lo < flat_hi and flat_lo < hi:
            in_slot = t.dtype == flat.dtype and lo == flat_lo + offsets[i] * fsize
            if not in_slot:
                raise ValueError(
                    f"{op}: {list_name}[{i}] overlaps {flat_name} outside its own slot "
                    f"(elements {offsets[i]}..{offsets[i] + t.numel()}); the op would read overwritten data: "
                    "use separate memory, or exactly that slot (fastcoll.bucket_views) for an in-place scale"
                )
        ranges.append((lo, hi, i))
    if writes_list and len(ranges) > 1:
        ranges.sort()
        for (_, hi_a, ia), (lo_b, _, ib) in zip(ranges, ranges[1:]):
            if lo_b < hi_a:
                raise ValueError(
                    f"{op}: {list_name}[{min(ia, ib)}] and {list_name}[{max(ia, ib)}] overlap in memory; "
                    "destinations must not share memory"
                )
    return offsets


def _memory_order(t: torch.Tensor) -> torch.Tensor:
    """1-D view of a dense tensor's elements in memory order."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def _opmath(a: torch.dtype, b: torch.dtype, c: Optional[torch.dtype] = None) -> torch.dtype:
    return torch.float64 if torch.float64 in (a, b, c) else torch.float32


def flatten_scale(tensors: Sequence[torch.Tensor], out: torch.Tensor, scale: float = 1.0) -> None:
    """Reference ``fastcoll::flatten_scale``: pack ``tensors * scale`` into ``out``."""
    offsets = _validate("fastcoll.flatten_scale", tensors, out, "out", "tensors", writes_list=False)
    with torch.no_grad():
        for t, off in zip(tensors, offsets):
            n = t.numel()
            if n == 0:
                continue
            src = _memory_order(t).to(_opmath(t.dtype, out.dtype))
            out[off : off + n].copy_(src * scale)


def unflatten_scale(flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float = 1.0) -> None:
    """Reference ``fastcoll::unflatten_scale``: write slices of ``flat * scale`` into ``tensors``."""
    offsets = _validate("fastcoll.unflatten_scale", tensors, flat, "flat", "tensors", writes_list=True)
    with torch.no_grad():
        for t, off in zip(tensors, offsets):
            n = t.numel()
            if n == 0:
                continue
            src = flat[off : off + n].to(_opmath(t.dtype, flat.dtype))
            _memory_order(t).copy_(src * scale)


# ---------------------------------------------------------------------------
# Gradient health: flatten_scale_ex, unflatten_scale_ex, sum_of_squares
# ---------------------------------------------------------------------------

# Elements per block of the ordered float64 sum (see _ordered_sum).
_SUM_BLOCK = 4096


def _describe(t: torch.Tensor) -> str:
    """How a message shows a small tensor argument: 'a float32 tensor of shape (2,) on cpu'."""
    layout = "" if t.layout == torch.strided else "non-strided "
    article = "an" if layout == "" and dtype_name(t.dtype)[0] in "aeiou" else "a"
    return f"{article} {layout}{dtype_name(t.dtype)} tensor of shape {tuple(t.shape)} on {t.device}"


def _check_small(
    op: str, t, name: str, dtypes: Tuple[torch.dtype, ...], need: str, device: torch.device, at_least_one: bool
) -> None:
    """``t`` must be a strided tensor of one of ``dtypes`` on ``device`` with exactly 1 (or >= 1) element.

    Raises TypeError (not a tensor, layout, dtype), RuntimeError (device) or
    ValueError (number of elements), with one message naming what is expected.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be {need} on {device}, got a {type(t).__name__}")
    msg = f"{op}: {name} must be {need} on {device}, got {_describe(t)}"
    if t.layout != torch.strided or t.dtype not in dtypes:
        raise TypeError(msg)
    if t.device != device:
        raise RuntimeError(msg)
    if not (t.numel() >= 1 if at_least_one else t.numel() == 1):
        raise ValueError(msg)


def _check_apart(op: str, t: torch.Tensor, name: str, others: Sequence[Tuple[str, Optional[torch.Tensor]]]) -> None:
    """The element of ``t`` the op reads or writes (its first) shares no byte with ``others``."""
    lo = t.data_ptr()
    hi = lo + t.element_size()
    for other_name, o in others:
        if o is None or o.numel() == 0:
            continue
        o_lo, o_hi = _byte_range(o)
        if lo < o_hi and o_lo < hi:
            raise ValueError(f"{op}: {name} overlaps {other_name}; give {name} memory of its own")


def check_health_args(
    op: str,
    device: torch.device,
    scale_by: Optional[torch.Tensor] = None,
    nonfinite: Optional[torch.Tensor] = None,
    sumsq: Optional[torch.Tensor] = None,
    sumsq_name: str = "sumsq",
) -> None:
    """Metadata checks of the health ops' small tensors (also run by the fake kernels).

    Same order and words as csrc/ops.cpp: ``scale_by``, then ``nonfinite``, then
    the sum's output (``sumsq``, or ``out`` of sum_of_squares, named by ``sumsq_name``).
    """
    if scale_by is not None:
        _check_small(
            op, scale_by, "scale_by", (torch.float32, torch.float64), "a float32 or float64 tensor with 1 element", device, False
        )
    if nonfinite is not None:
        _check_small(op, nonfinite, "nonfinite", (torch.int32,), "an int32 tensor with at least 1 element", device, True)
    if sumsq is not None:
        _check_small(op, sumsq, sumsq_name, (torch.float64,), "a float64 tensor with 1 element", device, False)


def _listed(name: str, tensors: Sequence[torch.Tensor]) -> List[Tuple[str, torch.Tensor]]:
    return [(f"{name}[{i}]", t) for i, t in enumerate(tensors)]


def _first(t: torch.Tensor) -> torch.Tensor:
    """0-d view of the element at ``t.data_ptr()`` (index 0 in every dimension)."""
    return t.as_strided((), (), t.storage_offset())


def _ordered_sum(parts: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """float64 sum of the concatenated 1-D ``parts`` in a fixed order, as a 0-d tensor.

    Blocks of _SUM_BLOCK elements are summed (each block by one thread: a
    reduction over the inner dimension of a (blocks, _SUM_BLOCK) view), then the
    block sums the same way, until one value is left. The order depends only on
    the number of elements, never on the number of threads.
    """
    parts = [p for p in parts if p.numel() > 0]
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=device)
    v = torch.cat(parts) if len(parts) > 1 else parts[0]
    while True:
        pad = (-v.numel()) % _SUM_BLOCK
        if pad:
            v = torch.cat([v, v.new_zeros(pad)])
        v = v.view(-1, _SUM_BLOCK).sum(dim=1)
        if v.numel() == 1:
            return v.reshape(())


def _check_list_only(op: str, tensors: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """The per-tensor checks of _validate, for an op without a flat buffer (sum_of_squares)."""
    if len(tensors) == 0:
        raise ValueError(f"{op}: tensors is empty; pass at least one tensor")
    for i, t in enumerate(tensors):
        _check_member(op, t, f"tensors[{i}]", out, "out")


def flatten_scale_ex(
    tensors: Sequence[torch.Tensor],
    out: torch.Tensor,
    scale: float = 1.0,
    scale_by: Optional[torch.Tensor] = None,
    nonfinite: Optional[torch.Tensor] = None,
) -> None:
    """Reference ``fastcoll::flatten_scale_ex``: flatten_scale by ``scale * scale_by[0]``, flagging non-finite values."""
    op = "fastcoll.flatten_scale_ex"
    offsets = _validate(op, tensors, out, "out", "tensors", writes_list=False)
    check_health_args(op, out.device, scale_by=scale_by, nonfinite=nonfinite)
    if scale_by is not None:
        _check_apart(op, scale_by, "scale_by", [("out", out)])
    if nonfinite is not None:
        _check_apart(op, nonfinite, "nonfinite", [("out", out)] + _listed("tensors", tensors) + [("scale_by", scale_by)])
    with torch.no_grad():
        bad = None
        for t, off in zip(tensors, offsets):
            n = t.numel()
            if n == 0:
                continue
            m = _opmath(t.dtype, out.dtype, None if scale_by is None else scale_by.dtype)
            factor = scale if scale_by is None else _first(scale_by).to(m) * scale
            value = (_memory_order(t).to(m) * factor).to(out.dtype)
            if nonfinite is not None:
                b = ~torch.isfinite(value).all()
                bad = b if bad is None else bad | b
            out[off : off + n].copy_(value)
        if bad is not None:
            _first(nonfinite).masked_fill_(bad, 1)


def unflatten_scale_ex(
    flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float = 1.0, sumsq: Optional[torch.Tensor] = None
) -> None:
    """Reference ``fastcoll::unflatten_scale_ex``: unflatten_scale, writing the sum of squares of the written values."""
    op = "fastcoll.unflatten_scale_ex"
    offsets = _validate(op, tensors, flat, "flat", "tensors", writes_list=True)
    check_health_args(op, flat.device, sumsq=sumsq)
    if sumsq is not None:
        _check_apart(op, sumsq, "sumsq", [("flat", flat)] + _listed("tensors", tensors))
    with torch.no_grad():
        squares = []
        for t, off in zip(tensors, offsets):
            n = t.numel()
            if n == 0:
                continue
            value = (flat[off : off + n].to(_opmath(t.dtype, flat.dtype)) * scale).to(t.dtype)
            if sumsq is not None:
                squares.append(value.to(torch.float64).square())
            _memory_order(t).copy_(value)
        if sumsq is not None:
            _first(sumsq).copy_(_ordered_sum(squares, flat.device))


def sum_of_squares(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """Reference ``fastcoll::sum_of_squares``: ``out[0]`` = float64 sum of x*x over all elements of all tensors."""
    op = "fastcoll.sum_of_squares"
    _check_list_only(op, tensors, out)
    check_health_args(op, out.device, sumsq=out, sumsq_name="out")
    _check_apart(op, out, "out", _listed("tensors", tensors))
    with torch.no_grad():
        squares = [_memory_order(t).to(torch.float64).square() for t in tensors if t.numel() > 0]
        _first(out).copy_(_ordered_sum(squares, out.device))


# ---------------------------------------------------------------------------
# fp32 main gradients: flatten_accumulate
# ---------------------------------------------------------------------------


def _two_sum(a: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(s, e)``: ``s`` = a + b rounded, ``e`` its error (s + e == a + b exactly, for finite float64 sums)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _add_round_to_odd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float64 ``a + b`` rounded to odd: the exact sum when it is a float64, else whichever of the two
    float64 values around it has an odd last bit. Rounding that to a format at least 2 bits narrower
    (float32 has 29 fewer) gives the sum correctly rounded to that format, with no double rounding."""
    s, e = _two_sum(a, b)
    inexact = (e != 0) & torch.isfinite(s) & ((s.view(torch.int64) & 1) == 0)
    toward = torch.where(e > 0, float("inf"), float("-inf")).to(s.dtype)
    return torch.where(inexact, torch.nextafter(s, toward), s)


def _two_product(a: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(p, e)``: float64 ``a * b`` rounded and its exact error (Dekker, Veltkamp's splitting), barring
    overflow and products below about 2**-969."""

    def split(x):
        c = x * 134217729.0  # 2**27 + 1
        hi = c - (c - x)
        return hi, x - hi

    p = a * b
    ah, al = split(a)
    bh, bl = split(b)
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


def _fma(x: torch.Tensor, scale: float, old: torch.Tensor, opmath: torch.dtype) -> torch.Tensor:
    """``x * scale + old`` as one fused multiply-add in ``opmath`` (float32 or float64): the exact value
    rounded once, as the kernels' FMA instructions (and std::fma) compute it. A new tensor of ``opmath``.

    float32: the product of two float32 values is exact in float64, and their sum rounded to odd in
    float64 then to float32 is the correctly rounded sum. float64: Boldo and Melquiond's emulation
    (the exact product, then the sum of its three parts with one rounding to odd). Non-finite values
    (and overflowing intermediates) take plain ``x * scale + old``, which gives the same infinities and NaNs.
    """
    if opmath == torch.float32:
        s = torch.tensor(scale, dtype=torch.float32, device=x.device).to(torch.float64)  # scale rounded to float32 first
        product = x.to(torch.float32).to(torch.float64) * s  # exact: 24 + 24 bits
        return _add_round_to_odd(product, old.to(torch.float32).to(torch.float64)).to(torch.float32)
    a, c = x.to(torch.float64), old.to(torch.float64)
    b = torch.tensor(scale, dtype=torch.float64, device=a.device)
    uh, ul = _two_product(a, b)
    th, tl = _two_sum(c, uh)
    z = th + _add_round_to_odd(tl, ul)
    return torch.where(torch.isfinite(z), z, a * b + c)


def flatten_accumulate(
    tensors: Sequence[torch.Tensor], out: torch.Tensor, scale: float = 1.0, nonfinite: Optional[torch.Tensor] = None
) -> None:
    """Reference ``fastcoll::flatten_accumulate``: ``out[slot] = out[slot] + scale * tensor``, one FMA per element."""
    op = "fastcoll.flatten_accumulate"
    offsets = _validate(op, tensors, out, "out", "tensors", writes_list=False, prefix=True)
    check_health_args(op, out.device, nonfinite=nonfinite)
    if nonfinite is not None:
        _check_apart(op, nonfinite, "nonfinite", [("out", out)] + _listed("tensors", tensors))
    with torch.no_grad():
        bad = None
        for t, off in zip(tensors, offsets):
            n = t.numel()
            if n == 0:
                continue
            slot = out[off : off + n]
            value = _fma(_memory_order(t), scale, slot, _opmath(t.dtype, out.dtype)).to(out.dtype)
            if nonfinite is not None:
                b = ~torch.isfinite(value).all()
                bad = b if bad is None else bad | b
            slot.copy_(value)
        if bad is not None:
            _first(nonfinite).masked_fill_(bad, 1)


# ---------------------------------------------------------------------------
# One-rounding reduction: sum_chunks
# ---------------------------------------------------------------------------

_CHUNK_DTYPES = (torch.float16, torch.bfloat16)


def check_sum_chunks(chunks: torch.Tensor, out: torch.Tensor, overlap: bool = True) -> None:
    """The argument checks of ``fastcoll::sum_chunks``, in csrc/ops.cpp's order and words (``overlap``: needs memory)."""
    op = "fastcoll.sum_chunks"
    for name, t in (("chunks", chunks), ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} is a {type(t).__name__}, not a tensor")
        _check_strided(op, t, name)
    if chunks.dtype not in _CHUNK_DTYPES:
        raise TypeError(
            f"{op}: chunks has dtype {dtype_name(chunks.dtype)}; it must be float16 or bfloat16 "
            "(the 16-bit values received from every rank)"
        )
    if chunks.dim() != 2 or chunks.shape[0] < 1 or not chunks.is_contiguous():
        raise ValueError(
            f"{op}: chunks must be a contiguous 2-D tensor [ranks, n] with at least one row, got shape "
            f"{tuple(chunks.shape)} with strides {tuple(chunks.stride())}"
        )
    if out.device != chunks.device:
        raise RuntimeError(f"{op}: out is on {out.device} but chunks is on {chunks.device}; move them to one device")
    if out.dtype not in (torch.float32, chunks.dtype):
        raise TypeError(
            f"{op}: out has dtype {dtype_name(out.dtype)}; it must be float32 or chunks' dtype ({dtype_name(chunks.dtype)})"
        )
    if out.dim() != 1 or not out.is_contiguous() or out.numel() != chunks.shape[1]:
        raise ValueError(
            f"{op}: out must be a 1-D contiguous tensor of {chunks.shape[1]} elements (one row of chunks), got shape "
            f"{tuple(out.shape)} with strides {tuple(out.stride())}"
        )
    if overlap and out.numel() and chunks.numel():
        lo, hi = _byte_range(out)
        c_lo, c_hi = _byte_range(chunks)
        if lo < c_hi and c_lo < hi:
            raise ValueError(f"{op}: out overlaps chunks; the sum would read values it overwrote: give out memory of its own")


def sum_chunks(chunks: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> None:
    """Reference ``fastcoll::sum_chunks``: float64 sum of the rows in row order, times scale, rounded once to float32.

    Each step is one IEEE float64 operation (torch's float64 add and multiply
    round correctly), then one rounding to float32 and, for a 16-bit ``out``,
    one more to its dtype, so this is the kernels' result bit for bit.
    """
    check_sum_chunks(chunks, out)
    if out.numel() == 0:
        return
    with torch.no_grad():
        acc = chunks[0].to(torch.float64)
        for r in range(1, chunks.shape[0]):
            acc = acc + chunks[r].to(torch.float64)
        acc = acc * torch.tensor(scale, dtype=torch.float64, device=acc.device)
        out.copy_(acc.to(torch.float32).to(out.dtype))


# ---------------------------------------------------------------------------
# Replica verification: checksum
# ---------------------------------------------------------------------------

# The constants of the hash (fastcoll.ops.checksum documents it), as the int64
# values with the same 64 bits.
_U64 = 1 << 64


def _i64(u: int) -> int:
    return u - _U64 if u >= 1 << 63 else u


_CS_K = _i64(0x9E3779B97F4A7C15)
_CS_M1 = _i64(0xBF58476D1CE4E5B9)
_CS_M2 = _i64(0x94D049BB133111EB)


def _lsr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> on int64 is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors (mod 2^64: int64 products wrap)."""
    x = x ^ _lsr(x, 30)
    x = x * _CS_M1
    x = x ^ _lsr(x, 27)
    x = x * _CS_M2
    return x ^ _lsr(x, 31)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The ``numel * element_size`` bytes of a dense tensor from ``data_ptr()``, in memory order, as uint8."""
    return _memory_order(t).view(torch.uint8)


def checksum(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Reference ``fastcoll::checksum``: one int64 hash per tensor of the bytes it holds.

    Per tensor, word by word, exactly as ``fastcoll.ops.checksum`` defines it
    (little-endian 64-bit words, zero-padded; ``mix`` is splitmix64's
    finalizer; all arithmetic mod 2^64 in int64 tensors on the tensors' device).
    """
    op = "fastcoll.checksum"
    for i, t in enumerate(tensors):
        what = f"tensors[{i}]"
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {what} is a {type(t).__name__}, not a tensor")
        _check_strided(op, t, what)
        if t.device != tensors[0].device:
            raise RuntimeError(f"{op}: {what} is on {t.device} but tensors[0] is on {tensors[0].device}; move them to one device")
        if not is_dense(t):
            raise ValueError(
                f"{op}: {what} (shape {tuple(t.shape)}, strides {tuple(t.stride())}) is not dense and "
                "non-overlapping; make it .contiguous() first"
            )
    if len(tensors) == 0:
        return torch.empty(0, dtype=torch.int64)
    device = tensors[0].device
    out = []
    with torch.no_grad():
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            nwords = (nbytes + 7) // 8
            padded = torch.zeros(nwords * 8, dtype=torch.uint8, device=device)
            if nbytes:
                padded[:nbytes].copy_(_bytes_of(t.detach()))
            words = padded.view(torch.int64)  # little-endian on every device fastcoll runs on
            keys = torch.arange(1, nwords + 1, dtype=torch.int64, device=device) * _CS_K
            s = _mix(words ^ keys).sum(dtype=torch.int64) if nwords else torch.zeros((), dtype=torch.int64, device=device)
            length = _mix(torch.tensor(_i64((nbytes + 0x9E3779B97F4A7C15) % _U64), dtype=torch.int64, device=device))
            out.append(_mix(s ^ length))
    return torch.stack(out)
