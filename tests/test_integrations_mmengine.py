"""fastcoll in mmengine: a real Runner / FlexibleRunner on 2 gloo CPU ranks.

The ranks initialize their process group the way an mmengine job does (the
'pytorch' launcher reading RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT), through fastcoll. Training: 4 iterations of SGD with momentum,
``accumulative_counts=2`` (so mmengine enters ``no_sync`` every other
iteration), then the validation loop. The final weights must be identical on
both ranks and equal (to float rounding) to one process training on the
global batch; the checkpoint must load into a plain, unwrapped model.
"""

from __future__ import annotations

import os
import socket
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

mmengine = pytest.importorskip(
    "mmengine", reason="mmengine is not installed (pip install 'fastcoll[mmengine]'; `make test` installs it)"
)

from mmengine.evaluator import BaseMetric, Evaluator  # noqa: E402
from mmengine.model import BaseDataPreprocessor, BaseModel  # noqa: E402
from multiproc import run_ranks  # noqa: E402

N_TRAIN, N_VAL, PER_RANK_BATCH, WORLD, ITERS, ACCUM, LR, MOMENTUM = 16, 6, 2, 2, 4, 2, 0.1, 0.9


# --------------------------------------------------------------------------- #
# A small mmengine model, data preprocessor, metric and data
# --------------------------------------------------------------------------- #


class ScalePreprocessor(BaseDataPreprocessor):
    """Maps inputs from [0, 1) to [-1, 1); counts training calls (train_step must pass training=True)."""

    def __init__(self):
        super().__init__()
        self.training_calls = 0

    def forward(self, data, training=False):
        data = self.cast_data(data)
        if training:
            self.training_calls += 1
        return dict(inputs=data["inputs"] * 2.0 - 1.0, data_samples=data["data_samples"])


class TinyModel(BaseModel):
    def __init__(self):
        super().__init__(data_preprocessor=ScalePreprocessor())
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, inputs, data_samples=None, mode="tensor"):
        out = self.net(inputs)
        if mode == "loss":
            return dict(loss_mse=F.mse_loss(out, data_samples))
        if mode == "predict":
            return [(o, t) for o, t in zip(out, data_samples)]
        return out


class MSEMetric(BaseMetric):
    def process(self, data_batch, data_samples):
        for pred, target in data_samples:
            self.results.append(float(((pred - target) ** 2).mean()))

    def compute_metrics(self, results):
        return dict(mse=sum(results) / len(results))


class NoneCountMetric(BaseMetric):
    """Records None for samples whose first target is negative ("no prediction"); counts what it gets back."""

    def process(self, data_batch, data_samples):
        for _pred, target in data_samples:
            self.results.append(None if float(target[0]) < 0 else 1.0)

    def compute_metrics(self, results):
        return dict(count=len(results), nones=sum(r is None for r in results))


def _samples(n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 8, generator=g)
    y = torch.randn(n, 3, generator=g)
    return [dict(inputs=x[i], data_samples=y[i]) for i in range(n)]


def _new_model() -> TinyModel:
    torch.manual_seed(1234)
    return TinyModel()


def _loader(dataset: list) -> dict:
    return dict(
        dataset=dataset,
        sampler=dict(type="DefaultSampler", shuffle=False),
        batch_size=PER_RANK_BATCH,
        num_workers=0,
        collate_fn=dict(type="default_collate"),
    )


def _runner_kwargs(work_dir: str, name: str) -> dict:
    return dict(
        model=_new_model(),
        work_dir=work_dir,
        experiment_name=name,
        train_dataloader=_loader(_samples(N_TRAIN, 0)),
        val_dataloader=_loader(_samples(N_VAL, 1)),
        val_evaluator=Evaluator(MSEMetric()),
        val_cfg=dict(),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=LR, momentum=MOMENTUM), accumulative_counts=ACCUM),
        train_cfg=dict(by_epoch=False, max_iters=ITERS, val_interval=ITERS),
        default_hooks=dict(
            checkpoint=dict(type="CheckpointHook", interval=ITERS, by_epoch=False),
            logger=dict(type="LoggerHook", interval=1),
        ),
        launcher="pytorch",
        randomness=dict(seed=0),
        log_level="WARNING",
    )


