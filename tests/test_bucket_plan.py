"""Bucket plans (fastcoll.ops.BucketPlan, csrc/plan.h): planned once, reused while the tensors stay put.

Checked: a second call on a planned bucket does no planning (the plan's
build counter), a plan invalidated by a storage change (a tensor replaced, its
storage swapped with ``set_``, a non-dense tensor at the same address) is
rebuilt and stays correct (against a float64 reference, outputs poisoned
first), bad input through a plan raises the op's own error before anything is
written, planned and unplanned calls give the same bits (hypothesis), and
calls the plan does not cover run as usual. On a GPU: CUDA graph capture of a
planned bucket past 512 chunks, and a plan built on one stream used on another.
"""

from __future__ import annotations

from typing import List, Sequence

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_ops import capture_graph, examples

from fastcoll import ops

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
NAN = float("nan")
HYP = dict(deadline=None, suppress_health_check=list(HealthCheck))
CHUNK_BYTES = 64 * 1024  # csrc/cuda/copy_chunk.cuh kChunkBytes


def active_plan() -> ops.BucketPlan:
    plan = ops.BucketPlan()
    if not plan.active:
        pytest.skip("bucket plans need the compiled extension's direct eager path")
    return plan


def tensors(sizes: Sequence[int], dtypes: Sequence[torch.dtype], seed: int, device: str = "cpu") -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(dt).to(device) for n, dt in zip(sizes, dtypes)]


def packed64(ts: Sequence[torch.Tensor], scale: float) -> torch.Tensor:
    """The float64 reference of flatten_scale (before the one rounding to the buffer's dtype)."""
    return torch.cat([t.detach().cpu().double().reshape(-1) * scale for t in ts])


def tol(dtype: torch.dtype) -> dict:
    return {F16: dict(rtol=1e-3, atol=1e-5), BF16: dict(rtol=8e-3, atol=1e-5)}.get(dtype, dict(rtol=1.3e-6, atol=1e-7))


def check_pack(ts: Sequence[torch.Tensor], out: torch.Tensor, scale: float, plan: ops.BucketPlan, what: str) -> None:
    out.fill_(NAN)
    ops.flatten_scale(ts, out, scale, plan=plan)
    torch.testing.assert_close(out.double().cpu(), packed64(ts, scale), **tol(out.dtype), msg=lambda m: f"{what}: {m}")


def check_unpack(flat: torch.Tensor, dests: Sequence[torch.Tensor], scale: float, plan: ops.BucketPlan, what: str) -> None:
    for d in dests:
        d.fill_(NAN)
    ops.unflatten_scale(flat, dests, scale, plan=plan)
    at = 0
    for i, d in enumerate(dests):
        want = flat[at : at + d.numel()].double().cpu() * scale
        at += d.numel()
        torch.testing.assert_close(d.double().cpu().reshape(-1), want, **tol(d.dtype), msg=lambda m: f"{what}: tensor {i}: {m}")


def test_second_call_does_no_planning():
    plan = active_plan()
    ts = tensors([5, 1, 300, 7, 64], [F32, F16, F32, BF16, F64], seed=1)
    out = torch.empty(sum(t.numel() for t in ts))
    check_pack(ts, out, 0.5, plan, "first pack")
    assert plan.stats() == {"builds": 1, "reuses": 0}
    for t in ts:  # new values in the same storage: the plan stays, the copy reads them
        t.copy_(torch.randn(t.shape))
    check_pack(ts, out, 0.5, plan, "second pack")
    check_pack(ts, out, 3.0, plan, "third pack, another scale")
    assert plan.stats() == {"builds": 1, "reuses": 2}
    dests = [torch.empty_like(t) for t in ts]
    check_unpack(out, dests, 0.25, plan, "first unpack")
    check_unpack(out, dests, 0.25, plan, "second unpack")
    assert plan.stats() == {"builds": 2, "reuses": 3}, "one plan per direction, both kept"
    check_pack(ts, out, 0.5, plan, "pack after the unpacks")
    assert plan.stats() == {"builds": 2, "reuses": 4}


def test_storage_changes_rebuild_the_plan():
    plan = active_plan()
    ts = tensors([33, 2, 129, 8], [F32, F32, BF16, F16], seed=2)
    out = torch.empty(sum(t.numel() for t in ts), dtype=F32)
    check_pack(ts, out, 0.5, plan, "planned")
    builds = plan.stats()["builds"]

    ts[2] = torch.randn(129).to(BF16)  # a new tensor in the list (new storage)
    check_pack(ts, out, 0.5, plan, "a tensor replaced")
    assert plan.stats()["builds"] == builds + 1
    ts[0].set_(torch.randn(33).untyped_storage())  # the same tensor object, another storage
    check_pack(ts, out, 0.5, plan, "a storage swapped with set_")
    assert plan.stats()["builds"] == builds + 2
    bigger = torch.full((out.numel() + 4,), 7.0, dtype=F32)
    out2 = bigger[2 : 2 + out.numel()]  # the buffer moved
    check_pack(ts, out2, 0.5, plan, "another buffer")
    assert plan.stats()["builds"] == builds + 3
    check_pack(ts, out2, 0.5, plan, "the new plan reused")
    assert plan.stats()["builds"] == builds + 3
    assert (bigger[:2] == 7.0).all() and (bigger[-2:] == 7.0).all(), "wrote outside the buffer"


