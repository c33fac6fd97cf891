"""Tests of fastcoll.ops.sum_chunks: N received 16-bit chunks summed exactly, scaled, rounded once to float32.

The op's definition (float64 adds in row order, one float64 multiply, one
rounding to float32, a 16-bit output rounded from that float32) is computed
here in float64 and must match bit for bit. Independently, the inputs keep
every column's sum exact in float64 (at most 9 rows of values over at most 40
binades), so the float32 result must be within half a float32 ulp of the
exact scaled sum, where a float32 accumulation is not (a cancellation case
shows it). ``out`` is poisoned (NaN) inside a buffer whose guard elements must
keep their bits.

Implementations under test: ``torch.ops.fastcoll.sum_chunks`` (the compiled
kernel, or the reference under ``FASTCOLL_NO_EXT=1``), the public
``fastcoll.ops.sum_chunks`` and fastcoll.ops.reference called directly; the
fake kernel under FakeTensorMode and torch.compile; CUDA (marked) against the
same oracle.
"""

from __future__ import annotations

import math
from typing import Callable, Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ops import HYP, examples

from fastcoll import ops
from fastcoll.ops import reference

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
CUDA = pytest.mark.cuda
GUARD = 5  # guard elements on each side of out
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

IMPLS = {
    "dispatcher": lambda c, o, s: torch.ops.fastcoll.sum_chunks(c, o, s),
    "public": lambda c, o, s: ops.sum_chunks(c, o, s),
    "reference": lambda c, o, s: reference.sum_chunks(c, o, s),
}
impl_param = pytest.mark.parametrize("impl", sorted(IMPLS))


