"""fastcoll.DDP under Hugging Face accelerate and transformers, side by side with torch DDP, on 2 gloo ranks.

accelerate and transformers recognize DDP with ``isinstance(model,
torch.nn.parallel.DistributedDataParallel)``; fastcoll.DDP subclasses it, so
they unwrap it (``extract_model_from_parallel``, ``Accelerator.unwrap_model``,
``transformers.modeling_utils.unwrap_model``), save the bare model's weights
(``Accelerator.save_model``, ``save_pretrained``: no ``module.`` prefix,
``from_pretrained`` finds every weight) and force a synchronization
(``Accelerator.trigger_sync_in_backward``) as they do for torch DDP.

The ranks' process group is the harness's; the torchrun-style environment
(RANK, WORLD_SIZE, LOCAL_RANK) makes ``Accelerator(cpu=True)`` a 2-process
MULTI_CPU accelerator that uses it. The model is a GPT-2 of a tiny config
(no download; tied input/output embeddings; no dropout, so both wrappers
compute the same thing).

``Accelerator.prepare`` wraps any model in torch DDP, a fastcoll.DDP too (as it
does a model already in torch DDP): gradients stay right but are reduced
twice. Pass the wrapped model through ``prepare`` marked as prepared
(``model._is_accelerate_prepared = True``, accelerate's own guard), or do not
pass it at all; the tests pin both behaviours.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from multiproc import run_ranks

# Checked without importing (transformers takes seconds to import; the ranks import it).
for _pkg in ("accelerate", "transformers", "safetensors"):
    if importlib.util.find_spec(_pkg) is None:
        pytest.skip(
            f"{_pkg} is not installed (`make test` installs accelerate==1.15.0 and transformers==5.24.0)",
            allow_module_level=True,
        )

pytestmark = pytest.mark.timeout(240)

WORLD = 2


def _gpt2(seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(100 * step + rank))


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _grads(model) -> list:
    return [p.grad.detach().clone() for p in model.parameters()]


def _all_ranks(tensors: list) -> list:
    """Each tensor as gathered from every rank: a list (per tensor) of per-rank tensors."""
    import torch.distributed as dist

    out = []
    for t in tensors:
        got = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(got, t)
        out.append(got)
    return out


def _same_across_ranks(tensors: list) -> bool:
    return all(all(torch.equal(per[0], x) for x in per) for per in _all_ranks(tensors))


def _assert_same_state(got: dict, want: dict, what: str) -> None:
    assert list(got) == list(want), f"{what}: keys {sorted(set(got) ^ set(want))} differ"
    for k, v in want.items():
        assert torch.equal(got[k], v), f"{what}: {k} differs"


def _hf_worker(rank: int, world_size: int, dirs: dict) -> dict:
    import os

    import safetensors.torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, extract_model_from_parallel
    from torch.nn.parallel import DistributedDataParallel as TorchDDP
    from transformers import GPT2LMHeadModel
    from transformers.modeling_utils import unwrap_model

    import fastcoll

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    acc = Accelerator(cpu=True)
    assert acc.distributed_type == DistributedType.MULTI_CPU, acc.distributed_type
    assert (acc.num_processes, acc.process_index) == (world_size, rank) == (dist.get_world_size(), dist.get_rank())

    # --- unwrapping
    bare = _gpt2(0)
    fast = fastcoll.DDP(bare)
    for how, got in (
        ("extract_model_from_parallel", extract_model_from_parallel(fast)),
        ("Accelerator.unwrap_model", acc.unwrap_model(fast)),
        ("transformers unwrap_model", unwrap_model(fast)),
        ("transformers unwrap_model(recursive=True)", unwrap_model(fast, recursive=True)),
    ):
        assert got is bare, f"{how} returned {type(got).__name__}, not the wrapped GPT2LMHeadModel"
    compiled = torch.compile(fast)  # not run: unwrapping only looks through _orig_mod
    assert extract_model_from_parallel(compiled, keep_torch_compile=False) is bare
    assert acc.unwrap_model(compiled, keep_torch_compile=False) is bare
    assert list(acc.get_state_dict(fast)) == list(bare.state_dict())

    # --- prepare: accelerate wraps a wrapped model again (in torch DDP), unless it is marked prepared
    small = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    twice = acc.prepare(fastcoll.DDP(small))
    assert type(twice) is TorchDDP and isinstance(twice.module, fastcoll.DDP), type(twice)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    acc.backward(twice(x).square().sum())
    reduced_twice = _grads(small)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    ref.load_state_dict(small.state_dict())
    ref_ddp = TorchDDP(ref)  # kept alive through the backward (its reducer goes with it)
    ref_ddp(x).square().sum().backward()
    for g, w in zip(reduced_twice, _grads(ref)):
        torch.testing.assert_close(g, w)  # right, at the cost of a second all-reduce
    marked = fastcoll.DDP(_gpt2(0))
    marked._is_accelerate_prepared = True
    assert acc.prepare(marked) is marked and marked in acc._models

    # --- trigger_sync_in_backward after two forwards under no_sync; then an ordinary synchronized step
    models = {"torch": acc.prepare(_gpt2(0)), "fastcoll": marked}  # accelerate's own torch DDP; the user's fastcoll.DDP
    assert type(models["torch"]) is TorchDDP
    opts = {kind: torch.optim.AdamW(m.parameters(), lr=1e-2) for kind, m in models.items()}
    grads = {}
    for kind, model in models.items():
        with acc.no_sync(model):
            loss_a = _loss(model, _batch(rank, 0))
            loss_b = _loss(model, _batch(rank, 1))
        acc.backward(loss_a)
        assert not _same_across_ranks(_grads(model)), f"{kind}: the backward under no_sync synchronized"
        with acc.trigger_sync_in_backward(model):
            acc.backward(loss_b)
        grads[kind] = _grads(model)
        assert _same_across_ranks(grads[kind]), f"{kind}: trigger_sync_in_backward did not synchronize"
        opts[kind].step()
        opts[kind].zero_grad()
        acc.backward(_loss(model, _batch(rank, 2)))
        grads[kind + " next step"] = _grads(model)
        assert _same_across_ranks(grads[kind + " next step"]), f"{kind}: the step after did not synchronize"
        opts[kind].step()
    for what in ("", " next step"):
        for i, (g, w) in enumerate(zip(grads["fastcoll" + what], grads["torch" + what])):
            assert torch.equal(g, w), f"gradient {i}{what}: fastcoll.DDP != torch DDP"
    # The synchronized gradient is the mean over ranks of each rank's two accumulated losses.
    local = _gpt2(0)
    (_loss(local, _batch(rank, 0)) + _loss(local, _batch(rank, 1))).backward()
    for i, (g, per_rank) in enumerate(zip(grads["fastcoll"], _all_ranks(_grads(local)))):
        torch.testing.assert_close(g, sum(per_rank) / world_size, msg=lambda m: f"gradient {i}: {m}")
    trained = models["fastcoll"].module
    assert _same_across_ranks([p.detach() for p in trained.parameters()])
    _assert_same_state(trained.state_dict(), models["torch"].module.state_dict(), "trained weights, fastcoll vs torch")

    # trigger_sync_in_backward arms the reducer with no outputs (reducer.prepare_for_backward([])). With
    # find_unused_parameters=True every parameter is then "unused" and its real gradient arrives again: torch
    # DDP and fastcoll.DDP both raise. With static_graph=True fastcoll.DDP synchronizes (torch 2.13 fails an
    # internal assert there).
    for kind in ("torch", "fastcoll"):
        model = (TorchDDP if kind == "torch" else fastcoll.DDP)(torch.nn.Linear(4, 2), find_unused_parameters=True)
        with acc.no_sync(model):
            loss = model(x).sum()
        try:
            with acc.trigger_sync_in_backward(model):
                acc.backward(loss)
        except RuntimeError as exc:
            assert "ready" in str(exc), exc
        else:
            raise AssertionError(f"{kind}: find_unused_parameters with trigger_sync_in_backward did not raise")
    model = fastcoll.DDP(torch.nn.Linear(4, 2), static_graph=True)
    for step in range(3):  # the first iteration learns the graph
        model.zero_grad()
        with acc.no_sync(model):
            loss_a, loss_b = model(x).sum(), model(2 * x).square().sum()
        acc.backward(loss_a)
        with acc.trigger_sync_in_backward(model):
            acc.backward(loss_b)
        assert _same_across_ranks(_grads(model.module)), f"static_graph: step {step} did not synchronize"

    # --- Accelerator.save_model, and transformers' save_pretrained on the unwrapped model
    for kind, model in models.items():
        acc.save_model(model, dirs[f"save_model_{kind}"])
        if acc.is_main_process:
            acc.unwrap_model(model).config.save_pretrained(dirs[f"save_model_{kind}"])
    unwrap_model(models["fastcoll"]).save_pretrained(
        dirs["save_pretrained"], is_main_process=acc.is_main_process, save_function=acc.save
    )
    acc.wait_for_everyone()
    want = trained.state_dict()
    files = {}
    for which in ("save_model_fastcoll", "save_model_torch", "save_pretrained"):
        files[which] = safetensors.torch.load_file(os.path.join(dirs[which], "model.safetensors"))
        assert not any(k.startswith("module.") for k in files[which]), (which, list(files[which]))
        loaded, info = GPT2LMHeadModel.from_pretrained(dirs[which], output_loading_info=True)
        assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), (which, info)
        _assert_same_state(loaded.state_dict(), want, f"{which}: from_pretrained")
    _assert_same_state(files["save_model_fastcoll"], files["save_model_torch"], "save_model's file, fastcoll vs torch")

    # --- save_state / load_state: the wrapper's own keys ("module." prefix), as for torch DDP. One
    # Accelerator per model (each saves the models it prepared; both were prepared already).
    states = {}
    for kind, model in models.items():
        own = Accelerator(cpu=True)
        assert own.prepare(model) is model
        own.save_state(dirs[f"state_{kind}"])
        own.wait_for_everyone()  # rank 0 writes the model file
        states[kind] = (own, safetensors.torch.load_file(os.path.join(dirs[f"state_{kind}"], "model.safetensors")))
    _assert_same_state(states["fastcoll"][1], states["torch"][1], "save_state's model file, fastcoll vs torch")
    assert all(k.startswith("module.") for k in states["fastcoll"][1])
    with torch.no_grad():
        for p in trained.parameters():
            p.zero_()
    states["fastcoll"][0].load_state(dirs["state_fastcoll"])
    _assert_same_state(trained.state_dict(), want, "after load_state")
    return {}


def test_accelerate_and_transformers_two_ranks(tmp_path):
    names = ("save_model_fastcoll", "save_model_torch", "save_pretrained", "state_fastcoll", "state_torch")
    dirs = {k: str(tmp_path / k) for k in names}
    run_ranks(_hf_worker, WORLD, dirs, timeout=200, pg_timeout=60)