def test_a_non_dense_tensor_at_the_same_address_is_refused():
    plan = active_plan()
    base = torch.randn(4, 6)
    dense = base.view(-1)[:12]  # 12 elements from base's first address
    out = torch.empty(12)
    check_pack([dense], out, 1.0, plan, "dense")
    strided = base[:, :3]  # 12 elements, same address, not dense
    assert strided.data_ptr() == dense.data_ptr() and strided.numel() == dense.numel()
    out.fill_(7.0)
    with pytest.raises(ValueError, match=r"fastcoll.flatten_scale: tensors\[0\] \(shape \(4, 3\).*not dense"):
        ops.flatten_scale([strided], out, 1.0, plan=plan)
    assert torch.equal(out, torch.full_like(out, 7.0)), "the refused call wrote"


def test_bad_input_through_a_plan_raises_the_ops_errors_before_writing():
    plan = active_plan()
    ts = tensors([4, 5], [F32, F32], seed=3)
    out = torch.full((9,), 7.0)
    ops.flatten_scale(ts, out, 1.0, plan=plan)
    out.fill_(7.0)
    short = torch.full((8,), 7.0)
    with pytest.raises(ValueError, match="fastcoll.flatten_scale: the tensors hold 9 elements in total but out has 8"):
        ops.flatten_scale(ts, short, 1.0, plan=plan)
    assert torch.equal(short, torch.full_like(short, 7.0))
    with pytest.raises(TypeError, match=r"fastcoll.flatten_scale: tensors\[1\] has dtype int64"):
        ops.flatten_scale([ts[0], torch.arange(5)], out, 1.0, plan=plan)
    dest = torch.full((9,), 7.0)
    with pytest.raises(ValueError, match=r"fastcoll.unflatten_scale: tensors\[0\] and tensors\[1\] overlap"):
        ops.unflatten_scale(torch.randn(9), [dest[:4], dest[2:7]], 1.0, plan=plan)
    assert torch.equal(dest, torch.full_like(dest, 7.0))
    assert torch.equal(out, torch.full_like(out, 7.0))
    with pytest.raises(TypeError, match="plan must be a fastcoll.ops.BucketPlan"):
        ops.flatten_scale(ts, out, 1.0, plan="no")  # type: ignore[arg-type]


def test_calls_the_plan_does_not_cover_run_as_usual():
    plan = active_plan()
    ts = tensors([6, 3], [F32, F16], seed=4)
    out = torch.empty(9)
    ops.flatten_scale(ts, out, 2.0, scale_by=torch.tensor([0.5]), plan=plan)  # the health variant: not planned
    torch.testing.assert_close(out.double(), packed64(ts, 1.0), **tol(F16))
    grads = [t.clone().requires_grad_() for t in tensors([6, 3], [F32, F32], seed=5)]
    ops.flatten_scale(grads, out, 1.0, plan=plan)  # requires_grad: torch.ops takes it
    torch.testing.assert_close(out.double(), packed64(grads, 1.0))
    assert plan.stats() == {"builds": 0, "reuses": 0}
    plan.clear()
    check_pack(ts, out, 1.0, plan, "after clear")
    plan.clear()
    check_pack(ts, out, 1.0, plan, "rebuilt after clear")
    assert plan.stats()["builds"] == 2


def test_copies_start_empty():
    import copy
    import pickle

    plan = active_plan()
    ts = tensors([3, 4], [F32, F32], seed=8)
    check_pack(ts, torch.empty(7), 1.0, plan, "planned")
    for other in (copy.copy(plan), copy.deepcopy(plan), pickle.loads(pickle.dumps(plan))):
        assert other is not plan and other.active and other.stats() == {"builds": 0, "reuses": 0}


def test_a_plan_without_the_extension_is_inert():
    plan = ops.BucketPlan()
    plan._impl = None  # as built when the extension is not loaded
    assert not plan.active and plan.stats() == {"builds": 0, "reuses": 0}
    ts = tensors([3, 4], [F32, F64], seed=6)
    out = torch.empty(7)
    check_pack(ts, out, 0.5, plan, "inert plan")


DT = st.sampled_from([F32, F16, BF16, F64])


