"""fastcoll in PyTorch Lightning (Trainer) and Lightning Fabric, on 2 gloo CPU processes.

Every run-based test runs once per Lightning distribution that is installed: the
standalone packages (``pytorch_lightning`` + ``lightning_fabric``) and the
unified package (``lightning.pytorch`` + ``lightning.fabric``); a distribution
that is not installed skips its parameter.

Lightning starts its extra processes by re-running the script, so the training
lives in this file's ``__main__`` part and runs as a standalone script
(``python tests/test_integrations_lightning.py --dist DIST --out DIR``), once per
distribution, in a subprocess with a timeout; each rank writes what it saw to
DIR and the tests below check it:

* Trainer(strategy="fastcoll_ddp", accumulate_grad_batches=2): weights identical
  on both ranks and equal to the same run with strategy="ddp" (torch DDP);
  gradient synchronization skipped on accumulating batches; a second fit on the
  same LightningModule works, with one fastcoll hook per parameter (no doubled
  hooks) and none left after teardown.
* Fabric(strategy="fastcoll_ddp") with no_backward_sync: the same comparison,
  and the saved checkpoint's model keys carry no "module." prefix and load back.

Importing the integration with one distribution hidden (``sys.modules[name] =
None``, in a subprocess) registers only the other one; with both hidden it
raises the ImportError that says what to install.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

N_SAMPLES, BATCH, WORLD = 32, 4, 2
STRATEGIES = ("fastcoll_ddp", "ddp")
# distribution -> (Trainer package, Fabric package, prefix of fastcoll's strategy class names)
DISTS = {
    "pytorch_lightning": ("pytorch_lightning", "lightning_fabric", ""),
    "lightning": ("lightning.pytorch", "lightning.fabric", "Unified"),
}


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


def _run_trainer(out_dir: str, dist: str) -> None:
    import torch.nn.functional as F

    import fastcoll.integrations.lightning as fl  # registers "fastcoll_ddp"

    trainer_pkg, _, prefix = DISTS[dist]
    pl = importlib.import_module(trainer_pkg)

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

    def quiet_trainer(strategy, **kwargs):
        """A one-epoch CPU Trainer on WORLD processes, without logger, checkpoints or progress output."""
        return pl.Trainer(
            accelerator="cpu",
            devices=WORLD,
            strategy=strategy,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            **kwargs,
        )

    results = {}
    rank = None
    for strategy in STRATEGIES:
        model = LitModel()
        fits = []
        for _ in range(2):  # a second fit on the same module
            trainer = quiet_trainer(strategy, accumulate_grad_batches=2, limit_val_batches=2, num_sanity_val_steps=0)
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
        trainer = quiet_trainer(strategy, limit_val_batches=0)
        trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(_data(), batch_size=BATCH))
        results[f"manual_{strategy}"] = dict(weights={k: v.detach().clone() for k, v in model.state_dict().items()})

    # A torch communication hook, registered by the strategy on a CPU model
    # (Lightning's own DDPStrategy only registers hooks on CUDA).
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    FastCollDDPStrategy = getattr(fl, f"{prefix}FastCollDDPStrategy")
    calls = []

    def counting_allreduce_hook(state, bucket):
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    model = LitModel()
    trainer = quiet_trainer(FastCollDDPStrategy(ddp_comm_hook=counting_allreduce_hook), limit_val_batches=0)
    trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(_data(), batch_size=BATCH))
    results["comm_hook"] = dict(weights={k: v.detach().clone() for k, v in model.state_dict().items()}, calls=len(calls))
    torch.save(results, os.path.join(out_dir, f"trainer_rank{rank}.pt"))


def _run_fabric(out_dir: str, dist: str) -> None:
    import torch.nn.functional as F

    import fastcoll.integrations.lightning  # noqa: F401

    Fabric = importlib.import_module(DISTS[dist][1]).Fabric

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
            strategy_cls=type(fabric.strategy).__name__,
            flags=flags,
            reloaded=reloaded,
        )
        rank = fabric.global_rank
    torch.save(results, os.path.join(out_dir, f"fabric_rank{rank}.pt"))


def _main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--dist", choices=sorted(DISTS), required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    _run_trainer(args.out, args.dist)
    _run_fabric(args.out, args.dist)


# --------------------------------------------------------------------------- #
# Tests
# --------------------------------------------------------------------------- #


def _require(dist: str) -> None:
    """Skip unless the distribution's Trainer and Fabric packages import."""
    for package in DISTS[dist][:2]:
        pytest.importorskip(
            package,
            reason=f"{package} is not installed (pip install 'fastcoll[lightning]'; `make test` installs it)",
        )


@pytest.fixture(scope="module", params=sorted(DISTS))
def dist(request):
    _require(request.param)
    return request.param


