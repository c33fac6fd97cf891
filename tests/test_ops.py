"""Tests of the fused ops: flatten_scale, unflatten_scale, bucket_views, build_info.

The oracle here is an independent float64 computation written in this file:
every test tensor is carved out of a 1-D storage buffer built by the test, so
the test knows each tensor's elements in memory order without asking the code
under test (or fastcoll.ops.reference) how to find them. Results are compared
with tolerances derived from the destination dtype: the op multiplies in
float32 (float64 when either side is float64) and then casts, so an element
may differ from the exact float64 product by half an ulp of the destination
plus two roundings of the multiply (scale and product).

Every test runs against both implementations: the active one, reached through
torch.ops.fastcoll.* (fastcoll.ops; the C++/CUDA kernels when the extension is
built), and fastcoll.ops.reference called directly. When the extension is built,
its results are also compared bit for bit with the reference's.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

import fastcoll
from fastcoll import ops
from fastcoll.bench.runner import num_threads
from fastcoll.ops import dtypes, loader, reference

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
DTYPES = [F32, F16, BF16, F64]
DTYPE_PAIRS = [(a, b) for a in DTYPES for b in DTYPES]
BIG_NUMELS = [65535, 65536, 65537]
HUGE_NUMEL = (1 << 20) + 3  # "one huge among many tiny": an embedding-like tensor
CUDA = pytest.mark.cuda
# Small tensors on a shared 2-core machine: 1 intra-op thread (tests/conftest.py). The
# multi-threaded kernel path has its own test (test_parallel_kernels).
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

# ---------------------------------------------------------------------------
# The two implementations under test
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def _cpu_streaming(enabled: bool):
    """With ``enabled``: every CPU kernel call uses its non-temporal-store path (threshold 0 bytes)."""
    if not enabled:
        yield
        return
    if not extension_active():
        pytest.skip("the streaming-store path is part of the compiled extension")
    from fastcoll import _C

    saved = _C._cpu_stream_min_bytes()
    _C._set_cpu_stream_min_bytes(0)
    try:
        yield
    finally:
        _C._set_cpu_stream_min_bytes(saved)


# The public name of the op an Impl called last: its error messages must start
# with "<that name>: " (the convention "fastcoll.<public name>: what; how to fix").
_LAST_OP = {"name": None}


@dataclass(frozen=True)
class Impl:
    name: str

    def flatten(self, tensors, out, scale=1.0):
        _LAST_OP["name"] = "fastcoll.flatten_scale"
        if self.name.startswith("ops"):
            with _cpu_streaming(self.name == "ops_streaming"):
                ret = ops.flatten_scale(tensors, out, scale)
            assert ret is out
        else:
            reference.flatten_scale(tensors, out, scale)

    def unflatten(self, flat, tensors, scale=1.0):
        _LAST_OP["name"] = "fastcoll.unflatten_scale"
        if self.name.startswith("ops"):
            with _cpu_streaming(self.name == "ops_streaming"):
                assert ops.unflatten_scale(flat, tensors, scale) is None
        else:
            reference.unflatten_scale(flat, tensors, scale)


# "ops_streaming": the compiled ops with the CPU kernels' non-temporal stores
# forced on (they are used by default only for calls writing >= 16 MiB).
IMPLS = [Impl("ops"), Impl("ops_streaming"), Impl("reference")]
IMPL_IDS = ["ops", "ops_streaming", "reference"]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]

impl_param = pytest.mark.parametrize("impl", IMPLS, ids=IMPL_IDS)
device_param = pytest.mark.parametrize("device", DEVICES)

# Shrinking a failing 300-tensor case can take hypothesis its full 5-minute shrink budget,
# so it is off unless asked for; the assertion messages name the tensor and its spec.
_PHASES = [Phase.explicit, Phase.reuse, Phase.generate]
if os.environ.get("FASTCOLL_HYPOTHESIS_SHRINK", "0") not in ("", "0"):
    _PHASES.append(Phase.shrink)
HYP = dict(deadline=None, suppress_health_check=list(HealthCheck), phases=_PHASES)


def examples(n: int) -> int:
    """``n`` hypothesis examples, scaled by FASTCOLL_TEST_EXAMPLES (default 1; CI's oldest-torch stage uses fewer).

    The other torch versions run the same kernels on the same inputs: there the
    examples check that the build and the dispatch work, not the arithmetic again.
    """
    scale = float(os.environ.get("FASTCOLL_TEST_EXAMPLES", "1"))
    return max(2, round(n * scale))


def extension_active() -> bool:
    return ops.implementation() == "extension"


# ---------------------------------------------------------------------------
# Building test tensors from storage buffers the test owns
# ---------------------------------------------------------------------------


@dataclass
class Spec:
    """One tensor: logical shape, memory order of its dims (outermost first), dtype, placement."""

    shape: Tuple[int, ...]
    order: Tuple[int, ...]
    dtype: torch.dtype
    offset: int = 0  # elements before the tensor in its storage buffer (odd = misaligned)
    pad: int = 0  # elements after it

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Made:
    tensor: torch.Tensor  # the tensor handed to the op
    buf: torch.Tensor  # its whole storage buffer (1-D)
    offset: int
    numel: int

    @property
    def mem(self) -> torch.Tensor:
        """The tensor's elements in memory order, straight from the buffer."""
        return self.buf[self.offset : self.offset + self.numel]


def _values(n: int, gen: torch.Generator) -> torch.Tensor:
    """float64 values in a range every dtype holds: normal draws plus zeros, -0.0, tiny values."""
    v = torch.randn(n, generator=gen, dtype=F64) * 2.0
    v[3::11] = 0.0
    v[5::13] = -0.0
    v[7::17] *= 1e-5
    return v


def make_tensor(spec: Spec, device, gen: torch.Generator, fill: Optional[float] = None) -> Made:
    """A dense tensor laid out as ``spec`` says, inside a larger buffer.

    ``fill`` None: random values; otherwise the whole buffer (tensor and guard
    regions) is set to ``fill`` (a poison value for destinations).
    """
    n = spec.numel
    size = spec.offset + n + spec.pad
    if fill is None:
        buf = _values(size, gen).to(spec.dtype)
    else:
        buf = torch.full((size,), fill, dtype=spec.dtype)
    buf = buf.to(device)
    phys_shape = [spec.shape[d] for d in spec.order]
    phys = buf[spec.offset : spec.offset + n].view(phys_shape)
    inv = [spec.order.index(d) for d in range(len(spec.shape))]
    t = phys.permute(inv) if spec.shape else phys
    assert tuple(t.shape) == tuple(spec.shape)
    assert t.storage_offset() == spec.offset
    return Made(t, buf, spec.offset, n)


def make_flat(n: int, dtype, device, offset: int, pad: int, gen=None, fill=float("nan")) -> Made:
    """A 1-D contiguous buffer of n elements at ``offset`` inside a larger one; guards hold 1234."""
    size = offset + n + pad
    buf = torch.full((size,), 1234.0, dtype=dtype)
    if fill is None:
        buf[offset : offset + n] = _values(n, gen).to(dtype)
    else:
        buf[offset : offset + n] = fill
    buf = buf.to(device)
    return Made(buf[offset : offset + n], buf, offset, n)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so that -0.0 != 0.0 and NaN == NaN (same payload)."""
    view = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.contiguous().view(view)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    ba, bb = bits(a).cpu(), bits(b).cpu()
    if not torch.equal(ba, bb):
        idx = (ba != bb).nonzero()[0].tolist()
        raise AssertionError(f"{what}: first bitwise difference at {idx}: {a.flatten()[idx[0]]} vs {b.flatten()[idx[0]]}")


def opmath(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return F64 if F64 in (a, b) else F32


def tolerance(dst: torch.dtype, op: torch.dtype) -> Tuple[float, float]:
    """(rtol, atol) for one multiply in ``op`` precision followed by a cast to ``dst``."""
    fi = torch.finfo(dst)
    u_op = torch.finfo(op).eps / 2  # unit roundoff of the multiply
    rtol = fi.eps / 2 + 2 * u_op + 1e-300  # cast + rounding of the scale + rounding of the product
    atol = fi.tiny * fi.eps  # the smallest subnormal: underflow of tiny results
    return rtol, atol


def assert_scaled(got: torch.Tensor, src_mem: torch.Tensor, scale: float, op: torch.dtype, what: str) -> None:
    """``got`` (destination dtype) ~= exact float64 ``src_mem * scale``, every element written."""
    got64 = got.detach().cpu().to(F64)
    exact = src_mem.detach().cpu().to(F64) * scale
    nan = torch.isnan(got64)
    if nan.any():
        raise AssertionError(f"{what}: {int(nan.sum())} element(s) not written (still NaN), first at {int(nan.nonzero()[0])}")
    rtol, atol = tolerance(got.dtype, op)
    err = (got64 - exact).abs()
    bad = err > rtol * exact.abs() + atol
    if bad.any():
        i = int(bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} element(s) off; first at {i}: got {got64[i].item()!r}, "
            f"exact {exact[i].item()!r} (src {src_mem.flatten()[i].item()!r} * {scale!r}), rtol {rtol:.3g}"
        )


def flatten_case(specs: Sequence[Spec], out_dtype, out_offset, out_pad, seed, device):
    """Inputs made from ``specs``, copies of their buffers, and a NaN-poisoned ``out``: (made, before, out, out's buffer)."""
    gen = torch.Generator().manual_seed(seed)
    made = [make_tensor(s, device, gen) for s in specs]
    before = [m.buf.clone() for m in made]
    out = make_flat(sum(s.numel for s in specs), out_dtype, device, out_offset, out_pad)
    return made, before, out, out.buf.clone()


def assert_inputs_and_guards_kept(made: Sequence[Made], before, out: Made, guards: torch.Tensor) -> None:
    """The inputs (and their buffers) are unchanged, and so are the guard regions around ``out``."""
    for i, (m, b) in enumerate(zip(made, before)):
        assert_bitwise(m.buf, b, f"input tensors[{i}] (and its buffer) changed")
    end = out.offset + out.numel
    assert_bitwise(out.buf[: out.offset], guards[: out.offset], "wrote before out")
    assert_bitwise(out.buf[end:], guards[end:], "wrote past out")


def unflatten_case(specs: Sequence[Spec], flat_dtype, flat_offset, flat_pad, seed, device):
    """A random flat source, NaN-poisoned destinations made from ``specs`` and copies of both buffers.

    Returns (gen, flat, flat's buffer, dests, dests' buffers); ``gen`` goes on from there.
    """
    gen = torch.Generator().manual_seed(seed)
    n = sum(s.numel for s in specs)
    flat = make_flat(n, flat_dtype, device, flat_offset, flat_pad, gen=gen, fill=None)
    flat_before = flat.buf.clone()
    dests = [make_tensor(s, device, gen, fill=float("nan")) for s in specs]
    return gen, flat, flat_before, dests, [d.buf.clone() for d in dests]


def assert_dest_guards_kept(d: Made, before: torch.Tensor, i: int) -> None:
    """Nothing written around destination ``i`` in its buffer."""
    end = d.offset + d.numel
    assert_bitwise(d.buf[: d.offset], before[: d.offset], f"wrote before tensors[{i}]")
    assert_bitwise(d.buf[end:], before[end:], f"wrote past tensors[{i}]")


def assert_slots_match(out: torch.Tensor, ref: torch.Tensor, specs: Sequence[Spec], skip: Callable[[Spec], bool]) -> None:
    """Each tensor's slot of ``out`` holds the bits of its slot of ``ref`` (the reference's), unless ``skip(spec)``."""
    pos = 0
    for i, s in enumerate(specs):
        if not skip(s):
            sl = slice(pos, pos + s.numel)
            assert_bitwise(out[sl], ref[sl], f"extension != reference for tensors[{i}] {s}")
        pos += s.numel


# ---------------------------------------------------------------------------
# Hypothesis strategies
# ---------------------------------------------------------------------------

ODD_OFFSETS = st.sampled_from([0, 0, 1, 2, 3, 5, 7])
SCALES = st.one_of(
    st.sampled_from([1.0, 1.0, 0.5, 0.25, 1 / 3, 1 / 8, 1 / 12, -1.0, 0.0, 2.0]),
    st.builds(lambda s, m: s * m, st.sampled_from([1.0, -1.0]), st.floats(1e-3, 8.0)),
)


@st.composite
def shapes_and_orders(draw, big: bool = False, huge: bool = False):
    if huge:
        n = HUGE_NUMEL
        return (n,), (0,)
    if big:
        n = draw(st.sampled_from(BIG_NUMELS))
        shape = draw(st.sampled_from([(n,), (1, n), (n, 1)]))
        return shape, tuple(range(len(shape)))
    kind = draw(st.sampled_from(["scalar", "vec", "vec", "mat", "conv", "conv", "5d", "zero"]))
    if kind == "scalar":
        shape = ()
    elif kind == "vec":
        shape = (draw(st.one_of(st.sampled_from([0, 1, 2, 3, 7, 31, 33, 127, 255, 257]), st.integers(0, 2000))),)
    elif kind == "mat":
        shape = (draw(st.integers(1, 48)), draw(st.integers(1, 48)))
    elif kind == "conv":
        shape = (
            draw(st.integers(1, 24)),
            draw(st.sampled_from([1, 2, 3, 8, 13])),
            draw(st.sampled_from([1, 3, 5])),
            draw(st.sampled_from([1, 3, 5])),
        )
    elif kind == "5d":
        shape = tuple(draw(st.integers(1, 4)) for _ in range(5))
    else:  # a zero-size dim somewhere
        rank = draw(st.integers(1, 4))
        shape = [draw(st.integers(1, 5)) for _ in range(rank)]
        shape[draw(st.integers(0, rank - 1))] = 0
        shape = tuple(shape)
    rank = len(shape)
    layout = draw(st.sampled_from(["contiguous", "contiguous", "channels_last", "permuted"]))
    if layout == "channels_last" and rank == 4:
        order = (0, 2, 3, 1)
    elif layout == "channels_last" and rank == 5:
        order = (0, 2, 3, 4, 1)
    elif layout == "permuted" and rank >= 2:
        order = tuple(draw(st.permutations(range(rank))))
    else:
        order = tuple(range(rank))
    return shape, order


@st.composite
def spec_lists(draw, dtypes=DTYPES, max_count: int = 300):
    """Random tensor lists: counts 1..300, big/odd/zero sizes, mixed dtypes and layouts, odd offsets."""
    count = draw(st.one_of(st.integers(1, 8), st.integers(1, max_count)))
    mixed = draw(st.booleans())
    base = draw(st.sampled_from(dtypes))
    positions = set(draw(st.lists(st.integers(0, count - 1), max_size=3)))
    huge_at = draw(st.one_of(st.none(), st.integers(0, count - 1))) if count >= 20 else None
    specs = []
    for i in range(count):
        shape, order = draw(shapes_and_orders(big=i in positions, huge=i == huge_at))
        dtype = draw(st.sampled_from(dtypes)) if mixed else base
        specs.append(Spec(shape, order, dtype, draw(ODD_OFFSETS), draw(st.sampled_from([0, 1, 4]))))
    return specs


@st.composite
def cases(draw, dtypes=DTYPES, out_dtypes=DTYPES):
    specs = draw(spec_lists(dtypes))
    return dict(
        specs=specs,
        out_dtype=draw(st.sampled_from(out_dtypes)),
        scale=draw(SCALES),
        out_offset=draw(ODD_OFFSETS),
        out_pad=draw(st.sampled_from([0, 1, 3])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


# ---------------------------------------------------------------------------
# The property checks, shared by the hypothesis tests and the fixed-case tests
# ---------------------------------------------------------------------------


def check_flatten(impl: Impl, specs: Sequence[Spec], out_dtype, scale, out_offset, out_pad, seed, device="cpu"):
    made, before, out, guards = flatten_case(specs, out_dtype, out_offset, out_pad, seed, device)
    impl.flatten([m.tensor for m in made], out.tensor, scale)

    assert_inputs_and_guards_kept(made, before, out, guards)
    pos = 0
    for i, (s, m) in enumerate(zip(specs, made)):
        got = out.tensor[pos : pos + s.numel]
        assert_scaled(got, m.mem, scale, opmath(s.dtype, out_dtype), f"out slot of tensors[{i}] {s}")
        if scale == 1.0:  # a pure copy: bitwise equal to a cast
            assert_bitwise(got, m.mem.to(out_dtype), f"scale 1.0 is not a plain cast for tensors[{i}]")
        pos += s.numel

    if impl.name == "ops" and extension_active():  # extension vs reference, bit for bit
        ref = make_flat(out.numel, out_dtype, device, out_offset, out_pad)
        reference.flatten_scale([m.tensor for m in made], ref.tensor, scale)
        assert_slots_match(out.tensor, ref.tensor, specs, skip=lambda s: s.dtype == F64 and out_dtype in (F16, BF16))


def check_unflatten(impl: Impl, specs: Sequence[Spec], out_dtype, scale, out_offset, out_pad, seed, device="cpu"):
    """Here ``out_dtype`` is the flat source's dtype and specs describe the destinations."""
    gen, flat, flat_before, dests, dest_before = unflatten_case(specs, out_dtype, out_offset, out_pad, seed, device)
    impl.unflatten(flat.tensor, [d.tensor for d in dests], scale)

    assert_bitwise(flat.buf, flat_before, "flat (or its buffer) changed")
    pos = 0
    for i, (s, d, b) in enumerate(zip(specs, dests, dest_before)):
        src = flat.tensor[pos : pos + s.numel]
        assert_scaled(d.mem, src, scale, opmath(s.dtype, out_dtype), f"destination tensors[{i}] {s}")
        if scale == 1.0:
            assert_bitwise(d.mem, src.to(s.dtype), f"scale 1.0 is not a plain cast for tensors[{i}]")
        assert_dest_guards_kept(d, b, i)
        pos += s.numel

    if impl.name == "ops" and extension_active():
        refs = [make_tensor(s, device, gen, fill=float("nan")) for s in specs]
        reference.unflatten_scale(flat.tensor, [r.tensor for r in refs], scale)
        for i, (s, d, r) in enumerate(zip(specs, dests, refs)):
            if not (out_dtype == F64 and s.dtype in (F16, BF16)):
                assert_bitwise(d.mem, r.mem, f"extension != reference for tensors[{i}] {s}")


def check_round_trip(impl: Impl, specs, out_dtype, scale, out_offset, out_pad, seed, device="cpu"):
    """flatten into a bucket; bucket_views see the values in logical order; unflatten restores them."""
    gen = torch.Generator().manual_seed(seed)
    made = [make_tensor(s, device, gen) for s in specs]
    like = [m.tensor for m in made]
    n = sum(s.numel for s in specs)
    flat = make_flat(n, out_dtype, device, out_offset, out_pad)
    impl.flatten(like, flat.tensor, scale)
    views = ops.bucket_views(flat.tensor, like)
    assert len(views) == len(like)
    for i, (v, t) in enumerate(zip(views, like)):
        assert v.shape == t.shape and v.dtype == out_dtype
        if t.numel() > 1:
            assert v.stride() == t.stride(), f"bucket view {i} has strides {v.stride()}, like has {t.stride()}"
        # logical (index-by-index) comparison: the view holds like[i] * scale
        assert_scaled(v.reshape(-1), t.reshape(-1), scale, opmath(t.dtype, out_dtype), f"bucket_views[{i}]")

    dests = [make_tensor(s, device, gen, fill=float("nan")) for s in specs]
    back = 1.0 / scale if scale != 0.0 else 1.0
    impl.unflatten(flat.tensor, [d.tensor for d in dests], back)
    for i, (s, d, v) in enumerate(zip(specs, dests, views)):
        assert_scaled(d.tensor.reshape(-1), v.reshape(-1), back, opmath(s.dtype, out_dtype), f"round trip tensors[{i}]")
        exact = out_dtype == s.dtype or out_dtype == F64 or (out_dtype == F32 and s.dtype in (F16, BF16))
        if scale == 1.0 and exact:  # widening then narrowing back is lossless
            assert_bitwise(d.tensor, made[i].tensor, f"lossless round trip of tensors[{i}]")


# ---------------------------------------------------------------------------
# Property tests
# ---------------------------------------------------------------------------


@impl_param
@settings(max_examples=examples(50), **HYP)
@given(case=cases())
@example(case=dict(specs=[Spec((65537,), (0,), BF16, 1, 1)], out_dtype=F32, scale=1.0, out_offset=3, out_pad=1, seed=1))
def test_flatten_matches_float64(impl, case):
    check_flatten(impl, **case)


@impl_param
@settings(max_examples=examples(50), **HYP)
@given(case=cases())
@example(case=dict(specs=[Spec((65535,), (0,), F16, 3, 0)], out_dtype=F64, scale=0.125, out_offset=1, out_pad=0, seed=2))
def test_unflatten_matches_float64(impl, case):
    check_unflatten(impl, **case)


@impl_param
@settings(max_examples=examples(30), **HYP)
@given(case=cases())
def test_round_trip_through_bucket_views(impl, case):
    check_round_trip(impl, **case)


def _fixed_specs(in_dtype) -> List[Spec]:
    """A fixed list covering the layouts and awkward sizes, for the all-pairs tests."""
    return [
        Spec((64, 3, 7, 7), (0, 2, 3, 1), in_dtype, 1, 1),  # channels_last conv weight, misaligned
        Spec((64,), (0,), in_dtype, 0, 0),
        Spec((0,), (0,), in_dtype, 3, 0),
        Spec((), (), in_dtype, 5, 2),
        Spec((65537,), (0,), in_dtype, 7, 1),
        Spec((17, 33), (1, 0), in_dtype, 2, 0),  # a transposed (dense, non-contiguous) matrix
        Spec((3, 0, 4), (0, 1, 2), in_dtype, 0, 0),
        Spec((1,), (0,), in_dtype, 1, 0),
        Spec((65535,), (0,), in_dtype, 0, 3),
        Spec((2, 3, 2, 3, 2), (0, 2, 3, 4, 1), in_dtype, 3, 0),  # channels_last_3d
        Spec((65536,), (0,), in_dtype, 1, 0),
    ]


@impl_param
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=[f"{str(a)[6:]}-{str(b)[6:]}" for a, b in DTYPE_PAIRS])
def test_all_dtype_pairs(impl, pair):
    src, dst = pair
    for scale in (1.0, 1 / 3):
        check_flatten(impl, _fixed_specs(src), dst, scale, 1, 2, seed=11)
        check_unflatten(impl, _fixed_specs(dst), src, scale, 3, 0, seed=12)


@impl_param
def test_mixed_input_dtypes_in_one_list(impl):
    specs = [Spec((5, 7), (0, 1), d, k % 3, 1) for k, d in enumerate(DTYPES * 4)]
    for out_dtype in DTYPES:
        check_flatten(impl, specs, out_dtype, 0.5, 1, 1, seed=3)
        check_unflatten(impl, specs, out_dtype, 0.5, 1, 1, seed=4)


@impl_param
@pytest.mark.parametrize("pair", [(F32, F32), (F32, BF16), (BF16, F32), (F16, F16)], ids=str)
def test_one_huge_among_many_tiny(impl, pair):
    src, dst = pair
    specs = [Spec((k % 9,), (0,), src, k % 4, 0) for k in range(150)]
    specs.append(Spec((HUGE_NUMEL,), (0,), src, 1, 1))
    specs += [Spec((1 + k % 5, 3), (0, 1), src, k % 2, 0) for k in range(149)]
    assert len(specs) == 300
    check_flatten(impl, specs, dst, 1 / 8, 1, 1, seed=5)
    check_unflatten(impl, specs, dst, 1 / 8, 3, 1, seed=6)


@impl_param
@pytest.mark.parametrize("threads", [2, 4])
def test_parallel_kernels(impl, threads):
    """The CPU kernels split work across threads: big and tiny tensors, several threads."""
    specs = [Spec((k % 7, 3), (1, 0), F16 if k % 3 else F32, k % 3, 1) for k in range(100)]
    specs.insert(37, Spec((HUGE_NUMEL,), (0,), F32, 1, 0))
    specs.insert(80, Spec((64, 32, 3, 3), (0, 2, 3, 1), BF16, 3, 0))
    with num_threads(threads):
        for dst in (F32, BF16):
            check_flatten(impl, specs, dst, 0.25, 1, 1, seed=7)
            check_unflatten(impl, specs, dst, 0.25, 1, 1, seed=8)


@impl_param
def test_channels_last_elements_go_in_memory_order(impl):
    t = torch.randn(4, 3, 5, 5).contiguous(memory_format=torch.channels_last)
    assert not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)
    out = torch.full((t.numel(),), float("nan"))
    impl.flatten([t], out, 1.0)
    assert torch.equal(out, t.permute(0, 2, 3, 1).reshape(-1))  # NHWC order, not NCHW
    (view,) = ops.bucket_views(out, [t])
    assert view.is_contiguous(memory_format=torch.channels_last) and torch.equal(view, t)
    back = torch.empty_like(t)
    impl.unflatten(out, [back], 1.0)
    assert back.stride() == t.stride() and torch.equal(back, t)


@impl_param
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_in_place_scale_of_bucket_views(impl, dtype):
    """Inputs that are exactly their own slot of out (gradient_as_bucket_view) are allowed."""
    flat = (torch.randn(1 + 64 * 3 * 3 + 10 + 7) * 4).to(dtype)
    buf = torch.cat([torch.zeros(1, dtype=dtype), flat])  # misaligned by one element
    flat = buf[1:]
    like = [
        torch.empty(64, 1, 3, 3).contiguous(memory_format=torch.channels_last),
        torch.empty(0),
        torch.empty(10, 1),
        torch.empty(7),
        torch.empty(()),
    ]
    views = ops.bucket_views(flat, like)
    original = flat.clone()
    impl.flatten(views, flat, 0.25)
    assert_scaled(flat, original, 0.25, opmath(dtype, dtype), "in-place flatten_scale")
    assert buf[0] == 0
    scaled = flat.clone()
    impl.unflatten(flat, views, 4.0)
    assert_scaled(flat, scaled, 4.0, opmath(dtype, dtype), "in-place unflatten_scale")


@impl_param
def test_all_zero_size_tensors_is_a_no_op(impl):
    out = torch.empty(0)
    impl.flatten([torch.empty(0), torch.empty(3, 0)], out, 0.5)
    impl.unflatten(out, [torch.empty(0, dtype=F16), torch.empty(0, 2)], 0.5)


@impl_param
def test_same_input_twice_is_allowed(impl):
    """Inputs are only read, so they may alias each other."""
    t = torch.randn(10)
    out = torch.full((20,), float("nan"))
    impl.flatten([t, t], out, 2.0)
    assert torch.equal(out, torch.cat([t * 2, t * 2]))


# ---------------------------------------------------------------------------
# Bad input: the right exception, naming the culprit, and nothing written
# ---------------------------------------------------------------------------


def _good_inputs(n=4, device="cpu"):
    return [torch.randn(3 + k, device=device) for k in range(n)]


class Snapshot:
    """Bit patterns of tensors, to assert that a failed call wrote nothing."""

    def __init__(self, *tensors):
        self.tensors = [t for t in tensors if t.device.type != "meta"]
        self.saved = [self._bytes(t) for t in self.tensors]

    @staticmethod
    def _bytes(t):
        return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().clone()

    def unchanged(self):
        for i, (t, b) in enumerate(zip(self.tensors, self.saved)):
            assert torch.equal(self._bytes(t), b), f"a failed call wrote into tensor {i} of the snapshot"


def _raises_and_writes_nothing(call, exc, patterns, *watched):
    snap = Snapshot(*watched)
    _LAST_OP["name"] = None
    with pytest.raises(exc) as info:
        call()
    msg = str(info.value)
    op = _LAST_OP["name"]
    assert op is not None and msg.startswith(f"{op}: "), f"message {msg!r} does not start with '{op}: '"
    for p in patterns:
        assert p in msg, f"message {msg!r} does not mention {p!r}"
    snap.unchanged()
    return msg


@impl_param
def test_empty_list(impl):
    out = torch.full((4,), 7.0)
    _raises_and_writes_nothing(lambda: impl.flatten([], out, 0.5), ValueError, ["empty"], out)
    _raises_and_writes_nothing(lambda: impl.unflatten(out, [], 0.5), ValueError, ["empty"], out)


@impl_param
@pytest.mark.parametrize("delta", [-1, 1, 100])
def test_total_numel_mismatch_gives_both_numbers(impl, delta):
    ts = _good_inputs()  # 3+4+5+6 = 18 elements
    out = torch.full((18 + delta,), 7.0)
    snap_in = [t.clone() for t in ts]
    _raises_and_writes_nothing(lambda: impl.flatten(ts, out, 0.5), ValueError, ["18", str(18 + delta)], out, *ts)
    _raises_and_writes_nothing(lambda: impl.unflatten(out, ts, 0.5), ValueError, ["18", str(18 + delta)], out, *ts)
    assert all(torch.equal(a, b) for a, b in zip(ts, snap_in))


@impl_param
@pytest.mark.parametrize("culprit", [0, 3])
def test_input_on_another_device_than_out(impl, culprit):
    """Simulated with a 'meta' tensor on a CPU-only machine (the CUDA tests do cpu vs cuda)."""
    ts = _good_inputs()
    ts[culprit] = torch.empty(ts[culprit].shape, device="meta")
    out = torch.full((18,), 7.0)
    idx = f"tensors[{culprit}]"
    _raises_and_writes_nothing(lambda: impl.flatten(ts, out, 0.5), RuntimeError, [idx, "meta", "cpu"], out, *ts)
    _raises_and_writes_nothing(lambda: impl.unflatten(out, ts, 0.5), RuntimeError, [idx, "meta", "cpu"], out, *ts)


@impl_param
def test_out_on_another_device_than_inputs(impl):
    ts = _good_inputs()
    out = torch.empty(18, device="meta")
    _raises_and_writes_nothing(lambda: impl.flatten(ts, out, 0.5), RuntimeError, ["tensors[0]", "meta"], *ts)
    _raises_and_writes_nothing(lambda: impl.unflatten(out, ts, 0.5), RuntimeError, ["tensors[0]", "meta"], *ts)


BAD_DTYPES = [torch.int32, torch.int64, torch.int8, torch.uint8, torch.bool, torch.complex64]


@impl_param
@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=str)
def test_unsupported_input_dtype(impl, dtype):
    ts = _good_inputs()
    ts[2] = torch.zeros(5, dtype=dtype)
    out = torch.full((18,), 7.0)
    name = str(dtype).replace("torch.", "")
    _raises_and_writes_nothing(lambda: impl.flatten(ts, out, 0.5), TypeError, ["tensors[2]", name], out, *ts)
    _raises_and_writes_nothing(lambda: impl.unflatten(out, ts, 0.5), TypeError, ["tensors[2]", name], out, *ts)


@impl_param
@pytest.mark.parametrize("dtype", [torch.int32, torch.bool], ids=str)
def test_unsupported_out_dtype(impl, dtype):
    ts = _good_inputs()
    out = torch.zeros(18, dtype=dtype)
    _raises_and_writes_nothing(lambda: impl.flatten(ts, out, 0.5), TypeError, ["out"], out, *ts)
    _raises_and_writes_nothing(lambda: impl.unflatten(out, ts, 0.5), TypeError, ["flat"], out, *ts)


@impl_param
def test_unsupported_dtype_message_lists_the_dtype_table(impl):
    ts = _good_inputs()
    ts[1] = torch.zeros(4, dtype=torch.int16)
    out = torch.zeros(18)
    msg = _raises_and_writes_nothing(lambda: impl.flatten(ts, out, 0.5), TypeError, ["tensors[1]", "int16"], out)
    assert msg.splitlines()[0].endswith(f"supported dtypes are {dtypes.SUPPORTED_NAMES}"), msg
    names = [dtypes.dtype_name(d) for d in dtypes.SUPPORTED_DTYPES]
    assert dtypes.SUPPORTED_NAMES == ", ".join(names[:-1]) + " and " + names[-1]


def _bad_calls():
    """Bad inputs of both ops, each once; the extension and the reference must say the same."""
    ok = _good_inputs
    buf = torch.randn(40)
    shared = torch.zeros(30)
    return {
        "empty": lambda f, u: f([], torch.zeros(3)),
        "empty-unflatten": lambda f, u: u(torch.zeros(3), []),
        "numel": lambda f, u: f(ok(), torch.zeros(19)),
        "numel-unflatten": lambda f, u: u(torch.zeros(17), ok()),
        "dtype": lambda f, u: f(ok()[:2] + [torch.zeros(5, dtype=torch.int64)], torch.zeros(12)),
        "out-dtype": lambda f, u: f(ok(), torch.zeros(18, dtype=torch.bool)),
        "flat-dtype": lambda f, u: u(torch.zeros(18, dtype=torch.int32), ok()),
        "non-dense": lambda f, u: f(ok()[:1] + [torch.randn(10)[::2]], torch.zeros(8)),
        "out-2d": lambda f, u: f(ok(), torch.zeros(2, 9)),
        "flat-strided": lambda f, u: u(torch.zeros(36)[::2], ok()),
        "alias": lambda f, u: f(ok()[:2] + [buf[12:17]], buf[10:22]),
        "alias-unflatten": lambda f, u: u(buf[10:22], ok()[:2] + [buf[12:17]]),
        "destinations-overlap": lambda f, u: u(torch.zeros(10), [shared[0:5], shared[3:8]]),
        "device": lambda f, u: f(ok()[:1] + [torch.empty(4, device="meta")], torch.zeros(7)),
        "device-unflatten": lambda f, u: u(torch.zeros(7), ok()[:1] + [torch.empty(4, device="meta")]),
    }


def assert_extension_and_reference_agree(case: str, bad_calls: Callable[[], dict], ext_ops, ref_ops, prefixes) -> None:
    """``bad_calls()[case](*ops)`` raises the same exception type and first line of message with the
    extension's ops and the reference's (skipped when the extension is not loaded); the message
    starts with one of ``prefixes``."""
    if not extension_active():
        pytest.skip("the compiled extension is not loaded: ops are the reference")
    call = bad_calls()[case]
    got = []
    for fns in (ext_ops, ref_ops):
        with pytest.raises(Exception) as info:
            call(*fns)
        got.append((type(info.value), str(info.value).splitlines()[0]))
    (ext_type, ext_msg), (ref_type, ref_msg) = got
    assert ext_msg == ref_msg
    assert issubclass(ext_type, ref_type), (ext_type, ref_type)
    assert ext_msg.startswith(prefixes), ext_msg


@pytest.mark.parametrize("case", sorted(_bad_calls()))
def test_extension_and_reference_say_the_same(case):
    """The compiled checks (csrc/ops.cpp; the fake kernels for mixed meta inputs) and the
    reference (fastcoll/reference.py) raise the same exception type with the same message."""
    assert_extension_and_reference_agree(
        case,
        _bad_calls,
        (ops.flatten_scale, ops.unflatten_scale),
        (reference.flatten_scale, reference.unflatten_scale),
        ("fastcoll.flatten_scale: ", "fastcoll.unflatten_scale: "),
    )


def _non_dense():
    base = torch.randn(8, 6)
    return {
        "transposed-slice": base[:, :5].t(),  # 5x8 with strides (1, 6): holes
        "stride-2": torch.randn(10)[::2],
        "expand": torch.randn(3, 1).expand(3, 4),  # overlapping (stride 0)
        "expand-scalar": torch.randn(1).expand(5),
    }


@impl_param
@pytest.mark.parametrize("kind", list(_non_dense()))
def test_non_dense_or_self_overlapping_tensor(impl, kind):
    bad = _non_dense()[kind]
    ts = _good_inputs() + [bad]
    n = sum(t.numel() for t in ts)
    out = torch.full((n,), 7.0)
    _raises_and_writes_nothing(lambda: impl.flatten(ts, out, 0.5), ValueError, ["tensors[4]"], out, *ts)
    watched = [out] + ts[:4] + ([bad] if "expand" not in kind else [])
    _raises_and_writes_nothing(lambda: impl.unflatten(out, ts, 0.5), ValueError, ["tensors[4]"], *watched)


@impl_param
@pytest.mark.parametrize("kind", ["stride-2", "2-D", "0-D"])
def test_out_not_1d_contiguous(impl, kind):
    ts = _good_inputs()
    out = {"stride-2": torch.full((36,), 7.0)[::2], "2-D": torch.full((2, 9), 7.0), "0-D": torch.tensor(7.0)}[kind]
    _raises_and_writes_nothing(lambda: impl.flatten(ts, out, 0.5), ValueError, ["out", "1-D contiguous"], out, *ts)
    _raises_and_writes_nothing(lambda: impl.unflatten(out, ts, 0.5), ValueError, ["flat", "1-D contiguous"], out, *ts)


@impl_param
@pytest.mark.parametrize("where", ["inside-wrong-slot", "straddles-start", "straddles-end", "own-slot-other-dtype"])
def test_out_partially_aliasing_an_input(impl, where):
    buf = torch.randn(40)
    out = buf[10:28]  # 18 elements for inputs of 3, 4, 5, 6
    ts = _good_inputs()
    if where == "inside-wrong-slot":
        ts[2] = buf[12:17]  # slot of tensors[2] starts at element 7 of out, not 2
    elif where == "straddles-start":
        ts[2] = buf[6:11]
    elif where == "straddles-end":
        ts[2] = buf[25:30]
    else:
        buf = (torch.randn(40) * 4).to(F16)
        out = buf[10:28]
        ts[2] = buf[17:22]  # float16 exactly in its own slot of a float16 out: allowed...
        ts[3] = buf.view(torch.bfloat16)[22:28]  # ...the next slot's bytes seen as bfloat16: not
    culprit = "tensors[3]" if where == "own-slot-other-dtype" else "tensors[2]"
    _raises_and_writes_nothing(lambda: impl.flatten(ts, out, 0.5), ValueError, [culprit, "overlaps"], buf, *ts)
    _raises_and_writes_nothing(lambda: impl.unflatten(out, ts, 0.5), ValueError, [culprit, "overlaps"], buf, *ts)


@impl_param
@pytest.mark.parametrize("kind", ["same-tensor", "partial", "channels-last-vs-slice"])
def test_unflatten_destinations_overlapping_each_other(impl, kind):
    a = torch.full((30,), 7.0)
    if kind == "same-tensor":
        ts = [torch.full((4,), 7.0), a[0:5], torch.full((2,), 7.0), a[0:5]]
        pair = "tensors[1] and tensors[3]"
    elif kind == "partial":
        ts = [a[0:5], torch.full((4,), 7.0), a[20:26], a[3:9]]
        pair = "tensors[0] and tensors[3]"
    else:
        w = a[1:28].view(3, 3, 3, 1).permute(0, 3, 1, 2)  # channels_last 3x1x3x3 at offset 1
        ts = [w, a[27:30], a[0:2]]
        pair = "tensors[0] and tensors[2]"
    flat = torch.randn(sum(t.numel() for t in ts))
    _raises_and_writes_nothing(lambda: impl.unflatten(flat, ts, 0.5), ValueError, [pair, "overlap"], a, flat, *ts)
    # reading from overlapping inputs is fine
    out = torch.full((flat.numel(),), float("nan"))
    impl.flatten(ts, out, 0.5)
    assert not torch.isnan(out).any()


# ---------------------------------------------------------------------------
# bucket_views and build_info
# ---------------------------------------------------------------------------


@settings(max_examples=examples(40), **HYP)
@given(specs=spec_lists(dtypes=[F32], max_count=40), offset=ODD_OFFSETS, dtype=st.sampled_from(DTYPES))
def test_bucket_views_cover_the_buffer_in_order(specs, offset, dtype):
    gen = torch.Generator().manual_seed(0)
    like = [make_tensor(s, "cpu", gen).tensor for s in specs]
    n = sum(s.numel for s in specs)
    flat = make_flat(n, dtype, "cpu", offset, 0, gen=gen, fill=None)
    views = ops.bucket_views(flat.tensor, like)
    pos = 0
    for v, t in zip(views, like):
        assert v.shape == t.shape and v.dtype == dtype and v.device == flat.tensor.device
        assert v.untyped_storage().data_ptr() == flat.buf.untyped_storage().data_ptr()
        if t.numel() > 0:
            assert v.data_ptr() == flat.tensor[pos:].data_ptr()
            # the view's elements in memory order are exactly this slot of flat
            mem = v.as_strided((v.numel(),), (1,), v.storage_offset())
            assert torch.equal(mem, flat.tensor[pos : pos + v.numel()])
        if t.numel() > 1:
            assert v.stride() == t.stride()
        pos += t.numel()
    assert pos == n


def test_bucket_views_errors():
    flat = torch.zeros(10)
    with pytest.raises(ValueError, match=r"like\[1\]"):
        ops.bucket_views(flat, [torch.zeros(2), torch.zeros(8, 2)[:, 0]])
    with pytest.raises(ValueError, match="9.*10"):
        ops.bucket_views(flat, [torch.zeros(9)])
    with pytest.raises(ValueError, match="1-D contiguous"):
        ops.bucket_views(torch.zeros(2, 5), [torch.zeros(10)])
    with pytest.raises(ValueError, match="1-D contiguous"):
        ops.bucket_views(torch.zeros(20)[::2], [torch.zeros(10)])


def test_extension_dtype_table_matches_python():
    """csrc/dtypes.h (FASTCOLL_FOR_EACH_DTYPE, in code order) and fastcoll/dtypes.py list the same dtypes."""
    if not extension_active():
        pytest.skip("the compiled extension is not loaded")
    from fastcoll import _C

    cpp = _C.build_info()["dtypes"]
    assert cpp == [dtypes.dtype_name(d) for d in dtypes.SUPPORTED_DTYPES]
    assert [getattr(torch, name) for name in cpp] == list(dtypes.SUPPORTED_DTYPES)
    assert fastcoll.build_info()["dtypes"] == cpp


def test_build_info():
    info = fastcoll.build_info()
    for key in ("fastcoll", "torch", "extension", "cuda_kernels", "compiler", "cuda_version", "cuda_arch_list"):
        assert key in info, key
    assert info["torch"] == torch.__version__
    assert info["extension"] == extension_active()
    assert isinstance(info["cuda_kernels"], bool) and isinstance(info["cuda_arch_list"], list)
    if info["extension"]:
        assert info["compiler"]
        assert info["fallback_reason"] is None
    else:
        assert not info["cuda_kernels"] and info["fallback_reason"]
    if info["cuda_kernels"]:
        assert info["cuda_arch_list"] and info["cuda_version"]


# ---------------------------------------------------------------------------
# Schema, opcheck, torch.compile
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(loader.SCHEMAS))
def test_schema_matches_loader(name):
    registered = getattr(torch.ops.fastcoll, name).default._schema
    expected = torch._C.parse_schema("fastcoll::" + loader.SCHEMAS[name])
    assert str(registered) == str(expected)