@settings(max_examples=examples(40), **HYP)
@given(
    specs=st.lists(st.tuples(st.integers(0, 70_000), DT), min_size=1, max_size=12),
    flat_dtype=DT,
    scale=st.sampled_from([1.0, 0.5, -3.0, 1 / 3]),
    seed=st.integers(0, 2**16),
)
def test_planned_and_unplanned_give_the_same_bits(specs, flat_dtype, scale, seed):
    plan = active_plan()
    sizes = [n if n < 1000 else n * 7 % 70_000 for n, _ in specs]
    ts = tensors(sizes, [d for _, d in specs], seed)
    n = sum(sizes)
    plain, planned = torch.full((n,), NAN, dtype=flat_dtype), torch.full((n,), NAN, dtype=flat_dtype)
    back_plain = [torch.empty_like(t) for t in ts]
    back_planned = [torch.empty_like(t) for t in ts]  # the same destinations every call: the plan is reused
    for step in range(3):  # the plan built, then reused on new values
        ops.flatten_scale(ts, plain, scale)
        ops.flatten_scale(ts, planned, scale, plan=plan)
        assert torch.equal(plain.view(torch.uint8), planned.view(torch.uint8)), f"pack, call {step}"
        for d in back_plain + back_planned:
            d.fill_(NAN)
        ops.unflatten_scale(planned, back_plain, 1 / scale)
        ops.unflatten_scale(planned, back_planned, 1 / scale, plan=plan)
        for i, (a, b) in enumerate(zip(back_plain, back_planned)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"unpack, call {step}, tensor {i}"
        for t in ts:
            t.copy_(torch.randn(t.shape).to(t.dtype))
    assert plan.stats() == {"builds": 2, "reuses": 4}


# ---------------------------------------------------------------------------
# CUDA (skipped without a GPU)
# ---------------------------------------------------------------------------


def _chunky(total: int, seed: int) -> List[torch.Tensor]:
    """float32 CUDA tensors that make ``total`` chunks: many tiny ones (one chunk each) and one big one."""
    g = torch.Generator().manual_seed(seed)
    big = max(1, total // 5)
    ts = [torch.randn(1 + k % 7, generator=g) for k in range(total - big)]
    ts.insert(len(ts) // 2, torch.randn(big * (CHUNK_BYTES // 4) - 3, generator=g))
    return [t.cuda() for t in ts]


@pytest.mark.cuda
@pytest.mark.parametrize("nchunks", [513, 1100, 3000])
def test_graph_capture_of_a_planned_bucket_past_512_chunks(nchunks):
    plan = active_plan()
    src = _chunky(nchunks, seed=nchunks)
    n = sum(t.numel() for t in src)
    flat = torch.full((n,), NAN, device="cuda")
    back = [torch.full_like(t, NAN) for t in src]
    ops.flatten_scale(src, flat, 0.5, plan=plan)  # the plans built (tables uploaded) before the capture
    ops.unflatten_scale(flat, back, 4.0, plan=plan)
    graph = capture_graph(lambda: (ops.flatten_scale(src, flat, 0.5, plan=plan), ops.unflatten_scale(flat, back, 4.0, plan=plan)))
    assert plan.stats()["builds"] == 2, plan.stats()
    g = torch.Generator().manual_seed(1)
    for replay in range(3):
        for t in src:
            t.copy_(torch.randn(t.shape, generator=g).cuda())
        flat.fill_(NAN)
        for b in back:
            b.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        want = torch.cat([t * 0.5 for t in src])
        assert torch.equal(flat, want), f"replay {replay}: packed bucket differs"
        at = 0
        for i, (b, t) in enumerate(zip(back, src)):
            assert torch.equal(b, want[at : at + t.numel()] * 4.0), f"replay {replay}: tensor {i}"
            at += t.numel()


@pytest.mark.cuda
def test_graph_capture_refuses_a_large_bucket_planned_inside_it():
    plan = active_plan()
    src = _chunky(600, seed=7)
    flat = torch.full((sum(t.numel() for t in src),), 7.0, device="cuda")
    errors: List[str] = []

    def record():
        try:
            ops.flatten_scale(src, flat, 0.5, plan=plan)
        except RuntimeError as err:
            errors.append(str(err))

    capture_graph(record)
    assert len(errors) == 1 and "make one call with this bucket plan before the capture" in errors[0], errors
    assert torch.equal(flat, torch.full_like(flat, 7.0))
    ops.flatten_scale(src, flat, 0.5, plan=plan)  # outside capture it builds and runs
    torch.testing.assert_close(flat, torch.cat(src) * 0.5, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("nchunks", [40, 700])
def test_plan_built_on_one_stream_used_on_another(nchunks):
    plan = active_plan()
    src = _chunky(nchunks, seed=11)
    flat = torch.full((sum(t.numel() for t in src),), NAN, device="cuda")
    side = torch.cuda.Stream()
    ops.flatten_scale(src, flat, 2.0, plan=plan)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flat.fill_(NAN)
        ops.flatten_scale(src, flat, 3.0, plan=plan)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(flat, torch.cat(src) * 3.0)
    assert plan.stats() == {"builds": 1, "reuses": 1}
