"""Gradient health fused into the reduction: grad_norm / clip_grad_norm_, non-finite gradients, the gradient divisor.

Each multi-rank run checks, per configuration, that ``grad_norm()`` equals a
float64 norm of the synchronized gradients (rtol 1e-5) and is bitwise equal
on every rank; that ``clip_grad_norm_`` trains exactly as torch DDP plus
``torch.nn.utils.clip_grad_norm_``; that a NaN or Inf planted on one rank is
reported on every rank with that rank and parameter; and that
``set_gradient_divisor`` divides the global sum as asked.
"""

from __future__ import annotations

import time

import ddp_models as M
import pytest
import torch
import torch.distributed as dist
from multiproc import run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as D
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastcoll

pytestmark = pytest.mark.timeout(240)


def _norm64(module: nn.Module) -> torch.Tensor:
    """Float64 L2 norm of every gradient that is not None (sparse ones densified)."""
    sq = [
        g.to_dense().double().square().sum() if g.is_sparse else g.double().square().sum()
        for g in (p.grad for p in module.parameters())
        if g is not None
    ]
    return torch.stack(sq).sum().sqrt()


def _same_everywhere(t: torch.Tensor, what: str) -> None:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    assert all(torch.equal(out[0], o) for o in out), f"{what}: differs across ranks: {[o.item() for o in out]}"


# (label, model, DDP kwargs, options)
NORM_CONFIGS = [
    ("default", "mlp", {"bucket_cap_mb": 0.001}, {}),
    ("gradient_as_bucket_view", "mlp", {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.001}, {}),
    ("comm_dtype fp16", "mlp", {"comm_dtype": torch.float16}, {}),
    ("comm hook (fp16 compress)", "mlp", {"bucket_cap_mb": 0.001}, {"hook": D.fp16_compress_hook}),
    ("sparse", "sparse", {}, {}),
    ("find_unused_parameters", "branchy", {"find_unused_parameters": True, "bucket_cap_mb": 1e-6}, {}),
    ("static_graph", "mlp", {"static_graph": True}, {}),
    ("mixed fp16/bf16/fp32", "mixed", {"bucket_cap_mb": 1e-4}, {}),
    ("no_sync accumulation", "convbn", {}, {"accumulate": True}),
    ("torch.compile", "mlp", {}, {"compile": True}),
]


def norm_worker(rank, world_size, configs):
    for label, name, kwargs, opts in configs:
        what = f"{label} (rank {rank}/{world_size})"
        model = M.build(name, seed=0)
        if opts.get("compile"):
            model = torch.compile(model, backend="eager")
        fast = fastcoll.DDP(model, compute_grad_norm=True, **kwargs)
        if "hook" in opts:
            fast.register_comm_hook(None, opts["hook"])
        for step in range(3):
            x, y = M.global_batch(name, world_size, step)
            xr, yr = M.chunk_of(x, rank), M.chunk_of(y, rank)
            fast.zero_grad()
            if opts.get("accumulate"):
                with fast.no_sync():
                    M.loss_of(name, fast, xr, yr, rank, step).backward()
                    with pytest.raises(RuntimeError, match="inside no_sync"):
                        fast.grad_norm()
            M.loss_of(name, fast, xr, yr, rank, step).backward()
            got = fast.grad_norm()
            assert got.dtype == torch.float32 and got.dim() == 0, what
            want = _norm64(fast.module)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0, msg=lambda m, s=step: f"{what} step {s}: {m}")
            _same_everywhere(got, f"{what} step {step}")
            assert torch.equal(fast.grad_norm(), got), f"{what}: a second call differs"
        fast.close()


@pytest.mark.parametrize("world_size", [2, 3])
def test_grad_norm_matches_float64_and_is_identical_on_every_rank(world_size):
    run_ranks(norm_worker, world_size, NORM_CONFIGS, timeout=240)


