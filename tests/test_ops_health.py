"""Tests of the gradient-health ops: flatten_scale_ex, unflatten_scale_ex, sum_of_squares.

Same approach as tests/test_ops.py, whose helpers this file imports: every
test tensor is carved out of a storage buffer the test owns, destinations are
poisoned (NaN, or a sentinel for the flag and the sum) with guard regions
around them, and results are compared with a float64 oracle computed here:
values with the tolerance of one multiply and one cast, sums of squares with
``math.fsum`` (correctly rounded) at a relative error of 1e-6, flags exactly.
The ``_ex`` ops must also write the same bits as flatten_scale /
unflatten_scale (and, with the extension, as the reference, but for the sums,
whose fixed order is each implementation's own).

Implementations under test: ``torch.ops.fastcoll.*`` (the compiled kernels, or
the reference under ``FASTCOLL_NO_EXT=1``, through the dispatcher's boxed
call), the public ``fastcoll.ops`` wrappers (the same kernels through their
direct eager entry points, csrc/eager.cpp) with the CPU kernels' non-temporal
stores forced on, and fastcoll.ops.reference called directly.

Chunk sizes the non-finite placements aim at: the CPU kernels sum in pieces of
CPU_PIECE elements of the flat range and their vector loops take 32 elements
a step (with a scalar head up to a 32-byte boundary when streaming); a CUDA
chunk is 64 KiB of the wider dtype (cuda_chunk_elements).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import pytest
import torch
from hypothesis import given, settings
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
    _cpu_streaming,
    _fixed_specs,
    _good_inputs,
    _opcheck_samples,
    _raises_and_writes_nothing,
    assert_bitwise,
    assert_dest_guards_kept,
    assert_extension_and_reference_agree,
    assert_inputs_and_guards_kept,
    assert_same_dests,
    assert_scaled,
    assert_slots_match,
    capture_graph,
    cases,
    compile_grads,
    eager_and_compiled,
    examples,
    extension_active,
    flatten_case,
    make_flat,
    make_tensor,
    opmath,
    unflatten_case,
)

import fastcoll
from fastcoll import ops
from fastcoll.bench.runner import num_threads
from fastcoll.ops import loader, reference

INF, NAN = float("inf"), float("nan")
CPU_PIECE = 16384  # csrc/cpu/health_cpu.cpp kPieceElements
CPU_STEP = 32  # csrc/cpu/copy_scale.h kObsStep
SUM_RTOL = 1e-6
PAIR_IDS = [f"{str(a)[6:]}-{str(b)[6:]}" for a, b in DTYPE_PAIRS]
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")  # as in test_ops.py (tests/conftest.py)


def cuda_chunk_elements(src: torch.dtype, dst: torch.dtype) -> int:
    """Elements of a CUDA chunk (csrc/cuda/copy_chunk.cuh chunk_elements): 64 KiB of the wider dtype."""
    return 65536 // max(torch.empty((), dtype=src).element_size(), torch.empty((), dtype=dst).element_size())


# ---------------------------------------------------------------------------
# The implementations under test
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class HImpl:
    """Like test_ops.Impl, each call records its op's public name in test_ops' _LAST_OP (for _raises_and_writes_nothing)."""

    name: str

    def _ctx(self):
        return _cpu_streaming(self.name == "ops_streaming") if self.name != "reference" else contextlib.nullcontext()

    def flatten_ex(self, tensors, out, scale=1.0, scale_by=None, nonfinite=None):
        _LAST_OP["name"] = "fastcoll.flatten_scale_ex"
        if self.name == "reference":
            reference.flatten_scale_ex(tensors, out, scale, scale_by, nonfinite)
        else:
            with self._ctx():
                if self.name == "ops_streaming" and (scale_by is not None or nonfinite is not None):
                    # the public wrapper (direct path); without either option it calls the plain op
                    ops.flatten_scale(tensors, out, scale, scale_by=scale_by, nonfinite=nonfinite)
                else:
                    torch.ops.fastcoll.flatten_scale_ex(list(tensors), out, float(scale), scale_by, nonfinite)

    def unflatten_ex(self, flat, tensors, scale=1.0, sumsq=None):
        _LAST_OP["name"] = "fastcoll.unflatten_scale_ex"
        if self.name == "reference":
            reference.unflatten_scale_ex(flat, tensors, scale, sumsq)
        else:
            with self._ctx():
                if self.name == "ops_streaming":
                    ops.unflatten_scale(flat, tensors, scale, sumsq=sumsq)
                else:
                    torch.ops.fastcoll.unflatten_scale_ex(flat, list(tensors), float(scale), sumsq)

    def sum_of_squares(self, tensors, out):
        _LAST_OP["name"] = "fastcoll.sum_of_squares"
        if self.name == "reference":
            reference.sum_of_squares(tensors, out)
        elif self.name == "ops_streaming":
            ops.sum_of_squares(tensors, out)
        else:
            torch.ops.fastcoll.sum_of_squares(list(tensors), out)

    # The plain ops of the same implementation, whose bits the _ex ops must write.
    def flatten(self, tensors, out, scale=1.0):
        if self.name == "reference":
            reference.flatten_scale(tensors, out, scale)
        else:
            with self._ctx():
                torch.ops.fastcoll.flatten_scale(list(tensors), out, float(scale))

    def unflatten(self, flat, tensors, scale=1.0):
        if self.name == "reference":
            reference.unflatten_scale(flat, tensors, scale)
        else:
            with self._ctx():
                torch.ops.fastcoll.unflatten_scale(flat, list(tensors), float(scale))


IMPLS = [HImpl("ops"), HImpl("ops_streaming"), HImpl("reference")]
impl_param = pytest.mark.parametrize("impl", IMPLS, ids=[i.name for i in IMPLS])
pair_param = pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=PAIR_IDS)


# ---------------------------------------------------------------------------
# Oracles and small tensors with guards
# ---------------------------------------------------------------------------


def fsum_squares(tensors: Sequence[torch.Tensor]) -> float:
    """Correctly rounded float64 sum of x*x over every element (x: the stored value as float64).

    The squares of float32/16-bit values are exact in float64; math.fsum adds them without error.
    """
    parts = [(t.detach().cpu().to(F64).reshape(-1) ** 2).numpy() for t in tensors if t.numel()]
    return math.fsum(itertools.chain.from_iterable(parts))


def assert_sum_close(got: float, exact: float, what: str, rtol: float = SUM_RTOL) -> None:
    if math.isnan(exact) or math.isinf(exact):
        assert (math.isnan(got) and math.isnan(exact)) or got == exact, f"{what}: got {got!r}, exact {exact!r}"
        return
    err = abs(got - exact)
    assert err <= rtol * abs(exact), f"{what}: got {got!r}, exact {exact!r}, relative error {err / max(abs(exact), 1e-300):.3g}"


class Guarded:
    """One element (a flag or a sum) in the middle of a 3-element buffer whose ends must stay as they are."""

    def __init__(self, dtype, value, device="cpu"):
        self.buf = torch.tensor([value, value, value], dtype=dtype, device=device)
        self.buf[0] = self.buf[2] = -7
        self.t = self.buf[1:2]

    def value(self):
        assert self.buf[0].item() == -7 and self.buf[2].item() == -7, "wrote outside the one element"
        return self.buf[1].item()


def flag(initial=0, device="cpu") -> Guarded:
    return Guarded(torch.int32, initial, device)


def sum_out(device="cpu") -> Guarded:
    return Guarded(F64, NAN, device)


def scale_by_tensor(kind: Optional[str], value: float, device="cpu") -> Optional[torch.Tensor]:
    if kind is None:
        return None
    return torch.tensor([value], dtype={"f32": F32, "f64": F64}[kind], device=device)


SCALE_BY = st.sampled_from([None, ("f32", 0.5), ("f32", 1.0), ("f64", 2.0), ("f64", 0.25)])


# ---------------------------------------------------------------------------
# The property checks
# ---------------------------------------------------------------------------


def check_flatten_ex(impl: HImpl, specs, out_dtype, scale, out_offset, out_pad, seed, scale_by=None, device="cpu"):
    """flatten_scale_ex with a flag (and maybe scale_by) on finite inputs: values, bits, guards, flag untouched."""
    made, before, out, guards = flatten_case(specs, out_dtype, out_offset, out_pad, seed, device)
    n = out.numel
    sb_kind, sb_value = scale_by if scale_by is not None else (None, 1.0)
    sb = scale_by_tensor(sb_kind, sb_value, device)
    nf = flag(5, device)  # finite inputs: the op must leave it alone (it never writes 0 either)
    impl.flatten_ex([m.tensor for m in made], out.tensor, scale, sb, nf.t)

    assert nf.value() == 5, "nonfinite changed although every value is finite"
    assert_inputs_and_guards_kept(made, before, out, guards)
    factor = scale * sb_value  # exact: the scale_by values are powers of two
    pos = 0
    for i, (s, m) in enumerate(zip(specs, made)):
        op = F64 if sb_kind == "f64" else opmath(s.dtype, out_dtype)
        assert_scaled(out.tensor[pos : pos + s.numel], m.mem, factor, op, f"out slot of tensors[{i}] {s}")
        pos += s.numel

    # The same bits as flatten_scale by the same factor (the factor is exact in any math)
    # unless a float64 scale_by moved the multiply to float64.
    if sb_kind != "f64":
        plain = make_flat(n, out_dtype, device, out_offset, out_pad)
        impl.flatten([m.tensor for m in made], plain.tensor, factor)
        assert_bitwise(out.tensor, plain.tensor, "flatten_scale_ex != flatten_scale")
    if impl.name == "ops" and extension_active():
        ref = make_flat(n, out_dtype, device, out_offset, out_pad)
        reference.flatten_scale_ex([m.tensor for m in made], ref.tensor, scale, sb, None)
        # float64 -> 16 bits rounds twice in both, not always alike
        assert_slots_match(
            out.tensor, ref.tensor, specs, skip=lambda s: (s.dtype == F64 or sb_kind == "f64") and out_dtype in (F16, BF16)
        )


def check_unflatten_ex(impl: HImpl, specs, out_dtype, scale, out_offset, out_pad, seed, device="cpu"):
    """unflatten_scale_ex with sumsq: values, bits of unflatten_scale, guards, the sum against fsum."""
    gen, flat, flat_before, dests, dest_before = unflatten_case(specs, out_dtype, out_offset, out_pad, seed, device)
    ss = sum_out(device)
    impl.unflatten_ex(flat.tensor, [d.tensor for d in dests], scale, ss.t)

    assert_bitwise(flat.buf, flat_before, "flat (or its buffer) changed")
    pos = 0
    for i, (s, d, b) in enumerate(zip(specs, dests, dest_before)):
        assert_scaled(d.mem, flat.tensor[pos : pos + s.numel], scale, opmath(s.dtype, out_dtype), f"destination tensors[{i}] {s}")
        assert_dest_guards_kept(d, b, i)
        pos += s.numel
    assert_sum_close(ss.value(), fsum_squares([d.mem for d in dests]), "sumsq")

    plain = [make_tensor(s, device, gen, fill=NAN) for s in specs]
    impl.unflatten(flat.tensor, [p.tensor for p in plain], scale)
    for i, (d, p) in enumerate(zip(dests, plain)):
        assert_bitwise(d.mem, p.mem, f"unflatten_scale_ex != unflatten_scale for tensors[{i}]")


def check_sum_of_squares(impl: HImpl, specs, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    made = [make_tensor(s, device, gen) for s in specs]
    before = [m.buf.clone() for m in made]
    out = sum_out(device)
    impl.sum_of_squares([m.tensor for m in made], out.t)
    for i, (m, b) in enumerate(zip(made, before)):
        assert_bitwise(m.buf, b, f"tensors[{i}] changed")
    assert_sum_close(out.value(), fsum_squares([m.mem for m in made]), "sum_of_squares")


# ---------------------------------------------------------------------------
# Property tests
# ---------------------------------------------------------------------------


@impl_param
@settings(max_examples=examples(30), **HYP)
@given(case=cases(), scale_by=SCALE_BY)
def test_flatten_ex_matches_float64(impl, case, scale_by):
    check_flatten_ex(impl, scale_by=scale_by, **case)


@impl_param
@settings(max_examples=examples(30), **HYP)
@given(case=cases())
def test_unflatten_ex_matches_float64(impl, case):
    check_unflatten_ex(impl, **case)


@impl_param
@settings(max_examples=examples(30), **HYP)
@given(case=cases())
def test_sum_of_squares_matches_float64(impl, case):
    check_sum_of_squares(impl, case["specs"], case["seed"])


@impl_param
@pair_param
def test_all_dtype_pairs(impl, pair):
    src, dst = pair
    for scale, scale_by in ((1.0, None), (1 / 3, ("f32", 0.5)), (0.75, ("f64", 2.0))):
        check_flatten_ex(impl, _fixed_specs(src), dst, scale, 1, 2, seed=11, scale_by=scale_by)
    for scale in (1.0, 1 / 3):
        check_unflatten_ex(impl, _fixed_specs(dst), src, scale, 3, 0, seed=12)
    check_sum_of_squares(impl, _fixed_specs(src), seed=13)


@impl_param
def test_one_huge_among_many_tiny(impl):
    specs = [Spec((k % 9,), (0,), F32, k % 4, 0) for k in range(150)]
    specs.append(Spec((HUGE_NUMEL,), (0,), F32, 1, 1))
    specs += [Spec((1 + k % 5, 3), (0, 1), BF16 if k % 2 else F32, k % 2, 0) for k in range(149)]
    check_flatten_ex(impl, specs, BF16, 1 / 8, 1, 1, seed=5, scale_by=("f32", 0.5))
    check_unflatten_ex(impl, specs, BF16, 1 / 8, 3, 1, seed=6)
    check_sum_of_squares(impl, specs, seed=7)


@impl_param
def test_scale_by_in_float32_and_float64_math(impl):
    """The factor is scale * scale_by[0], multiplied in float32 unless a side or scale_by is float64."""
    gen = torch.Generator().manual_seed(3)
    x32 = torch.randn(1000, generator=gen)
    x64 = torch.randn(1000, generator=gen, dtype=F64)
    scale, sbv = 1 / 3, 0.3
    cases_ = [
        (x32, F32, F32, lambda x: x * (torch.tensor(scale, dtype=F32) * torch.tensor(sbv, dtype=F32))),
        (x32, F32, F64, lambda x: (x.to(F64) * (scale * sbv)).to(F32)),
        (x64, F32, F32, lambda x: (x * (scale * float(torch.tensor(sbv, dtype=F32)))).to(F32)),
        (
            x32.to(F16),
            BF16,
            F32,
            lambda x: (x.float() * (torch.tensor(scale, dtype=F32) * torch.tensor(sbv, dtype=F32))).to(BF16),
        ),
    ]
    for x, out_dtype, sb_dtype, expect in cases_:
        out = torch.full((1000,), NAN, dtype=out_dtype)
        impl.flatten_ex([x], out, scale, torch.tensor([sbv], dtype=sb_dtype))
        assert_bitwise(out, expect(x), f"{x.dtype} -> {out_dtype} by a {sb_dtype} scale_by")


@impl_param
def test_scale_by_is_read_at_each_call(impl):
    x = torch.randn(100)
    out = torch.empty(100)
    sb = torch.tensor(2.0)  # 0-d: any 1-element tensor will do
    impl.flatten_ex([x], out, 0.5, sb)
    assert torch.equal(out, x)
    sb.fill_(4.0)
    impl.flatten_ex([x], out, 0.5, sb)
    assert torch.equal(out, x * 2)
    impl.flatten_ex([x], out, 0.5, torch.tensor([[8.0]], dtype=F64))
    assert torch.equal(out, x * 4)


@impl_param
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_in_place_on_bucket_views(impl, dtype):
    """Tensors that are their own slot of the flat buffer: the flag and the sum see the values before/after correctly."""
    flat = (torch.randn(1 + 64 * 9 + 10 + 7 + CPU_PIECE + 1) * 4).to(dtype)[1:]
    like = [
        torch.empty(64, 1, 3, 3).contiguous(memory_format=torch.channels_last),
        torch.empty(10, 1),
        torch.empty(7),
        torch.empty(CPU_PIECE + 1),
    ]
    views = ops.bucket_views(flat, like)
    original = flat.clone()
    nf = flag(0)
    impl.flatten_ex(views, flat, 0.25, None, nf.t)
    assert nf.value() == 0
    assert_scaled(flat, original, 0.25, opmath(dtype, dtype), "in-place flatten_scale_ex")
    scaled = flat.clone()
    ss = sum_out()
    impl.unflatten_ex(flat, views, 4.0, ss.t)
    assert_scaled(flat, scaled, 4.0, opmath(dtype, dtype), "in-place unflatten_scale_ex")
    assert_sum_close(ss.value(), fsum_squares([flat]), "in-place sumsq")
    views[2].view(-1)[3] = INF
    impl.flatten_ex(views, flat, 1.0, None, nf.t)
    assert nf.value() == 1


@impl_param
def test_all_zero_size_tensors(impl):
    out = torch.empty(0)
    nf = flag(0)
    impl.flatten_ex([torch.empty(0), torch.empty(3, 0)], out, 0.5, torch.tensor([2.0]), nf.t)
    assert nf.value() == 0
    ss = sum_out()
    impl.unflatten_ex(out, [torch.empty(0, dtype=F16), torch.empty(0, 2)], 0.5, ss.t)
    assert ss.value() == 0.0
    ss = sum_out()
    impl.sum_of_squares([torch.empty(0, dtype=BF16)], ss.t)
    assert ss.value() == 0.0


# ---------------------------------------------------------------------------
# Non-finite values: placement, overflow on the cast, scale 0
# ---------------------------------------------------------------------------


def _placements(chunk: int) -> List[int]:
    """Positions inside a middle tensor of 2 * chunk + 37 elements: first, last and neighbours of chunk
    and vector-step boundaries (the tensor starts at flat offset 100, so its chunks are offset too)."""
    n = 2 * chunk + 37
    return sorted({0, 1, CPU_STEP - 1, CPU_STEP, chunk - 1, chunk, chunk + 1, 2 * chunk - 1, 2 * chunk, n - 1})


NONFINITE_PAIRS = [(F32, F32), (F32, BF16), (BF16, F32), (F16, F16), (F64, F32), (F32, F64)]


def _check_one_nonfinite(impl, src, dst, value, where, n_mid, device):
    gen = torch.Generator().manual_seed(where)
    first = torch.randn(100, generator=gen).to(src)
    mid = torch.randn(n_mid, generator=gen).to(src)
    only = torch.randn(1, generator=gen).to(src)  # a one-element tensor: a chunk of its own
    last = torch.randn(50, generator=gen).to(src)
    if where >= 0:
        mid[where] = value
    else:
        only[0] = value
    ts = [t.to(device) for t in (first, mid, only, last)]
    out = torch.full((151 + n_mid,), 7.0, dtype=dst, device=device)
    nf = flag(0, device)
    impl.flatten_ex(ts, out, 0.5, None, nf.t)
    assert nf.value() == 1, f"{value} at {where} of {n_mid} ({src} -> {dst}) not flagged"
    pos = 100 + where if where >= 0 else 100 + n_mid
    got = out[pos].item()
    assert (math.isnan(got) and math.isnan(value)) or got == value * 0.5, f"wrote {got} for {value}"
    # the other values are written as by flatten_scale
    plain = torch.full_like(out, 7.0)
    impl.flatten(ts, plain, 0.5)
    assert_bitwise(out, plain, "flatten_scale_ex != flatten_scale with a non-finite value")


@impl_param
@pytest.mark.parametrize("pair", NONFINITE_PAIRS, ids=lambda p: f"{str(p[0])[6:]}-{str(p[1])[6:]}")
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
def test_nonfinite_anywhere_is_flagged(impl, pair, value):
    src, dst = pair
    chunk = CPU_PIECE
    for where in _placements(chunk) + [-1]:
        _check_one_nonfinite(impl, src, dst, value, where, 2 * chunk + 37, "cpu")


@impl_param
@pytest.mark.parametrize(
    "src,dst,x,scale,flagged",
    [
        (F32, F16, 70000.0, 1.0, True),  # overflows float16 on the cast
        (F32, F16, 40000.0, 2.0, True),  # the product overflows
        (F32, F16, 65519.0, 1.0, False),  # rounds down to 65504
        (F32, F16, 65520.0, 1.0, True),  # the halfway point rounds to inf
        (F32, BF16, 3.3e38, 1.0, False),
        (F32, BF16, 3.4e38, 1.0, True),  # past bfloat16's largest finite value after rounding
        (F64, F32, 1e39, 1.0, True),
        (F64, F16, 1e5, 1.0, True),
        (F32, F32, 3e38, 2.0, True),  # float32 overflow of the product
        (F16, F16, 60000.0, 2.0, True),
    ],
)
def test_overflow_on_the_cast_is_flagged(impl, src, dst, x, scale, flagged):
    for n, at in ((1, 0), (100, 99), (3 * CPU_STEP + 5, CPU_STEP)):
        t = torch.zeros(n, dtype=src)
        t[at] = x
        out = torch.full((n,), NAN, dtype=dst)
        nf = flag(0)
        impl.flatten_ex([t], out, scale, None, nf.t)
        assert nf.value() == int(flagged), f"{x} * {scale} ({src} -> {dst}) flagged {nf.value()}"
        assert math.isinf(out[at].item()) == flagged
        # the flag says exactly whether the written value is finite
        assert bool(torch.isfinite(out).all()) == (not flagged)


@pytest.mark.parametrize("impl", IMPLS[:1] + IMPLS[2:], ids=["ops", "reference"])
def test_bfloat16_overflow_boundary(impl):
    """bfloat16 rounds to nearest even: float32 0x7F7F7FFF stays finite, 0x7F7F8000 becomes inf."""
    t = torch.tensor([0x7F7F7FFF, 0x7F7F8000], dtype=torch.int32).view(F32)
    for k, flagged in ((0, False), (1, True)):
        out = torch.empty(1, dtype=BF16)
        nf = flag(0)
        impl.flatten_ex([t[k : k + 1]], out, 1.0, None, nf.t)
        assert nf.value() == int(flagged) and math.isinf(out.item()) == flagged


@impl_param
def test_scale_zero_does_not_hide_nonfinite(impl):
    for value in (NAN, INF, -INF):
        t = torch.ones(40)
        t[17] = value
        out = torch.empty(40)
        nf = flag(0)
        impl.flatten_ex([t], out, 0.0, None, nf.t)  # inf * 0 and nan * 0 are NaN: written and flagged
        assert nf.value() == 1 and math.isnan(out[17].item())
    out = torch.empty(40)
    nf = flag(0)
    impl.flatten_ex([torch.ones(40)], out, 1.0, torch.tensor([INF]), nf.t)  # a non-finite scale_by
    assert nf.value() == 1


@impl_param
def test_flag_is_never_cleared_and_collects_calls(impl):
    nf = flag(0)
    good, bad = torch.ones(10), torch.ones(10)
    bad[3] = NAN
    out = torch.empty(10)
    impl.flatten_ex([good], out, 1.0, None, nf.t)
    assert nf.value() == 0
    impl.flatten_ex([bad], out, 1.0, None, nf.t)
    impl.flatten_ex([good], out, 1.0, None, nf.t)
    assert nf.value() == 1
    buf = torch.zeros(6, dtype=torch.int32)  # a longer flag tensor: only its element 0 is written
    impl.flatten_ex([bad], out, 1.0, None, buf[2:5])
    assert buf.tolist() == [0, 0, 1, 0, 0, 0]


@impl_param
def test_sums_with_nonfinite_values(impl):
    for value, expect in ((INF, INF), (-INF, INF), (NAN, NAN)):
        flat = torch.ones(CPU_PIECE + 10)
        flat[CPU_PIECE + 3] = value
        dests = [torch.empty(5), torch.empty(CPU_PIECE + 5)]
        ss = sum_out()
        impl.unflatten_ex(flat, dests, 1.0, ss.t)
        got = ss.value()
        assert (math.isnan(got) and math.isnan(expect)) or got == expect
        out = sum_out()
        impl.sum_of_squares(dests, out.t)
        got = out.value()
        assert (math.isnan(got) and math.isnan(expect)) or got == expect


# ---------------------------------------------------------------------------
# Sums: determinism and accuracy
# ---------------------------------------------------------------------------


def _sum_case(gen, dtype=F32):
    sizes = [3, CPU_PIECE - 1, 1, 5 * CPU_PIECE + 17, 100, 1_000_003, 7, 3 * CPU_PIECE]
    tensors = [(torch.randn(n, generator=gen) * (1 + k)).to(dtype) for k, n in enumerate(sizes)]
    flat = torch.cat([t.reshape(-1) for t in tensors]).to(BF16 if dtype == F32 else F32)
    return tensors, flat


@impl_param
@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=str)
def test_sums_are_bitwise_identical_for_any_thread_count(impl, dtype):
    gen = torch.Generator().manual_seed(21)
    tensors, flat = _sum_case(gen, dtype)
    got = []
    for threads in (1, 2, 4, 1):
        with num_threads(threads):
            dests = [torch.empty_like(t) for t in tensors]
            ss = sum_out()
            impl.unflatten_ex(flat, dests, 0.5, ss.t)
            out = sum_out()
            impl.sum_of_squares(tensors, out.t)
            got.append((ss.value(), out.value()))
    assert len({(a.hex(), b.hex()) for a, b in got}) == 1, f"sums differ between thread counts or runs: {got}"
    assert_sum_close(got[0][0], fsum_squares(dests), "sumsq")
    assert_sum_close(got[0][1], fsum_squares(tensors), "sum_of_squares")


def test_cpu_sums_do_not_depend_on_alignment():
    """The CPU kernels' order depends on sizes and values only: the same values at other addresses, same bits."""
    if not extension_active():
        pytest.skip("a property of the compiled CPU kernels")
    gen = torch.Generator().manual_seed(4)
    vals = [torch.randn(n, generator=gen) for n in (CPU_PIECE + 77, 5, 3 * CPU_PIECE + 1)]
    results = set()
    for offset in (0, 1, 3, 8):
        with _cpu_streaming(offset % 2 == 1):
            buf = torch.empty(sum(v.numel() for v in vals) + offset + 8)
            ts, pos = [], offset
            for v in vals:
                ts.append(buf[pos : pos + v.numel()])
                ts[-1].copy_(v)
                pos += v.numel() + 2
            out = sum_out()
            ops.sum_of_squares(ts, out.t)
            flat = torch.cat(vals)
            dests = [torch.empty(v.numel() + offset)[offset:] for v in vals]
            ss = sum_out()
            ops.unflatten_scale(flat, dests, 1.0, sumsq=ss.t)
            results.add((out.value().hex(), ss.value().hex()))
    assert len(results) == 1, results