@pytest.fixture(scope="module")
def run_dir(dist, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"lightning_{dist}")
    env = dict(os.environ, OMP_NUM_THREADS="1", PL_DISABLE_FORK="1")
    env.pop("LOCAL_RANK", None)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--dist", dist, "--out", str(out)],
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
def test_trainer_fastcoll_ddp_matches_torch_ddp(run_dir, dist):
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
    assert fc["trainer_wrapper"] == f"{DISTS[dist][2]}FastCollDDPStrategy"
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
def test_fabric_no_backward_sync_and_checkpoint(run_dir, dist):
    ranks = _load(run_dir, "fabric")
    for res in ranks:
        assert res["fastcoll_ddp"]["strategy_cls"] == f"{DISTS[dist][2]}FastCollFabricStrategy"
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


@pytest.mark.parametrize("dist", sorted(DISTS))
def test_registered_and_bad_kwargs(dist):
    _require(dist)
    trainer_pkg, fabric_pkg, prefix = DISTS[dist]
    trainer_registry = importlib.import_module(f"{trainer_pkg}.strategies").StrategyRegistry
    fabric_registry = importlib.import_module(f"{fabric_pkg}.strategies").STRATEGY_REGISTRY

    from fastcoll.integrations import lightning as fl

    trainer_cls, fabric_cls = fl.STRATEGY_CLASSES[dist]
    assert trainer_cls is getattr(fl, f"{prefix}FastCollDDPStrategy")
    assert fabric_cls is getattr(fl, f"{prefix}FastCollFabricStrategy")
    # built on this distribution's own base classes (the other's would be rejected by its Trainer / Fabric)
    assert issubclass(trainer_cls, importlib.import_module(f"{trainer_pkg}.strategies").DDPStrategy)
    assert issubclass(fabric_cls, importlib.import_module(f"{fabric_pkg}.strategies").DDPStrategy)
    assert trainer_registry.get("fastcoll_ddp").__class__ is trainer_cls
    assert fabric_registry.get("fastcoll_ddp").__class__ is fabric_cls
    assert trainer_registry.get("fastcoll_ddp_find_unused_parameters_true")._ddp_kwargs == {"find_unused_parameters": True}
    assert fabric_registry.get("fastcoll_ddp_find_unused_parameters_true")._ddp_kwargs == {"find_unused_parameters": True}
    assert "ddp" in trainer_registry and "ddp" in fabric_registry  # untouched

    importlib.reload(fl)  # registering twice is fine
    assert trainer_registry.get("fastcoll_ddp").__class__ is fl.STRATEGY_CLASSES[dist][0]
    with pytest.raises(TypeError, match="not_a_ddp_argument"):
        fl._wrap(torch.nn.Linear(2, 2), None, {"not_a_ddp_argument": 1})


_PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    sys.modules[name] = None  # as if not installed: importing it raises ModuleNotFoundError
try:
    import fastcoll.integrations.lightning as fl
except ImportError as exc:
    print(json.dumps({"error": str(exc)}))
    raise SystemExit(0)
registered = {}
for dist, (trainer_pkg, fabric_pkg) in {"pytorch_lightning": ("pytorch_lightning", "lightning_fabric"),
                                        "lightning": ("lightning.pytorch", "lightning.fabric")}.items():
    try:
        trainer_registry = importlib.import_module(trainer_pkg + ".strategies").StrategyRegistry
        fabric_registry = importlib.import_module(fabric_pkg + ".strategies").STRATEGY_REGISTRY
    except ImportError:
        continue
    registered[dist] = ["fastcoll_ddp" in trainer_registry, "fastcoll_ddp" in fabric_registry]
missing = {}
for name in ("FastCollDDPStrategy", "UnifiedFastCollDDPStrategy"):
    try:
        getattr(fl, name)
    except AttributeError as exc:
        missing[name] = str(exc)
print(json.dumps({"dists": list(fl.STRATEGY_CLASSES), "all": fl.__all__, "registered": registered, "missing": missing}))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "hidden, installed",
    [
        (("lightning",), "pytorch_lightning"),
        (("pytorch_lightning", "lightning_fabric"), "lightning"),
        (("pytorch_lightning", "lightning_fabric", "lightning"), None),
    ],
    ids=["standalone_only", "unified_only", "neither"],
)
def test_registers_only_installed_distributions(hidden, installed):
    if installed is not None:
        _require(installed)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _PROBE, *hidden], env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    if installed is None:
        assert "needs PyTorch Lightning" in res["error"] and "fastcoll[lightning]" in res["error"], res
        return
    other = "lightning" if installed == "pytorch_lightning" else "pytorch_lightning"
    prefix, other_prefix = DISTS[installed][2], DISTS[other][2]
    assert res["dists"] == [installed], res
    assert res["registered"] == {installed: [True, True]}, res  # the hidden one could not even be imported
    assert f"{prefix}FastCollDDPStrategy" in res["all"] and f"{other_prefix}FastCollDDPStrategy" not in res["all"], res
    assert f"{prefix}FastCollDDPStrategy" not in res["missing"], res
    assert f"`{other}` package" in res["missing"][f"{other_prefix}FastCollDDPStrategy"], res


if __name__ == "__main__":
    _main()
