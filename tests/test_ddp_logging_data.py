"""fastcoll.DDP's ``_get_ddp_logging_data()`` against torch DDP's, key by key (2 gloo ranks).

Each scenario runs torch DDP and fastcoll.DDP side by side in the same rank
processes and compares what both report: construction data and environment,
bucket sizes before and after the rebuild, which iterations are sampled,
ready orders, unused-parameter sizes, ``can_set_static_graph`` and the errors
torch logs. Times are checked for what they must satisfy (positive, the
overlap within both intervals, host times in order), not for equality.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from multiproc import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastcoll
from fastcoll.reducer.runtime_log import should_sample

pytestmark = pytest.mark.timeout(150)

ENV = {"MASTER_PORT": "29999", "MASTER_ADDR": "127.0.0.1", "CUDA_VISIBLE_DEVICES": ""}

#: Keys torch reports that fastcoll leaves out, and why (none in these scenarios).
NOT_GIVEN = {"join_uneven_inputs"}
#: Keys fastcoll reports where torch (2.13) has none yet: static_graph is only logged by torch once set,
#: can_set_static_graph only once the unused parameters changed.
FASTCOLL_ONLY = {"static_graph", "can_set_static_graph"}
#: Keys that describe the bucket layout, which is fastcoll's own (compared with fastcoll's buckets where they differ).
#: has_rebuilt_buckets too: a static graph's rebuild comes one iteration earlier in fastcoll (it records the ready
#: order in the first, learning, iteration; torch in the second).
LAYOUT = frozenset(
    {"bucket_sizes", "has_rebuilt_buckets", "rebuilt_bucket_sizes", "rebuilt_per_bucket_param_indices", "num_buckets_reduced"}
)
#: Keys whose values are times: compared for consistency, not equality.
TIMES = {
    "forward_compute_time",
    "backward_compute_time",
    "backward_comm_time",
    "backward_compute_comm_overlap_time",
    "avg_forward_compute_time",
    "avg_backward_compute_time",
    "avg_backward_comm_time",
    "avg_backward_compute_comm_overlap_time",
    "forward_compute_time_start",
    "backward_compute_time_start",
    "backward_compute_time_end",
    "backward_comm_time_start",
    "backward_comm_time_end",
}


class Net(nn.Module):
    """torch's distributed_test Net: three bias-free layers, reduced in one bucket."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 50, bias=False)
        self.fc3 = nn.Linear(50, 4, bias=False)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class Branchy(nn.Module):
    """A model whose unused parameters change with ``branch`` (mixed dtypes, a buffer, several buckets)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.a = nn.Linear(4, 300)
        self.b = nn.Linear(300, 300)
        self.c = nn.Linear(300, 4)
        self.d = nn.Linear(300, 4)
        self.e = nn.Linear(3, 3).double()
        self.register_buffer("seen", torch.zeros(1))

    def forward(self, x, branch: int = 0):
        h = torch.relu(self.b(torch.relu(self.a(x))))
        out = self.c(h) if branch == 0 else self.d(h) if branch == 1 else self.c(h) + self.d(h)
        return out + self.e(torch.ones(1, 3, dtype=torch.float64)).sum().float()


def _compare(fc: dict, td: dict, where: str, ignore: frozenset = frozenset()) -> None:
    """Every torch key is given by fastcoll (bar NOT_GIVEN); every shared non-time key has the same value."""
    missing = set(td) - set(fc) - NOT_GIVEN - ignore
    assert not missing, f"{where}: fastcoll lacks torch's keys {sorted(missing)}"
    extra = set(fc) - set(td) - FASTCOLL_ONLY - ignore
    assert not extra, f"{where}: fastcoll reports keys torch does not: {sorted(extra)}"
    for k in sorted((set(fc) & set(td)) - TIMES - ignore):
        assert fc[k] == td[k], f"{where}: {k}: fastcoll {fc[k]!r}, torch {td[k]!r}"


def _check_times(d: dict, where: str) -> None:
    assert d["forward_compute_time"] >= 1 and d["backward_compute_time"] >= 1 and d["backward_comm_time"] >= 1, where
    overlap = d["backward_compute_comm_overlap_time"]
    assert 0 <= overlap <= min(d["backward_compute_time"], d["backward_comm_time"]), where
    assert d["forward_compute_time_start"] <= d["backward_compute_time_start"] <= d["backward_compute_time_end"], where
    assert d["backward_compute_time_start"] <= d["backward_comm_time_start"] <= d["backward_comm_time_end"], where
    for k in ("forward_compute_time", "backward_compute_time", "backward_comm_time"):
        assert d[f"avg_{k}"] >= 1, where
    assert 0 <= d["avg_backward_compute_comm_overlap_time"] <= d["avg_backward_compute_time"], where


def _sizes(layout: list, params: list) -> str:
    return ", ".join(str(sum(params[i].numel() * params[i].element_size() for i in b)) for b in layout)


def _train_both(rank: int, world_size: int, make, kwargs: dict, steps: int, rate: int, branch=None) -> list:
    """Train torch DDP and fastcoll.DDP side by side; returns (step, torch data, fastcoll data) after each step.

    The last entry is fastcoll's own layout: ``(initial bucket sizes, final sizes, final per-bucket indices)``.
    """
    wrappers = []
    for cls in (TorchDDP, fastcoll.DDP):
        ddp = cls(make(), **kwargs)
        if rate:
            ddp._set_ddp_runtime_logging_sample_rate(rate)
        wrappers.append(ddp)
    out = [(-1, wrappers[0]._get_ddp_logging_data(), wrappers[1]._get_ddp_logging_data())]
    torch.manual_seed(10 + rank)
    for step in range(steps):
        x = torch.randn(4, 2 if make is Net else 4)
        for ddp in wrappers:
            args = () if branch is None else (branch(step, rank),)
            ddp(x, *args).square().sum().backward()
        out.append((step, wrappers[0]._get_ddp_logging_data(), wrappers[1]._get_ddp_logging_data()))
    r = wrappers[1].reducer
    layout = r.layout()
    out.append((_sizes(r.initial_layout(), r.params), _sizes(layout, r.params), ", ".join(" ".join(map(str, b)) for b in layout)))
    return out


def _scenario_net(rank: int, world_size: int) -> list:
    return _train_both(rank, world_size, Net, {}, steps=20, rate=2)


def test_net_matches_torch_every_iteration():
    """torch's test_ddp_logging_data_cpu model: same keys and values as torch after every one of 20 iterations."""
    for rank, history in enumerate(run_ranks(_scenario_net, 2, timeout=120, env=ENV)):
        history = history[:-1]
        for step, td, fc in history:
            where = f"rank {rank} after step {step}"
            _compare(fc, td, where)
            assert fc["iteration"] == td["iteration"], where
            if step >= 1 and should_sample(step, 2):
                assert fc["iteration"] == step, where  # torch's rule: the sample published at forward step+1
                _check_times(fc, where)
        fc = history[-1][2]
        assert fc["iteration"] == 18 and fc["module_name"] == "Net" and fc["device_ids"] == "" and fc["output_device"] == -1
        assert fc["master_port"] == "29999" and fc["cuda_visible_devices"] == "" and fc["gloo_device_transport"] == "N/A"
        assert fc["gloo_num_threads"] == 2 and fc["backend_name"] == "gloo" and fc["dtypes"] == "float"
        assert fc["has_rebuilt_buckets"] == 1 and fc["rebuilt_per_bucket_param_indices"] == "2 1 0"
        assert fc["prev_iteration_grad_ready_order_indices"] == "2, 1, 0" and fc["unused_parameter_size"] == 0


