"""fastcoll in PyTorch Lightning (Trainer) and Lightning Fabric, on 2 gloo CPU processes.

Lightning starts its extra processes by re-running the script, so the training
lives in this file's ``__main__`` part and runs as a standalone script
(``python tests/test_integrations_lightning.py --out DIR``), once, in a
subprocess with a timeout; each rank writes what it saw to DIR and the tests
below check it:

* Trainer(strategy="fastcoll_ddp", accumulate_grad_batches=2): weights identical
  on both ranks and equal to the same run with strategy="ddp" (torch DDP);
  gradient synchronization skipped on accumulating batches; a second fit on the
  same LightningModule works, with one fastcoll hook per parameter (no doubled
  hooks) and none left after teardown.
* Fabric(strategy="fastcoll_ddp") with no_backward_sync: the same comparison,
  and the saved checkpoint's model keys carry no "module." prefix and load back.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch

N_SAMPLES, BATCH, WORLD = 32, 4, 2
STRATEGIES = ("fastcoll_ddp", "ddp")


# --------------------------------------------------------------------------- #
# The script part (runs on every rank; Lightning re-runs this file for rank 1)
# --------------------------------------------------------------------------- #


def _data():
    g = torch.Generator().manual_seed(7)
    x = torch.rand(N_SAMPLES, 8, generator=g)
    y = torch.randn(N_SAMPLES, 3, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def _net():
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _hook_count(module) -> int:
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in module.parameters())


def _run_trainer(out_dir: str) -> None:
    import pytorch_lightning as pl
    import torch.nn.functional as F

    import fastcoll.integrations.lightning  # noqa: F401  (registers "fastcoll_ddp")

    class LitModel(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()
            self.sync_flags = []
            self.hook_counts = []
            self.wrappers = set()
            self.val_batches = 0

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            wrapper = self.trainer.strategy.model  # this runs inside the wrapper's forward
            self.sync_flags.append(bool(wrapper.require_backward_grad_sync))
            self.wrappers.add(type(wrapper).__name__)
            self.hook_counts.append(_hook_count(self))
            return F.mse_loss(self(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.val_batches += 1
            self.log("val_mse", F.mse_loss(self(x), y), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    results = {}
    rank = None
    for strategy in STRATEGIES:
        model = LitModel()
        fits = []
        for _ in range(2):  # a second fit on the same module
            trainer = pl.Trainer(
                accelerator="cpu",
                devices=WORLD,
                strategy=strategy,
                accumulate_grad_batches=2,
                max_epochs=1,
                limit_val_batches=2,
                num_sanity_val_steps=0,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
            )
            loader = torch.utils.data.DataLoader(_data(), batch_size=BATCH)
            trainer.fit(model, train_dataloaders=loader, val_dataloaders=loader)
            rank = trainer.global_rank
            fits.append(
                dict(
                    weights={k: v.detach().clone() for k, v in model.state_dict().items()},
                    wrapper=type(trainer.strategy.model).__name__,
                    hooks_after=_hook_count(model),
                    steps=trainer.global_step,
                )
            )
        results[strategy] = dict(
            fits=fits,
            sync_flags=model.sync_flags,
            hook_counts=model.hook_counts,
            n_params=len(list(model.parameters())),
            wrappers_in_step=sorted(model.wrappers),
            val_batches=model.val_batches,
            trainer_wrapper=type(trainer.strategy).__name__,
        )

    class ManualLit(LitModel):
        """Manual optimization: the backward runs inside training_step, i.e. inside the wrapper's forward."""

        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            x, y = batch
            opt = self.optimizers()
            self.manual_backward(F.mse_loss(self(x), y))
            opt.step()
            opt.zero_grad()

    for strategy in STRATEGIES:
        model = ManualLit()
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=WORLD,
            strategy=strategy,
            max_epochs=1,
            limit_val_batches=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(_data(), batch_size=BATCH))
        results[f"manual_{strategy}"] = dict(weights={k: v.detach().clone() for k, v in model.state_dict().items()})

    # A torch communication hook, registered by the strategy on a CPU model
    # (Lightning's own DDPStrategy only registers hooks on CUDA).
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from fastcoll.integrations.lightning import FastCollDDPStrategy

    calls = []

    def counting_allreduce_hook(state, bucket):
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    model = LitModel()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=FastCollDDPStrategy(ddp_comm_hook=counting_allreduce_hook),
        max_epochs=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(_data(), batch_size=BATCH))
    results["comm_hook"] = dict(weights={k: v.detach().clone() for k, v in model.state_dict().items()}, calls=len(calls))
    torch.save(results, os.path.join(out_dir, f"trainer_rank{rank}.pt"))