def _opcheck_samples():
    """(tensors, flat dtype, scale) for opcheck: mixed dtypes and layouts, an empty tensor."""
    cl = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    mats = torch.randn(6, 5).t()
    yield [torch.randn(3, 4), cl, torch.randn(7, dtype=F16), mats, torch.randn(0)], F32, 0.5
    yield [torch.randn(33, dtype=BF16), torch.randn(2, 2, dtype=F64)], BF16, 1.0


@pytest.mark.parametrize("op", ["flatten_scale", "unflatten_scale"])
def test_opcheck(op):
    for tensors, dtype, scale in _opcheck_samples():
        n = sum(t.numel() for t in tensors)
        flat = torch.randn(n).to(dtype)
        if op == "flatten_scale":
            args = (tensors, flat, scale)
        else:
            args = (flat, tensors, scale)
        torch.library.opcheck(getattr(torch.ops.fastcoll, op).default, args)


def compile_grads() -> List[torch.Tensor]:
    """Gradients for the torch.compile tests: a channels_last one, a vector, a bfloat16 matrix."""
    return [
        torch.randn(8, 3, 3, 3).contiguous(memory_format=torch.channels_last),
        torch.randn(8),
        torch.randn(5, 7, dtype=BF16),
    ]


def eager_and_compiled(step: Callable, backend: str, run: Callable[[Callable], tuple]) -> List[tuple]:
    """``[run(step), run(compiled step)]``, ``step`` compiled with ``backend`` as one graph (fullgraph)."""
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    return [run(fn) for fn in (step, compiled)]


