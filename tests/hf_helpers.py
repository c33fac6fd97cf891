"""Helpers shared by the Hugging Face integration tests (test_integrations_accelerate.py, test_integrations_trainer.py)."""

from __future__ import annotations

import os

import torch


def tiny_gpt2(seed: int = 0):
    """A GPT-2 of a tiny config (no download; no dropout, so every wrapper computes the same thing)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)


def torchrun_env(rank: int, world_size: int) -> None:
    """The torchrun-style environment that makes accelerate's state a MULTI_CPU one over the harness's process group."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))


def compare_states(got: dict, want: dict, what: str, exact: bool) -> None:
    """Assert two state dicts equal: bitwise (``exact``) or to float32 rounding."""
    assert list(got) == list(want), what
    for k in want:
        if exact:
            assert torch.equal(got[k], want[k]), f"{what}: {k} differs (max {float((got[k] - want[k]).abs().max())})"
        else:
            torch.testing.assert_close(got[k], want[k], rtol=2e-5, atol=2e-6, msg=lambda m: f"{what}: {k}: {m}")