def _run_fabric(out_dir: str) -> None:
    import torch.nn.functional as F
    from lightning_fabric import Fabric

    import fastcoll.integrations.lightning  # noqa: F401

    results = {}
    for strategy in STRATEGIES:
        fabric = Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
        fabric.launch()
        model = _net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, opt = fabric.setup(model, opt)
        loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(_data(), batch_size=BATCH))
        flags = []
        for i, (x, y) in enumerate(loader):
            accumulating = i % 2 == 0
            with fabric.no_backward_sync(model, enabled=accumulating):
                flags.append(bool(model._forward_module.require_backward_grad_sync))
                fabric.backward(F.mse_loss(model(x), y) / 2)
            if not accumulating:
                opt.step()
                opt.zero_grad()
        path = os.path.join(out_dir, f"fabric_{strategy}.ckpt")
        fabric.save(path, {"model": model, "optimizer": opt})
        # load back into a fresh wrapped model through the strategy
        other = fabric.setup_module(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)))
        fabric.load(path, {"model": other})
        reloaded = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
        results[strategy] = dict(
            weights={k: v.detach().clone() for k, v in model.state_dict().items()},
            wrapper=type(model._forward_module).__name__,
            flags=flags,
            reloaded=reloaded,
        )
        rank = fabric.global_rank
    torch.save(results, os.path.join(out_dir, f"fabric_rank{rank}.pt"))


def _main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    _run_trainer(args.out)
    _run_fabric(args.out)


# --------------------------------------------------------------------------- #
# Tests
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    pytest.importorskip(
        "pytorch_lightning",
        reason="PyTorch Lightning is not installed (pip install 'fastcoll[lightning]'; `make test` installs it)",
    )
    out = tmp_path_factory.mktemp("lightning")
    env = dict(os.environ, OMP_NUM_THREADS="1", PL_DISABLE_FORK="1")
    env.pop("LOCAL_RANK", None)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--out", str(out)],
        env=env,
        cwd=str(out),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"training script failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return out