def assert_same_dests(d0: Sequence[torch.Tensor], d1: Sequence[torch.Tensor]) -> None:
    for a, b in zip(d0, d1):
        assert a.stride() == b.stride() and torch.equal(a, b)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile(backend):
    def step(grads, bucket, dests, world_size: int):
        ops.flatten_scale(grads, bucket, 1.0 / world_size)
        bucket.mul_(world_size)  # stands in for the all-reduce (sum over identical ranks)
        ops.unflatten_scale(bucket, dests, 0.5)
        return bucket.sum()

    grads = compile_grads()
    n = sum(g.numel() for g in grads)

    def run(fn):
        bucket = torch.full((n,), float("nan"))
        dests = [torch.full_like(g, float("nan")) for g in grads]
        total = fn(grads, bucket, dests, 4)
        return bucket, dests, total

    (b0, d0, s0), (b1, d1, s1) = eager_and_compiled(step, backend, run)
    assert torch.equal(b0, b1) and torch.equal(s0, s1)
    assert_same_dests(d0, d1)


# ---------------------------------------------------------------------------
# CUDA: the same properties on the GPU, one kernel per direction, device errors
# ---------------------------------------------------------------------------


@CUDA
@impl_param
@settings(max_examples=examples(20), **HYP)
@given(case=cases())
def test_cuda_flatten_matches_float64(impl, case):
    check_flatten(impl, device="cuda", **case)


