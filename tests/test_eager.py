"""Tests of the fused ops' direct eager entry points (csrc/eager.cpp).

``fastcoll.ops`` calls on plain CPU (or CUDA) tensors skip torch.ops' boxed
call and redispatch to the same backend kernel. These tests check that the
direct path (1) writes the same bits as the boxed ``torch.ops.fastcoll.*``
call on random inputs, with poisoned outputs; (2) raises the same errors;
(3) is taken exactly when the result cannot differ (``ops.eager_stats()``
counts the calls each way) and leaves everything else (autograd, tensor
subclasses, fake tensors, dispatch and torch function modes, torch.compile)
to torch.ops; (4) is switched off by ``FASTCOLL_EAGER=0``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ops import HYP, _bad_calls, assert_bitwise, cases, examples, extension_active, flatten_case, unflatten_case
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from fastcoll import ops

pytestmark = [
    pytest.mark.usefixtures("one_intra_op_thread"),
    pytest.mark.skipif(not extension_active(), reason="the direct entry points are part of the compiled extension"),
]


class counts:
    """The direct and deferred calls made inside the block (``.direct``, ``.deferred``)."""

    def __enter__(self):
        self._before = ops.eager_stats()
        return self

    def __exit__(self, *exc):
        after = ops.eager_stats()
        self.direct = after["direct"] - self._before["direct"]
        self.deferred = after["deferred"] - self._before["deferred"]


def _boxed_flatten(tensors, out, scale=1.0, scale_by=None, nonfinite=None):
    if scale_by is None and nonfinite is None:
        torch.ops.fastcoll.flatten_scale(list(tensors), out, float(scale))
    else:
        torch.ops.fastcoll.flatten_scale_ex(list(tensors), out, float(scale), scale_by, nonfinite)


def _boxed_unflatten(flat, tensors, scale=1.0, sumsq=None):
    if sumsq is None:
        torch.ops.fastcoll.unflatten_scale(flat, list(tensors), float(scale))
    else:
        torch.ops.fastcoll.unflatten_scale_ex(flat, list(tensors), float(scale), sumsq)


# ---------------------------------------------------------------------------
# Same bits as the boxed call
# ---------------------------------------------------------------------------


def _case_args(case):
    return case["specs"], case["out_dtype"], case["out_offset"], case["out_pad"], case["seed"], "cpu"


@settings(max_examples=examples(40), **HYP)
@given(case=cases(), with_flag=st.booleans(), with_scale_by=st.booleans())
def test_flatten_writes_the_boxed_bits(case, with_flag, with_scale_by):
    """Same inputs, same NaN-poisoned out with guard regions: the whole buffers match bit for bit."""
    results = []
    for path in ("direct", "boxed"):
        made, _, out, _ = flatten_case(*_case_args(case))
        srcs = [m.tensor for m in made]
        flag = torch.zeros(1, dtype=torch.int32) if with_flag else None
        by = torch.tensor([0.75]) if with_scale_by else None
        with counts() as c:
            if path == "direct":
                ops.flatten_scale(srcs, out.tensor, case["scale"], scale_by=by, nonfinite=flag)
            else:
                _boxed_flatten(srcs, out.tensor, case["scale"], by, flag)
        if path == "direct":
            assert (c.direct, c.deferred) == (1, 0)
        results.append((out.buf, flag))
    (d_buf, d_flag), (b_buf, b_flag) = results
    assert_bitwise(d_buf, b_buf, "out's buffer")
    if with_flag:
        assert d_flag.item() == b_flag.item()


@settings(max_examples=examples(40), **HYP)
@given(case=cases(), with_sum=st.booleans())
def test_unflatten_writes_the_boxed_bits(case, with_sum):
    """Same source, same NaN-poisoned destinations with guard regions: their buffers match bit for bit."""
    results = []
    for path in ("direct", "boxed"):
        _, flat, _, dests, _ = unflatten_case(*_case_args(case))
        targets = [d.tensor for d in dests]
        sumsq = torch.full((1,), -1.0, dtype=torch.float64) if with_sum else None
        with counts() as c:
            if path == "direct":
                ops.unflatten_scale(flat.tensor, targets, case["scale"], sumsq=sumsq)
            else:
                _boxed_unflatten(flat.tensor, targets, case["scale"], sumsq)
        if path == "direct":
            assert (c.direct, c.deferred) == (1, 0)
        results.append(([d.buf for d in dests], sumsq))
    (d_bufs, d_sum), (b_bufs, b_sum) = results
    for i, (a, b) in enumerate(zip(d_bufs, b_bufs)):
        assert_bitwise(a, b, f"tensors[{i}]'s buffer")
    if with_sum:
        assert_bitwise(d_sum, b_sum, "sumsq")


def test_sum_of_squares_matches_the_boxed_call():
    gen = torch.Generator().manual_seed(3)
    ts = [torch.randn(n, generator=gen).to(dt) for n, dt in [(5, torch.float32), (300, torch.bfloat16), (7, torch.float64)]]
    boxed = torch.full((1,), -1.0, dtype=torch.float64)
    torch.ops.fastcoll.sum_of_squares(ts, boxed)
    with counts() as c:
        direct = ops.sum_of_squares(ts)
    assert (c.direct, c.deferred) == (1, 0)
    assert_bitwise(direct.reshape(1), boxed, "sum")


def test_a_generator_survives_a_deferred_call():
    ts = [torch.randn(4, requires_grad=True), torch.randn(3)]  # requires_grad: torch.ops takes it
    out = torch.full((7,), float("nan"))
    with counts() as c:
        ops.flatten_scale((t for t in ts), out, 0.5)
    assert (c.direct, c.deferred) == (0, 1)
    torch.testing.assert_close(out, torch.cat([t.detach() for t in ts]) * 0.5, rtol=0, atol=0)


def test_a_tuple_or_generator_of_tensors_works():
    ts = [torch.randn(4), torch.randn(3)]
    want = torch.cat(ts) * 0.5
    for seq in (tuple(ts), (t for t in ts)):
        out = torch.full((7,), float("nan"))
        with counts() as c:
            ops.flatten_scale(seq, out, 0.5)
        assert c.direct == 1
        torch.testing.assert_close(out, want, rtol=0, atol=0)


# ---------------------------------------------------------------------------
# Same errors, raised before anything is written
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(_bad_calls()))
def test_direct_and_boxed_say_the_same(case):
    got = []
    for fns in ((ops.flatten_scale, ops.unflatten_scale), (_boxed_flatten, _boxed_unflatten)):
        with pytest.raises(Exception) as info:
            _bad_calls()[case](*fns)
        got.append((type(info.value), str(info.value).splitlines()[0]))
    assert got[0] == got[1]


def test_a_non_tensor_in_the_list_gets_torch_ops_error():
    out = torch.zeros(4)
    with counts() as c, pytest.raises((TypeError, RuntimeError)) as direct:
        ops.flatten_scale([torch.zeros(2), [1.0, 2.0]], out)
    assert c.deferred == 1
    with pytest.raises((TypeError, RuntimeError)) as boxed:
        _boxed_flatten([torch.zeros(2), [1.0, 2.0]], out, 1.0)
    assert type(direct.value) is type(boxed.value)
    assert torch.equal(out, torch.zeros(4))


# ---------------------------------------------------------------------------
# Which calls take the direct path
# ---------------------------------------------------------------------------


def test_plain_tensors_and_parameters_take_the_direct_path():
    p = torch.nn.Parameter(torch.randn(3), requires_grad=False)
    with counts() as c:
        ops.flatten_scale([p, torch.randn(2)], torch.empty(5))
        ops.unflatten_scale(torch.randn(5), [torch.empty(3), torch.empty(2)])
    assert (c.direct, c.deferred) == (2, 0)


def _deferred_cases():
    class Sub(torch.Tensor):
        pass

    def requires_grad():
        ops.flatten_scale([torch.randn(3, requires_grad=True)], torch.empty(3))

    def subclass():
        ops.flatten_scale([torch.randn(3).as_subclass(Sub)], torch.empty(3))

    def inference_tensor():
        with torch.inference_mode():
            t = torch.randn(3)
        ops.flatten_scale([t], torch.empty(3))

    def pack_under(mode):
        with mode:
            ops.flatten_scale([torch.randn(3)], torch.empty(3))

    class PassDispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class PassFunction(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def dispatch_mode():
        pack_under(PassDispatch())

    def function_mode():
        pack_under(PassFunction())

    def fake_tensors():
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            ops.flatten_scale([torch.empty(3)], torch.empty(3))

    def meta_tensors():
        ops.flatten_scale([torch.empty(3, device="meta")], torch.empty(3, device="meta"))

    return {
        f.__name__: f
        for f in (requires_grad, subclass, inference_tensor, dispatch_mode, function_mode, fake_tensors, meta_tensors)
    }


@pytest.mark.parametrize("case", sorted(_deferred_cases()))
def test_anything_else_is_left_to_torch_ops(case):
    with counts() as c:
        _deferred_cases()[case]()
    assert (c.direct, c.deferred) == (0, 1)


def test_torch_compile_traces_torch_ops():
    def pack(ts, out):
        ops.flatten_scale(ts, out, 0.25)
        return out

    ts = [torch.randn(5), torch.randn(6)]
    compiled = torch.compile(pack, backend="aot_eager", fullgraph=True)
    out = compiled(ts, torch.full((11,), float("nan")))
    torch.testing.assert_close(out, torch.cat(ts) * 0.25, rtol=0, atol=0)


def test_the_gil_is_released_while_the_kernel_runs():
    """A Python thread runs in the middle of a long direct call (not only at its ends, where the wrapper's
    own Python code could let it in)."""
    src = [torch.randn(1 << 22) for _ in range(6)]
    out = torch.empty(6 << 22)
    ticks = []
    done = threading.Event()

    def ticker():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0)

    th = threading.Thread(target=ticker)
    th.start()
    try:
        windows = []
        for _ in range(3):
            start = time.perf_counter()
            ops.flatten_scale(src, out, 0.5)
            windows.append((start, time.perf_counter()))
    finally:
        done.set()
        th.join()
    margin = 2e-3
    inside = [t for t in ticks for a, b in windows if a + margin < t < b - margin]
    assert any(b - a > 4 * margin for a, b in windows), windows
    assert inside, "no tick in the middle of any call: the GIL was held while the kernel ran"


def test_fastcoll_eager_0_turns_the_direct_path_off():
    code = (
        "import torch; from fastcoll import ops\n"
        "ts = [torch.randn(3), torch.randn(2)]; out = torch.empty(5)\n"
        "ops.flatten_scale(ts, out, 2.0)\n"
        "assert torch.equal(out, torch.cat(ts) * 2.0)\n"
        "print(ops.eager_stats())\n"
    )
    env = dict(os.environ, FASTCOLL_EAGER="0")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "{'enabled': False, 'direct': 0, 'deferred': 0}"


@pytest.mark.cuda
def test_cuda_tensors_take_the_direct_path_and_write_the_boxed_bits():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run `make gpu-check` on the GPU machine)")
    gen = torch.Generator().manual_seed(5)
    srcs = [torch.randn(n, generator=gen).to("cuda", dt) for n, dt in [(1000, torch.float32), (77, torch.bfloat16)]]
    direct, boxed = (torch.full((1077,), float("nan"), device="cuda") for _ in range(2))
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    with counts() as c:
        ops.flatten_scale(srcs, direct, 0.5, nonfinite=flag)
    _boxed_flatten(srcs, boxed, 0.5)
    assert (c.direct, c.deferred) == (1, 0)
    assert_bitwise(direct, boxed, "out")
    assert flag.item() == 0