@impl_param
def test_sum_accuracy_on_ten_million_elements(impl):
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(10_000_000, generator=gen) * torch.rand(10_000_000, generator=gen).pow(8) * 1e3
    exact = fsum_squares([x])
    out = sum_out()
    impl.sum_of_squares([x[:3], x[3:]], out.t)
    assert_sum_close(out.value(), exact, "sum_of_squares of 1e7 float32")
    ss = sum_out()
    impl.unflatten_ex(x, [torch.empty(5_000_000), torch.empty(5_000_000)], 1.0, ss.t)
    assert_sum_close(ss.value(), exact, "sumsq of 1e7 float32")


@pytest.mark.parametrize("dtype", [F32, BF16, F16, F64], ids=str)
def test_extension_sums_are_accurate_to_float64(dtype):
    """Squares added in float64: far better than the 1e-6 target (about n * 2**-53 at worst)."""
    if not extension_active():
        pytest.skip("the compiled kernels' accuracy")
    gen = torch.Generator().manual_seed(9)
    x = (torch.randn(300_001, generator=gen) * 3).to(dtype)
    out = sum_out()
    ops.sum_of_squares([x], out.t)
    assert_sum_close(out.value(), fsum_squares([x]), "sum_of_squares", rtol=1e-11)


# ---------------------------------------------------------------------------
# The Python wrappers
# ---------------------------------------------------------------------------


