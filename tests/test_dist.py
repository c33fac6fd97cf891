"""Tests for fastcoll.dist: single process, 2 and 3 gloo ranks, launcher environments.

Multi-rank checks are batched into a few spawned functions (each run_ranks call
costs process start-up), which assert inside the ranks; error cases return
what every rank raised so the parent can check that all of them did.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import threading
import warnings

import pytest
import torch
import torch.distributed as tdist
from multiproc import run_ranks

import fastcoll
from fastcoll import bucketing
from fastcoll import dist as fd
from fastcoll.distributed import _agree, backends, serialize

# --------------------------------------------------------------------------- #
# Deterministic per-rank inputs (any rank can rebuild any other rank's input)
# --------------------------------------------------------------------------- #


def _dict_for(rank: int) -> dict:
    g = torch.Generator().manual_seed(100 + rank)
    d = {
        "loss": torch.tensor(float(rank + 1)),
        "vec": torch.randn(5, generator=g),
        "mat": torch.randn(2, 3, generator=g, dtype=torch.float64),
        "half": torch.randn(4, generator=g).half(),
        "count": torch.tensor([rank, 2 * rank + 1], dtype=torch.int32),
        "flag": torch.tensor(rank == 0),
        "num": 0.5 * rank,
        "empty": torch.zeros(0),
        "cl": torch.randn(1, 2, 3, 2, generator=g).to(memory_format=torch.channels_last),
        7: torch.tensor([1.0 + rank]),
    }
    keys = list(d)
    shift = rank * 3 % len(keys)
    keys = keys[shift:] + keys[:shift]  # a different key order on every rank
    if rank % 2:
        keys.reverse()
    return {k: d[k] for k in keys}


def _expected_dict(ws: int, op: str, to_float: bool) -> dict:
    dicts = [_dict_for(r) for r in range(ws)]
    out = {}
    for k in dicts[0]:
        vals = [torch.as_tensor(d[k]) for d in dicts]
        dtype = vals[0].dtype
        total = torch.stack([v.double() for v in vals]).sum(0)
        if op == "mean":
            total = total / ws
        if to_float:
            out[k] = total.float()
        elif dtype.is_floating_point:
            out[k] = total.to(dtype)
        elif op == "mean":
            out[k] = total.float()
        else:
            out[k] = total.to(dtype) if dtype != torch.bool else total > 0
    return out


def _tol(dtype):
    return {torch.float16: 2e-3, torch.bfloat16: 2e-2}.get(dtype, 1e-5)


def _grad_specs():
    # (shape, dtype, layout) ; layouts: c = contiguous, cl = channels_last,
    # t = transposed (dense, not contiguous), gap = strided with gaps (not dense)
    return [
        ((3, 4), torch.float32, "c"),
        ((5,), torch.float64, "c"),
        ((2, 3, 4, 4), torch.float32, "cl"),
        ((6,), torch.float16, "c"),
        ((4, 3), torch.float32, "t"),
        ((0,), torch.float32, "c"),
        ((3,), torch.bfloat16, "c"),
        ((4, 3), torch.float32, "gap"),
        ((40,), torch.float32, "c"),
    ]


def _grad_value(rank: int, i: int, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + i)
    return (torch.randn(shape, generator=g) * (rank + 1)).to(dtype)


def _make_params(rank: int):
    params = []
    for i, (shape, dtype, layout) in enumerate(_grad_specs()):
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        val = _grad_value(rank, i, shape, dtype)
        if layout == "cl":
            grad = val.contiguous(memory_format=torch.channels_last)
        elif layout == "t":
            grad = val.t().contiguous().t()
        elif layout == "gap":
            grad = torch.zeros(shape[0], shape[1] * 2, dtype=dtype)[:, ::2]
            grad.copy_(val)
        else:
            grad = val.clone()
        p.grad = grad
        params.append(p)
    no_grad = torch.nn.Parameter(torch.zeros(2))
    params.insert(2, no_grad)
    return params


def _obj_for(rank: int):
    return {"rank": rank, "items": list(range(rank * 300)), "text": "x" * (1000 * rank + 1), "none": None}


def _result_for(i: int):
    return None if i % 3 == 0 else {"idx": i, "blob": "r" * i}


# --------------------------------------------------------------------------- #
# Rank functions
# --------------------------------------------------------------------------- #


def _rank_tensor_collectives(rank: int, ws: int):
    # process information
    assert fd.get_rank() == rank and fastcoll.get_rank() == rank
    assert fd.get_world_size() == ws
    assert fd.is_distributed() and fd.distributed_available()
    assert backends.bound_device() is None and backends.comm_device() == torch.device("cpu")  # gloo, no device_id
    fd.synchronize()
    assert fd.rank_zero_only(lambda: "ran")() == ("ran" if rank == 0 else None)

    # reduce_mean: new tensor, input untouched, strides kept, ints -> float mean
    mean_factor = sum(range(1, ws + 1)) / ws
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    x = base * (rank + 1)
    x_before = x.clone()
    out = fd.reduce_mean(x)
    assert torch.equal(x, x_before), "reduce_mean modified its input"
    assert out.data_ptr() != x.data_ptr()
    torch.testing.assert_close(out, base * mean_factor)
    cl = (torch.arange(24.0).reshape(1, 2, 3, 4) * (rank + 1)).to(memory_format=torch.channels_last)
    out_cl = fd.reduce_mean(cl)
    assert out_cl.stride() == cl.stride()
    torch.testing.assert_close(out_cl, torch.arange(24.0).reshape(1, 2, 3, 4) * mean_factor)
    gap = (torch.arange(12.0).reshape(3, 4) * (rank + 1))[:, ::2]
    torch.testing.assert_close(fd.reduce_mean(gap), torch.arange(12.0).reshape(3, 4)[:, ::2] * mean_factor)
    half = torch.full((3,), float(rank + 1), dtype=torch.float16)
    out_half = fd.reduce_mean(half)
    assert out_half.dtype == torch.float16
    torch.testing.assert_close(out_half.float(), torch.full((3,), mean_factor), atol=1e-3, rtol=1e-3)
    big = fd.reduce_mean(torch.tensor([200, 1], dtype=torch.uint8))  # summed in int64: no wrap-around
    assert big.dtype == torch.float32 and torch.equal(big, torch.tensor([200.0, 1.0]))
    ints = torch.tensor([rank, 1], dtype=torch.int64)
    ints_out = fd.reduce_mean(ints)
    assert ints_out.dtype == torch.float32 and torch.equal(ints, torch.tensor([rank, 1]))
    torch.testing.assert_close(ints_out, torch.tensor([sum(range(ws)) / ws, 1.0]))
    scalar = torch.tensor(float(rank), requires_grad=True)
    out_scalar = fd.reduce_mean(scalar * 1)
    assert out_scalar.shape == () and not out_scalar.requires_grad
    torch.testing.assert_close(out_scalar, torch.tensor(sum(range(ws)) / ws))

    # all_reduce_dict against its definition, rank-dependent key order
    for op in ("sum", "mean"):
        for to_float in (True, False):
            d = _dict_for(rank)
            got = fd.all_reduce_dict(d, op=op, to_float=to_float)
            assert list(got) == list(d), "result not in the caller's key order"
            want = _expected_dict(ws, op, to_float)
            for k, v in got.items():
                assert v.dtype == want[k].dtype, (op, to_float, k, v.dtype, want[k].dtype)
                assert v.shape == want[k].shape, (k, v.shape)
                tol = _tol(torch.as_tensor(d[k]).dtype) if not to_float else 1e-5
                torch.testing.assert_close(v, want[k], atol=tol, rtol=tol, msg=lambda m, w=f"{op} {to_float} {k!r}": f"{w}: {m}")
            fresh = _dict_for(rank)
            for k in d:  # inputs untouched
                assert torch.equal(torch.as_tensor(d[k]), torch.as_tensor(fresh[k]))
    got = fd.all_reduce_dict({"b": torch.ones(2), "a": torch.tensor(float(rank))}, reduce_op="mean")
    torch.testing.assert_close(got["a"], torch.tensor(sum(range(ws)) / ws))
    assert fd.all_reduce_dict({}) == {}

    # allreduce_grads: every configuration against the mean of every rank's grads
    for coalesce, bucket in ((True, -1), (True, 1e-4), (False, -1)):
        params = _make_params(rank)
        before = [(p.grad.data_ptr(), p.grad.stride()) if p.grad is not None else None for p in params]
        fd.allreduce_grads((p for p in params), coalesce=coalesce, bucket_size_mb=bucket)
        specs = _grad_specs()
        with_grad = [p for p in params if p.grad is not None]
        assert len(with_grad) == len(specs) and params[2].grad is None
        for i, ((shape, dtype, _), p) in enumerate(zip(specs, with_grad)):
            want = sum(_grad_value(r, i, shape, dtype).double() for r in range(ws)) / ws
            tol = _tol(dtype)
            torch.testing.assert_close(
                p.grad.double(), want, atol=tol, rtol=tol, msg=lambda m, w=f"{coalesce} {bucket} grad {i}": f"{w}: {m}"
            )
        after = [(p.grad.data_ptr(), p.grad.stride()) if p.grad is not None else None for p in params]
        assert before == after, "gradients were replaced instead of updated in place"

    # sparse COO gradients (as nn.Embedding(sparse=True) makes) next to a dense one: the mean, still
    # sparse; rows differ and repeat across ranks, and in round 1 rank 0 has no rows at all
    def sparse_grad(r: int, round_: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(50 + 10 * r + round_)
        n = 0 if (round_ == 1 and r == 0) else 4
        idx = torch.randint(0, 10, (1, n), generator=g)
        return torch.sparse_coo_tensor(idx, torch.randn(n, 3, generator=g), (10, 3))

    for round_ in range(2):
        for coalesce in (True, False):
            emb, lin = torch.nn.Parameter(torch.zeros(10, 3)), torch.nn.Parameter(torch.zeros(2))
            emb.grad, lin.grad = sparse_grad(rank, round_), torch.full((2,), float(rank))
            fd.allreduce_grads([emb, lin], coalesce=coalesce)
            want = sum(sparse_grad(r, round_).to_dense().double() for r in range(ws)) / ws
            assert emb.grad.is_sparse, f"round {round_} coalesce={coalesce}: the sparse gradient came back dense"
            torch.testing.assert_close(
                emb.grad.to_dense().double(), want, msg=lambda m, w=f"round {round_} coalesce={coalesce}": f"{w}: {m}"
            )
            torch.testing.assert_close(lin.grad, torch.full((2,), sum(range(ws)) / ws))
    csr = torch.eye(2).to_sparse_csr().requires_grad_()
    csr.grad = torch.eye(2).to_sparse_csr()
    with pytest.raises(TypeError, match="gradient 0 .*layout torch.sparse_csr"):
        fd.allreduce_grads([csr])

    # the reused CPU buffer: smaller, then larger again, then after release
    for subset in (slice(0, 3), slice(None), None):
        if subset is None:
            fd.release_buffers()
            subset = slice(None)
        params = _make_params(rank)
        with_grad = [p for p in params if p.grad is not None][subset]
        fd.allreduce_grads(with_grad)
        for i, ((shape, dtype, _), p) in enumerate(zip(_grad_specs()[subset], with_grad)):
            want = sum(_grad_value(r, i, shape, dtype).double() for r in range(ws)) / ws
            torch.testing.assert_close(p.grad.double(), want, atol=_tol(dtype), rtol=_tol(dtype))

    # a subgroup: only its members reduce
    members = [0, ws - 1]
    sub = tdist.new_group(members)
    if rank in members:
        got = fd.all_reduce_dict({"v": torch.tensor([float(rank)])}, op="sum", group=sub)
        torch.testing.assert_close(got["v"], torch.tensor([float(sum(members))]))
        assert fd.get_world_size(sub) == 2
        torch.testing.assert_close(fd.reduce_mean(torch.tensor(float(rank)), group=sub), torch.tensor(sum(members) / 2))
        got_b = fd.broadcast({"from": rank}, src=ws - 1, group=sub)
        assert got_b == {"from": ws - 1}

    # is_module_wrapper with real wrappers
    lin = torch.nn.Linear(2, 2)
    ddp = torch.nn.parallel.DistributedDataParallel(lin)

    class MyDDP(torch.nn.parallel.DistributedDataParallel):
        pass

    assert fd.is_module_wrapper(ddp)
    assert fd.is_module_wrapper(MyDDP(torch.nn.Linear(2, 2)))
    assert fd.is_module_wrapper(torch.nn.DataParallel(ddp))
    assert not fd.is_module_wrapper(torch.nn.Sequential(ddp))
    assert not fd.is_module_wrapper(lin)
    assert fd.is_module_wrapper(fastcoll.DDP(torch.nn.Linear(2, 2)))

    # a backend that cannot use this device: everything is staged through the comm device
    real_supports = backends.group_supports
    backends.group_supports = lambda device, group=None: False
    try:
        got = fd.all_reduce_dict({"v": torch.tensor([float(rank)]), "n": torch.tensor([rank])}, to_float=False)
        assert torch.equal(got["v"], torch.tensor([float(sum(range(ws)))])) and torch.equal(
            got["n"], torch.tensor([sum(range(ws))])
        )
        torch.testing.assert_close(fd.reduce_mean(torch.tensor([float(rank)])), torch.tensor([sum(range(ws)) / ws]))
        for coalesce in (True, False):
            params = _make_params(rank)
            fd.allreduce_grads(params, coalesce=coalesce)
            for i, ((shape, dtype, _), p) in enumerate(zip(_grad_specs(), [p for p in params if p.grad is not None])):
                want = sum(_grad_value(r, i, shape, dtype).double() for r in range(ws)) / ws
                torch.testing.assert_close(p.grad.double(), want, atol=_tol(dtype), rtol=_tol(dtype))
    finally:
        backends.group_supports = real_supports
    return True


def _rank_objects(rank: int, ws: int, sysdir: str, cwd: str):
    tempfile.tempdir = sysdir  # every fresh "system" temporary directory lands here
    os.chdir(cwd)
    obj = _obj_for(rank)

    t = fd.obj2tensor(obj)
    assert t.dtype == torch.uint8 and t.device.type == "cpu" and t.dim() == 1
    assert fd.tensor2obj(t) == obj
    s = fd.serialize_to_tensor(obj)
    assert s.device.type == "cpu" and fd.tensor2obj(s) == obj

    sizes, padded = fd.pad_to_largest_tensor(s)
    want_sizes = [len(pickle.dumps(_obj_for(r), protocol=pickle.HIGHEST_PROTOCOL)) for r in range(ws)]
    assert sizes == want_sizes, (sizes, want_sizes)
    assert padded.numel() == max(want_sizes) and torch.equal(padded[: s.numel()], s)
    assert int(padded[s.numel() :].abs().sum()) == 0

    assert fd.broadcast(obj, src=ws - 1) == _obj_for(ws - 1)
    assert fd.broadcast(obj) == _obj_for(0)

    everyone = [_obj_for(r) for r in range(ws)]
    assert fd.all_gather_object_gpu(obj, rank_zero_return_only=False) == everyone
    assert fd.all_gather_object_gpu(obj) == (everyone if rank == 0 else None)

    assert fd.all_gather_object_cpu(obj, use_system_tmp=True, rank_zero_return_only=False) == everyone
    assert fd.all_gather_object_cpu(obj) == (everyone if rank == 0 else None)  # under ./.dist_tmp
    given = os.path.join(sysdir, "given")
    assert fd.all_gather_object_cpu(obj, tmpdir=given) == (everyone if rank == 0 else None)
    fd.synchronize()
    assert os.path.isdir(given) and os.listdir(given) == [], os.listdir(given)
    fd.synchronize()
    if rank == 0:
        os.rmdir(given)

    path = fd.create_tmpdir(rank)
    assert os.path.isdir(path) and path.startswith(sysdir)
    assert fd.all_gather_object_gpu(path, rank_zero_return_only=False) == [path] * ws
    fd.synchronize()
    if rank == 0:
        os.rmdir(path)

    # collect_results: DistributedSampler order and padding, None results kept
    from torch.utils.data import DistributedSampler

    for n in (7, 8):
        sampler = DistributedSampler(range(n), num_replicas=ws, rank=rank, shuffle=False)
        results = [_result_for(i) for i in sampler]
        for device in ("cpu", "gpu"):
            got = fd.collect_results(results, n, device=device)
            if rank == 0:
                assert got == [_result_for(i) for i in range(n)], (n, device, got)
            else:
                assert got is None
    # unequal shares (no padding): still interleaved into dataset order
    results = [_result_for(i) for i in range(rank, 7, ws)]
    got = fd.collect_results(results, 7, device="gpu")
    assert got == ([_result_for(i) for i in range(7)] if rank == 0 else None)
    fd.synchronize()
    return True


def _capture(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the parent checks type and message
        return type(exc).__name__, str(exc)
    return None


def _still_in_step(ws):
    got = fd.all_reduce_dict({"ok": torch.tensor(1.0)})
    assert float(got["ok"]) == ws, "ranks fell out of step after an error"


def _rank_errors(rank: int, ws: int, sysdir: str):
    tempfile.tempdir = sysdir
    out = {}

    d = {"a": torch.ones(2), "b": torch.ones(3)}
    if rank == 1:
        d["extra_key"] = torch.ones(1)
    if rank == 2:
        d["b"] = torch.ones(4)
    out["dict_keys"] = _capture(lambda: fd.all_reduce_dict(d))
    _still_in_step(ws)

    d = {"a": torch.ones(2, dtype=torch.float32 if rank == 0 else torch.float64)}
    out["dict_dtype"] = _capture(lambda: fd.all_reduce_dict(d))
    _still_in_step(ws)

    out["dict_op"] = _capture(lambda: fd.all_reduce_dict({"a": torch.ones(1)}, op="sum" if rank == 0 else "mean"))
    _still_in_step(ws)

    out["dict_value_one_rank"] = _capture(lambda: fd.all_reduce_dict({"a": "text" if rank == 1 else torch.ones(1)}))
    _still_in_step(ws)
    out["dict_value_all"] = _capture(lambda: fd.all_reduce_dict({"a": torch.ones(1), "s": "text"}))
    _still_in_step(ws)
    out["dict_bad_op"] = _capture(lambda: fd.all_reduce_dict({"a": torch.ones(1)}, op="max"))

    params = _make_params(rank)
    if rank == ws - 1:
        params[0].grad = None
    snapshot = [None if p.grad is None else p.grad.clone() for p in params]
    out["grads"] = _capture(lambda: fd.allreduce_grads(params))
    out["grads_untouched"] = all((a is None and p.grad is None) or torch.equal(a, p.grad) for a, p in zip(snapshot, params))
    _still_in_step(ws)

    def unpicklable_on(r):
        return threading.Lock() if rank == r else _obj_for(rank)

    out["gather_gpu_all"] = _capture(lambda: fd.all_gather_object_gpu(unpicklable_on(1), rank_zero_return_only=False))
    _still_in_step(ws)
    out["gather_gpu_zero"] = _capture(lambda: fd.all_gather_object_gpu(unpicklable_on(1)))
    _still_in_step(ws)

    def local_fn():
        return None

    out["broadcast"] = _capture(lambda: fd.broadcast(local_fn if rank == 1 else None, src=1))
    _still_in_step(ws)
    out["broadcast_src"] = _capture(lambda: fd.broadcast(1, src=ws))
    _still_in_step(ws)

    out["gather_cpu"] = _capture(lambda: fd.all_gather_object_cpu(unpicklable_on(ws - 1), use_system_tmp=True))
    _still_in_step(ws)
    given = os.path.join(sysdir, "given")
    out["gather_cpu_given"] = _capture(
        lambda: fd.all_gather_object_cpu(unpicklable_on(0), tmpdir=given, rank_zero_return_only=False)
    )
    _still_in_step(ws)
    out["collect_device"] = _capture(lambda: fd.collect_results([1], 1, device="tpu"))
    _still_in_step(ws)

    # the agreement protocol itself
    assert _agree.agree("fastcoll.t", values=[rank, 10 * rank], desc=("same", 1)) == [[r, 10 * r] for r in range(ws)]
    errors = {1: ValueError("fastcoll.t: bad value 7"), 2: FileNotFoundError("no such file")}
    out["agree_types"] = _capture(lambda: _agree.agree("fastcoll.t", error=errors.get(rank)))
    same = RuntimeError("same text") if rank != 1 else None
    out["agree_grouped"] = _capture(lambda: _agree.agree("fastcoll.t", error=same, desc=rank))  # errors beat desc
    out["agree_other_type"] = _capture(lambda: _agree.agree("fastcoll.t", error=KeyError("k") if rank == 2 else None))
    try:
        _agree.agree("fastcoll.t", error=ValueError("mine") if rank == 0 else None)
    except ValueError as exc:
        assert (exc.__cause__ is not None) == (rank == 0), "the failing rank's own error is the cause"
    out["agree_mismatch"] = _capture(
        lambda: _agree.agree(
            "fastcoll.t", desc=("x", rank == 2), mismatch=RuntimeError, explain=lambda descs: f"got {[d[1] for d in descs]}"
        )
    )
    out["agree_default_explain"] = _capture(lambda: _agree.agree("fastcoll.t", desc={"n": 3 if rank == 1 else 4}))
    _still_in_step(ws)
    return out


_LAUNCH_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
    "SLURM_NODELIST", "SLURM_JOB_NODELIST", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_RANK", "PMI_SIZE",
    "MPI_LOCALRANKID", "PMI_LOCAL_RANK",
)  # fmt: skip


def _rank_init_launchers(rank: int, ws: int, ports):
    envs = {
        "pytorch": {"RANK": rank, "WORLD_SIZE": ws, "LOCAL_RANK": rank, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": ports[0]},
        "slurm": {"SLURM_PROCID": rank, "SLURM_NTASKS": ws, "SLURM_NODELIST": "localhost,node[2-5]", "SLURM_NTASKS_PER_NODE": ws, "MASTER_PORT": ports[1]},  # noqa: E501
        "mpi": {"PMI_RANK": rank, "PMI_SIZE": ws, "MASTER_ADDR": "127.0.0.1"},
    }  # fmt: skip
    seen = {}
    for launcher, env in envs.items():
        for var in _LAUNCH_VARS:
            os.environ.pop(var, None)
        os.environ.update({k: str(v) for k, v in env.items()})
        kwargs = {"port": ports[2]} if launcher == "mpi" else {}
        fd.init_dist(launcher, timeout=30, **kwargs)
        try:
            assert tdist.get_backend() == "gloo"
            assert fd.get_rank() == rank and fd.get_world_size() == ws
            assert fd.get_local_rank() == (rank if launcher != "mpi" else 0)
            t = torch.tensor([rank + 1.0])
            tdist.all_reduce(t)
            seen[launcher] = (float(t), os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
        finally:
            tdist.destroy_process_group()
    return seen


# --------------------------------------------------------------------------- #
# Multi-rank tests
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("ws", [2, 3])
def test_tensor_collectives_multi_rank(ws):
    assert run_ranks(_rank_tensor_collectives, ws, timeout=120) == [True] * ws


@pytest.mark.parametrize("ws", [2, 3])
def test_object_collectives_multi_rank(ws, tmp_path):
    sysdir, cwd = tmp_path / "sys", tmp_path / "cwd"
    sysdir.mkdir()
    cwd.mkdir()
    assert run_ranks(_rank_objects, ws, str(sysdir), str(cwd), timeout=120) == [True] * ws
    assert os.listdir(sysdir) == [], "temporary directories were left behind"
    assert os.listdir(cwd) == [], "./.dist_tmp was left behind"


def test_errors_raise_on_every_rank(tmp_path):
    ws = 3
    outs = run_ranks(_rank_errors, ws, str(tmp_path), timeout=90, pg_timeout=20)

    def every_rank(case, exc_type, *fragments, absent=()):
        for r, out in enumerate(outs):
            got = out[case]
            assert got is not None, f"{case}: rank {r} did not raise"
            assert got[0] == exc_type, f"{case}: rank {r} raised {got}"
            for frag in fragments:
                assert frag in got[1], f"{case}: rank {r}: {frag!r} not in {got[1]!r}"
            for frag in absent:
                assert frag not in got[1], f"{case}: rank {r}: {frag!r} in {got[1]!r}"

    every_rank("dict_keys", "ValueError", "'extra_key'", "'b'", absent=("'a'",))
    every_rank("dict_dtype", "ValueError", "'a'", "float64")
    every_rank("dict_op", "ValueError", "op=")
    every_rank("dict_value_one_rank", "ValueError", "'a'")
    every_rank("dict_value_all", "TypeError", "'s'")
    every_rank("dict_bad_op", "ValueError", "'max'")
    every_rank("grads", "ValueError", "number of gradients differs")
    assert all(out["grads_untouched"] for out in outs)
    every_rank("gather_gpu_all", "TypeError", "rank 1", "_thread.lock")
    every_rank("gather_gpu_zero", "TypeError", "rank 1", "_thread.lock")
    every_rank("broadcast", "TypeError", "rank 1", "function")
    every_rank("broadcast_src", "ValueError", f"src={ws}")
    every_rank("gather_cpu", "TypeError", f"rank {ws - 1}", "_thread.lock")
    every_rank("gather_cpu_given", "TypeError", "rank 0")
    every_rank("collect_device", "ValueError", "'tpu'")
    every_rank("agree_types", "ValueError", "fastcoll.t: failed on 2 rank(s): rank 1: bad value 7; rank 2: no such file")
    every_rank("agree_grouped", "RuntimeError", "failed on 2 rank(s): ranks 0, 2: same text")
    every_rank("agree_other_type", "RuntimeError", "rank 2: 'k'")
    every_rank("agree_mismatch", "RuntimeError", "fastcoll.t: got [False, False, True]")
    every_rank("agree_default_explain", "ValueError", "rank 0: {'n': 4}; rank 1: {'n': 3}")
    assert sorted(os.listdir(tmp_path)) == ["given"], "the temporary directory was not removed"
    assert os.listdir(tmp_path / "given") == [], "part files were left behind"


def _free_ports(n):
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def test_init_dist_really_initializes_each_launcher():
    ws = 2
    ports = _free_ports(3)
    outs = run_ranks(_rank_init_launchers, ws, ports, init_pg=False, timeout=90)
    for out in outs:
        assert out["pytorch"] == (3.0, "127.0.0.1", str(ports[0]))
        assert out["slurm"] == (3.0, "localhost", str(ports[1]))  # host parsed from SLURM_NODELIST
        assert out["mpi"] == (3.0, "127.0.0.1", str(ports[2]))


# --------------------------------------------------------------------------- #
# Single process, no process group
# --------------------------------------------------------------------------- #


@pytest.fixture
def no_pg():
    assert not tdist.is_initialized(), "a test left a process group in the main process"
    yield


def test_process_info_without_process_group(no_pg, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert (fd.get_rank(), fd.get_world_size(), fd.get_local_rank()) == (0, 1, 0)
    assert not fd.is_distributed() and not fd.distributed_available()
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert fd.get_local_rank() == 3
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        fd.get_local_rank()
    fd.synchronize()  # a no-op, must not raise
    calls = []

    @fd.rank_zero_only
    def log(x):
        """Doc."""
        calls.append(x)
        return x * 2

    assert log(4) == 8 and calls == [4] and log.__doc__ == "Doc."


def test_tensor_collectives_without_process_group(no_pg):
    x = torch.arange(6.0).reshape(2, 3)
    out = fd.reduce_mean(x)
    assert out is not x and out.data_ptr() != x.data_ptr() and torch.equal(out, x)
    out.add_(1)
    assert torch.equal(x, torch.arange(6.0).reshape(2, 3))
    assert torch.equal(fd.reduce_mean(torch.tensor([1, 2])), torch.tensor([1.0, 2.0]))

    for op in ("sum", "mean"):
        for to_float in (True, False):
            d = _dict_for(0)
            got = fd.all_reduce_dict(d, op=op, to_float=to_float)
            assert list(got) == list(d)
            want = _expected_dict(1, op, to_float)
            for k in d:
                assert got[k].dtype == want[k].dtype, (op, to_float, k)
                torch.testing.assert_close(got[k], want[k])
            assert got["loss"].data_ptr() != d["loss"].data_ptr()

    params = _make_params(0)
    before = [None if p.grad is None else p.grad.clone() for p in params]
    fd.allreduce_grads(params)
    fd.allreduce_grads(params, coalesce=False)
    for a, p in zip(before, params):
        assert (a is None and p.grad is None) or torch.equal(a, p.grad)


def test_object_collectives_without_process_group(no_pg, tmp_path, monkeypatch):
    obj = _obj_for(2)
    t = fd.obj2tensor(obj)
    assert t.dtype == torch.uint8 and t.device.type == "cpu"
    assert fd.tensor2obj(t) == obj and fd.tensor2obj(fd.serialize_to_tensor(obj)) == obj
    sizes, padded = fd.pad_to_largest_tensor(t)
    assert sizes == [t.numel()] and torch.equal(padded, t)
    assert fd.broadcast(obj) is obj
    assert fd.all_gather_object_gpu(obj) == [obj]
    assert fd.all_gather_object_cpu(obj) == [obj]
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = fd.create_tmpdir(0)
    assert os.path.isdir(path) and path.startswith(str(tmp_path))
    given = str(tmp_path / "a" / "b")
    assert fd.create_tmpdir(0, given) == given and os.path.isdir(given)
    assert fd.collect_results([1, None, 3, 4], 3) == [1, None, 3]
    with pytest.warns(RuntimeWarning, match="gathered 2 results"):
        assert fd.collect_results([1, 2], 5) == [1, 2]
    with pytest.raises(ValueError, match="'tpu'"):
        fd.collect_results([1], 1, device="tpu")


def test_pickling_errors_and_large_payload_warning(no_pg, monkeypatch):
    with pytest.raises(TypeError, match=r"_thread\.lock"):
        fd.obj2tensor(threading.Lock())
    with pytest.raises(TypeError, match="function"):
        fd.serialize_to_tensor(lambda: None)
    with pytest.raises(TypeError, match="expected a tensor"):
        fd.tensor2obj(b"abc")
    monkeypatch.setattr(serialize, "LARGE_PAYLOAD_BYTES", 1000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fd.obj2tensor("x" * 10)
    with pytest.warns(RuntimeWarning, match="GiB"):
        fd.obj2tensor("x" * 5000)


def test_is_module_wrapper(no_pg, monkeypatch):
    lin = torch.nn.Linear(2, 2)
    dp = torch.nn.DataParallel(lin)
    assert fd.is_module_wrapper(dp) and fastcoll.is_module_wrapper(torch.nn.DataParallel(dp))
    assert not fd.is_module_wrapper(lin) and not fd.is_module_wrapper(torch.nn.Sequential(dp))
    assert not fd.is_module_wrapper("not a module")

    class DDP(torch.nn.parallel.DistributedDataParallel):  # as fastcoll.DDP subclasses it; no process group needed
        def __init__(self, module):
            torch.nn.Module.__init__(self)
            self.module = module

    assert fd.is_module_wrapper(DDP(lin))
    assert fd.is_module_wrapper(torch.compile(DDP(lin)))  # compiled wrapper: looked through
    assert not fd.is_module_wrapper(torch.compile(lin))


@pytest.mark.parametrize(
    "backend,cpu_ok,cuda_ok",
    [
        ("gloo", True, True),
        ("nccl", False, True),
        ("mpi", True, False),
        ("cpu:gloo,cuda:nccl", True, True),
        ("cuda:nccl", False, True),
        ("ucc", True, True),  # unknown: torch decides
    ],
)
def test_backend_supports_device(backend, cpu_ok, cuda_ok):
    assert backends.supports_device(backend, torch.device("cpu")) is cpu_ok
    assert backends.supports_device(backend, torch.device("cuda", 0)) is cuda_ok


_CPU, _C0, _C1, _C2, _C3 = (torch.device(d) for d in ("cpu", "cuda:0", "cuda:1", "cuda:2", "cuda:3"))


@pytest.mark.parametrize(
    "backend,devices,bound,current,want",
    [
        # backends that handle CPU tensors communicate on the CPU, whatever else is known
        ("gloo", [_C2], _C1, 3, _CPU),
        ("mpi", [], None, 0, _CPU),
        ("cpu:gloo,cuda:nccl", [_C2], _C1, 3, _CPU),
        ("", [], None, None, _CPU),  # not distributed
        # nccl: the tensors' CUDA device first ...
        ("nccl", [_C2], _C1, 3, _C2),
        ("nccl", [_CPU, _C3, _C2], _C1, 0, _C3),
        ("cuda:nccl", [_C2], None, 0, _C2),
        # ... else the group's bound device ...
        ("nccl", [], _C1, 3, _C1),
        ("nccl", [_CPU], _C1, 3, _C1),
        # ... else the current device (set_device never called: cuda:0)
        ("nccl", [_CPU], None, 3, _C3),
        ("nccl", [], None, 0, _C0),
        ("cuda:nccl", [], None, None, _CPU),  # no CUDA at all
    ],
)
def test_comm_device_rule(backend, devices, bound, current, want):
    assert backends.pick_comm_device(backend, devices, bound, current) == want


def test_comm_device_without_process_group(no_pg):
    assert backends.comm_device() == torch.device("cpu") and backends.bound_device() is None
    assert backends.comm_device(tensors=[torch.zeros(1)]) == torch.device("cpu")


@pytest.mark.parametrize(
    "sizes,cap,runs",
    [
        ([4, 4, 4], 8, [[0, 1], [2]]),
        ([4, 20, 4], 8, [[0], [1], [2]]),  # too large for the cap: a run of its own
        ([4, 4, 4], 12, [[0, 1, 2]]),
        ([4, 4, 4], -1, [[0, 1, 2]]),  # no cap: one run
        ([0, 0, 9, 0], 8, [[0, 1], [2], [3]]),
    ],
)
def test_split_by_bytes(sizes, cap, runs):
    assert bucketing.split_by_bytes(sizes, cap) == runs


def test_agree_without_process_group(no_pg):
    assert _agree.agree("fastcoll.x", values=[3, 4], desc="anything") == [[3, 4]]
    err = OSError("disk full")
    with pytest.raises(OSError) as info:
        _agree.agree("fastcoll.x", error=err)
    assert info.value is err  # the local error itself, no collective


def test_reexports():
    for name in ("init_dist", "reduce_mean", "all_reduce_dict", "allreduce_grads", "collect_results", "get_rank"):
        assert getattr(fastcoll, name) is getattr(fd, name) and name in fastcoll.__all__


# --------------------------------------------------------------------------- #
# Launchers, in process (init_process_group replaced by a recorder)
# --------------------------------------------------------------------------- #


@pytest.fixture
def launch(monkeypatch):
    saved = dict(os.environ)
    for var in _LAUNCH_VARS:
        os.environ.pop(var, None)
    calls = []
    monkeypatch.setattr(tdist, "init_process_group", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(tdist, "is_initialized", lambda: False)
    yield calls
    os.environ.clear()
    os.environ.update(saved)


LAUNCH_CASES = [
    # launcher, env, init_dist kwargs, (rank, world_size, local_rank, MASTER_ADDR, MASTER_PORT)
    ("pytorch", {"RANK": 3, "WORLD_SIZE": 8, "LOCAL_RANK": 1, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": 1234}, {}, (3, 8, 1, "10.0.0.1", 1234)),  # noqa: E501
    ("pytorch", {"RANK": 0, "WORLD_SIZE": 1, "MASTER_ADDR": "h"}, {"port": 4321}, (0, 1, 0, "h", 4321)),
    ("pytorch", {"RANK": 0, "WORLD_SIZE": 1, "MASTER_ADDR": "h", "MASTER_PORT": 1}, {"port": 4321}, (0, 1, 0, "h", 4321)),
    ("slurm", {"SLURM_PROCID": 5, "SLURM_NTASKS": 8, "SLURM_NODELIST": "gpu[03-04,09]", "SLURM_LOCALID": 1}, {}, (5, 8, 1, "gpu03", 29500)),  # noqa: E501
    ("slurm", {"SLURM_PROCID": 6, "SLURM_NTASKS": 8, "SLURM_JOB_NODELIST": "a[1-2]b", "SLURM_NTASKS_PER_NODE": 4}, {}, (6, 8, 2, "a1b", 29500)),  # noqa: E501
    ("slurm", {"SLURM_PROCID": 5, "SLURM_NTASKS": 8, "SLURM_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "2(x2),4"}, {}, (5, 8, 1, "n1", 29500)),  # noqa: E501
    ("slurm", {"SLURM_PROCID": 3, "SLURM_NTASKS": 8, "SLURM_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "2(x2),4"}, {}, (3, 8, 1, "n1", 29500)),  # noqa: E501
    ("slurm", {"SLURM_PROCID": 3, "SLURM_NTASKS": 4, "SLURM_NODELIST": "x,y"}, {}, (3, 4, 0, "x", 29500)),
    ("slurm", {"SLURM_PROCID": 0, "SLURM_NTASKS": 2, "SLURM_NODELIST": "x", "MASTER_ADDR": "m", "MASTER_PORT": 7}, {}, (0, 2, 0, "m", 7)),  # noqa: E501
    ("slurm", {"SLURM_PROCID": 0, "SLURM_NTASKS": 2, "SLURM_NODELIST": "x", "MASTER_PORT": 7}, {"port": 9}, (0, 2, 0, "x", 9)),
    ("mpi", {"OMPI_COMM_WORLD_RANK": 2, "OMPI_COMM_WORLD_SIZE": 4, "OMPI_COMM_WORLD_LOCAL_RANK": 0, "MASTER_ADDR": "m"}, {}, (2, 4, 0, "m", 29500)),  # noqa: E501
    ("mpi", {"PMI_RANK": 1, "PMI_SIZE": 2, "MPI_LOCALRANKID": 1, "MASTER_ADDR": "m", "MASTER_PORT": 99}, {}, (1, 2, 1, "m", 99)),
]  # fmt: skip


@pytest.mark.parametrize("launcher,env,kwargs,want", LAUNCH_CASES)
def test_init_dist_launcher_environments(launch, launcher, env, kwargs, want):
    os.environ.update({k: str(v) for k, v in env.items()})
    fd.init_dist(launcher, timeout=5, **kwargs)
    assert len(launch) == 1
    args, kw = launch[0]
    rank, ws, local, addr, port = want
    assert args == ("gloo",) and kw["rank"] == rank and kw["world_size"] == ws
    assert kw["init_method"] == "env://" and kw["timeout"] == datetime.timedelta(seconds=5)
    exported = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    assert exported == {
        "RANK": str(rank),
        "WORLD_SIZE": str(ws),
        "LOCAL_RANK": str(local),
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
    }
    assert fd.get_local_rank() == local


@pytest.mark.parametrize(
    "launcher,env,fragments",
    [
        ("torchrun", {}, ["'torchrun'", "pytorch", "slurm", "mpi"]),
        ("pytorch", {}, ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]),
        ("pytorch", {"RANK": 0, "WORLD_SIZE": 2, "MASTER_ADDR": "h"}, ["MASTER_PORT"]),
        ("slurm", {}, ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_NODELIST"]),
        ("slurm", {"SLURM_PROCID": 0, "SLURM_NTASKS": 2}, ["SLURM_NODELIST"]),
        ("mpi", {}, ["OMPI_COMM_WORLD_RANK or PMI_RANK", "OMPI_COMM_WORLD_SIZE or PMI_SIZE", "MASTER_ADDR"]),
        ("pytorch", {"RANK": "abc", "WORLD_SIZE": 2, "MASTER_ADDR": "h", "MASTER_PORT": 1}, ["RANK='abc'"]),
        ("pytorch", {"RANK": 2, "WORLD_SIZE": 2, "MASTER_ADDR": "h", "MASTER_PORT": 1}, ["RANK=2"]),
        ("slurm", {"SLURM_PROCID": 0, "SLURM_NTASKS": 2, "SLURM_NODELIST": "n[1-"}, ["SLURM_NODELIST"]),
        ("pytorch", {"RANK": 0, "WORLD_SIZE": 2, "MASTER_ADDR": "h", "MASTER_PORT": 70000}, ["70000"]),
    ],
)
def test_init_dist_errors(launch, launcher, env, fragments):
    os.environ.update({k: str(v) for k, v in env.items()})
    with pytest.raises(ValueError) as info:
        fd.init_dist(launcher)
    for frag in fragments:
        assert frag in str(info.value), (frag, str(info.value))
    assert launch == [], "init_process_group was called despite the error"


def test_init_dist_backend_and_cuda_device(launch, monkeypatch):
    devices = []
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    os.environ.update(RANK="5", WORLD_SIZE="8", LOCAL_RANK="5", MASTER_ADDR="h", MASTER_PORT="1")
    fd.init_dist("pytorch")  # no CUDA here: gloo, device untouched
    assert launch[-1][0] == ("gloo",) and devices == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    fd.init_dist("pytorch")
    assert launch[-1][0] == ("nccl",) and devices == [1]
    fd.init_dist("pytorch", "gloo")  # CUDA available but not used by the backend
    assert launch[-1][0] == ("gloo",) and devices == [1]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA"):
        fd.init_dist("pytorch", "nccl")
    monkeypatch.setattr(tdist, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="already initialized"):
        fd.init_dist("pytorch")


NODELISTS = [
    ("node01", ["node01"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a[1-2]b", ["a1b", "a2b"]),
    ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
    ("n1,n2", ["n1", "n2"]),
    ("gpu[1-2],cpu[08-10]", ["gpu1", "gpu2", "cpu08", "cpu09", "cpu10"]),
    ("node[007-009]", ["node007", "node008", "node009"]),
    ("node[9-11]", ["node9", "node10", "node11"]),
    ("host-1.example.com", ["host-1.example.com"]),
    (" node[3] ", ["node3"]),
    ("x[2,1],y", ["x2", "x1", "y"]),
]


@pytest.mark.parametrize("nodelist,hosts", NODELISTS)
def test_slurm_nodelist_parsing(nodelist, hosts):
    assert fd.expand_slurm_nodelist(nodelist) == hosts
    assert fd.slurm_first_host(nodelist) == hosts[0]


@pytest.mark.parametrize("nodelist", ["", " , ", "node[1-2", "node]1[", "node[a-b]", "node[3-1]", "node[1-]", "n[[1]]"])
def test_slurm_nodelist_errors(nodelist):
    with pytest.raises(ValueError):
        fd.expand_slurm_nodelist(nodelist)
    with pytest.raises(ValueError):
        fd.slurm_first_host(nodelist)


def _helpers_at_world_size_one(rank, world_size):
    """Every tensor/object helper once; returns the results and how many collectives torch saw."""
    calls = []
    names = ("all_reduce", "all_gather", "broadcast", "all_gather_into_tensor", "gather")
    real = {n: getattr(tdist, n) for n in names}
    for n in names:
        setattr(tdist, n, lambda *a, _n=n, **k: calls.append(_n) or real[_n](*a, **k))
    try:
        t = torch.arange(6.0).reshape(2, 3)
        p = torch.nn.Parameter(torch.ones(3))
        p.grad = torch.full((3,), 2.0)
        out = (
            fd.reduce_mean(t),
            fd.all_reduce_dict({"a": t, "b": 2}, op="mean"),
            fd.allreduce_grads([p]) or p.grad.clone(),
            fd.broadcast({"x": 1}),
            fd.all_gather_object_gpu([1, 2], rank_zero_return_only=False),
        )
    finally:
        for n in names:
            setattr(tdist, n, real[n])
    return str(out), calls  # text: tensors sent back through the queue would need this process alive


def test_force_collectives_at_world_size_one():
    ((forced, calls),) = run_ranks(_helpers_at_world_size_one, 1, env={"FASTCOLL_FORCE_COLLECTIVES": "1"})
    ((plain, none),) = run_ranks(_helpers_at_world_size_one, 1)
    assert none == [], none
    assert {"all_reduce", "all_gather"} <= set(calls), calls
    assert forced == plain  # same results, with the collectives issued
