"""fastcoll.DDP in timm's training helpers, side by side with torch DDP, on 2 gloo ranks.

timm finds the model inside a wrapper by duck typing (``timm.utils.unwrap_model``
follows ``.module``; ``TrainingTask.no_sync`` calls the trainable module's
``no_sync``; checkpoints go through ``unwrap_model``), and its tasks'
``prepare_distributed`` builds torch DDP itself: a fastcoll user sets
``task.trainable_module = fastcoll.DDP(task.trainable_module)`` instead. The
task's losses, gradient accumulation under ``no_sync``, EMA (``ModelEmaV3``)
and checkpoint state must equal torch DDP's, bitwise.

timm 1.0.31 imports torchvision when imported, and PyPI's torchvision for torch
2.13.0 is a CUDA build that does not load with the CPU build of torch that
``make test`` uses; there these tests skip. ``make test-timm`` runs them in
the CUDA build's environment (torch 2.14.1, its torchvision, timm).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from multiproc import run_ranks

try:
    import timm  # noqa: F401
except Exception as exc:  # ImportError, or torchvision's RuntimeError when its operators fail to load
    pytest.skip(
        f"timm cannot be imported with this torch ({torch.__version__}): {type(exc).__name__}: {exc}. "
        "timm imports torchvision, and PyPI's torchvision for torch 2.13.0 is a CUDA build that does not "
        "load with the CPU torch; `make test-timm` runs these tests with the CUDA build of torch",
        allow_module_level=True,
    )

pytestmark = pytest.mark.timeout(180)

KINDS = ("torch", "fastcoll")
ACCUM = 2


def _task(kind: str):
    from timm import create_model
    from timm.task import ClassificationTask

    import fastcoll

    torch.manual_seed(0)
    model = create_model("test_efficientnet", num_classes=3, drop_rate=0.0, drop_path_rate=0.0)
    task = ClassificationTask(model, criterion=torch.nn.CrossEntropyLoss(), device=torch.device("cpu"), verbose=False)
    task.setup_ema(decay=0.9)
    if kind == "torch":
        task.prepare_distributed()
    else:  # what prepare_distributed does, with fastcoll's wrapper
        task.trainable_module = fastcoll.DDP(task.trainable_module)
    return task, model


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 3, (2,), generator=g)


def _same_across_ranks(tensors) -> bool:
    import torch.distributed as dist

    for t in tensors:
        got = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(got, t.contiguous())
        if not all(torch.equal(got[0], x) for x in got):
            return False
    return True


def _timm_worker(rank: int, ws: int) -> None:
    from timm.utils import get_state_dict, unwrap_model
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import fastcoll

    out = {}
    for kind in KINDS:
        task, model = _task(kind)
        wrapper = task.get_trainable_module()
        assert isinstance(wrapper, fastcoll.DDP if kind == "fastcoll" else TorchDDP)
        assert unwrap_model(wrapper) is model and unwrap_model(task) is not model
        assert list(get_state_dict(wrapper)) == list(model.state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for step in range(4):
            for micro in range(ACCUM):  # gradient accumulation: the last micro-batch synchronizes
                sync = micro == ACCUM - 1
                with contextlib.nullcontext() if sync else task.no_sync():
                    result = task(*_batch(rank, ACCUM * step + micro))
                    (result["loss"] / ACCUM).backward()
                losses.append(result["loss"].detach())
                grads = [p.grad for p in model.parameters()]
                assert _same_across_ranks(grads) == sync, f"{kind}: step {step}, micro-batch {micro}"
            opt.step()
            opt.zero_grad()
            task.update_ema(step=step)
        state = task.get_checkpoint_state()
        state.update(task.get_checkpoint_state(ema=True))
        assert list(state["state_dict"]) == list(model.state_dict()), list(state["state_dict"])
        fresh, _ = _task(kind)
        fresh.load_checkpoint_state(state["state_dict"])
        fresh.load_checkpoint_state(state["state_dict_ema"], ema=True)
        out[kind] = dict(state=state, losses=losses, reloaded=unwrap_model(fresh.get_trainable_module()).state_dict())
    for part in ("state_dict", "state_dict_ema"):
        a, b = out["fastcoll"]["state"][part], out["torch"]["state"][part]
        assert list(a) == list(b)
        for k in a:
            assert torch.equal(a[k], b[k]), f"rank {rank}: {part} {k}: fastcoll != torch"
    for k, v in out["fastcoll"]["state"]["state_dict"].items():
        assert torch.equal(out["fastcoll"]["reloaded"][k], v), k
    assert all(torch.equal(a, b) for a, b in zip(out["fastcoll"]["losses"], out["torch"]["losses"]))


def test_timm_task_with_fastcoll_ddp():
    run_ranks(_timm_worker, 2, timeout=150)