def _ops_called(fn) -> List[str]:
    from torch.utils._python_dispatch import TorchDispatchMode

    names: List[str] = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            names.append(str(func.name()))
            return func(*args, **(kwargs or {}))

    with Log():
        fn()
    return [n for n in names if n.startswith("fastcoll::")]


def test_wrappers_call_the_ex_ops_only_for_the_new_keywords():
    ts = [torch.randn(5), torch.randn(3, dtype=F16)]
    out = torch.empty(8)
    dests = [torch.empty(5), torch.empty(3, dtype=F16)]
    assert _ops_called(lambda: ops.flatten_scale(ts, out, 0.5)) == ["fastcoll::flatten_scale"]
    assert _ops_called(lambda: ops.flatten_scale(ts, out, 0.5, scale_by=torch.tensor([2.0]))) == ["fastcoll::flatten_scale_ex"]
    nf = torch.zeros(1, dtype=torch.int32)
    assert _ops_called(lambda: ops.flatten_scale(ts, out, 0.5, nonfinite=nf)) == ["fastcoll::flatten_scale_ex"]
    assert _ops_called(lambda: ops.unflatten_scale(out, dests, 2.0)) == ["fastcoll::unflatten_scale"]
    ss = torch.zeros(1, dtype=F64)
    assert _ops_called(lambda: ops.unflatten_scale(out, dests, 2.0, sumsq=ss)) == ["fastcoll::unflatten_scale_ex"]
    assert ops.flatten_scale(ts, out, 0.5, scale_by=torch.tensor([2.0]), nonfinite=nf) is out
    assert nf.item() == 0 and torch.equal(out[:5], ts[0])