def _branch_alternating(step: int, rank: int) -> int:
    return step % 2  # c, then d: the unused parameters change


def _branch_c(step: int, rank: int) -> int:
    return 0  # d is never used


def _branch_both(step: int, rank: int) -> int:
    return 2  # every parameter is used


def _scenario_branchy(rank: int, world_size: int, kwargs: dict, branch) -> list:
    return _train_both(rank, world_size, Branchy, {"bucket_cap_mb": 0.3, **kwargs}, steps=14, rate=3, branch=branch)


@pytest.mark.parametrize(
    "kwargs,branch",
    [
        ({}, _branch_both),
        ({"find_unused_parameters": True}, _branch_c),
        ({"find_unused_parameters": True}, _branch_alternating),
        ({"static_graph": True}, _branch_c),
        ({"gradient_as_bucket_view": True, "broadcast_buffers": False, "find_unused_parameters": True}, _branch_c),
    ],
    ids=["plain", "find_unused", "find_unused_changing", "static_graph", "view_no_buffers"],
)
def test_buckets_unused_and_graph_match_torch(kwargs, branch):
    """Several buckets, two dtypes, unused parameters (fixed or changing), static graphs: torch's values."""
    changing = branch is _branch_alternating
    dynamic = kwargs.get("find_unused_parameters") and not kwargs.get("static_graph")
    results = run_ranks(_scenario_branchy, 2, kwargs, branch, timeout=120, env=ENV)
    for rank, history in enumerate(results):
        (initial, final, indices), history = history[-1], history[:-1]
        for step, td, fc in history:
            where = f"rank {rank} after step {step}"
            _compare(fc, td, where, ignore=LAYOUT)  # fastcoll buckets by its own rule (never over the cap)
            assert fc["bucket_sizes"] == initial, where
            if step >= 1:  # the first sample is published at the second forward
                # fastcoll rebuilds at the second forward (never for a dynamic graph); the second sample sees it
                rebuilt = step >= 2 and not dynamic
                assert fc["has_rebuilt_buckets"] == int(rebuilt), where
                assert fc.get("rebuilt_bucket_sizes") == (final if rebuilt else None), where
                assert fc.get("rebuilt_per_bucket_param_indices") == (indices if rebuilt else None), where
                assert fc["num_buckets_reduced"] == len((final if rebuilt else initial).split(", ")), where
            # torch logs can_set_static_graph only once the unused parameters changed, then 0 like fastcoll
            if "can_set_static_graph" in td:
                assert fc["can_set_static_graph"] == td["can_set_static_graph"] == 0, where
        td, fc = history[-1][1], history[-1][2]
        assert fc["dtypes"] == "double, float" and len(fc["bucket_sizes"].split(", ")) >= 3
        if kwargs.get("find_unused_parameters"):
            assert fc["can_set_static_graph"] == int(not changing)
            assert fc["unused_parameter_size"] == (4 * 300 + 4) * 4  # c or d, both unused in turn
        _check_times(fc, f"rank {rank}")


