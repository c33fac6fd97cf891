"""torch 2.13's ``bucket_cap_mb_list`` on fastcoll.DDP, against torch DDP (2 gloo ranks).

torch's rule (``_BucketCapacityConfig.create``): a non-empty list gives one cap per
bucket in MiB and ``bucket_cap_mb`` is ignored; None or ``[]`` leaves ``bucket_cap_mb``
in force. The observable layout is compared after torch's one rebuild from the
gradients' ready order (iteration 2 on): torch's first iteration applies the list
in registration order, fastcoll's in reduction order from the start, and both
rebuild to the same reduction-order layout. Each case also compares torch DDP's
bucket attributes and the trained parameters.
"""

from __future__ import annotations

import copy

import ddp_models as M
import pytest
import torch
import torch.distributed as dist
from multiproc import run_ranks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastcoll

STEPS = 4
EXACT = {"rtol": 1e-5, "atol": 1e-6}

# (bucket_cap_mb, bucket_cap_mb_list): caps in MiB small enough for the MLP's 8 parameters to make several buckets.
CASES = {
    "list alone": (None, [0.0001, 0.0004]),
    "list wins over a number": (25, [0.0002, 0.0001, 0.0003]),
    "tuple": (None, (0.0003,)),
    "empty list: bucket_cap_mb": (0.0002, []),
    "empty list, default caps": (None, []),
}


def _recording_hook(log, bucket):
    log.setdefault(bucket.index(), [id(p) for p in bucket.parameters()])
    buf = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])


def _layouts_worker(rank, world_size):
    for case, (cap_mb, cap_list) in CASES.items():
        model = M.build("mlp", 0)
        fast = fastcoll.DDP(copy.deepcopy(model), bucket_cap_mb=cap_mb, bucket_cap_mb_list=cap_list)
        ref = TorchDDP(copy.deepcopy(model), bucket_cap_mb=cap_mb, bucket_cap_mb_list=cap_list)
        for attr in ("bucket_bytes_cap", "bucket_bytes_cap_list", "bucket_bytes_cap_default"):
            assert getattr(fast, attr) == getattr(ref, attr), (case, attr, getattr(fast, attr), getattr(ref, attr))
        pairs = []
        for mod in (fast, ref):
            log: dict = {}
            mod.register_comm_hook(log, _recording_hook)
            pairs.append((mod, torch.optim.SGD(mod.parameters(), lr=0.1, momentum=0.9), log))
        for step in range(STEPS):
            x, y = M.global_batch("mlp", world_size, step)
            layouts = []
            for mod, opt, log in pairs:
                log.clear()
                opt.zero_grad()
                M.loss_of("mlp", mod, M.chunk_of(x, rank), M.chunk_of(y, rank), rank, step).backward()
                opt.step()
                names = {id(p): n for n, p in mod.module.named_parameters()}
                layouts.append([[names[i] for i in log[b]] for b in sorted(log)])
            if step >= 1:  # after torch's rebuild from the ready order
                assert layouts[0] == layouts[1], f"{case} step {step}: fastcoll {layouts[0]} torch {layouts[1]}"
        n = len(layouts[0])
        assert n >= 2 or case == "empty list, default caps", f"{case}: expected several buckets, got {layouts[0]}"
        for (name, p), q in zip(fast.module.named_parameters(), ref.module.parameters()):
            torch.testing.assert_close(p, q, **EXACT, msg=lambda m: f"{case}: {name}: {m}")
        fast.close()


def test_bucket_cap_mb_list_gives_torch_ddps_layout_and_training():
    run_ranks(_layouts_worker, 2, timeout=120)


def _refused_worker(rank, world_size, cap_mb, cap_list, exc_type, match):
    # Every rank raises the same error (the construction checks are agreed on), none hangs; a rank-dependent
    # bad value is raised on the rank that has it and on the others too.
    bad = cap_list if rank == world_size - 1 else [1.0]
    with pytest.raises(exc_type, match=match):
        fastcoll.DDP(M.build("mlp", 0), bucket_cap_mb=cap_mb, bucket_cap_mb_list=bad)
    return True


@pytest.mark.parametrize(
    "cap_mb, cap_list, exc_type, match",
    [
        (None, [1, 0], ValueError, r"bucket_cap_mb_list\[1\] is 0; every per-bucket cap must be a positive"),
        (None, [float("nan")], ValueError, r"bucket_cap_mb_list\[0\] is nan"),
        (None, 5, TypeError, "bucket_cap_mb_list must be a list of per-bucket caps in MiB"),
        ([2, 8], [1, 4], ValueError, r"bucket_cap_mb=\[2, 8\] and bucket_cap_mb_list=\[1(\.0)?(, 4)?\] both ask"),
        ("auto", [1], ValueError, "both ask for a bucket layout"),
    ],
    ids=["zero", "nan", "not-a-list", "two-lists", "auto-and-list"],
)
def test_bad_bucket_cap_mb_list_is_refused_on_every_rank(cap_mb, cap_list, exc_type, match):
    assert run_ranks(_refused_worker, 2, cap_mb, cap_list, exc_type, match, timeout=60) == [True, True]