def test_sum_of_squares_wrapper():
    ts = [torch.randn(7, 3), torch.randn(5, dtype=BF16)]
    got = ops.sum_of_squares(ts)
    assert got.dtype == F64 and got.shape == () and got.device == ts[0].device
    assert_sum_close(got.item(), fsum_squares(ts), "ops.sum_of_squares")
    out = torch.full((1,), NAN, dtype=F64)
    assert ops.sum_of_squares(ts, out) is out and out.item() == got.item()
    with pytest.raises(ValueError, match="fastcoll.sum_of_squares: tensors is empty"):
        ops.sum_of_squares([])


def test_extension_has_every_op():
    """A fresh build serves every op of SCHEMAS (none fell back to the reference), on CPU and, if built, CUDA."""
    if not extension_active():
        pytest.skip("the compiled extension is not loaded")
    assert loader.REFERENCE_OPS == ()
    keys = ["CPU"] + (["CUDA"] if fastcoll.build_info()["cuda_kernels"] else [])
    for name in ("flatten_scale_ex", "unflatten_scale_ex", "sum_of_squares"):
        for key in keys:
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fastcoll::{name}", key), (name, key)


# ---------------------------------------------------------------------------
# Bad input: the right exception, naming the culprit, nothing written
# ---------------------------------------------------------------------------


