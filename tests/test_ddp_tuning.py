"""Bucket layouts chosen by the user (lists of caps) or by fastcoll ("auto"), and the synchronization timeline.

Multi-rank runs train fastcoll.DDP next to torch DDP on the same data and
compare the parameters after every step, across the autotuner's layout
switches; every rank must end with the same layout, rank 0's choice.
"""

from __future__ import annotations

import copy
import json
import time

import ddp_models as M
import pytest
import torch
import torch.distributed as dist
from multiproc import run_ranks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastcoll

pytestmark = pytest.mark.timeout(240)

EVENTS = (
    "ready_first_us",
    "ready_last_us",
    "pack_start_us",
    "pack_end_us",
    "issued_us",
    "completed_us",
    "writeback_start_us",
    "writeback_end_us",
)


def _train_pair(rank, world_size, name, steps, fast_kwargs, torch_kwargs=None, slow=None):
    """Train fastcoll.DDP and torch DDP side by side; parameters compared after every step."""
    model = M.build(name, 0)
    fast = fastcoll.DDP(copy.deepcopy(model), **fast_kwargs)
    ref = TorchDDP(copy.deepcopy(model), **(torch_kwargs or {}))
    of = torch.optim.SGD(fast.parameters(), lr=0.05, momentum=0.9)
    ot = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    layouts = []
    for step in range(steps):
        x, y = M.global_batch(name, world_size, step % 4)
        xr, yr = M.chunk_of(x, rank), M.chunk_of(y, rank)
        for mod, opt in ((fast, of), (ref, ot)):
            opt.zero_grad()
            if slow is not None and mod is fast:
                slow(fast, step)
            M.loss_of(name, mod, xr, yr, rank, step).backward()
            opt.step()
        for (n, p), q in zip(fast.module.named_parameters(), ref.module.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=n, s=step: f"step {s} {n}: {m}")
        layouts.append([b["names"] for b in fast.bucket_info()])
    return fast, layouts


def list_caps_worker(rank, world_size):
    # mlp: 12 layers of 8x8 (+8) and a head; in reduction order the head comes first.
    fast, layouts = _train_pair(rank, world_size, "mlp", 4, {"bucket_cap_mb": [0.0002, 0.0005, 0.01]}, {"bucket_cap_mb": 0.0005})
    info = fast.bucket_info()
    sizes = [b["bytes"] for b in info]
    # Caps 204.8 B, 524.3 B, then 10 KiB repeating: a bucket closes once it reaches its cap.
    assert sizes[0] >= 204 and sum(sizes[:1]) < 204 + 288, sizes
    assert len(info) >= 3 and sizes[-1] <= 10486 + 288, sizes
    assert layouts[-1] == [b["names"] for b in info]
    fast.close()
    with pytest.raises(ValueError, match="bucket_cap_mb must be"):
        fastcoll.DDP(M.build("mlp", 0), bucket_cap_mb=[1.0, 0])
    with pytest.raises(ValueError, match="bucket_cap_mb must be"):
        fastcoll.DDP(M.build("mlp", 0), bucket_cap_mb="fast")
    return sizes


def test_list_of_caps():
    sizes = run_ranks(list_caps_worker, 2)
    assert sizes[0] == sizes[1]


def _auto_worker(rank, world_size, slow_rank):
    torch.manual_seed(0)
    # About 1.6 MiB of float32 gradients in 6 layers: the candidate caps (1, 5, 25, 100 MiB, growing lists) differ.
    model = M.MLP(width=256, depth=6, head=None)
    fast = fastcoll.DDP(copy.deepcopy(model), bucket_cap_mb="auto", first_bucket_mb=0.25)
    ref = TorchDDP(copy.deepcopy(model))
    of = torch.optim.SGD(fast.parameters(), lr=0.05)
    ot = torch.optim.SGD(ref.parameters(), lr=0.05)
    layouts = []
    for step in range(18):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(4, 256, generator=g)
        for mod, opt in ((fast, of), (ref, ot)):
            opt.zero_grad()
            if mod is fast and rank == slow_rank:
                # This rank measures very different times: slow in layouts with few buckets.
                time.sleep(0.03 / len(fast.bucket_info()))
            mod(x).square().mean().backward()
            opt.step()
        for (n, p), q in zip(fast.module.named_parameters(), ref.module.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=n, s=step: f"step {s} {n}: {m}")
        layouts.append([b["names"] for b in fast.bucket_info()])
    report = fast.tuning_report()
    chosen = [r for r in report if r["chosen"]]
    assert len(chosen) == 1, report
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (layouts[-1], [r["chosen"] for r in report]))
    assert all(e == everyone[0] for e in everyone), f"ranks ended with different layouts or choices: {everyone}"
    assert len({str(layout) for layout in layouts}) > 1, "the autotuner never switched layouts"
    with pytest.raises(RuntimeError, match="bucket_cap_mb='auto'"):
        fast.register_comm_hook(None, lambda s, b: None)
    fast.close()
    return report


