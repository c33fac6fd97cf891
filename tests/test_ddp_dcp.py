"""fastcoll.DDP under torch.distributed.checkpoint (DCP), side by side with torch DDP, on 2 gloo ranks.

DCP's state-dict functions recognize DDP with ``isinstance`` and strip its
``module.`` prefix; fastcoll.DDP subclasses torch's DDP, so they must give the
same fully qualified names for both wrappers (those of the bare model) and
the same values. A DCP checkpoint (model + AdamW state after a few steps)
saved under one wrapper must load under the other and into the bare model,
and training continued after loading must match, bitwise (2 ranks: averaging
two gradients rounds the same way whether divided before or after the sum),
training continued under the wrapper that saved it.
"""

from __future__ import annotations

import copy

import ddp_models as M
import pytest
import torch
from multiproc import run_ranks

pytestmark = pytest.mark.timeout(180)

NAME, LR, SAVE_AT, MORE = "convbn", 0.01, 3, 2  # a model with BatchNorm buffers (int64 num_batches_tracked too)


def _pair(kind: str, seed: int):
    """A ConvBN model from ``seed``, wrapped by ``kind`` ('torch' or 'fastcoll'), and its AdamW."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import fastcoll

    wrapper = TorchDDP if kind == "torch" else fastcoll.DDP
    model = wrapper(M.build(NAME, seed))
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def _train(rank: int, ws: int, model, opt, steps) -> None:
    for step in steps:
        M.backward_on_chunk(NAME, ws, rank, step, [(model, opt)])
        opt.step()


def _snapshot(state):
    """A copy of nested state dicts: DCP's hold the live parameters and optimizer state, which training changes."""
    return copy.deepcopy(state)