def _bad_scale_by():
    return {
        "f16": (torch.ones(1, dtype=F16), TypeError, ["scale_by", "float16", "float32 or float64"]),
        "int": (torch.ones(1, dtype=torch.int64), TypeError, ["scale_by", "int64"]),
        "two": (torch.ones(2), ValueError, ["scale_by", "shape (2,)", "1 element"]),
        "empty": (torch.ones(0, dtype=F64), ValueError, ["scale_by", "shape (0,)"]),
        "meta": (torch.ones(1, device="meta"), RuntimeError, ["scale_by", "on meta", "on cpu"]),
    }


def _bad_flag():
    return {
        "int64": (torch.zeros(1, dtype=torch.int64), TypeError, ["nonfinite", "int64", "an int32 tensor"]),
        "float": (torch.zeros(1), TypeError, ["nonfinite", "float32"]),
        "empty": (torch.zeros(0, dtype=torch.int32), ValueError, ["nonfinite", "at least 1 element", "shape (0,)"]),
        "meta": (torch.zeros(1, dtype=torch.int32, device="meta"), RuntimeError, ["nonfinite", "on meta"]),
    }


def _bad_sum():
    return {
        "f32": (torch.zeros(1), TypeError, ["float64 tensor with 1 element", "float32"]),
        "two": (torch.zeros(2, dtype=F64), ValueError, ["shape (2,)"]),
        "empty": (torch.zeros(0, dtype=F64), ValueError, ["shape (0,)"]),
        "meta": (torch.zeros(1, dtype=F64, device="meta"), RuntimeError, ["on meta", "on cpu"]),
    }


