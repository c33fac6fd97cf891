"""fastcoll.DDP where libraries look for torch DDP: mmengine's wrapper checks and checkpoints, torch.optim.swa_utils.

Side by side with torch DDP on 2 gloo ranks:

* mmengine 0.10.7: ``is_model_wrapper`` is True for a plain fastcoll.DDP (torch's
  DDP class is registered in ``MODEL_WRAPPERS``, fastcoll.DDP subclasses it),
  so ``get_state_dict``, ``save_checkpoint``/``load_checkpoint`` and a
  ``Runner`` given an already-wrapped model save and load the bare model's
  keys (no ``module.`` prefix), as for torch DDP.
* ``torch.optim.swa_utils``: ``AveragedModel(ddp)`` deep-copies the wrapper
  (torch DDP rebuilds its reducer on the copy, fastcoll.DDP too) and averages
  by zipping ``parameters()`` (and ``buffers()`` with ``use_buffers=True``)
  with the live wrapper's; ``update_bn`` runs the copy's forward in train mode
  under ``no_grad`` (the first forward broadcasts rank 0's freshly reset
  buffers, later ones do not). Every averaged parameter, buffer and output
  must equal torch DDP's, bitwise. ``AveragedModel(ddp.module)``, the usual
  form, is the bare model's business and needs no test.
"""

from __future__ import annotations

import importlib.util

import ddp_models as M
import pytest
import torch
from multiproc import run_ranks

pytestmark = pytest.mark.timeout(180)

NAME, LR = "convbn", 0.05
KINDS = ("torch", "fastcoll")


def _wrap(kind: str, model):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import fastcoll

    return TorchDDP(model) if kind == "torch" else fastcoll.DDP(model)


def _train(rank: int, ws: int, model, opt, steps) -> None:
    for step in steps:
        M.backward_on_chunk(NAME, ws, rank, step, [(model, opt)])
        opt.step()


def _assert_same_state(got: dict, want: dict, what: str) -> None:
    assert list(got) == list(want), f"{what}: keys {list(got)} != {list(want)}"
    for k, v in want.items():
        assert torch.equal(got[k], v), f"{what}: {k} differs"


# --------------------------------------------------------------------------- #
# mmengine
# --------------------------------------------------------------------------- #


def _mmengine_worker(rank: int, ws: int, work_dir: str) -> None:
    import os

    import torch.distributed as dist
    from mmengine.model import is_model_wrapper
    from mmengine.runner import Runner
    from mmengine.runner.checkpoint import get_state_dict, load_checkpoint, save_checkpoint

    import fastcoll

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(ws), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(ws))
    bare_keys = list(M.build(NAME, 0).state_dict())
    wrapped = {}
    for kind in KINDS:
        model = _wrap(kind, M.build(NAME, 0))
        assert is_model_wrapper(model), kind
        _train(rank, ws, model, torch.optim.SGD(model.parameters(), lr=LR), range(2))
        for b in model.module.buffers():  # BatchNorm statistics are each rank's own between forwards
            dist.broadcast(b, src=0)
        wrapped[kind] = model
    assert isinstance(wrapped["fastcoll"], fastcoll.DDP) and not is_model_wrapper(wrapped["fastcoll"].module)
    states = {kind: get_state_dict(m) for kind, m in wrapped.items()}
    assert list(states["fastcoll"]) == bare_keys, list(states["fastcoll"])
    _assert_same_state(states["fastcoll"], states["torch"], "mmengine get_state_dict, fastcoll vs torch")

    want = states["fastcoll"]
    for kind in KINDS:
        path = os.path.join(work_dir, f"{kind}.pth")
        if rank == 0:
            save_checkpoint({"state_dict": get_state_dict(wrapped[kind]), "meta": {}}, path)
        dist.barrier()
        raw = torch.load(path, map_location="cpu")["state_dict"]
        assert list(raw) == bare_keys, (kind, list(raw))
        for target_kind in KINDS:  # into a wrapper (mmengine unwraps it) and into the bare model
            target = _wrap(target_kind, M.build(NAME, 7))
            load_checkpoint(target, path, map_location="cpu", strict=True)
            _assert_same_state(target.module.state_dict(), want, f"saved from {kind}, loaded into {target_kind}")
        bare = M.build(NAME, 7)
        load_checkpoint(bare, path, map_location="cpu", strict=True)
        _assert_same_state(bare.state_dict(), want, f"saved from {kind}, loaded into the bare model")
        bare.load_state_dict(raw)

    # A Runner given an already-wrapped model keeps it, saves and loads the bare model's keys.
    data = [dict(inputs=torch.zeros(3, 6, 6), data_samples=0) for _ in range(4)]
    for kind in KINDS:
        runner = Runner(
            model=wrapped[kind],
            work_dir=os.path.join(work_dir, f"runner_{kind}"),
            train_dataloader=dict(dataset=data, sampler=dict(type="DefaultSampler", shuffle=False), batch_size=2),
            train_cfg=dict(by_epoch=False, max_iters=1),
            optim_wrapper=dict(optimizer=dict(type="SGD", lr=LR)),
            launcher="pytorch",
            log_level="WARNING",
        )
        assert runner.model is wrapped[kind]
        runner.save_checkpoint(runner.work_dir, "ckpt.pth", save_optimizer=False, save_param_scheduler=False)
        dist.barrier()
        path = os.path.join(runner.work_dir, "ckpt.pth")
        raw = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
        _assert_same_state(raw, want, f"Runner.save_checkpoint with {kind}")
        with torch.no_grad():
            for p in wrapped[kind].parameters():
                p.zero_()
        runner.load_checkpoint(path, map_location="cpu")
        _assert_same_state(wrapped[kind].module.state_dict(), want, f"Runner.load_checkpoint with {kind}")