def _scenario_errors(rank: int, world_size: int) -> dict:
    out = {}
    for name, cls in (("torch", TorchDDP), ("fastcoll", fastcoll.DDP)):
        ddp = cls(Net())
        ddp(torch.randn(3, 2)).sum().backward()
        res = {"before": ddp._get_ddp_logging_data()}
        try:
            ddp._set_static_graph()
        except RuntimeError as exc:
            res["static_graph_error"] = str(exc)
        res["static"] = ddp._get_ddp_logging_data()
        try:
            ddp._set_ddp_runtime_logging_sample_rate(0)
        except ValueError:
            pass
        res["rate"] = ddp._get_ddp_logging_data()
        try:
            ddp._check_comm_hook(5)  # torch's validator, inherited by fastcoll.DDP
        except TypeError:
            pass
        res["hook"] = ddp._get_ddp_logging_data()
        out[name] = res
    # fastcoll's own reducer checks: parameters without a gradient leave the reduction unfinished
    model = Net()
    ddp = fastcoll.DDP(model)
    ddp(torch.randn(3, 2))
    model.fc3.weight.sum().backward()  # fc1, fc2: no gradient
    try:
        ddp(torch.randn(3, 2))
    except RuntimeError as exc:
        out["unfinished"] = (str(exc), ddp._get_ddp_logging_data())
    return out


def test_errors_recorded_as_torch_records_them():
    """The errors torch's _log_and_throw and reducer checks log: has_error, error, iteration (the forwards begun)."""
    for res in run_ranks(_scenario_errors, 2, timeout=120, env=ENV):
        td, fc = res["torch"], res["fastcoll"]
        assert "has_error" not in fc["before"] and "error" not in fc["before"]
        assert "should be called before training loop starts" in fc["static_graph_error"]
        for key in ("static", "rate", "hook"):
            assert fc[key]["has_error"] == td[key]["has_error"] == 1
            assert fc[key]["iteration"] == td[key]["iteration"] == 1, key
        assert fc["static"]["error"] == fc["static_graph_error"]
        assert "should be called before training loop starts" in td["static"]["error"]
        rate_error = "<class 'ValueError'>: DDP runtime logging sample rate should be equal or greater than 1"
        assert fc["rate"]["error"] == td["rate"]["error"] == rate_error
        assert fc["hook"]["error"] == td["hook"]["error"] == "<class 'TypeError'>: Communication hook must be callable."
        msg, data = res["unfinished"]
        assert data["has_error"] == 1 and data["error"] == msg and "fc1.weight" in msg and data["iteration"] == 1


def _scenario_hooks_dtypes(rank: int, world_size: int) -> dict:
    def my_hook(state, bucket):
        return dist.all_reduce(bucket.buffer().div_(2), async_op=True).get_future().then(lambda f: f.value()[0])

    out = {}
    for name, cls in (("torch", TorchDDP), ("fastcoll", fastcoll.DDP)):
        a = cls(Net())
        a.register_comm_hook(None, my_hook)
        b = cls(Net())
        b._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
        c = cls(nn.Sequential(nn.Linear(3, 3).half(), nn.Linear(3, 3).bfloat16(), nn.Linear(3, 3)))
        out[name] = [x._get_ddp_logging_data() for x in (a, b, c)]
    fc = fastcoll.DDP(Net(), comm_dtype=torch.bfloat16)
    out["comm_dtype"] = fc._get_ddp_logging_data()
    return out


def test_comm_hooks_and_dtypes_named_as_torch_names_them():
    for res in run_ranks(_scenario_hooks_dtypes, 2, timeout=120, env=ENV):
        for td, fc in zip(res["torch"], res["fastcoll"]):
            _compare(fc, td, "construction")
        assert res["fastcoll"][0]["comm_hook"] == "_scenario_hooks_dtypes.<locals>.my_hook"
        assert res["fastcoll"][1]["comm_hook"] == "BuiltinCommHookType.FP16_COMPRESS"
        assert res["fastcoll"][2]["dtypes"] == "c10::BFloat16, c10::Half, float"
        assert res["comm_dtype"]["comm_hook"] == "comm_dtype=torch.bfloat16"