@impl_param
@pytest.mark.parametrize("kind", sorted(_bad_scale_by()))
def test_bad_scale_by(impl, kind):
    bad, exc, patterns = _bad_scale_by()[kind]
    ts, out, nf = _good_inputs(), torch.full((18,), 7.0), flag(0)
    _raises_and_writes_nothing(lambda: impl.flatten_ex(ts, out, 0.5, bad, nf.t), exc, patterns, out, nf.buf, *ts)


@impl_param
@pytest.mark.parametrize("kind", sorted(_bad_flag()))
def test_bad_nonfinite(impl, kind):
    bad, exc, patterns = _bad_flag()[kind]
    ts, out = _good_inputs(), torch.full((18,), 7.0)
    ts[1][0] = NAN  # a value that would set the flag
    _raises_and_writes_nothing(lambda: impl.flatten_ex(ts, out, 0.5, None, bad), exc, patterns, out, bad, *ts)


@impl_param
@pytest.mark.parametrize("kind", sorted(_bad_sum()))
def test_bad_sumsq_and_sum_of_squares_out(impl, kind):
    bad, exc, patterns = _bad_sum()[kind]
    ts, flat = _good_inputs(), torch.full((18,), 7.0)
    _raises_and_writes_nothing(lambda: impl.unflatten_ex(flat, ts, 0.5, bad), exc, ["sumsq"] + patterns, flat, bad, *ts)
    _raises_and_writes_nothing(lambda: impl.sum_of_squares(ts, bad), exc, ["out"] + patterns, bad, *ts)


@impl_param
def test_small_tensors_must_not_overlap_what_the_op_touches(impl):
    ts, out = _good_inputs(), torch.full((18,), 7.0)
    as_int = out.view(torch.int32)  # the flag inside out's bytes
    _raises_and_writes_nothing(
        lambda: impl.flatten_ex(ts, out, 0.5, None, as_int[5:6]), ValueError, ["nonfinite overlaps out"], out, *ts
    )
    _raises_and_writes_nothing(
        lambda: impl.flatten_ex(ts, out, 0.5, None, ts[2].view(torch.int32)[1:]),
        ValueError,
        ["nonfinite overlaps tensors[2]"],
        out,
        *ts,
    )
    sb = torch.tensor([2.0, 0.0])
    _raises_and_writes_nothing(
        lambda: impl.flatten_ex(ts, out, 0.5, sb[:1], sb.view(torch.int32)[:1]),
        ValueError,
        ["nonfinite overlaps scale_by"],
        out,
        sb,
        *ts,
    )
    _raises_and_writes_nothing(lambda: impl.flatten_ex(ts, out, 0.5, out[4:5]), ValueError, ["scale_by overlaps out"], out, *ts)
    impl.flatten_ex(ts, out, 0.5, ts[1][:1])  # scale_by may be one of the inputs (both only read)
    wide = torch.zeros(20, dtype=F64)
    flat64 = wide[:18]
    _raises_and_writes_nothing(
        lambda: impl.unflatten_ex(flat64, ts, 0.5, wide[17:18]), ValueError, ["sumsq overlaps flat"], wide, *ts
    )
    dests64 = [torch.zeros(3 + k, dtype=F64) for k in range(4)]
    _raises_and_writes_nothing(
        lambda: impl.unflatten_ex(out, dests64, 0.5, dests64[3][2:3]), ValueError, ["sumsq overlaps tensors[3]"], out, *dests64
    )
    _raises_and_writes_nothing(
        lambda: impl.sum_of_squares(dests64, dests64[0][:1]), ValueError, ["out overlaps tensors[0]"], *dests64
    )


@impl_param
def test_list_checks_name_the_ex_op(impl):
    ts, out = _good_inputs(), torch.full((18,), 7.0)
    ts[3] = torch.zeros(6, dtype=torch.int32)
    _raises_and_writes_nothing(lambda: impl.flatten_ex(ts, out, 0.5, torch.ones(1)), TypeError, ["tensors[3]", "int32"], out)
    _raises_and_writes_nothing(lambda: impl.unflatten_ex(out, ts, 0.5, torch.zeros(1, dtype=F64)), TypeError, ["tensors[3]"], out)
    _raises_and_writes_nothing(lambda: impl.sum_of_squares(ts, torch.zeros(1, dtype=F64)), TypeError, ["tensors[3]"])
    _raises_and_writes_nothing(lambda: impl.flatten_ex(_good_inputs(), torch.full((19,), 7.0)), ValueError, ["18", "19"])
    _raises_and_writes_nothing(lambda: impl.sum_of_squares([], torch.zeros(1, dtype=F64)), ValueError, ["empty"])
    meta = _good_inputs()
    meta[2] = torch.empty(5, device="meta")
    _raises_and_writes_nothing(lambda: impl.sum_of_squares(meta, torch.zeros(1, dtype=F64)), RuntimeError, ["tensors[2]", "meta"])
    _raises_and_writes_nothing(
        lambda: impl.sum_of_squares([torch.randn(10)[::2]], torch.zeros(1, dtype=F64)), ValueError, ["tensors[0]", "not dense"]
    )