def _assert_same(a, b, what: str) -> None:
    """Nested state dicts ``a`` and ``b``: same structure, bitwise-equal tensors."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{what}: keys {list(a)} != {list(b)}"
        for k in a:
            _assert_same(a[k], b[k], f"{what}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{what}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{what}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a!r} vs {b!r}"
        assert torch.equal(a, b), f"{what}: values differ"
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


def _state_dict_api(rank: int, ws: int) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
        set_state_dict,
    )

    import fastcoll

    pairs = {kind: _pair(kind, seed=0) for kind in ("torch", "fastcoll")}
    assert isinstance(pairs["fastcoll"][0], fastcoll.DDP)
    for model, opt in pairs.values():
        _train(rank, ws, model, opt, range(SAVE_AT))
    bare_keys = list(M.build(NAME, 0).state_dict())
    got = {}
    for kind, (model, opt) in pairs.items():
        msd, osd = get_state_dict(model, opt)
        got[kind] = _snapshot(
            dict(
                model=get_model_state_dict(model),
                optim=get_optimizer_state_dict(model, opt),
                both=dict(model=msd, optim=osd),
                full=get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)),
                flat=get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)),
            )
        )
        assert list(got[kind]["model"]) == bare_keys, (kind, list(got[kind]["model"]))
        assert set(got[kind]["optim"]["state"]) == {k for k in bare_keys if "running" not in k and "num_batches" not in k}
        assert not any(k.startswith("module.") for k in got[kind]["flat"]), (kind, list(got[kind]["flat"]))
    _assert_same(got["torch"], got["fastcoll"], f"rank {rank}: DCP state dicts, torch DDP vs fastcoll.DDP")

    # set_*: torch DDP's state into freshly initialized models (another seed) under each wrapper,
    # through each of the three setters; all then continue bitwise like the original.
    src_model, src_opt = pairs["torch"]
    source = got["torch"]
    _train(rank, ws, src_model, src_opt, range(SAVE_AT, SAVE_AT + MORE))
    rank0_model = [source["model"]]
    dist.broadcast_object_list(rank0_model, src=0)
    rank0_model = rank0_model[0]
    want = _snapshot(get_state_dict(src_model, src_opt))
    for kind in ("torch", "fastcoll"):
        for setter in ("separate", "set_state_dict", "broadcast_from_rank0"):
            model, opt = _pair(kind, seed=7)
            given = copy.deepcopy(source)  # the setters rename the keys of the dicts they are given, in place
            if setter == "separate":
                set_model_state_dict(model, given["model"])
                set_optimizer_state_dict(model, opt, given["optim"])
            elif setter == "set_state_dict":
                set_state_dict(model, opt, model_state_dict=given["both"]["model"], optim_state_dict=given["both"]["optim"])
            else:  # rank 0 alone holds the full model state; the others receive it
                opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
                set_model_state_dict(model, given["full"] if rank == 0 else {}, options=opts)
                set_optimizer_state_dict(model, opt, given["optim"])
            # BatchNorm's running statistics differ across ranks between forwards (each forward starts by
            # broadcasting rank 0's): after broadcast_from_rank0 every rank holds rank 0's.
            expected = rank0_model if setter == "broadcast_from_rank0" else source["model"]
            _assert_same(get_model_state_dict(model), expected, f"rank {rank}: {kind} after {setter}")
            _train(rank, ws, model, opt, range(SAVE_AT, SAVE_AT + MORE))
            _assert_same(get_state_dict(model, opt), want, f"rank {rank}: {kind} loaded by {setter}, trained on")


def _dcp_roundtrip(rank: int, ws: int, ckpt_dirs: dict) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    trained = {kind: _pair(kind, seed=0) for kind in ("torch", "fastcoll")}
    for kind, (model, opt) in trained.items():
        _train(rank, ws, model, opt, range(SAVE_AT))
        # BatchNorm's running statistics are each rank's own between forwards; DCP saves one copy of each
        # replicated entry, from whichever rank its planner picks: make them rank 0's first.
        for b in model.module.buffers():
            dist.broadcast(b, src=0)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt_dirs[kind])
    saved = {kind: _snapshot(get_state_dict(*pair)) for kind, pair in trained.items()}
    _assert_same(saved["torch"], saved["fastcoll"], f"rank {rank}: saved state, torch DDP vs fastcoll.DDP")
    for model, opt in trained.values():
        _train(rank, ws, model, opt, range(SAVE_AT, SAVE_AT + MORE))
    continued = {kind: _snapshot(get_state_dict(*pair)) for kind, pair in trained.items()}

    def load(model, opt, ckpt_dir):
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=ckpt_dir)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    for saver, loader in (("torch", "fastcoll"), ("fastcoll", "torch"), ("fastcoll", "fastcoll")):
        what = f"rank {rank}: saved under {saver}, loaded under {loader}"
        model, opt = _pair(loader, seed=7)
        load(model, opt, ckpt_dirs[saver])
        _assert_same(get_state_dict(model, opt), saved[saver], what)
        _train(rank, ws, model, opt, range(SAVE_AT, SAVE_AT + MORE))
        _assert_same(get_state_dict(model, opt), continued[saver], f"{what}, trained on")

    # Into the bare model: the same names and values, through DCP's functions and through a plain load_state_dict.
    for saver in ("torch", "fastcoll"):
        bare = M.build(NAME, seed=7)
        opt = torch.optim.AdamW(bare.parameters(), lr=LR, weight_decay=0.1)
        load(bare, opt, ckpt_dirs[saver])
        _assert_same(get_state_dict(bare, opt), saved[saver], f"rank {rank}: saved under {saver}, loaded into the bare model")
        _assert_same(bare.state_dict(), saved[saver][0], f"rank {rank}: bare model's own state_dict")
        plain = M.build(NAME, seed=7)
        plain.load_state_dict(saved[saver][0])  # the DCP model state dict is the bare model's


def test_state_dict_functions_match_torch_ddp():
    run_ranks(_state_dict_api, 2, timeout=150)


def test_dcp_checkpoint_across_wrappers(tmp_path):
    dirs = {kind: str(tmp_path / kind) for kind in ("torch", "fastcoll")}
    run_ranks(_dcp_roundtrip, 2, dirs, timeout=150)