@CUDA
@impl_param
@settings(max_examples=examples(20), **HYP)
@given(case=cases())
def test_cuda_unflatten_matches_float64(impl, case):
    check_unflatten(impl, device="cuda", **case)


@CUDA
@impl_param
@settings(max_examples=examples(10), **HYP)
@given(case=cases())
def test_cuda_round_trip_through_bucket_views(impl, case):
    check_round_trip(impl, device="cuda", **case)


@CUDA
@impl_param
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=[f"{str(a)[6:]}-{str(b)[6:]}" for a, b in DTYPE_PAIRS])
def test_cuda_all_dtype_pairs(impl, pair):
    src, dst = pair
    for scale in (1.0, 1 / 3):
        check_flatten(impl, _fixed_specs(src), dst, scale, 1, 2, seed=11, device="cuda")
        check_unflatten(impl, _fixed_specs(dst), src, scale, 3, 0, seed=12, device="cuda")


@CUDA
@impl_param
def test_cuda_one_huge_among_many_tiny(impl):
    specs = [Spec((k % 9,), (0,), F32, k % 4, 0) for k in range(150)]
    specs.append(Spec((HUGE_NUMEL * 8,), (0,), F32, 1, 1))
    specs += [Spec((1 + k % 5, 3), (0, 1), F32, k % 2, 0) for k in range(149)]
    check_flatten(impl, specs, BF16, 1 / 8, 1, 1, seed=5, device="cuda")
    check_unflatten(impl, specs, BF16, 1 / 8, 3, 1, seed=6, device="cuda")