def join_norm_worker(rank, world_size):
    model = fastcoll.DDP(M.build("mlp", 0), compute_grad_norm=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join():
        for step in range(rank + 2):  # uneven inputs
            x, y = M.global_batch("mlp", world_size, step)
            opt.zero_grad()
            M.loss_of("mlp", model, M.chunk_of(x, rank), M.chunk_of(y, rank), rank, step).backward()
            torch.testing.assert_close(model.grad_norm().double(), _norm64(model.module), rtol=1e-5, atol=0)
            opt.step()
    model.close()


def test_grad_norm_under_join():
    run_ranks(join_norm_worker, 2)


# --------------------------------------------------------------------------- clipping


def clip_worker(rank, world_size):
    for opt_name in ("sgd", "adamw"):
        for max_norm in (0.05, 1e3):  # below the norm (clips) and above it (leaves the gradients)
            what = f"{opt_name} max_norm={max_norm} (rank {rank})"
            fast = fastcoll.DDP(M.build("mlp", rank), compute_grad_norm=True, bucket_cap_mb=0.001)
            ref = TorchDDP(M.build("mlp", 0), bucket_cap_mb=0.001)
            make = (
                (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
                if opt_name == "sgd"
                else (lambda ps: torch.optim.AdamW(ps, lr=1e-2))
            )
            of, ot = make(fast.parameters()), make(ref.parameters())
            for step in range(4):
                x, y = M.global_batch("mlp", world_size, step)
                xr, yr = M.chunk_of(x, rank), M.chunk_of(y, rank)
                for mod, opt in ((fast, of), (ref, ot)):
                    opt.zero_grad()
                    M.loss_of("mlp", mod, xr, yr, rank, step).backward()
                n_fast = fast.clip_grad_norm_(max_norm)
                n_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
                torch.testing.assert_close(n_fast, n_ref, rtol=1e-5, atol=0, msg=lambda m, s=step: f"{what} step {s}: norm: {m}")
                # The returned norm is the one before clipping; grad_norm() now describes the clipped gradients.
                torch.testing.assert_close(fast.grad_norm().double(), _norm64(fast.module), rtol=1e-5, atol=0)
                of.step()
                ot.step()
            for (n, p), q in zip(fast.module.named_parameters(), ref.module.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{what}: {n}: {m}")
            fast.close()
    # Other norm types fall back to torch's function.
    fast = fastcoll.DDP(M.build("mlp", 0), compute_grad_norm=True)
    x, y = M.global_batch("mlp", world_size, 0)
    M.loss_of("mlp", fast, M.chunk_of(x, rank), M.chunk_of(y, rank), rank, 0).backward()
    want = torch.stack([p.grad.abs().max() for p in fast.parameters()]).max()
    torch.testing.assert_close(fast.clip_grad_norm_(1e9, norm_type=float("inf")), want)
    fast.close()


def test_clip_grad_norm_trains_like_torch_ddp_with_clip_grad_norm():
    run_ranks(clip_worker, 2, timeout=240)


def misuse_worker(rank, world_size):
    x, y = M.global_batch("mlp", world_size, 0)
    xr, yr = M.chunk_of(x, rank), M.chunk_of(y, rank)
    off = fastcoll.DDP(M.build("mlp", 0))
    M.loss_of("mlp", off, xr, yr, rank, 0).backward()
    with pytest.raises(RuntimeError, match="compute_grad_norm=True"):
        off.grad_norm()
    off.close()
    on = fastcoll.DDP(M.build("mlp", 0), compute_grad_norm=True)
    with pytest.raises(RuntimeError, match="no synchronized backward"):
        on.grad_norm()
    M.loss_of("mlp", on, xr, yr, rank, 0).backward()
    on.grad_norm()
    on.zero_grad()
    with pytest.raises(RuntimeError, match="changed since the last synchronized backward"):
        on.grad_norm()
    M.loss_of("mlp", on, xr, yr, rank, 1).backward()
    next(on.parameters()).grad.mul_(2)
    with pytest.raises(RuntimeError, match="changed since"):
        on.clip_grad_norm_(1.0)
    on.close()


def test_grad_norm_misuse_raises_clearly():
    run_ranks(misuse_worker, 2)


# --------------------------------------------------------------------------- non-finite gradients


PLANTED = "layers.3.weight"


def _plant(model: nn.Module, name: str, value: float, index: int = 0):
    """Make ``name``'s local gradient hold ``value`` at ``index`` (a hook on the parameter's gradient); returns its handle."""
    p = dict(model.named_parameters())[name]

    def hook(g):
        g = g.clone()
        g.view(-1)[index] = value
        return g

    return p.register_hook(hook)


@pytest.mark.parametrize("world_size, bad_rank", [(2, 1), (3, 2)])
def test_nonfinite_gradient_named_on_every_rank(world_size, bad_rank):
    run_ranks(_nonfinite_entry, world_size, bad_rank, timeout=120)


def _nonfinite_entry(rank, world_size, bad_rank):
    x, y = M.global_batch("mlp", world_size, 0)
    xr, yr = M.chunk_of(x, rank), M.chunk_of(y, rank)
    for value in (float("nan"), float("inf"), float("-inf")):
        model = fastcoll.DDP(M.build("mlp", 0), check_nonfinite=True, bucket_cap_mb=0.001)
        handle = _plant(model.module, PLANTED, value, index=5) if rank == bad_rank else None
        t0 = time.monotonic()
        with pytest.raises(fastcoll.NonFiniteGradError) as err:
            M.loss_of("mlp", model, xr, yr, rank, 0).backward()
        msg = str(err.value)
        assert time.monotonic() - t0 < 10, f"{value}: took {time.monotonic() - t0:.1f}s"
        assert f"rank {bad_rank}: '{PLANTED}' (1 non-finite)" in msg and "iteration 1" in msg, msg
        lines = [None] * world_size
        dist.all_gather_object(lines, msg)
        assert len(set(lines)) == 1, f"{value}: messages differ across ranks: {lines}"
        # A caller that catches the error zeroes the gradients, skips the step and goes on training.
        if handle is not None:
            handle.remove()
        model.zero_grad()
        M.loss_of("mlp", model, xr, yr, rank, 1).backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        model.close()


def overflow_worker(rank, world_size):
    """fp16 wire: every rank's gradient and share is finite, but their sum overflows float16."""
    model = fastcoll.DDP(nn.Linear(4, 1, bias=False), check_nonfinite=True, comm_dtype=torch.float16)
    with torch.no_grad():
        model.module.weight.fill_(1.0)
    x = torch.full((1, 4), 60000.0 * world_size)  # gradient 60000*ws: share 60000 each, sum 60000*ws > 65504
    with pytest.raises(fastcoll.NonFiniteGradError, match="no rank's local gradients were non-finite") as err:
        model(x).sum().backward()
    model.close()
    return str(err.value)


def test_wire_overflow_reported_as_such():
    msgs = run_ranks(overflow_worker, 2)
    assert msgs[0] == msgs[1]
    assert "float16" in msgs[0]


def finite_worker(rank, world_size):
    counts = []
    for check in (False, True):
        model = fastcoll.DDP(M.build("mlp", 0), check_nonfinite=check, bucket_cap_mb=0.001)
        seen = []
        model.reducer.add_collective_listener(seen.append)
        for step in range(3):
            x, y = M.global_batch("mlp", world_size, step)
            model.zero_grad()
            M.loss_of("mlp", model, M.chunk_of(x, rank), M.chunk_of(y, rank), rank, step).backward()
        counts.append(len(seen))
        model.close()
    return counts


def test_all_finite_no_error_and_no_extra_collective():
    for off, on in run_ranks(finite_worker, 2):
        assert off == on and off > 0, (off, on)


# --------------------------------------------------------------------------- the divisor


class TokenModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 6)
        self.out = nn.Linear(6, 11)

    def forward(self, tokens):
        return self.out(self.emb(tokens))


def _tokens(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randint(0, 11, (3 + 4 * rank + step,), generator=g)  # a different token count per rank


def divisor_worker(rank, world_size, as_tensor):
    model = fastcoll.DDP(TokenModel(), bucket_cap_mb=0.0005)
    ref = TokenModel()
    for step in range(2):
        toks = _tokens(rank, step)
        total = sum(len(_tokens(r, step)) - 1 for r in range(world_size))
        model.set_gradient_divisor(torch.tensor(float(total)) if as_tensor else float(total))
        model.zero_grad()
        nn.functional.cross_entropy(model(toks[:-1]), toks[1:], reduction="sum").backward()
        # One process on the concatenated batch, loss summed over tokens and divided by their number.
        ref.zero_grad()
        loss = sum(
            nn.functional.cross_entropy(ref(_tokens(r, step)[:-1]), _tokens(r, step)[1:], reduction="sum")
            for r in range(world_size)
        )
        (loss / total).backward()
        for (n, p), q in zip(model.module.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"step {step} {n}: {m}")
    model.set_gradient_divisor(None)  # back to the mean over ranks
    model.zero_grad()
    toks = _tokens(rank, 0)
    nn.functional.cross_entropy(model(toks[:-1]), toks[1:]).backward()
    ref.zero_grad()
    (
        sum(nn.functional.cross_entropy(ref(_tokens(r, 0)[:-1]), _tokens(r, 0)[1:]) for r in range(world_size)) / world_size
    ).backward()
    for p, q in zip(model.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="set_gradient_divisor"):
        model.set_gradient_divisor(0.0)
    with pytest.raises(ValueError, match="set_gradient_divisor"):
        model.set_gradient_divisor(torch.ones(2))
    model.close()


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_gradient_divisor_divides_the_global_sum(world_size, as_tensor):
    run_ranks(divisor_worker, world_size, as_tensor)
