"""The fused ops on complex tensors: each element moves as its real and imaginary parts.

``fastcoll.ops`` hands the kernels the real views of a complex flat buffer and
of its tensors (``torch.view_as_real``), so the contract is the real one applied
to both parts: the multiply in float32 (float64 when either side is
complex128), then the cast. The oracle is computed here in float64 from each
tensor's parts in memory order (tensors are contiguous or transposed views of
a base the test owns, so the test knows that order), and outputs are poisoned
with NaN first so that an element left unwritten shows.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ops import HYP, examples

from fastcoll import ops

C64, C128 = torch.complex64, torch.complex128
REAL_OF = {C64: torch.float32, C128: torch.float64}
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@st.composite
def complex_lists(draw):
    """(tensor, its parts in memory order as float64 [n, 2]) pairs: contiguous, transposed or conjugated views."""
    out = []
    for _ in range(draw(st.integers(1, 6))):
        dtype = draw(st.sampled_from([C64, C128]))
        rows, cols = draw(st.integers(0, 9)), draw(st.integers(1, 9))
        seed = draw(st.integers(0, 2**31 - 1))
        base = torch.randn(rows, cols, dtype=dtype, generator=torch.Generator().manual_seed(seed)) * 10 ** draw(
            st.integers(-3, 3)
        )
        parts = torch.view_as_real(base).to(torch.float64).reshape(-1, 2)  # memory order of base
        kind = draw(st.sampled_from(["contiguous", "transposed", "conj"]))
        if kind == "transposed":
            out.append((base.t(), parts))  # same memory, same order
        elif kind == "conj":
            out.append((base.conj(), parts * torch.tensor([1.0, -1.0], dtype=torch.float64)))  # read as its values
        else:
            out.append((base, parts))
    return out


def _expected(parts: torch.Tensor, scale: float, math: torch.dtype, out_real: torch.dtype) -> torch.Tensor:
    """float64 parts times the scale rounded as the kernel rounds it, each product rounded once to ``math``."""
    s = torch.tensor(scale, dtype=math).to(torch.float64)
    return (parts * s).to(math).to(out_real)


@settings(max_examples=examples(40), **HYP)
@given(items=complex_lists(), out_dtype=st.sampled_from([C64, C128]), scale=st.sampled_from([1.0, 0.5, 1 / 3, -2.5]))
def test_flatten_scale_of_complex_tensors_matches_float64(items, out_dtype, scale):
    tensors = [t for t, _ in items]
    out = torch.full((sum(t.numel() for t in tensors),), complex(float("nan"), float("nan")), dtype=out_dtype)
    ops.flatten_scale(tensors, out, scale)
    got = torch.view_as_real(out).reshape(-1, 2)
    at = 0
    for i, (t, parts) in enumerate(items):
        math = torch.float64 if C128 in (t.dtype, out_dtype) else torch.float32
        want = _expected(parts, scale, math, REAL_OF[out_dtype])
        assert torch.equal(got[at : at + t.numel()], want), f"tensor {i} ({t.dtype}, shape {tuple(t.shape)})"
        at += t.numel()


@settings(max_examples=examples(40), **HYP)
@given(items=complex_lists(), flat_dtype=st.sampled_from([C64, C128]), scale=st.sampled_from([1.0, 0.25, 1 / 3]))
def test_unflatten_scale_into_complex_tensors_matches_float64_with_its_norm(items, flat_dtype, scale):
    n = sum(t.numel() for t, _ in items)
    flat = torch.randn(n, dtype=flat_dtype, generator=torch.Generator().manual_seed(n))
    flat_parts = torch.view_as_real(flat).to(torch.float64).reshape(-1, 2)
    dests = [torch.full_like(t.resolve_conj(), complex(float("nan"), float("nan"))) for t, _ in items]
    dests = [d if t.is_contiguous() else d.t().contiguous().t() for d, (t, _) in zip(dests, items)]  # keep layouts
    sumsq = torch.full((1,), float("nan"), dtype=torch.float64)
    ops.unflatten_scale(flat, dests, scale, sumsq=sumsq)
    at, want_sumsq = 0, 0.0
    for i, d in enumerate(dests):
        math = torch.float64 if C128 in (d.dtype, flat_dtype) else torch.float32
        want = _expected(flat_parts[at : at + d.numel()], scale, math, REAL_OF[d.dtype])
        mem = torch.view_as_real(d.t() if not d.is_contiguous() else d).reshape(-1, 2)  # memory order
        assert torch.equal(mem, want), f"destination {i} ({d.dtype}, shape {tuple(d.shape)})"
        want_sumsq += float(want.to(torch.float64).pow(2).sum())
        at += d.numel()
    assert sumsq.item() == pytest.approx(want_sumsq, rel=1e-12, abs=1e-300)


@settings(max_examples=examples(30), **HYP)
@given(items=complex_lists(), scale=st.sampled_from([1.0, 0.5, -3.0]))
def test_flatten_accumulate_and_sum_of_squares_of_complex_tensors(items, scale):
    tensors = [t for t, _ in items]
    n = sum(t.numel() for t in tensors)
    start = torch.randn(n, dtype=C128, generator=torch.Generator().manual_seed(7))
    out = start.clone()
    ops.flatten_accumulate(tensors, out, scale)
    parts = torch.cat([p for _, p in items]) if items else torch.empty(0, 2, dtype=torch.float64)
    was = torch.view_as_real(start).reshape(-1, 2)
    want = was + scale * parts  # float64 math (out is complex128): one rounding of the exact sum, at most
    bound = 2.0**-52 * (was.abs() + (scale * parts).abs())
    assert bool(((torch.view_as_real(out).reshape(-1, 2) - want).abs() <= bound).all())
    want_sq = float(parts.pow(2).sum())
    assert ops.sum_of_squares(tensors).item() == pytest.approx(want_sq, rel=1e-12, abs=1e-300)


def test_complex_and_real_refused_together_before_anything_is_written():
    out = torch.full((7,), complex(1, 2), dtype=C64)
    before = out.clone()
    with pytest.raises(TypeError, match=r"fastcoll.flatten_scale: tensors\[1\] is torch.float32"):
        ops.flatten_scale([torch.ones(3, dtype=C64), torch.ones(4)], out)
    assert torch.equal(out, before)
    with pytest.raises(TypeError, match=r"tensors\[0\] has dtype complex64"):  # a real buffer: the kernels' own check
        ops.flatten_scale([torch.ones(3, dtype=C64)], torch.zeros(3))


def test_a_conjugated_destination_is_refused_not_written_through_a_copy():
    flat = torch.ones(3, dtype=C64)
    dest = torch.zeros(3, dtype=C64).conj()
    with pytest.raises(TypeError, match=r"fastcoll.unflatten_scale: tensors\[0\] is a lazily conjugated view"):
        ops.unflatten_scale(flat, [dest])
    with pytest.raises(TypeError, match=r"fastcoll.flatten_scale: out is a lazily conjugated view"):
        ops.flatten_scale([torch.ones(3, dtype=C64)], torch.zeros(3, dtype=C64).conj())
    assert torch.equal(dest.resolve_conj(), torch.zeros(3, dtype=C64))


def test_bucket_views_of_a_complex_buffer_share_its_memory():
    like = [torch.zeros(2, 3, dtype=C64), torch.zeros(4, 2, dtype=C64).t()]
    flat = torch.arange(28, dtype=torch.float32).view(C64)
    views = ops.bucket_views(flat, like)
    ops.unflatten_scale(flat, [v.clone() for v in views])  # a round trip through copies
    for v, t in zip(views, like):
        assert v.shape == t.shape and v.stride() == t.stride() and v.dtype == C64
    assert torch.equal(torch.cat([v.t().reshape(-1) if not v.is_contiguous() else v.reshape(-1) for v in views]), flat)