def _load(run_dir, name):
    return [torch.load(run_dir / f"{name}_rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _assert_equal_weights(a: dict, b: dict, what: str, exact: bool = True) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), f"{what}: {k}"
        else:
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7, msg=lambda m: f"{what}: {k}: {m}")


@pytest.mark.timeout(300)
def test_trainer_fastcoll_ddp_matches_torch_ddp(run_dir):
    ranks = _load(run_dir, "trainer")
    for strategy in STRATEGIES:
        for fit in range(2):
            _assert_equal_weights(
                ranks[0][strategy]["fits"][fit]["weights"],
                ranks[1][strategy]["fits"][fit]["weights"],
                f"{strategy} fit {fit}: rank 0 vs rank 1",
            )
    for fit in range(2):
        _assert_equal_weights(
            ranks[0]["fastcoll_ddp"]["fits"][fit]["weights"],
            ranks[0]["ddp"]["fits"][fit]["weights"],
            f"fit {fit}: fastcoll_ddp vs ddp",
            exact=False,
        )
    fc = ranks[0]["fastcoll_ddp"]
    assert fc["trainer_wrapper"] == "FastCollDDPStrategy"
    assert fc["wrappers_in_step"] == ["DDP"]  # training_step ran inside fastcoll.DDP's forward
    assert ranks[0]["ddp"]["wrappers_in_step"] == ["DistributedDataParallel"]
    # the wrapper is gone after teardown (the bare LightningModule is back)
    assert [f["wrapper"] for f in fc["fits"]] == ["LitModel", "LitModel"]
    # the weights moved in both fits: 4 batches per rank, 2 optimizer steps per fit
    assert [f["steps"] for f in fc["fits"]] == [2, 2]
    w0 = {k: v.clone() for k, v in _net().state_dict().items()}
    assert not torch.equal(fc["fits"][0]["weights"]["net.0.weight"], w0["0.weight"])
    assert not torch.equal(fc["fits"][1]["weights"]["net.0.weight"], fc["fits"][0]["weights"]["net.0.weight"])
    assert fc["val_batches"] > 0


@pytest.mark.timeout(300)
def test_trainer_manual_optimization(run_dir):
    ranks = _load(run_dir, "trainer")
    _assert_equal_weights(ranks[0]["manual_fastcoll_ddp"]["weights"], ranks[1]["manual_fastcoll_ddp"]["weights"], "manual: ranks")
    _assert_equal_weights(
        ranks[0]["manual_fastcoll_ddp"]["weights"], ranks[0]["manual_ddp"]["weights"], "manual: fastcoll_ddp vs ddp", exact=False
    )
    assert not torch.equal(ranks[0]["manual_fastcoll_ddp"]["weights"]["net.0.weight"], _net().state_dict()["0.weight"])


@pytest.mark.timeout(300)
def test_trainer_comm_hook_on_cpu(run_dir):
    ranks = _load(run_dir, "trainer")
    for res in ranks:
        assert res["comm_hook"]["calls"] >= 4, res["comm_hook"]["calls"]  # 4 synchronized backwards, >= 1 bucket each
    _assert_equal_weights(ranks[0]["comm_hook"]["weights"], ranks[1]["comm_hook"]["weights"], "comm hook: ranks")
    # no accumulation here: the same as the manual-optimization run (one step per batch, plain SGD)
    _assert_equal_weights(
        ranks[0]["comm_hook"]["weights"], ranks[0]["manual_ddp"]["weights"], "comm hook vs torch DDP", exact=False
    )


@pytest.mark.timeout(300)
def test_trainer_accumulation_skips_sync_and_hooks_are_not_doubled(run_dir):
    for res in _load(run_dir, "trainer"):
        for strategy in STRATEGIES:
            # accumulate_grad_batches=2: the first batch of each pair runs under no_sync
            assert res[strategy]["sync_flags"] == [False, True] * 4, (strategy, res[strategy]["sync_flags"])
        fc = res["fastcoll_ddp"]
        # one post-accumulate-grad hook per parameter in the first fit and in the second
        assert fc["hook_counts"] == [fc["n_params"]] * 8, fc["hook_counts"]
        assert [f["hooks_after"] for f in fc["fits"]] == [0, 0]


@pytest.mark.timeout(300)
def test_fabric_no_backward_sync_and_checkpoint(run_dir):
    ranks = _load(run_dir, "fabric")
    for res in ranks:
        assert res["fastcoll_ddp"]["wrapper"] == "DDP"  # fastcoll.DDP
        assert res["ddp"]["wrapper"] == "DistributedDataParallel"
        for strategy in STRATEGIES:
            assert res[strategy]["flags"] == [False, True] * 2, (strategy, res[strategy]["flags"])
            assert res[strategy]["reloaded"], strategy
    for strategy in STRATEGIES:
        _assert_equal_weights(ranks[0][strategy]["weights"], ranks[1][strategy]["weights"], f"fabric {strategy}: ranks")
    _assert_equal_weights(
        ranks[0]["fastcoll_ddp"]["weights"], ranks[0]["ddp"]["weights"], "fabric: fastcoll_ddp vs ddp", exact=False
    )
    for strategy in STRATEGIES:
        ckpt = torch.load(run_dir / f"fabric_{strategy}.ckpt", weights_only=False)
        keys = list(ckpt["model"])
        assert keys == ["0.weight", "0.bias", "2.weight", "2.bias"], (strategy, keys)
        _assert_equal_weights(ckpt["model"], ranks[0][strategy]["weights"], f"fabric {strategy}: checkpoint")


def test_registered_and_bad_kwargs():
    pytest.importorskip(
        "pytorch_lightning",
        reason="PyTorch Lightning is not installed (pip install 'fastcoll[lightning]'; `make test` installs it)",
    )
    from lightning_fabric.strategies import STRATEGY_REGISTRY
    from pytorch_lightning.strategies import StrategyRegistry

    from fastcoll.integrations import lightning as fl

    assert StrategyRegistry.get("fastcoll_ddp").__class__ is fl.FastCollDDPStrategy
    assert STRATEGY_REGISTRY.get("fastcoll_ddp").__class__ is fl.FastCollFabricStrategy
    assert StrategyRegistry.get("fastcoll_ddp_find_unused_parameters_true")._ddp_kwargs == {"find_unused_parameters": True}
    assert "ddp" in StrategyRegistry and "ddp" in STRATEGY_REGISTRY  # untouched
    import importlib

    importlib.reload(fl)  # registering twice is fine
    with pytest.raises(TypeError, match="not_a_ddp_argument"):
        fl._wrap(torch.nn.Linear(2, 2), None, {"not_a_ddp_argument": 1})


if __name__ == "__main__":
    _main()