def oracle(chunks: torch.Tensor, scale: float, out_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(result, exact)``: the op's defined result (out_dtype) and the float64 ``scale * sum`` (exact sums here)."""
    x = chunks.detach().cpu().to(torch.float64)  # 16-bit values are exact in float64
    acc = x[0].clone()
    for r in range(1, x.shape[0]):
        acc = acc + x[r]
    value = (acc * torch.tensor(scale, dtype=torch.float64)).to(F32)
    return value.to(out_dtype), x.sum(0) * scale


def random_chunks(rows: int, n: int, dtype: torch.dtype, seed: int, spread: int) -> torch.Tensor:
    """Values of both signs over ``2 * spread`` binades (cancellation and alignment both happen)."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(-spread, spread + 1, (rows, n), generator=g).to(torch.float64))
    vals = torch.randn(rows, n, generator=g, dtype=torch.float64) * mag
    return vals.to(dtype)


def poisoned_out(n: int, dtype: torch.dtype, device: str = "cpu") -> Tuple[torch.Tensor, torch.Tensor]:
    """``(buffer, out)``: out is ``buffer[GUARD:GUARD + n]``, all NaN."""
    buf = torch.full((n + 2 * GUARD,), float("nan"), dtype=dtype, device=device)
    return buf, buf[GUARD : GUARD + n]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.int16 if t.element_size() == 2 else torch.int32)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype, (what, a.dtype, b.dtype)
    bad = (_bits(a) != _bits(b)).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.numel()} elements differ, first at {bad[0].tolist()}: {a[bad[0]]} vs {b[bad[0]]}"


def check_sum(fn: Callable, rows: int, n: int, dtype: torch.dtype, out_dtype: torch.dtype, scale: float, seed: int,
              spread: int = 6, device: str = "cpu") -> None:  # fmt: skip
    chunks = random_chunks(rows, n, dtype, seed, spread).to(device)
    before = chunks.clone()
    buf, out = poisoned_out(n, out_dtype, device)
    guards = buf.clone()
    fn(chunks, out, scale)
    expected, exact = oracle(chunks, scale, out_dtype)
    assert_same_bits(out, expected, f"sum_chunks [{rows}, {n}] {dtype} -> {out_dtype}, scale {scale}")
    assert torch.equal(chunks, before), "chunks were written"
    assert_same_bits(torch.cat([buf[:GUARD], buf[GUARD + n :]]), torch.cat([guards[:GUARD], guards[GUARD + n :]]), "guards")
    # Within half a float32 ulp of the exact scaled sum (and the float64 product's rounding), plus one 16-bit
    # rounding: not a float32 accumulation's bound, which grows with the rows and the cancellation.
    bound = exact.abs() * (2.0**-24 + 2.0**-52) + 2.0**-149
    if out_dtype != F32:
        bound = bound + exact.abs() * (2.0**-8 if out_dtype == BF16 else 2.0**-11) + 2.0**-24
    err = (out.cpu().to(torch.float64) - exact).abs()
    assert bool((err <= bound * (1 + 1e-12)).all()), f"error {err.max().item()} exceeds the bound"


def cases(max_n: int) -> dict:
    """The hypothesis strategies of one sum: up to 9 ranks, up to ``max_n`` columns."""
    return dict(
        rows=st.integers(1, 9),
        n=st.integers(0, max_n),
        dtype=st.sampled_from([BF16, F16]),
        to_f32=st.booleans(),
        scale=st.sampled_from([1.0, 0.5, 1 / 3, 1 / 7, 0.1, 2.0, -0.25]),
        seed=st.integers(0, 2**31 - 1),
    )


@impl_param
@settings(max_examples=examples(40), **HYP)
@given(**cases(700))
def test_matches_float64_oracle(impl, rows, n, dtype, to_f32, scale, seed):
    spread = 4 if dtype == F16 else 20  # float16's range is narrow
    check_sum(IMPLS[impl], rows, n, dtype, F32 if to_f32 else dtype, scale, seed, spread)


@impl_param
def test_cancellation_is_summed_exactly(impl):
    """A float32 accumulation in row order loses 2**-12 here (4096 + 2**-12 is a tie, rounded to 4096); the op does not."""
    chunks = torch.tensor([[4096.0, 1.0], [2.0**-12, 2.0**-24], [-4096.0, -1.0], [2.0**-13, 0.0]], dtype=BF16)
    out, low = torch.empty(2), torch.empty(2, dtype=BF16)
    IMPLS[impl](chunks, out, 1.0)
    IMPLS[impl](chunks, low, 1.0)
    assert out.tolist() == [3 * 2.0**-13, 2.0**-24]
    assert low.tolist() == [3 * 2.0**-13, 2.0**-24]
    f32 = chunks[0].float()
    for r in range(1, 4):
        f32 = f32 + chunks[r].float()
    assert f32.tolist() == [2.0**-13, 0.0]  # what float32 sums would store


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_one_rounding_beats_a_16_bit_ring(dtype):
    """The point of the op: 8 ranks' sum stored once is within half an ulp of the float32 sum; a ring is not."""
    rows, n = 8, 4096
    chunks = random_chunks(rows, n, dtype, 7, 2)
    out = torch.empty(n, dtype=dtype)
    ops.sum_chunks(chunks, out, 1 / rows)
    exact = chunks.to(torch.float64).sum(0) / rows
    ring = chunks[0].clone()
    for r in range(1, rows):
        ring = (ring.float() + chunks[r].float()).to(dtype)  # one rounding per hop
    ring = (ring.float() / rows).to(dtype)
    one = (out.double() - exact).abs().mean().item()
    many = (ring.double() - exact).abs().mean().item()
    assert one < many


def test_threads_do_not_change_the_bits():
    chunks = random_chunks(4, 100_003, BF16, 3, 10)
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        out = torch.empty(100_003)
        ops.sum_chunks(chunks, out, 0.25)
        outs.append(out)
    torch.set_num_threads(1)
    assert_same_bits(outs[0], outs[1], "1 thread vs 2")


@impl_param
def test_nonfinite_values_propagate(impl):
    inf, nan = float("inf"), float("nan")
    chunks = torch.tensor([[1.0, inf, nan, inf, 3e38], [2.0, 1.0, 1.0, -inf, 3e38]], dtype=BF16)
    out = torch.empty(5)
    IMPLS[impl](chunks, out, 1.0)
    assert out[0].item() == 3.0 and out[1].item() == inf
    assert math.isnan(out[2].item()) and math.isnan(out[3].item())
    assert out[4].item() == inf  # the sum exceeds float32's range
    half = torch.empty(1, dtype=F16)
    IMPLS[impl](torch.tensor([[60000.0], [60000.0]], dtype=F16), half, 0.5)  # a wide sum, no float16 overflow
    assert half.item() == 60000.0


BAD = [
    ("chunks has dtype float32", TypeError, lambda: (torch.zeros(2, 4), torch.zeros(4))),
    ("out has dtype float64", TypeError, lambda: (torch.zeros(2, 4, dtype=BF16), torch.zeros(4, dtype=torch.float64))),
    ("out has dtype float16", TypeError, lambda: (torch.zeros(2, 4, dtype=BF16), torch.zeros(4, dtype=F16))),
    ("chunks must be a contiguous 2-D", ValueError, lambda: (torch.zeros(8, dtype=BF16), torch.zeros(8))),
    ("chunks must be a contiguous 2-D", ValueError, lambda: (torch.zeros(0, 4, dtype=BF16), torch.zeros(4))),
    ("chunks must be a contiguous 2-D", ValueError, lambda: (torch.zeros(4, 2, dtype=BF16).t(), torch.zeros(4))),
    ("out must be a 1-D contiguous tensor of 4", ValueError, lambda: (torch.zeros(2, 4, dtype=BF16), torch.zeros(5))),
    ("out must be a 1-D contiguous tensor of 4", ValueError, lambda: (torch.zeros(2, 4, dtype=BF16), torch.zeros(8)[::2])),
    ("layout", TypeError, lambda: (torch.zeros(2, 4, dtype=BF16).to_sparse(), torch.zeros(4))),
]


@impl_param
@pytest.mark.parametrize("match,exc,make", BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_name_the_culprit_and_write_nothing(impl, match, exc, make):
    chunks, out = make()
    if chunks.layout != torch.strided and impl != "reference":
        pytest.skip("the dispatcher has no sparse kernel to reach (NotImplementedError before any check)")
    if out.dtype.is_floating_point:
        out.fill_(float("nan"))
    before = out.clone()
    with pytest.raises(exc, match=match):
        IMPLS[impl](chunks, out, 1.0)
    assert_same_bits(out, before, "out after a refused call")


@impl_param
def test_overlap_is_refused(impl):
    buf = torch.zeros(12, dtype=BF16)
    with pytest.raises(ValueError, match="out overlaps chunks"):
        IMPLS[impl](buf[:8].view(2, 4), buf[6:10], 1.0)


@impl_param
def test_device_mismatch_is_refused(impl):
    with pytest.raises((RuntimeError, NotImplementedError), match="out is on meta|meta"):
        IMPLS[impl](torch.zeros(2, 4, dtype=BF16), torch.zeros(4, device="meta"), 1.0)


def test_opcheck():
    samples = [
        (random_chunks(3, 17, BF16, 1, 3), torch.empty(17), 0.5),
        (random_chunks(1, 5, F16, 2, 3), torch.empty(5, dtype=F16), 1.0),
        (random_chunks(4, 0, BF16, 3, 3), torch.empty(0, dtype=BF16), 0.25),
    ]
    for chunks, out, scale in samples:
        torch.library.opcheck(torch.ops.fastcoll.sum_chunks.default, (chunks, out, scale))


def test_fake_kernel_checks_metadata():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        ops.sum_chunks(torch.empty(4, 10, dtype=BF16), torch.empty(10), 0.25)
        with pytest.raises(TypeError, match="out has dtype float16"):
            ops.sum_chunks(torch.empty(4, 10, dtype=BF16), torch.empty(10, dtype=F16))
        with pytest.raises(ValueError, match="one row of chunks"):
            ops.sum_chunks(torch.empty(4, 10, dtype=BF16), torch.empty(11))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile(backend):
    """The received chunks summed into a float32 range and into a bf16 range, one graph (fullgraph)."""

    def step(chunks, main, low):
        ops.sum_chunks(chunks, main, 0.25)
        ops.sum_chunks(chunks, low, 0.25)
        return main.sum() + low.float().sum()

    chunks = random_chunks(4, 33, BF16, 5, 4)
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    results = []
    for fn in (step, compiled):
        main, low = torch.full((33,), float("nan")), torch.full((33,), float("nan"), dtype=BF16)
        total = fn(chunks, main, low)
        results.append((main, low, total))
    (m0, l0, t0), (m1, l1, t1) = results
    assert_same_bits(m0, m1, "float32, eager vs compiled")
    assert_same_bits(l0, l1, "bf16, eager vs compiled")
    assert_same_bits(m0, oracle(chunks, 0.25, F32)[0], "float32 vs the oracle")
    assert torch.equal(t0, t1)


# ---------------------------------------------------------------------------
# CUDA: the same oracle on the GPU
# ---------------------------------------------------------------------------


@CUDA
@impl_param
@settings(max_examples=examples(20), **HYP)
@given(**cases(70_000))
def test_cuda_matches_float64_oracle(impl, rows, n, dtype, to_f32, scale, seed):
    spread = 4 if dtype == F16 else 20
    check_sum(IMPLS[impl], rows, n, dtype, F32 if to_f32 else dtype, scale, seed, spread, device="cuda")


@CUDA
def test_cuda_checks_name_the_culprit():
    with pytest.raises(RuntimeError, match="out is on cpu but chunks is on cuda"):
        ops.sum_chunks(torch.zeros(2, 4, dtype=BF16, device="cuda"), torch.zeros(4), 1.0)
    with pytest.raises(TypeError, match="chunks has dtype float32"):
        ops.sum_chunks(torch.zeros(2, 4, device="cuda"), torch.zeros(4, device="cuda"), 1.0)