def _bad_calls():
    """Bad calls of the health ops; the extension and the reference must say the same."""
    ok = _good_inputs
    out = torch.zeros(18)
    return {
        "scale_by-dtype": lambda fx, ux, sq: fx(ok(), out, 1.0, torch.ones(1, dtype=F16), None),
        "scale_by-numel": lambda fx, ux, sq: fx(ok(), out, 1.0, torch.ones(2, 2), None),
        "scale_by-device": lambda fx, ux, sq: fx(ok(), out, 1.0, torch.ones(1, device="meta"), None),
        "scale_by-overlap": lambda fx, ux, sq: fx(ok(), out, 1.0, out[3:4], None),
        "nonfinite-dtype": lambda fx, ux, sq: fx(ok(), out, 1.0, None, torch.zeros(1, dtype=torch.uint8)),
        "nonfinite-empty": lambda fx, ux, sq: fx(ok(), out, 1.0, None, torch.zeros(0, 3, dtype=torch.int32)),
        "nonfinite-overlap": lambda fx, ux, sq: fx(ok(), out, 1.0, None, out.view(torch.int32)[2:3]),
        "sumsq-dtype": lambda fx, ux, sq: ux(out, ok(), 1.0, torch.zeros((), dtype=F16)),
        "sumsq-numel": lambda fx, ux, sq: ux(out, ok(), 1.0, torch.zeros(3, dtype=F64)),
        "sumsq-device": lambda fx, ux, sq: ux(out, ok(), 1.0, torch.zeros(1, dtype=F64, device="meta")),
        "sumsq-overlap": lambda fx, ux, sq: ux(out, ok(), 1.0, out.view(F64)[1:2]),
        "list-dtype": lambda fx, ux, sq: fx(ok()[:3] + [torch.zeros(6, dtype=torch.int8)], out, 1.0, None, None),
        "list-numel": lambda fx, ux, sq: ux(torch.zeros(17), ok(), 1.0, None),
        "sos-empty": lambda fx, ux, sq: sq([], torch.zeros(1, dtype=F64)),
        "sos-out": lambda fx, ux, sq: sq(ok(), torch.zeros(1, 1, dtype=F32)),
        "sos-device": lambda fx, ux, sq: sq(ok()[:1] + [torch.empty(3, device="meta")], torch.zeros(1, dtype=F64)),
        "sos-dense": lambda fx, ux, sq: sq([torch.randn(4, 4)[:, :2]], torch.zeros(1, dtype=F64)),
        "sos-overlap": lambda fx, ux, sq: sq([out, out[2:5]], out.view(F64)[4:5]),
    }


@pytest.mark.parametrize("case", sorted(_bad_calls()))
def test_extension_and_reference_say_the_same(case):
    assert_extension_and_reference_agree(
        case,
        _bad_calls,
        (torch.ops.fastcoll.flatten_scale_ex, torch.ops.fastcoll.unflatten_scale_ex, torch.ops.fastcoll.sum_of_squares),
        (reference.flatten_scale_ex, reference.unflatten_scale_ex, reference.sum_of_squares),
        ("fastcoll.flatten_scale_ex: ", "fastcoll.unflatten_scale_ex: ", "fastcoll.sum_of_squares: "),
    )


# ---------------------------------------------------------------------------
# opcheck and torch.compile
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["flatten_scale_ex", "unflatten_scale_ex", "sum_of_squares"])
def test_opcheck(op):
    for tensors, dtype, _ in _opcheck_samples():  # test_ops' samples; the scales are its own
        n = sum(t.numel() for t in tensors)
        flat = torch.randn(n).to(dtype)
        if op == "flatten_scale_ex":
            arg_sets = [
                (tensors, flat, 0.5, torch.tensor([2.0]), torch.zeros(1, dtype=torch.int32)),
                (tensors, flat, 0.5, torch.tensor(2.0, dtype=F64), None),
                (tensors, flat, 1.0, None, torch.zeros(3, dtype=torch.int32)),
            ]
        elif op == "unflatten_scale_ex":
            arg_sets = [(flat, tensors, 0.5, torch.zeros(1, dtype=F64)), (flat, tensors, 2.0, None)]
        else:
            arg_sets = [(tensors, torch.zeros((), dtype=F64))]
        for args in arg_sets:
            torch.library.opcheck(getattr(torch.ops.fastcoll, op).default, args)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile(backend):
    def step(grads, bucket, dests, loss_scale, found_inf, sumsq, world_size: int):
        ops.flatten_scale(grads, bucket, 1.0 / world_size, scale_by=loss_scale, nonfinite=found_inf)
        bucket.mul_(world_size)  # stands in for the all-reduce
        ops.unflatten_scale(bucket, dests, 0.5, sumsq=sumsq)
        return ops.sum_of_squares(dests).sqrt() + sumsq.sqrt() + found_inf

    grads = compile_grads()
    grads[1][2] = INF
    n = sum(g.numel() for g in grads)

    def run(fn):
        bucket = torch.full((n,), NAN)
        dests = [torch.full_like(g, NAN) for g in grads]
        found_inf = torch.zeros(1, dtype=torch.int32)
        sumsq = torch.full((1,), NAN, dtype=F64)
        total = fn(grads, bucket, dests, torch.tensor([0.25]), found_inf, sumsq, 4)
        return bucket, dests, found_inf, sumsq, total

    (b0, d0, f0, s0, t0), (b1, d1, f1, s1, t1) = eager_and_compiled(step, backend, run)
    assert torch.equal(b0, b1) and torch.equal(f0, f1) and f0.item() == 1
    assert torch.equal(s0, s1) and torch.equal(t0, t1) and math.isinf(s0.item())
    assert_same_dests(d0, d1)


# ---------------------------------------------------------------------------
# CUDA: the same properties on the GPU, launches, no host sync, graph capture
# ---------------------------------------------------------------------------


@CUDA
@impl_param
@settings(max_examples=examples(15), **HYP)
@given(case=cases(), scale_by=SCALE_BY)
def test_cuda_flatten_ex_matches_float64(impl, case, scale_by):
    check_flatten_ex(impl, scale_by=scale_by, device="cuda", **case)


@CUDA
@impl_param
@settings(max_examples=examples(15), **HYP)
@given(case=cases())
def test_cuda_unflatten_ex_matches_float64(impl, case):
    check_unflatten_ex(impl, device="cuda", **case)