@CUDA
@impl_param
@pytest.mark.parametrize("culprit", [0, 3])
def test_cuda_input_on_cpu(impl, culprit):
    ts = _good_inputs(device="cuda")
    ts[culprit] = ts[culprit].cpu()
    out = torch.full((18,), 7.0, device="cuda")
    idx = f"tensors[{culprit}]"
    _raises_and_writes_nothing(lambda: impl.flatten(ts, out, 0.5), RuntimeError, [idx, "cpu", "cuda"], out, *ts)
    _raises_and_writes_nothing(lambda: impl.unflatten(out, ts, 0.5), RuntimeError, [idx, "cpu", "cuda"], out, *ts)
    cpu_out = torch.full((18,), 7.0)
    cuda_ts = _good_inputs(device="cuda")
    _raises_and_writes_nothing(lambda: impl.flatten(cuda_ts, cpu_out, 0.5), RuntimeError, ["tensors[0]"], cpu_out, *cuda_ts)


def _cuda_kernels(fn) -> List[str]:
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm up (lazy init, metadata buffers)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")):
            names.append(e.name)
    return names


def capture_graph(record: Callable[[], None], warm: Optional[Callable[[], None]] = None) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of what ``record()`` launches, captured on a side stream (``warm()`` runs there first, uncaptured)."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        if warm is not None:
            warm()
        graph.capture_begin()
        try:
            record()
        finally:
            graph.capture_end()
    torch.cuda.synchronize()
    return graph