def _weights(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(runner) -> dict:
    from fastcoll.integrations.mmengine import FastCollDDP

    entered = []

    def wrap_no_sync(wrapper):
        original = wrapper.no_sync

        def no_sync():
            entered.append(True)
            return original()

        wrapper.no_sync = no_sync

    if isinstance(runner.model, FastCollDDP):  # Runner wraps at construction
        wrap_no_sync(runner.model)
    else:  # FlexibleRunner wraps when training starts
        prepare = runner.strategy.prepare

        def prepare_and_wrap(*args, **kwargs):
            out = prepare(*args, **kwargs)
            wrap_no_sync(runner.strategy.model)
            return out

        runner.strategy.prepare = prepare_and_wrap
    runner.train()
    assert isinstance(runner.model, FastCollDDP), type(runner.model)
    # mmengine's gradient accumulation skips the synchronization on the
    # iterations that do not update: every ACCUM-th iteration synchronizes.
    assert len(entered) == ITERS - ITERS // ACCUM, entered
    module = runner.model.module
    # 4 training iterations, each preprocessed with training=True
    assert module.data_preprocessor.training_calls == ITERS
    metrics = runner.val()
    # numpy, not tensors: tensors sent through a multiprocessing queue go by
    # shared memory, which is gone once the rank process exits.
    return dict(weights={k: v.numpy() for k, v in _weights(module).items()}, mse=float(metrics["mse"]), metrics=dict(metrics))


# --------------------------------------------------------------------------- #
# Rank functions (no process group yet: the runner / strategy creates it)
# --------------------------------------------------------------------------- #


def runner_worker(rank: int, world_size: int, work_dirs: dict) -> dict:
    import torch.distributed as dist
    from mmengine.runner import Runner

    from fastcoll.integrations.mmengine import FastCollEvaluator, FastCollRunner

    out = {}
    # 1. FastCollRunner: initializes the group itself from the torchrun-style
    #    environment (mmengine's own init_dist cannot on CPU torch); the
    #    default dist_cfg backend 'nccl' falls back to gloo without CUDA.
    #    Validation through FastCollEvaluator (keeps None results).
    kwargs = _runner_kwargs(work_dirs["fastcoll_runner"], "fastcoll_runner")
    kwargs["val_evaluator"] = FastCollEvaluator([MSEMetric(), NoneCountMetric()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        runner = FastCollRunner(**kwargs, env_cfg=dict(dist_cfg=dict(backend="nccl", timeout=60)))
    assert dist.is_initialized() and dist.get_world_size() == world_size and dist.get_rank() == rank
    assert dist.get_backend() == "gloo"
    out["fastcoll_runner"] = _train(runner)
    # 2. mmengine's own Runner with the one-line wrapper config; the group
    #    exists already (as after fastcoll.dist.init_dist), so it is reused.
    runner = Runner(
        **_runner_kwargs(work_dirs["runner"], "plain_runner"),
        cfg=dict(model_wrapper_cfg=dict(type="FastCollDDP", detect_anomalous_params=True)),
    )
    out["runner"] = _train(runner)
    return out


def strategy_worker(rank: int, world_size: int, work_dirs: dict) -> dict:
    import torch.distributed as dist
    from mmengine.runner import FlexibleRunner

    import fastcoll.integrations.mmengine  # noqa: F401  (what a config's custom_imports does)

    out = {}
    # 1. fastcoll's strategy: initializes the group through fastcoll.dist.init_dist.
    runner = FlexibleRunner(
        strategy=dict(type="FastCollDDPStrategy"),
        env_cfg=dict(dist_cfg=dict(backend="gloo", timeout=60)),
        **_runner_kwargs(work_dirs["fastcoll_strategy"], "fastcoll_strategy"),
    )
    assert dist.is_initialized() and dist.get_world_size() == world_size
    out["fastcoll_strategy"] = _train(runner)
    # 2. mmengine's own DDPStrategy with the wrapper swapped in: it passes
    #    device_ids=[LOCAL_RANK] for this CPU model, which FastCollDDP drops.
    runner = FlexibleRunner(
        strategy=dict(type="DDPStrategy", model_wrapper=dict(type="FastCollDDP")),
        env_cfg=dict(dist_cfg=dict(backend="gloo", timeout=60)),
        **_runner_kwargs(work_dirs["mmengine_strategy"], "mmengine_strategy"),
    )
    out["mmengine_strategy"] = _train(runner)
    return out


# --------------------------------------------------------------------------- #
# The single-process reference on the global batch
# --------------------------------------------------------------------------- #


def _reference() -> dict:
    model = _new_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    data = _samples(N_TRAIN, 0)
    global_batch = PER_RANK_BATCH * WORLD
    for it in range(ITERS):
        # DefaultSampler(shuffle=False) deals sample j to rank j % WORLD, so
        # iteration `it` covers samples [it * global_batch, (it + 1) * global_batch).
        chunk = data[it * global_batch : (it + 1) * global_batch]
        x = torch.stack([d["inputs"] for d in chunk]) * 2.0 - 1.0
        y = torch.stack([d["data_samples"] for d in chunk])
        (F.mse_loss(model.net(x), y) / ACCUM).backward()
        if (it + 1) % ACCUM == 0:
            opt.step()
            opt.zero_grad()
    with torch.no_grad():
        val = _samples(N_VAL, 1)
        x = torch.stack([d["inputs"] for d in val]) * 2.0 - 1.0
        y = torch.stack([d["data_samples"] for d in val])
        mse = ((model.net(x) - y) ** 2).mean(dim=1)
    return dict(weights=_weights(model), mse=float(mse.mean()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(fn, *args) -> list:
    """Run ``fn`` on WORLD ranks with a torchrun-style environment and no process group yet."""
    port = _free_port()
    return run_ranks(_with_rank_env, WORLD, fn, port, *args, init_pg=False, timeout=150, pg_timeout=60)


def _with_rank_env(rank: int, world_size: int, fn, port: int, *args):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    return fn(rank, world_size, *args)


def _check_run(results: list, ref: dict, what: str) -> None:
    for res in results:
        res["weights"] = {k: torch.from_numpy(v) for k, v in res["weights"].items()}
    w0 = results[0]["weights"]
    for r, res in enumerate(results[1:], 1):
        assert res["weights"].keys() == w0.keys()
        for k in w0:
            assert torch.equal(res["weights"][k], w0[k]), f"{what}: {k} differs between rank 0 and rank {r}"
    for k, v in ref["weights"].items():
        torch.testing.assert_close(w0[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {k}: {m}")
    for res in results:
        assert res["mse"] == pytest.approx(ref["mse"], rel=1e-5), what


def _check_checkpoint(work_dir: str, weights: dict, unprefixed: bool = True) -> None:
    """The checkpoint loads into a plain model with mmengine's loader, and (``unprefixed``) with torch's."""
    from mmengine.runner.checkpoint import _load_checkpoint_to_model

    path = os.path.join(work_dir, f"iter_{ITERS}.pth")
    assert os.path.exists(path), os.listdir(work_dir)
    # (mmengine 0.10.7's load_checkpoint calls torch.load with torch >= 2.6's
    # weights_only=True default, which refuses the message-hub objects that
    # mmengine itself stores in the file; read it here, then let mmengine map the keys.)
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    plain = TinyModel()
    _load_checkpoint_to_model(plain, ckpt, strict=True)
    for k, v in plain.state_dict().items():
        assert torch.equal(v, weights[k]), k
    if unprefixed:
        state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
        assert not any(k.startswith("module.") for k in state), list(state)
        plain = TinyModel()
        plain.load_state_dict(state, strict=True)
        for k, v in plain.state_dict().items():
            assert torch.equal(v, weights[k]), k


# --------------------------------------------------------------------------- #
# Tests
# --------------------------------------------------------------------------- #


@pytest.mark.timeout(240)
def test_runner_two_ranks_matches_single_process(tmp_path):
    work_dirs = {k: str(tmp_path / k) for k in ("fastcoll_runner", "runner")}
    results = _launch(runner_worker, work_dirs)
    ref = _reference()
    for kind in ("fastcoll_runner", "runner"):
        per_rank = [r[kind] for r in results]
        _check_run(per_rank, ref, kind)
        _check_checkpoint(work_dirs[kind], per_rank[0]["weights"])
    # FastCollEvaluator: every validation sample counted once (sampler padding
    # cut off), the None results kept, the metrics the same on every rank.
    nones = sum(float(d["data_samples"][0]) < 0 for d in _samples(N_VAL, 1))
    assert 0 < nones < N_VAL
    for r in results:
        assert r["fastcoll_runner"]["metrics"]["count"] == N_VAL
        assert r["fastcoll_runner"]["metrics"]["nones"] == nones


@pytest.mark.timeout(240)
def test_flexible_runner_strategy_two_ranks(tmp_path):
    work_dirs = {k: str(tmp_path / k) for k in ("fastcoll_strategy", "mmengine_strategy")}
    results = _launch(strategy_worker, work_dirs)
    ref = _reference()
    for kind in work_dirs:
        per_rank = [r[kind] for r in results]
        _check_run(per_rank, ref, kind)
        # mmengine's own DDPStrategy saves the wrapper's keys ("module." prefix; its loader strips it)
        _check_checkpoint(work_dirs[kind], per_rank[0]["weights"], unprefixed=kind == "fastcoll_strategy")


# --------------------------------------------------------------------------- #
# Single-process checks (no ranks)
# --------------------------------------------------------------------------- #


def test_registered_and_config_imports(tmp_path):
    """One line of config: custom_imports registers the wrapper, strategy and runner in mmengine's root registries."""
    from mmengine.config import Config
    from mmengine.registry import EVALUATOR, MODEL_WRAPPERS, RUNNERS, STRATEGIES

    cfg_file = tmp_path / "cfg.py"
    cfg_file.write_text(
        "custom_imports = dict(imports=['fastcoll.integrations.mmengine'], allow_failed_imports=False)\n"
        "model_wrapper_cfg = dict(type='FastCollDDP', find_unused_parameters=True)\n"
        "strategy = dict(type='FastCollDDPStrategy')\n"
        "runner_type = 'FastCollRunner'\n"
        "val_evaluator = dict(type='FastCollEvaluator', metrics=[])\n"
    )
    cfg = Config.fromfile(str(cfg_file))
    from fastcoll.integrations import mmengine as fm

    assert MODEL_WRAPPERS.get(cfg.model_wrapper_cfg["type"]) is fm.FastCollDDP
    assert STRATEGIES.get(cfg.strategy["type"]) is fm.FastCollDDPStrategy
    assert RUNNERS.get(cfg.runner_type) is fm.FastCollRunner
    assert EVALUATOR.get(cfg.val_evaluator["type"]) is fm.FastCollEvaluator
    from mmengine.model import is_model_wrapper

    assert issubclass(fm.FastCollDDP, __import__("fastcoll").DDP)
    assert not is_model_wrapper(TinyModel())


def test_setup_dist_errors():
    from fastcoll.integrations.mmengine import setup_dist_from_cfg

    with pytest.raises(ValueError, match="init_backend"):
        setup_dist_from_cfg("pytorch", "gloo", init_backend="deepspeed")
    with pytest.raises(ValueError, match="launcher"):
        setup_dist_from_cfg("nonsense", "gloo")