@CUDA
@impl_param
@settings(max_examples=examples(15), **HYP)
@given(case=cases())
def test_cuda_sum_of_squares_matches_float64(impl, case):
    check_sum_of_squares(impl, case["specs"], case["seed"], device="cuda")


@CUDA
@impl_param
@pair_param
def test_cuda_all_dtype_pairs(impl, pair):
    src, dst = pair
    for scale, scale_by in ((1.0, None), (1 / 3, ("f32", 0.5)), (0.75, ("f64", 2.0))):
        check_flatten_ex(impl, _fixed_specs(src), dst, scale, 1, 2, seed=11, scale_by=scale_by, device="cuda")
    check_unflatten_ex(impl, _fixed_specs(dst), src, 1 / 3, 3, 0, seed=12, device="cuda")
    check_sum_of_squares(impl, _fixed_specs(src), seed=13, device="cuda")


@CUDA
@impl_param
@pytest.mark.parametrize("pair", NONFINITE_PAIRS, ids=lambda p: f"{str(p[0])[6:]}-{str(p[1])[6:]}")
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
def test_cuda_nonfinite_anywhere_is_flagged(impl, pair, value):
    src, dst = pair
    chunk = cuda_chunk_elements(src, dst)
    for where in _placements(chunk) + [-1]:
        _check_one_nonfinite(impl, src, dst, value, where, 2 * chunk + 37, "cuda")


@CUDA
def test_cuda_overflow_on_the_cast_is_flagged():
    t = torch.zeros(70000, device="cuda")
    t[40000] = 70000.0
    out = torch.empty(70000, dtype=F16, device="cuda")
    nf = flag(0, "cuda")
    ops.flatten_scale([t], out, nonfinite=nf.t)
    assert nf.value() == 1 and math.isinf(out[40000].item())


@CUDA
@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=str)
def test_cuda_sums_are_deterministic(dtype):
    gen = torch.Generator().manual_seed(21)
    tensors, flat = _sum_case(gen, dtype)
    tensors = [t.cuda() for t in tensors]
    flat = flat.cuda()
    dests = [torch.empty_like(t) for t in tensors]
    got = set()
    for _ in range(3):
        ss = sum_out("cuda")
        ops.unflatten_scale(flat, dests, 0.5, sumsq=ss.t)
        out = sum_out("cuda")
        ops.sum_of_squares(tensors, out.t)
        got.add((ss.value().hex(), out.value().hex()))
    assert len(got) == 1, got
    a, b = next(iter(got))
    assert_sum_close(float.fromhex(a), fsum_squares(dests), "cuda sumsq")
    assert_sum_close(float.fromhex(b), fsum_squares(tensors), "cuda sum_of_squares")


@CUDA
def test_cuda_launches_and_no_host_sync():
    """One kernel per call (plus one tiny kernel adding the partials of a sum), and no host synchronization."""
    if not fastcoll.build_info()["cuda_kernels"]:
        pytest.skip("the CUDA kernels are not built")
    from test_ops import _cuda_kernels

    specs = [Spec((1 + (k * 37) % 700,), (0,), F32, 0, 0) for k in range(299)] + [Spec((1 << 20,), (0,), F32, 0, 0)]
    gen = torch.Generator().manual_seed(0)
    tensors = [make_tensor(s, "cuda", gen).tensor for s in specs]
    flat = torch.empty(sum(s.numel for s in specs), dtype=BF16, device="cuda")
    sb = torch.tensor([0.5], device="cuda")
    nf = torch.zeros(1, dtype=torch.int32, device="cuda")
    ss = torch.zeros(1, dtype=F64, device="cuda")
    calls = {
        "flatten_ex": (lambda: ops.flatten_scale(tensors, flat, 0.25, scale_by=sb, nonfinite=nf), 1),
        "unflatten_ex": (lambda: ops.unflatten_scale(flat, tensors, 4.0, sumsq=ss), 2),
        "sum_of_squares": (lambda: ops.sum_of_squares(tensors, ss), 2),
    }
    for name, (call, expected) in calls.items():
        kernels = _cuda_kernels(call)
        assert len(kernels) == expected, f"{name} launched {kernels}"
        assert all("fastcoll" in k or "sum_partials" in k or "health" in k for k in kernels), kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for call, _ in calls.values():
            call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@CUDA
def test_cuda_graph_capture():
    """On the kernel-argument path the health ops capture; replays read the inputs and scale_by anew."""
    if not fastcoll.build_info()["cuda_kernels"]:
        pytest.skip("the CUDA kernels are not built")
    small = [torch.randn(5, device="cuda"), torch.randn(70000, device="cuda")]
    flat = torch.full((70005,), 7.0, device="cuda")
    back = [torch.zeros_like(t) for t in small]
    sb = torch.tensor([0.5], device="cuda")
    nf = torch.zeros(1, dtype=torch.int32, device="cuda")
    ss = torch.zeros(1, dtype=F64, device="cuda")
    norm = torch.zeros((), dtype=F64, device="cuda")
    many = [torch.randn(3, device="cuda") for _ in range(600)]  # 600 chunks: refused under capture
    many_flat = torch.full((1800,), 7.0, device="cuda")

    def record():
        ops.flatten_scale(small, flat, 1.0, scale_by=sb, nonfinite=nf)
        ops.unflatten_scale(flat, back, 4.0, sumsq=ss)
        ops.sum_of_squares(small, norm)
        with pytest.raises(RuntimeError, match="CUDA graph capture"):
            ops.flatten_scale(many, many_flat, 0.5, nonfinite=nf)

    # warm: the caching allocator, outside capture
    graph = capture_graph(record, warm=lambda: ops.sum_of_squares(small, norm))
    assert torch.equal(many_flat, torch.full((1800,), 7.0, device="cuda")), "a refused call may write nothing"
    for k in range(3):
        for t in small:
            t.copy_(torch.randn_like(t))
        sb.fill_(0.5 * (k + 1))
        if k == 2:
            small[1][123] = INF
        nf.zero_()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(flat, torch.cat(small) * 0.5 * (k + 1))
        assert nf.item() == (1 if k == 2 else 0)
        if k < 2:
            assert_sum_close(ss.item(), fsum_squares(back), "replayed sumsq")
            assert_sum_close(norm.item(), fsum_squares(small), "replayed sum_of_squares")