@CUDA
@pytest.mark.parametrize("dtypes", [(F32, F32), (F32, BF16), (F16, F32)], ids=str)
def test_cuda_one_kernel_per_direction_for_300_tensors(dtypes):
    if not fastcoll.build_info()["cuda_kernels"]:
        pytest.skip("the CUDA kernels are not built (the reference launches one kernel per tensor)")
    src, dst = dtypes
    gen = torch.Generator().manual_seed(0)
    specs = [Spec((1 + (k * 37) % 700,), (0,), src, 0, 0) for k in range(299)] + [Spec((1 << 22,), (0,), src, 0, 0)]
    tensors = [make_tensor(s, "cuda", gen).tensor for s in specs]
    flat = torch.empty(sum(s.numel for s in specs), dtype=dst, device="cuda")
    pack = _cuda_kernels(lambda: ops.flatten_scale(tensors, flat, 0.25))
    unpack = _cuda_kernels(lambda: ops.unflatten_scale(flat, tensors, 4.0))
    for direction, names in (("flatten_scale", pack), ("unflatten_scale", unpack)):
        assert len(names) == 1, f"{direction} launched {len(names)} kernels for 300 tensors: {names[:5]}"
        assert "fastcoll" in names[0], f"{direction} launched {names[0]!r}, not a fastcoll kernel"


