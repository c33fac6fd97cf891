"""Tests of fastcoll.ops.flatten_accumulate: out[slot] = out[slot] + scale * tensor, one fused multiply-add.

Same approach as tests/test_ops.py, whose helpers this file imports: every test
tensor is carved out of a storage buffer the test owns, so the test knows each
tensor's elements in memory order without asking the code under test. ``out``
is prefilled with random values (they must be accumulated into), followed by a
tail that belongs to ``out`` but to no tensor's slot (poisoned with NaN: it
must keep its bits), inside a buffer whose guard regions must keep theirs.
Values are compared with a float64 oracle computed here (one rounding of the
multiply-add in float32, float64 when either side is float64, then the cast
to out's dtype); with the extension, its results must also be the bits of the
reference's, whose fused multiply-add is itself checked against exact rational
arithmetic (``fractions.Fraction``).

Implementations under test: ``torch.ops.fastcoll.flatten_accumulate`` (the
compiled kernel, or the reference under ``FASTCOLL_NO_EXT=1``, through the
dispatcher's boxed call), the public ``fastcoll.ops.flatten_accumulate`` (with
the extension, its direct eager entry point, csrc/eager.cpp: the tests check
that it was taken) and fastcoll.ops.reference called directly.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from fractions import Fraction
from typing import List, Sequence

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_ops import (
    _LAST_OP,
    BF16,
    CUDA,
    DTYPE_PAIRS,
    DTYPES,
    F16,
    F32,
    F64,
    HUGE_NUMEL,
    HYP,
    Spec,
    _fixed_specs,
    _good_inputs,
    _raises_and_writes_nothing,
    assert_bitwise,
    assert_extension_and_reference_agree,
    capture_graph,
    cases,
    compile_grads,
    eager_and_compiled,
    examples,
    extension_active,
    make_tensor,
    opmath,
)

import fastcoll
from fastcoll import ops
from fastcoll.bench.runner import num_threads
from fastcoll.ops import reference

INF, NAN = float("inf"), float("nan")
OP = "fastcoll.flatten_accumulate"
CPU_STEP = 32  # csrc/cpu/copy_scale.h kObsStep: elements per step of the vector loop
PAIR_IDS = [f"{str(a)[6:]}-{str(b)[6:]}" for a, b in DTYPE_PAIRS]
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")  # as in test_ops.py (tests/conftest.py)


# ---------------------------------------------------------------------------
# The implementations under test
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class AImpl:
    """Each call records the op's public name in test_ops' _LAST_OP (for _raises_and_writes_nothing)."""

    name: str  # "ops" (public wrapper), "boxed" (torch.ops), "reference"

    def accumulate(self, tensors, out, scale=1.0, nonfinite=None):
        _LAST_OP["name"] = OP
        if self.name == "reference":
            reference.flatten_accumulate(tensors, out, scale, nonfinite)
        elif self.name == "boxed":
            torch.ops.fastcoll.flatten_accumulate(list(tensors), out, float(scale), nonfinite)
        else:
            before = ops.eager_stats()
            assert ops.flatten_accumulate(tensors, out, scale, nonfinite=nonfinite) is out
            after = ops.eager_stats()
            if before["enabled"]:  # with the extension: plain tensors take the direct entry point
                assert after["direct"] == before["direct"] + 1, (before, after)


IMPLS = [AImpl("ops"), AImpl("boxed"), AImpl("reference")]
impl_param = pytest.mark.parametrize("impl", IMPLS, ids=[i.name for i in IMPLS])
pair_param = pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=PAIR_IDS)


# ---------------------------------------------------------------------------
# An out buffer with prefilled values, a tail and guards; the float64 oracle
# ---------------------------------------------------------------------------

GUARD = 1234.0


@dataclass
class Out:
    """``tensor``: 1-D out of ``packed + tail`` elements at ``offset`` inside ``buf``.

    Its first ``packed`` elements hold random values (accumulated into); the
    ``tail`` elements after them are NaN, the guards around it 1234."""

    tensor: torch.Tensor
    buf: torch.Tensor
    offset: int
    packed: int
    tail: int

    @property
    def slots(self) -> torch.Tensor:
        return self.tensor[: self.packed]


def make_out(packed: int, tail: int, dtype, device, offset: int, pad: int, gen: torch.Generator) -> Out:
    size = offset + packed + tail + pad
    buf = torch.full((size,), GUARD, dtype=F64)
    buf[offset : offset + packed] = torch.randn(packed, generator=gen, dtype=F64) * 3.0
    buf[offset + packed : offset + packed + tail] = NAN
    buf = buf.to(dtype).to(device)
    return Out(buf[offset : offset + packed + tail], buf, offset, packed, tail)


def assert_untouched_outside_slots(out: Out, before: torch.Tensor) -> None:
    """The tail of out and the guards around it keep their bits."""
    start = out.offset + out.packed
    assert_bitwise(out.buf[: out.offset], before[: out.offset], "wrote before out")
    assert_bitwise(out.buf[start:], before[start:], "wrote into out's tail (past the last slot) or past out")


def assert_accumulated(got, old, src_mem, scale: float, src_dtype, what: str) -> None:
    """``got`` (out's dtype) ~= exact float64 ``old + src * scale``.

    Error budget: one rounding in the op math (float32 unless a side is
    float64), the cast to out's dtype, and the rounding of ``scale`` to the op
    math (an error relative to the product, which cancellation can leave
    larger than the result).
    """
    m = opmath(src_dtype, got.dtype)
    got64 = got.detach().cpu().to(F64)
    x = src_mem.detach().cpu().to(F64)
    product = x * scale
    exact = old.detach().cpu().to(F64) + product
    u_m = torch.finfo(m).eps / 2
    fi = torch.finfo(got.dtype)
    tol = (fi.eps / 2 + 2 * u_m) * exact.abs() + 2 * u_m * product.abs() + fi.tiny * fi.eps
    if got.dtype in (F16, BF16) and src_dtype == F64:  # float64 -> float32 -> 16 bits: one more rounding
        tol = tol + fi.eps / 2 * exact.abs()
    nan = torch.isnan(got64)
    if nan.any():
        i = int(nan.nonzero()[0])
        raise AssertionError(f"{what}: {int(nan.sum())} NaN element(s), first at {i}")
    bad = (got64 - exact).abs() > tol
    if bad.any():
        i = int(bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} element(s) off; first at {i}: got {got64[i].item()!r}, exact "
            f"{exact[i].item()!r} (old {old.flatten()[i].item()!r} + src {x[i].item()!r} * {scale!r})"
        )


def skip_bitwise(src_dtype, out_dtype) -> bool:
    """float64 -> 16 bits rounds twice (to float32, then to 16 bits) in the kernels; torch's cast may not
    (test_ops.py skips these pairs too)."""
    return src_dtype == F64 and out_dtype in (F16, BF16)


def check_accumulate(
    impl: AImpl, specs: Sequence[Spec], out_dtype, scale, out_offset, out_pad, seed, tail=0, device="cpu"
) -> None:
    gen = torch.Generator().manual_seed(seed)
    made = [make_tensor(s, device, gen) for s in specs]
    before_inputs = [m.buf.clone() for m in made]
    n = sum(s.numel for s in specs)
    out = make_out(n, tail, out_dtype, device, out_offset, out_pad, gen)
    old = out.slots.clone()
    before = out.buf.clone()
    impl.accumulate([m.tensor for m in made], out.tensor, scale)

    for i, (m, b) in enumerate(zip(made, before_inputs)):
        assert_bitwise(m.buf, b, f"input tensors[{i}] (and its buffer) changed")
    assert_untouched_outside_slots(out, before)
    pos = 0
    for i, (s, m) in enumerate(zip(specs, made)):
        sl = slice(pos, pos + s.numel)
        assert_accumulated(out.slots[sl], old[sl], m.mem, scale, s.dtype, f"slot of tensors[{i}] {s}")
        pos += s.numel

    if impl.name != "reference" and extension_active():  # extension vs reference, bit for bit
        ref = old.clone()
        ref_full = torch.cat([ref, out.tensor[n:]])
        reference.flatten_accumulate([m.tensor for m in made], ref_full, scale)
        pos = 0
        for i, s in enumerate(specs):
            if not skip_bitwise(s.dtype, out_dtype):
                sl = slice(pos, pos + s.numel)
                assert_bitwise(out.slots[sl], ref_full[sl], f"extension != reference for tensors[{i}] {s}")
            pos += s.numel


TAILS = st.sampled_from([0, 0, 1, 3, 64])


# ---------------------------------------------------------------------------
# Values against float64, every dtype pair, the layout of flatten_scale
# ---------------------------------------------------------------------------


@impl_param
@settings(max_examples=examples(40), **HYP)
@given(case=cases(), tail=TAILS)
@example(
    case=dict(specs=[Spec((65537,), (0,), BF16, 1, 1)], out_dtype=F32, scale=1.0, out_offset=3, out_pad=1, seed=1),
    tail=5,
)
def test_accumulate_matches_float64(impl, case, tail):
    check_accumulate(impl, tail=tail, **case)


@impl_param
@pair_param
def test_all_dtype_pairs(impl, pair):
    src, dst = pair
    for scale, tail in ((1.0, 0), (1 / 3, 7), (-0.5, 1)):
        check_accumulate(impl, _fixed_specs(src), dst, scale, 1, 2, seed=11, tail=tail)


@impl_param
def test_mixed_input_dtypes_and_layouts(impl):
    specs = [Spec((5, 7), (1, 0), d, k % 3, 1) for k, d in enumerate(DTYPES * 4)]
    specs.append(Spec((4, 3, 5, 5), (0, 2, 3, 1), BF16, 1, 0))  # channels_last: memory order
    for out_dtype in DTYPES:
        check_accumulate(impl, specs, out_dtype, 0.5, 1, 1, seed=3, tail=9)


@impl_param
def test_one_huge_among_many_tiny(impl):
    specs = [Spec((k % 9,), (0,), BF16, k % 4, 0) for k in range(150)]
    specs.append(Spec((HUGE_NUMEL,), (0,), BF16, 1, 1))
    specs += [Spec((1 + k % 5, 3), (0, 1), F16 if k % 2 else F32, k % 2, 0) for k in range(149)]
    check_accumulate(impl, specs, F32, 1 / 8, 1, 1, seed=5, tail=100)


@impl_param
@pytest.mark.parametrize("threads", [2, 4])
def test_parallel_split_writes_the_same_bits(impl, threads):
    """Elementwise work: any split across threads stores the bits of one thread."""
    gen = torch.Generator().manual_seed(9)
    ts = [torch.randn(n, generator=gen).to(d) for n, d in [(3, F32), (HUGE_NUMEL, BF16), (100000, F16), (7, F32)]]
    start = torch.randn(sum(t.numel() for t in ts) + 11, generator=gen)
    results = []
    for k in (1, threads):
        out = start.clone()
        with num_threads(k):
            impl.accumulate(ts, out, 0.3)
        results.append(out)
    assert_bitwise(results[0], results[1], f"{threads} threads vs 1")


@impl_param
def test_channels_last_elements_go_in_memory_order(impl):
    t = torch.randn(4, 3, 5, 5).contiguous(memory_format=torch.channels_last)
    out = torch.ones(t.numel() + 2)
    impl.accumulate([t], out, 2.0)
    assert torch.equal(out[:-2], 1 + 2 * t.permute(0, 2, 3, 1).reshape(-1))  # NHWC order, not NCHW
    assert torch.equal(out[-2:], torch.ones(2))
    (view,) = ops.bucket_views(out[:-2], [t])
    assert torch.equal(view, 1 + 2 * t)


# ---------------------------------------------------------------------------
# One fused multiply-add: the rounding the op promises, and what it is for
# ---------------------------------------------------------------------------


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=F32))


# x * s + old where a float64 sum rounded to float32 (two roundings) misses the correctly rounded
# result by one ulp: the exact value, 1 + 2**-23 + 2**-24 - 2**-70, lies just below the midpoint
# between two float32 values; its float64 rounding lands on that midpoint, which then ties to even
# (up, to 1 + 2**-22), where the correctly rounded value is 1 + 2**-23. All three are float32 values.
HARD_X = 2.0**-24 * (1 + 2.0**-23)
HARD_S = 1 - 2.0**-23
HARD_OLD = 1 + 2.0**-23


@impl_param
def test_one_rounding_in_float32(impl):
    """out + scale * x is rounded once to float32 (a fused multiply-add), not twice."""
    exact = Fraction(HARD_OLD) + Fraction(HARD_X) * Fraction(HARD_S)
    want = _round_fraction(exact, 24, -126)
    naive = _f32(HARD_OLD + HARD_X * HARD_S)  # float64 product and sum, then float32
    assert want == HARD_OLD and naive != want, (want, naive)  # the case does tell them apart
    for n, at in ((1, 0), (100, 37), (3 * CPU_STEP + 5, CPU_STEP)):  # scalar tail and vector loop
        x = torch.zeros(n)
        x[at] = HARD_X
        out = torch.zeros(n)
        out[at] = HARD_OLD
        impl.accumulate([x], out, HARD_S)
        assert out[at].item() == want, f"n={n}: got {out[at].item()!r}, correctly rounded {want!r}"


@impl_param
@pytest.mark.parametrize("grad_dtype", [BF16, F16, F32], ids=str)
def test_scale_one_is_torch_add(impl, grad_dtype):
    """At scale 1 the product is exact: the result is the bits of Megatron's ``main_grad.add_(grad)``."""
    gen = torch.Generator().manual_seed(4)
    grads = [torch.randn(n, generator=gen).to(grad_dtype) for n in (1, 33, 1000, 70001)]
    main = torch.randn(sum(g.numel() for g in grads), generator=gen)
    want = main.clone()
    for view, g in zip(ops.bucket_views(want, grads), grads):
        view.add_(g)
    impl.accumulate(grads, main)
    assert_bitwise(main, want, "flatten_accumulate(scale=1) vs per-tensor add_")


@impl_param
def test_eight_accumulations_match_the_float64_sum(impl):
    """8 micro-batches of bfloat16 gradients into float32 main gradients: within float32 rounding
    of the float64 sum, where accumulating in bfloat16 loses the small contributions."""
    gen = torch.Generator().manual_seed(8)
    shapes = [(64, 3, 3, 3), (512,), (300, 7)]
    # One large contribution (the first micro-batch), then seven small ones.
    batches = []
    for k in range(8):
        size = 1.0 if k == 0 else 3e-3
        batches.append([(torch.rand(s, generator=gen) * size).to(BF16) for s in shapes])
    n = sum(math.prod(s) for s in shapes)
    main = torch.zeros(n + 5)
    main[n:] = NAN  # padding past the gradients: untouched
    low = [torch.zeros(s, dtype=BF16) for s in shapes]
    for grads in batches:
        impl.accumulate(grads, main, 1 / 8)
        for acc, g in zip(low, grads):
            acc.add_(g, alpha=1 / 8)  # bfloat16 accumulation
    exact = torch.zeros(n, dtype=F64)
    for grads in batches:
        exact += torch.cat([g.to(F64).reshape(-1) for g in grads]) / 8
    assert torch.isnan(main[n:]).all()
    err = (main[:n].to(F64) - exact).abs().max().item()
    low_err = (torch.cat([a.to(F64).reshape(-1) for a in low]) - exact).abs().max().item()
    bound = 8 * torch.finfo(F32).eps * exact.abs().max().item()  # 8 roundings of at most half an ulp, and margin
    assert err <= bound, f"float32 accumulation off by {err:.3g} (bound {bound:.3g})"
    assert low_err > 100 * max(err, bound / 8), f"bfloat16 accumulation off by only {low_err:.3g} (fp32: {err:.3g})"


# ---------------------------------------------------------------------------
# Layout edge cases: longer out, empty list, zero-size tensors, in place
# ---------------------------------------------------------------------------


@impl_param
def test_empty_list_and_zero_size_tensors_touch_nothing(impl):
    gen = torch.Generator().manual_seed(1)
    out = torch.randn(6, generator=gen)
    before = out.clone()
    impl.accumulate([], out, 0.5)
    impl.accumulate([torch.empty(0), torch.empty(3, 0, dtype=BF16)], out, 0.5)
    impl.accumulate([], torch.empty(0), 0.5)
    nf = torch.zeros(1, dtype=torch.int32)
    out[2] = NAN  # in the tail of every call: not written, so not flagged
    before = out.clone()
    impl.accumulate([torch.empty(0)], out, 0.5, nf)
    assert_bitwise(out, before, "out")
    assert nf.item() == 0


@impl_param
def test_out_longer_than_the_tensors(impl):
    ts = [torch.ones(3), torch.full((2,), 2.0, dtype=BF16)]
    out = torch.full((9,), 10.0)
    impl.accumulate(ts, out, 0.5)
    assert out.tolist() == [10.5, 10.5, 10.5, 11.0, 11.0, 10.0, 10.0, 10.0, 10.0]


@impl_param
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensors_that_are_their_own_slot(impl, dtype):
    """A tensor exactly in its own slot (same dtype) becomes (1 + scale) * x, as flatten_scale allows it."""
    gen = torch.Generator().manual_seed(2)
    buf = (torch.randn(1 + 64 * 9 + 10 + 7 + 3, generator=gen) * 4).to(dtype)
    out = buf[1:]  # misaligned by one element; 3 elements of tail
    like = [torch.empty(64, 1, 3, 3).contiguous(memory_format=torch.channels_last), torch.empty(10, 1), torch.empty(7)]
    views = ops.bucket_views(out[:-3], like)
    before = buf.clone()
    impl.accumulate(views, out, 0.25)
    old = before[1:]
    assert_accumulated(out[:-3], old[:-3], old[:-3], 0.25, dtype, "in-place accumulation")
    assert_bitwise(buf[-3:], before[-3:], "tail")
    assert_bitwise(buf[:1], before[:1], "before out")


@impl_param
def test_same_input_twice_is_allowed(impl):
    t = torch.randn(10)
    out = torch.ones(20)
    impl.accumulate([t, t], out, 2.0)
    torch.testing.assert_close(out, 1 + torch.cat([t, t]) * 2, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------
# nonfinite: flatten_scale_ex's convention
# ---------------------------------------------------------------------------


def flag(initial: int = 0, device="cpu") -> torch.Tensor:
    """A 3-element int32 buffer whose middle element is the flag; returns the buffer (flag: buf[1:2])."""
    return torch.tensor([-7, initial, -7], dtype=torch.int32, device=device)


def flag_value(buf: torch.Tensor) -> int:
    assert buf[0].item() == -7 and buf[2].item() == -7, "wrote outside the flag's element"
    return int(buf[1].item())


NONFINITE_PAIRS = [(BF16, F32), (F16, F32), (F32, F32), (F32, BF16), (F64, F32), (F32, F64), (BF16, BF16)]


def _placements(n: int) -> List[int]:
    return sorted({0, 1, CPU_STEP - 1, CPU_STEP, CPU_STEP + 1, n // 2, n - CPU_STEP, n - 2, n - 1})


@impl_param
@pytest.mark.parametrize("pair", NONFINITE_PAIRS, ids=lambda p: f"{str(p[0])[6:]}-{str(p[1])[6:]}")
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
def test_nonfinite_input_anywhere_is_flagged(impl, pair, value):
    src, dst = pair
    n_mid = 5 * CPU_STEP + 7
    for where in _placements(n_mid) + [-1]:
        gen = torch.Generator().manual_seed(where + 10)
        first = torch.randn(100, generator=gen).to(src)
        mid = torch.randn(n_mid, generator=gen).to(src)
        only = torch.randn(1, generator=gen).to(src)  # a one-element tensor
        if where >= 0:
            mid[where] = value
        else:
            only[0] = value
        ts = [first, mid, only]
        out = torch.zeros(101 + n_mid + 4, dtype=dst)
        nf = flag(0)
        impl.accumulate(ts, out, 0.5, nf[1:2])
        assert flag_value(nf) == 1, f"{value} at {where} ({src} -> {dst}) not flagged"
        pos = 100 + where if where >= 0 else 100 + n_mid
        got = out[pos].item()
        assert (math.isnan(got) and math.isnan(value)) or got == value, f"wrote {got} for {value}"
        # every other value as without a flag
        plain = torch.zeros_like(out)
        impl.accumulate(ts, plain, 0.5)
        assert_bitwise(out, plain, "with a flag vs without")


@impl_param
@pytest.mark.parametrize(
    "src,dst,old,x,scale,flagged",
    [
        (F32, F32, 3e38, 3e38, 1.0, True),  # the sum overflows float32
        (BF16, F32, 3e38, 3e38, 1.0, True),
        (F32, F32, 3e38, -3e38, 1.0, False),
        (F32, BF16, 3e38, 0.5e38, 1.0, True),  # finite in float32, past bfloat16's largest finite value
        (F32, F16, 60000.0, 5520.0, 1.0, True),  # 65520, the halfway point past 65504, rounds to inf
        (F32, F16, 60000.0, 5519.0, 1.0, False),  # 65519 rounds down to 65504
        (F16, F16, 60000.0, 3000.0, 2.0, True),
        (F64, F64, 1e308, 1e308, 1.0, True),
        (F64, F32, 0.0, 1e39, 1.0, True),
        (F32, F32, INF, 1.0, 1.0, True),  # a non-finite value already in out is written back
        (F32, F32, NAN, 1.0, 1.0, True),
        (F32, F32, 1.0, INF, 0.0, True),  # inf * 0 is NaN: a scale of 0 hides nothing
        (F32, F32, 1.0, 3.0, 0.0, False),
    ],
)
def test_what_sets_the_flag(impl, src, dst, old, x, scale, flagged):
    for n, at in ((1, 0), (100, 99), (3 * CPU_STEP + 5, CPU_STEP)):
        t = torch.zeros(n, dtype=src)
        t[at] = x
        out = torch.zeros(n, dtype=dst)
        out[at] = old
        nf = flag(0)
        impl.accumulate([t], out, scale, nf[1:2])
        assert flag_value(nf) == int(flagged), f"{old} + {x} * {scale} ({src} -> {dst}) flagged {flag_value(nf)}"
        assert bool(torch.isfinite(out).all()) == (not flagged)  # the flag says whether what was written is finite


@impl_param
def test_flag_is_never_cleared_and_collects_calls(impl):
    nf = flag(0)
    good, bad = torch.ones(10), torch.ones(10)
    bad[3] = NAN
    out = torch.zeros(12)
    impl.accumulate([good], out, 1.0, nf[1:2])
    assert flag_value(nf) == 0
    impl.accumulate([bad], out, 1.0, nf[1:2])
    assert flag_value(nf) == 1
    impl.accumulate([good], torch.zeros(10), 1.0, nf[1:2])
    assert flag_value(nf) == 1
    finite = flag(5)  # finite values: the flag is left as it is (never written 0)
    impl.accumulate([good], torch.zeros(10), 1.0, finite[1:2])
    assert flag_value(finite) == 5
    buf = torch.zeros(6, dtype=torch.int32)  # a longer flag tensor: only its element 0 is written
    impl.accumulate([bad], torch.zeros(10), 1.0, buf[2:5])
    assert buf.tolist() == [0, 0, 1, 0, 0, 0]


# ---------------------------------------------------------------------------
# Bad input: the right exception, naming the culprit, and nothing written
# ---------------------------------------------------------------------------


def _bad_arguments():
    """{case: (call(accumulate), exception, substrings of its message, tensors that must keep their bits)}."""
    ts = _good_inputs()  # 3 + 4 + 5 + 6 = 18 elements
    out = torch.full((18,), 7.0)
    nf = torch.zeros(1, dtype=torch.int32)
    buf = torch.randn(40)
    half_buf = (torch.randn(40) * 4).to(F16)
    cases_ = {
        "out-too-short": (lambda a: a(ts, torch.full((17,), 7.0)), ValueError, ["18", "17", "at least"]),
        "input-dtype": (lambda a: a(ts[:2] + [torch.zeros(5, dtype=torch.int64)], out), TypeError, ["tensors[2]", "int64"]),
        "out-dtype": (lambda a: a(ts, torch.zeros(18, dtype=torch.int32)), TypeError, ["out", "int32"]),
        "out-dtype-empty-list": (lambda a: a([], torch.zeros(3, dtype=torch.bool)), TypeError, ["out", "bool"]),
        "input-device": (lambda a: a(ts[:3] + [torch.empty(6, device="meta")], out), RuntimeError, ["tensors[3]", "meta"]),
        "out-device": (lambda a: a(ts, torch.empty(18, device="meta")), RuntimeError, ["tensors[0]", "meta"]),
        "non-dense": (lambda a: a(ts[:1] + [torch.randn(10)[::2]], out), ValueError, ["tensors[1]", "not dense"]),
        "expanded": (lambda a: a(ts[:2] + [torch.randn(1).expand(5)], out), ValueError, ["tensors[2]", "not dense"]),
        "out-2d": (lambda a: a(ts, torch.full((2, 9), 7.0)), ValueError, ["out", "1-D contiguous"]),
        "out-strided": (lambda a: a(ts, torch.full((36,), 7.0)[::2]), ValueError, ["out", "1-D contiguous"]),
        "alias-wrong-slot": (lambda a: a(ts[:2] + [buf[12:17]], buf[10:28]), ValueError, ["tensors[2]", "overlaps out"]),
        "alias-in-tail": (lambda a: a(ts[:2] + [buf[22:27]], buf[0:30]), ValueError, ["tensors[2]", "overlaps out"]),
        "alias-other-dtype": (
            lambda a: a([half_buf[10:13], half_buf.view(BF16)[13:17]], half_buf[10:30]),
            ValueError,
            ["tensors[1]", "overlaps out"],
        ),
        "nonfinite-dtype": (lambda a: a(ts, out, nonfinite=torch.zeros(1, dtype=torch.int64)), TypeError, ["nonfinite", "int64"]),
        "nonfinite-empty": (lambda a: a(ts, out, nonfinite=torch.zeros(0, dtype=torch.int32)), ValueError, ["nonfinite"]),
        "nonfinite-device": (
            lambda a: a(ts, out, nonfinite=torch.zeros(1, dtype=torch.int32, device="meta")),
            RuntimeError,
            ["nonfinite", "meta"],
        ),
        "nonfinite-in-out": (lambda a: a(ts, out, nonfinite=out.view(torch.int32)[4:5]), ValueError, ["nonfinite overlaps out"]),
        "nonfinite-in-input": (
            lambda a: a(ts, out, nonfinite=ts[2].view(torch.int32)[1:2]),
            ValueError,
            ["nonfinite overlaps tensors[2]"],
        ),
    }
    watched = [out, nf, buf, half_buf] + ts
    return cases_, watched


@impl_param
@pytest.mark.parametrize("case", sorted(_bad_arguments()[0]))
def test_bad_arguments(impl, case):
    cases_, watched = _bad_arguments()
    call, exc, patterns = cases_[case]
    ts_nan = watched[4:]
    ts_nan[1][0] = NAN  # a value that would set a flag

    def run(tensors, out, scale=0.5, nonfinite=None):
        impl.accumulate(tensors, out, scale, nonfinite)

    _raises_and_writes_nothing(lambda: call(run), exc, patterns, *watched)


def _bad_calls():
    """{case: call(accumulate)} of _bad_arguments, for test_extension_and_reference_say_the_same."""
    return {k: v[0] for k, v in _bad_arguments()[0].items()}


@pytest.mark.parametrize("case", sorted(_bad_arguments()[0]))
def test_extension_and_reference_say_the_same(case):
    def ext(tensors, out, scale=0.5, nonfinite=None):
        torch.ops.fastcoll.flatten_accumulate(list(tensors), out, scale, nonfinite)

    def ref(tensors, out, scale=0.5, nonfinite=None):
        reference.flatten_accumulate(tensors, out, scale, nonfinite)

    assert_extension_and_reference_agree(case, _bad_calls, (ext,), (ref,), (f"{OP}: ",))


# ---------------------------------------------------------------------------
# The reference's fused multiply-add is correctly rounded
# ---------------------------------------------------------------------------


def _round_fraction(q: Fraction, bits: int, emin: int) -> float:
    """``q`` rounded to nearest even in a binary format of ``bits`` significand bits, smallest normal
    exponent ``emin`` (gradual underflow), largest exponent that of float32 or float64; as a float."""
    if q == 0:
        return 0.0
    sign = -1 if q < 0 else 1
    q = abs(q)
    e = q.numerator.bit_length() - q.denominator.bit_length()
    if Fraction(2) ** e > q:
        e -= 1
    e = max(e, emin)
    ulp = Fraction(2) ** (e - bits + 1)
    m = q / ulp
    k = m.numerator // m.denominator
    rest = m - k
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and k % 2 == 1):
        k += 1
    value = k * ulp
    emax = 127 if bits == 24 else 1023
    if value >= Fraction(2) ** (emax + 1):
        return sign * INF
    return sign * float(value)


def _fma_cases(opmath: torch.dtype, n: int, seed: int):
    rnd = random.Random(seed)
    dt = opmath
    xs, ss, olds = [], [], []
    for k in range(n):
        e1, e2 = rnd.randint(-30, 30), rnd.randint(-30, 30)
        x = rnd.uniform(-1, 1) * 2.0**e1
        s = rnd.uniform(-1, 1) * 2.0**e2
        old = -x * s * (1 + rnd.choice([0.0, 2.0 ** -rnd.randint(1, 60)])) if k % 3 == 0 else rnd.uniform(-1, 1) * 2.0**e1
        xs.append(x)
        ss.append(s)
        olds.append(old)
    cast = (lambda v: float(torch.tensor(v, dtype=dt))) if dt == F32 else float
    return [cast(v) for v in xs], [cast(v) for v in ss], [cast(v) for v in olds]


@pytest.mark.parametrize("opmath", [F32, F64], ids=str)
def test_reference_fma_is_correctly_rounded(opmath):
    """reference._fma against exact rational arithmetic: near-cancellations, midpoints, random values."""
    bits, emin = (24, -126) if opmath == F32 else (53, -1022)
    xs, ss, olds = _fma_cases(opmath, 400, seed=7)
    if opmath == F32:
        xs.append(HARD_X), ss.append(HARD_S), olds.append(HARD_OLD)
        xs.append(-HARD_X), ss.append(HARD_S), olds.append(-HARD_OLD)
    else:  # the same trap one level up: 1 + 2**-52 + 2**-53 - tiny, for float64
        xs.append(2.0**-53 * (1 + 2.0**-52)), ss.append(1 - 2.0**-53), olds.append(1 + 2.0**-52)
    for k, (x, s, old) in enumerate(zip(xs, ss, olds)):
        got = reference._fma(torch.tensor([x], dtype=opmath), s, torch.tensor([old], dtype=opmath), opmath).item()
        want = _round_fraction(Fraction(old) + Fraction(x) * Fraction(s), bits, emin)
        assert got == want, f"case {k}: fma({x!r}, {s!r}, {old!r}) = {got!r}, correctly rounded {want!r}"


# ---------------------------------------------------------------------------
# The direct eager path: same bits as the boxed call, what it defers
# ---------------------------------------------------------------------------


@pytest.mark.skipif(not extension_active(), reason="the direct entry point is part of the compiled extension")
@settings(max_examples=examples(25), **HYP)
@given(case=cases(), tail=TAILS, with_flag=st.booleans())
def test_direct_path_writes_the_boxed_bits(case, tail, with_flag):
    results = []
    for path in ("direct", "boxed"):
        gen = torch.Generator().manual_seed(case["seed"])
        made = [make_tensor(s, "cpu", gen) for s in case["specs"]]
        n = sum(s.numel for s in case["specs"])
        out = make_out(n, tail, case["out_dtype"], "cpu", case["out_offset"], case["out_pad"], gen)
        nf = torch.zeros(1, dtype=torch.int32) if with_flag else None
        if path == "direct":
            before = ops.eager_stats()["direct"]
            ops.flatten_accumulate([m.tensor for m in made], out.tensor, case["scale"], nonfinite=nf)
            assert ops.eager_stats()["direct"] == before + 1
        else:
            torch.ops.fastcoll.flatten_accumulate([m.tensor for m in made], out.tensor, float(case["scale"]), nf)
        results.append((out.buf, nf))
    (d_buf, d_nf), (b_buf, b_nf) = results
    assert_bitwise(d_buf, b_buf, "out's buffer")
    if with_flag:
        assert d_nf.item() == b_nf.item()


@pytest.mark.skipif(not extension_active(), reason="the direct entry point is part of the compiled extension")
def test_requires_grad_and_subclasses_are_left_to_torch_ops():
    class Sub(torch.Tensor):
        pass

    for ts in ([torch.randn(3, requires_grad=True)], [torch.randn(3).as_subclass(Sub)]):
        out = torch.ones(4)
        before = ops.eager_stats()
        ops.flatten_accumulate(ts, out, 2.0)
        after = ops.eager_stats()
        assert (after["direct"] - before["direct"], after["deferred"] - before["deferred"]) == (0, 1)
        torch.testing.assert_close(out[:3], 1 + 2 * ts[0].detach().as_subclass(torch.Tensor), rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------
# opcheck and torch.compile (the fake kernel)
# ---------------------------------------------------------------------------


def test_opcheck():
    cl = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    samples = [
        ([torch.randn(3, 4, dtype=BF16), cl, torch.randn(7, dtype=F16), torch.randn(0)], F32, 0.5, None),
        ([torch.randn(33, dtype=BF16)], F32, 1.0, torch.zeros(1, dtype=torch.int32)),
        ([torch.randn(2, 2, dtype=F64), torch.randn(5)], BF16, 0.25, torch.zeros(3, dtype=torch.int32)),
        ([], F32, 1.0, None),
    ]
    for tensors, dtype, scale, nf in samples:
        out = torch.randn(sum(t.numel() for t in tensors) + 3).to(dtype)
        torch.library.opcheck(torch.ops.fastcoll.flatten_accumulate.default, (tensors, out, scale, nf))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile(backend):
    """Two micro-batches accumulated into fp32 main gradients, one graph (fullgraph) through the fake kernel."""

    def step(grads, more, main, found_inf, num_micro: int):
        ops.flatten_accumulate(grads, main, 1.0 / num_micro, nonfinite=found_inf)
        ops.flatten_accumulate(more, main, 1.0 / num_micro, nonfinite=found_inf)
        return main.sum() + found_inf

    grads = [g.to(BF16) for g in compile_grads()]
    more = [g * 2 for g in grads]
    more[1][3] = INF
    n = sum(g.numel() for g in grads)

    def run(fn):
        main = torch.zeros(n + 4)
        found_inf = torch.zeros(1, dtype=torch.int32)
        total = fn(grads, more, main, found_inf, 2)
        return main, found_inf, total

    (m0, f0, t0), (m1, f1, t1) = eager_and_compiled(step, backend, run)
    assert_bitwise(m0, m1, "main gradients, eager vs compiled")
    assert f0.item() == f1.item() == 1 and torch.equal(t0, t1)


def test_fake_kernel_checks_devices_and_the_flag():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = torch.empty(10)
        ops.flatten_accumulate([torch.empty(4, dtype=BF16)], out, 0.5, nonfinite=torch.zeros(1, dtype=torch.int32))
        with pytest.raises(TypeError, match="nonfinite"):
            ops.flatten_accumulate([torch.empty(4)], out, nonfinite=torch.zeros(1))


# ---------------------------------------------------------------------------
# CUDA: the same properties on the GPU, one launch, graph capture
# ---------------------------------------------------------------------------


@CUDA
@impl_param
@settings(max_examples=examples(20), **HYP)
@given(case=cases(), tail=TAILS)
def test_cuda_accumulate_matches_float64(impl, case, tail):
    check_accumulate(impl, tail=tail, device="cuda", **case)


@CUDA
@impl_param
@pair_param
def test_cuda_all_dtype_pairs(impl, pair):
    src, dst = pair
    for scale, tail in ((1.0, 0), (1 / 3, 7)):
        check_accumulate(impl, _fixed_specs(src), dst, scale, 1, 2, seed=11, tail=tail, device="cuda")


@CUDA
@impl_param
def test_cuda_matches_the_cpu_kernel(impl):
    """Both devices compute one FMA per element: the same bits (float math pairs)."""
    gen = torch.Generator().manual_seed(12)
    ts = [torch.randn(n, generator=gen).to(d) for n, d in [(5, BF16), (70001, BF16), (3, F32), (40000, F16)]]
    start = torch.randn(sum(t.numel() for t in ts) + 9, generator=gen)
    cpu = start.clone()
    impl.accumulate(ts, cpu, 1 / 3)
    gpu = start.cuda()
    impl.accumulate([t.cuda() for t in ts], gpu, 1 / 3)
    assert_bitwise(gpu.cpu(), cpu, "cuda vs cpu")


@CUDA
@impl_param
@pytest.mark.parametrize("pair", NONFINITE_PAIRS, ids=lambda p: f"{str(p[0])[6:]}-{str(p[1])[6:]}")
def test_cuda_nonfinite_is_flagged(impl, pair):
    src, dst = pair
    chunk = 65536 // max(torch.empty((), dtype=src).element_size(), torch.empty((), dtype=dst).element_size())
    n = 2 * chunk + 37
    for where in (0, chunk - 1, chunk, n - 1):
        t = torch.randn(n).to(src)
        t[where] = NAN
        out = torch.zeros(n + 3, dtype=dst, device="cuda")
        nf = flag(0, "cuda")
        impl.accumulate([t.cuda()], out, 0.5, nf[1:2])
        assert flag_value(nf) == 1, f"NaN at {where} ({src} -> {dst}) not flagged"
    nf = flag(0, "cuda")
    impl.accumulate([torch.randn(n).to(src).cuda()], torch.zeros(n, dtype=dst, device="cuda"), 0.5, nf[1:2])
    assert flag_value(nf) == 0


@CUDA
def test_cuda_one_launch_and_graph_capture():
    if not fastcoll.build_info()["cuda_kernels"]:
        pytest.skip("the CUDA kernels are not built (the reference launches several kernels per tensor)")
    from test_ops import _cuda_kernels

    specs = [Spec((1 + (k * 37) % 700,), (0,), BF16, 0, 0) for k in range(299)] + [Spec((1 << 20,), (0,), BF16, 0, 0)]
    gen = torch.Generator().manual_seed(0)
    grads: List[torch.Tensor] = [make_tensor(s, "cuda", gen).tensor for s in specs]
    main = torch.zeros(sum(s.numel for s in specs) + 8, device="cuda")
    nf = torch.zeros(1, dtype=torch.int32, device="cuda")
    for call in (lambda: ops.flatten_accumulate(grads, main, 0.5), lambda: ops.flatten_accumulate(grads, main, nonfinite=nf)):
        kernels = _cuda_kernels(call)
        assert len(kernels) == 1 and "fastcoll" in kernels[0], kernels

    small = [torch.randn(5, device="cuda", dtype=BF16), torch.randn(70000, device="cuda", dtype=BF16)]
    acc = torch.zeros(70010, device="cuda")
    many = [torch.randn(3, device="cuda") for _ in range(600)]  # 600 chunks: refused under capture
    many_out = torch.full((1800,), 7.0, device="cuda")

    def record():
        ops.flatten_accumulate(small, acc, 0.5, nonfinite=nf)
        with pytest.raises(RuntimeError, match="CUDA graph capture"):
            ops.flatten_accumulate(many, many_out, 0.5)

    graph = capture_graph(record)
    assert torch.equal(many_out, torch.full((1800,), 7.0, device="cuda")), "a refused call may write nothing"
    want = torch.zeros(70005, dtype=F64, device="cuda")
    for _ in range(3):  # each replay adds the inputs' current values
        for t in small:
            t.copy_(torch.randn_like(t))
        want += torch.cat([t.to(F64) for t in small]) * 0.5
        graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(acc[:70005].to(F64), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(acc[70005:], torch.zeros(5, device="cuda")) and nf.item() == 0


@CUDA
@impl_param
def test_cuda_input_on_cpu(impl):
    ts = _good_inputs(device="cuda")
    ts[2] = ts[2].cpu()
    out = torch.full((18,), 7.0, device="cuda")
    _raises_and_writes_nothing(lambda: impl.accumulate(ts, out, 0.5), RuntimeError, ["tensors[2]", "cpu", "cuda"], out, *ts)