@pytest.mark.skipif(importlib.util.find_spec("mmengine") is None, reason="mmengine is not installed (`make test` installs it)")
def test_mmengine_sees_plain_fastcoll_ddp_as_wrapper(tmp_path):
    run_ranks(_mmengine_worker, 2, str(tmp_path), timeout=150, pg_timeout=60)


# --------------------------------------------------------------------------- #
# torch.optim.swa_utils
# --------------------------------------------------------------------------- #


def _swa_worker(rank: int, ws: int) -> dict:
    from torch.optim.swa_utils import SWALR, AveragedModel, get_ema_multi_avg_fn, update_bn

    import fastcoll

    out = {}
    for kind in KINDS:
        model = _wrap(kind, M.build(NAME, 0))
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        swa = AveragedModel(model)  # a deep copy of the wrapper
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)
        assert type(swa.module) is type(model) and swa.module.module is not model.module
        if kind == "fastcoll":
            assert isinstance(swa.module, fastcoll.DDP) and swa.module.reducer is not model.reducer
        sched = SWALR(opt, swa_lr=LR / 2, anneal_epochs=2)
        for step in range(4):
            _train(rank, ws, model, opt, [step])
            swa.update_parameters(model)
            ema.update_parameters(model)
            sched.step()
        loader = [M.chunk_of(M.global_batch(NAME, ws, 10 + i)[0], rank) for i in range(3)]
        update_bn(loader, swa)
        swa.eval()
        with torch.no_grad():
            x = M.chunk_of(M.global_batch(NAME, ws, 20)[0], rank)
            outputs = (swa(x), ema(x))
        # The averaged copy still trains and synchronizes like its original.
        swa.train()
        torch.nn.functional.cross_entropy(swa(x), torch.zeros(len(x), dtype=torch.long)).backward()
        out[kind] = dict(
            swa=dict(swa.state_dict()),
            ema=dict(ema.state_dict()),
            outputs=outputs,
            grads=[p.grad.clone() for p in swa.module.module.parameters()],
        )
    keys = list(out["torch"]["swa"])
    assert keys[0] == "n_averaged" and all(k.startswith("module.module.") for k in keys[1:]), keys
    for what in ("swa", "ema"):
        _assert_same_state(out["fastcoll"][what], out["torch"][what], f"rank {rank}: {what}, fastcoll vs torch")
    for a, b in zip(
        out["fastcoll"]["outputs"] + tuple(out["fastcoll"]["grads"]), out["torch"]["outputs"] + tuple(out["torch"]["grads"])
    ):
        assert torch.equal(a, b), f"rank {rank}: averaged model's outputs or gradients differ"
    return {k: v["grads"] for k, v in out.items()}


def test_swa_utils_match_torch_ddp():
    results = run_ranks(_swa_worker, 2, timeout=150)
    for kind in KINDS:  # the averaged copy's backward synchronized
        for g0, g1 in zip(results[0][kind], results[1][kind]):
            assert torch.equal(g0, g1), kind