@CUDA
def test_cuda_graph_capture():
    """Up to 512 chunks the chunk table is the kernel's argument: capturable, and a replay reads the inputs anew.

    Past that the table is uploaded from host memory per call, so capture is refused before anything runs.
    """
    if not fastcoll.build_info()["cuda_kernels"]:
        pytest.skip("the CUDA kernels are not built")
    small = [torch.randn(5, device="cuda"), torch.randn(70000, device="cuda")]  # 1 + 5 chunks
    flat = torch.full((70005,), 7.0, device="cuda")
    back = [torch.zeros_like(t) for t in small]
    many = [torch.randn(3, device="cuda") for _ in range(600)]  # 600 chunks
    many_flat = torch.full((1800,), 7.0, device="cuda")

    def record():
        ops.flatten_scale(small, flat, 0.5)
        ops.unflatten_scale(flat, back, 4.0)
        for call in (lambda: ops.flatten_scale(many, many_flat, 0.5), lambda: ops.unflatten_scale(many_flat, many, 2.0)):
            with pytest.raises(RuntimeError, match="CUDA graph capture"):
                call()

    graph = capture_graph(record)
    assert torch.equal(many_flat, torch.full((1800,), 7.0, device="cuda")), "a refused call may write nothing"
    for _ in range(2):  # each replay packs the inputs' current values
        for t in small:
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(flat, torch.cat(small) * 0.5)
        for b, t in zip(back, small):
            torch.testing.assert_close(b, t * 2.0)
    ops.flatten_scale(many, many_flat, 0.5)  # outside capture the large table works
    torch.testing.assert_close(many_flat, torch.cat(many) * 0.5)