@pytest.mark.parametrize("world_size", [2, 3])
def test_auto_layout_trains_like_torch_ddp_and_rank_zero_decides(world_size):
    reports = run_ranks(_auto_worker, world_size, 1, env={"FASTCOLL_AUTOTUNE_STEPS": "14"})
    assert len(reports[0]) > 1, reports[0]  # several candidate layouts were measured
    # Every rank measured its own times; the one chosen is rank 0's decision on every rank.
    assert [r["chosen"] for r in reports[0]] == [r["chosen"] for r in reports[-1]]


def timeline_worker(rank, world_size, tmpdir):
    fast = fastcoll.DDP(M.build("convbn", 0), bucket_cap_mb=0.002)
    for step in range(4):
        x, y = M.global_batch("convbn", world_size, step)
        fast.zero_grad()
        M.loss_of("convbn", fast, M.chunk_of(x, rank), M.chunk_of(y, rank), rank, step).backward()
    its = fast.sync_timeline()
    assert len(its) == 4
    n = len(fast.bucket_info())
    assert its[-1]["n_buckets"] == n  # the first iteration ran before the ready-order rebuild, maybe with another layout
    for it in its:
        assert len(it["buckets"]) == it["n_buckets"]
        assert it["forward_start_us"] <= 0 <= it["backward_end_us"] <= it["finalize_start_us"] <= it["finalize_end_us"], it
        assert it["exposed_sync_us"] >= 0 and it["step_us"] > 0
        for b in it["buckets"]:
            times = [b[e] for e in EVENTS]
            assert None not in times, b
            assert times == sorted(times), f"bucket {b['bucket']} events out of order: {dict(zip(EVENTS, times))}"
    path = fast.export_chrome_trace(f"{tmpdir}/trace-rank{rank}.json")
    trace = json.loads(open(path).read())
    names = {e["name"] for e in trace["traceEvents"]}
    assert {f"bucket {k} all-reduce" for k in range(n)} <= names, sorted(names)[:20]
    fast.close()
    off = fastcoll.DDP(M.build("mlp", 0), record_timeline=False)
    x, y = M.global_batch("mlp", world_size, 0)
    M.loss_of("mlp", off, M.chunk_of(x, rank), M.chunk_of(y, rank), rank, 0).backward()
    assert all(not it["buckets"] or all(b["pack_start_us"] is None for b in it["buckets"]) for it in off.sync_timeline())
    off.close()


def test_sync_timeline_and_chrome_trace(tmp_path):
    run_ranks(timeline_worker, 2, str(tmp_path))


def nothing_yet_worker(rank, world_size, tmpdir):
    """The inspection APIs raise, on every rank, where they would have answered with nothing: before a synchronized
    iteration, after no_sync() ones only, without "auto" or before its tuning starts, a trace without recording."""
    import os

    x, y = M.global_batch("mlp", world_size, 0)
    x, y = M.chunk_of(x, rank), M.chunk_of(y, rank)
    path = os.path.join(tmpdir, f"trace-{rank}.json")
    fast = fastcoll.DDP(M.build("mlp", 0))
    for what, call in (("sync_timeline", fast.sync_timeline), ("export_chrome_trace", lambda: fast.export_chrome_trace(path))):
        with pytest.raises(RuntimeError, match=rf"{what}\(\): no synchronized iteration has completed"):
            call()
    with pytest.raises(RuntimeError, match="built without bucket_cap_mb='auto'"):
        fast.tuning_report()
    with fast.no_sync():
        M.loss_of("mlp", fast, x, y, rank, 0).backward()
    with pytest.raises(RuntimeError, match="no synchronized iteration"):
        fast.sync_timeline()
    M.loss_of("mlp", fast, x, y, rank, 0).backward()
    assert len(fast.sync_timeline()) == 1 and fast.export_chrome_trace(path).exists()
    fast.close()
    os.remove(path)

    off = fastcoll.DDP(M.build("mlp", 0), record_timeline=False)
    M.loss_of("mlp", off, x, y, rank, 0).backward()
    assert len(off.sync_timeline()) == 1  # the iteration-level times
    with pytest.raises(RuntimeError, match="record_timeline=False"):
        off.export_chrome_trace(path)
    assert not os.path.exists(path)  # refused before writing
    off.close()

    auto = fastcoll.DDP(M.build("mlp", 0), bucket_cap_mb="auto")
    for step in range(2):  # the tuning starts at the forward after the first iteration's ready-order rebuild
        with pytest.raises(RuntimeError, match="the tuning has not started yet"):
            auto.tuning_report()
        auto.zero_grad()
        M.loss_of("mlp", auto, x, y, rank, step).backward()
    assert [r["label"] for r in auto.tuning_report()][:1] == ["default (25 MiB)"]  # started: the default is candidate 0
    auto.close()


def test_inspection_raises_where_there_is_nothing_to_show(tmp_path):
    run_ranks(nothing_yet_worker, 2, str(tmp_path))
