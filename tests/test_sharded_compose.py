"""ShardedOptimizer with fastcoll.DDP's other features, against the same training without sharding (2 gloo ranks).

Each case trains under fastcoll.DDP + the plain optimizer (or torch DDP where
it has the feature) and under fastcoll.DDP + ShardedOptimizer in both
``grads`` modes; the parameters must match bitwise (2 ranks), and the
feature must behave as it does unsharded.
"""

from __future__ import annotations

import os

import pytest
import torch
from multiproc import run_ranks
from test_sharded_optimizer import Reordered, _batch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastcoll

pytestmark = pytest.mark.timeout(300)


class Branchy(Reordered):
    """``side`` takes part in some steps only (find_unused_parameters)."""

    def forward(self, x, use_side: bool = True):
        h = torch.tanh(self.emb(x))
        h = torch.tanh(self.mid(h) + (self.side(x) if use_side else 0))
        return self.out(h)


class Tied(torch.nn.Module):
    """A language-model head tied to the embedding (one Parameter in two modules, as transformers tie them)."""

    def __init__(self, aligned: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.vocab, dim = (64, 32) if aligned else (37, 13)
        self.emb = torch.nn.Embedding(self.vocab, dim)
        self.mid = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, self.vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        ids = (x.abs() * 10).long() % self.vocab
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def TiedAligned() -> Tied:
    return Tied(aligned=True)


def Aligned() -> Reordered:
    """The model whose parameters move into flat buffers under a ShardedOptimizer (the others are staged)."""
    return Reordered(aligned=True)


def BranchyAligned() -> Branchy:
    return Branchy(aligned=True)


def _train(impl: str, grads, ddp_kwargs: dict, steps: int = 4, model_cls=Reordered, step_fn=None):
    model = model_cls()
    if impl == "torch":
        ddp = TorchDDP(model, **{k: v for k, v in ddp_kwargs.items() if k in ("find_unused_parameters", "static_graph",
                                                                              "gradient_as_bucket_view")})  # fmt: skip
    else:
        ddp = fastcoll.DDP(model, bucket_cap_mb=0.0004, first_bucket_mb=0.0002, **ddp_kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    if grads is not None:
        opt = fastcoll.ShardedOptimizer(opt, ddp, grads=grads)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    extra = []
    for step in range(steps):
        opt.zero_grad()
        if step_fn is None:
            ddp(_batch(step, rank, world)).pow(2).mean().backward()
        else:
            extra.append(step_fn(ddp, opt, step, rank, world))
        opt.step()
    return _final_params(model, ddp, opt), extra


def _final_params(model, ddp, opt) -> dict:
    """The parameters once the last all-gathers are written (copies); closes a fastcoll wrapper."""
    if isinstance(opt, fastcoll.ShardedOptimizer):
        opt.finish_param_sync()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    if isinstance(ddp, fastcoll.DDP):
        ddp.close()
    return params


def _compare(ref: dict, got: dict, what: str, bitwise: bool = True) -> None:
    for n, p in ref.items():
        ok = torch.equal(got[n], p) if bitwise else torch.allclose(got[n], p, rtol=1e-5, atol=1e-7)
        assert ok, f"{what}: {n} differs by {(got[n] - p).abs().max()}"


def _branchy_step(ddp, opt, step, rank, world):
    ddp(_batch(step, rank, world), use_side=(step + rank) % 2 == 0).pow(2).mean().backward()


def ddp_options_worker(rank: int, world: int) -> None:
    cases = [
        ("find_unused_parameters", "torch", {"find_unused_parameters": True}, Branchy, _branchy_step),
        ("find_unused_parameters, buffers", "torch", {"find_unused_parameters": True}, BranchyAligned, _branchy_step),
        ("static_graph", "torch", {"static_graph": True}, Reordered, None),
        ("static_graph, buffers", "torch", {"static_graph": True}, Aligned, None),
        ("gradient_as_bucket_view", "torch", {"gradient_as_bucket_view": True}, Reordered, None),
        ("gradient_as_bucket_view, buffers", "torch", {"gradient_as_bucket_view": True}, Aligned, None),
        ("stall_timeout", "torch", {"stall_timeout": 20}, Reordered, None),
        ("record_timeline off", "torch", {"record_timeline": False}, Aligned, None),
        ("tied embedding and head", "torch", {}, Tied, None),
        ("tied embedding and head, buffers", "torch", {}, TiedAligned, None),
    ]
    for name, ref_impl, kwargs, cls, fn in cases:
        ref, _ = _train(ref_impl, None, kwargs, model_cls=cls, step_fn=fn)
        for grads in ("full", "sharded"):
            got, _ = _train("fastcoll", grads, kwargs, model_cls=cls, step_fn=fn)
            _compare(ref, got, f"{name} grads={grads} rank {rank}")


def test_with_ddp_options():
    run_ranks(ddp_options_worker, 2, timeout=280)


def _divisor_step(ddp, opt, step, rank, world):
    ddp.set_gradient_divisor(torch.tensor(3.0 + step))
    ddp(_batch(step, rank, world)).pow(2).sum().backward()


def _norm_step(ddp, opt, step, rank, world):
    ddp(_batch(step, rank, world)).pow(2).mean().backward()
    return ddp.grad_norm().clone()


def health_worker(rank: int, world: int) -> None:
    # set_gradient_divisor: a tensor divisor folded into the pack, as unsharded.
    ref, _ = _train("fastcoll", None, {}, step_fn=_divisor_step)
    for grads in ("full", "sharded"):
        got, _ = _train("fastcoll", grads, {}, step_fn=_divisor_step)
        _compare(ref, got, f"set_gradient_divisor grads={grads}")
    # compute_grad_norm: model.grad_norm() is the norm of the full synchronized gradients, on every rank.
    ref, ref_norms = _train("fastcoll", None, {"compute_grad_norm": True}, step_fn=_norm_step)
    for grads in ("full", "sharded"):
        got, norms = _train("fastcoll", grads, {"compute_grad_norm": True}, step_fn=_norm_step)
        _compare(ref, got, f"compute_grad_norm grads={grads}")
        for a, b in zip(norms, ref_norms):
            assert torch.allclose(a, b, rtol=1e-6), (grads, a, b)
    # check_nonfinite: a NaN in one rank's gradients raises on every rank, naming it (sharded gradients too).
    for grads in ("full", "sharded"):
        model = Reordered()
        ddp = fastcoll.DDP(model, bucket_cap_mb=0.0004, first_bucket_mb=0.0002, check_nonfinite=True)
        opt = fastcoll.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), ddp, grads=grads)
        x = _batch(0, rank, world)
        if rank == 1:
            x = x.clone()
            x[0, 0] = float("nan")
        with pytest.raises(fastcoll.NonFiniteGradError, match="rank 1"):
            ddp(x).pow(2).mean().backward()
        opt.zero_grad()
        ddp(_batch(1, rank, world)).pow(2).mean().backward()  # trains on afterwards
        opt.step()
        opt.finish_param_sync()
        ddp.verify_replicas()
        ddp.close()


def test_with_gradient_health():
    run_ranks(health_worker, 2, timeout=280)


def replicas_worker(rank: int, world: int) -> None:
    """verify_replicas right after step (it finishes the all-gathers itself) and every N iterations; a state_dict
    taken right after the last step (while the all-gathers may still run) holds the stepped parameters."""
    expected = {}
    for grads in (None, "full", "sharded", "full-aligned"):
        model = Aligned() if grads == "full-aligned" else Reordered()
        if grads is None:
            ddp = TorchDDP(model)
            opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        else:
            ddp = fastcoll.DDP(model, bucket_cap_mb=0.0004, first_bucket_mb=0.0002, verify_replicas_every=2)
            opt = fastcoll.ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), ddp, grads=grads.split("-")[0])
        for step in range(4):
            opt.zero_grad()
            ddp(_batch(step, rank, world)).pow(2).mean().backward()
            opt.step()
            if grads is not None and step < 3:
                ddp.verify_replicas()
        # The wrapper's and the module's state_dict wait for the all-gathers themselves.
        sd = ddp.state_dict() if grads != "sharded" else {f"module.{k}": v for k, v in model.state_dict().items()}
        got = {k: v.clone() for k, v in sd.items()}
        if grads is None:
            expected = got
            continue
        if grads == "full-aligned":  # its own reference: torch DDP on the aligned model
            model_ref = Aligned()
            ref_ddp, ref_opt = TorchDDP(model_ref), torch.optim.AdamW(model_ref.parameters(), lr=0.01)
            for step in range(4):
                ref_opt.zero_grad()
                ref_ddp(_batch(step, rank, world)).pow(2).mean().backward()
                ref_opt.step()
            want = {f"module.{k}": v for k, v in model_ref.state_dict().items()}
            untrained = Aligned().state_dict()
            trained = [not torch.equal(v, untrained[k[7:]]) for k, v in want.items() if ".frozen." not in k]
            assert all(trained), trained
        else:
            want = expected
        assert sorted(got) == sorted(want), grads
        for k, v in want.items():
            assert torch.equal(got[k], v), (grads, k)
        ddp.verify_replicas()
        ddp.close()


def test_replicas_stay_equal():
    run_ranks(replicas_worker, 2, timeout=120)


def compile_worker(rank: int, world: int, order: str, aligned: bool) -> None:
    torch._dynamo.reset()
    out = []
    for grads in (None, "full", "sharded"):
        model = Reordered(aligned=aligned)
        if order == "ddp(compile)":
            ddp = fastcoll.DDP(torch.compile(model, backend="aot_eager"), bucket_cap_mb=0.0004, first_bucket_mb=0.0002)
            call = ddp
        else:
            ddp = fastcoll.DDP(model, bucket_cap_mb=0.0004, first_bucket_mb=0.0002)
            call = torch.compile(ddp, backend="aot_eager")
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        if grads is not None:
            opt = fastcoll.ShardedOptimizer(opt, ddp, grads=grads)
        for step in range(4):
            opt.zero_grad()
            call(_batch(step, rank, world)).pow(2).mean().backward()
            opt.step()
        if grads is not None:
            opt.finish_param_sync()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
        ddp.close()
    for got in out[1:]:
        _compare(out[0], got, f"torch.compile {order}", bitwise=False)


@pytest.mark.parametrize("aligned", [False, True], ids=["staged", "buffers"])
@pytest.mark.parametrize("order", ["ddp(compile)", "compile(ddp)"])
def test_under_torch_compile(order, aligned):
    run_ranks(compile_worker, 2, order, aligned, timeout=280)


def test_padding_rule():
    """Ranges are equal and the padding stays within max(1 % of the bucket, 256 elements)."""
    from fastcoll.reducer.shards import padded_numel

    numel = 1_000_003
    for world in (2, 8, 64):
        padded = padded_numel(numel, world, 4)
        assert padded % world == 0 and padded - numel <= max(numel // 100, 256)
        assert (padded // world) * world == padded
    assert padded_numel(0, 4, 4) == 0
    assert padded_numel(10, 3, 2) % 3 == 0


def _combined_run(
    impl: str,
    grads,
    rank: int,
    world: int,
    comm_dtype,
    resume_at=None,
    aligned=False,
    bf16=False,
    keep_zeros=False,
    fp16_scaler=False,
) -> dict:
    """4 steps of 2 micro-batches (the first under no_sync, using ``side`` on some ranks only), find_unused on.

    With ``resume_at``, the model and the optimizer are rebuilt from their
    state dicts after that many steps (a checkpoint round trip), then train on.
    With ``keep_zeros``, ``zero_grad(set_to_none=False)``, and after step 1 a
    skipped batch: the reset, then a step with no backward (torch steps the
    zeroed gradients).
    With ``fp16_scaler``, float16 parameters (float32 main gradients and masters) under torch's GradScaler, whose
    first scale overflows (skipped steps), its state in the checkpoint; the scales are returned as ``"scales"``.
    """

    low = torch.float16 if fp16_scaler else torch.bfloat16 if bf16 else torch.float32
    sixteen = bf16 or fp16_scaler  # float32 main gradients and masters
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, backoff_factor=2.0**-4) if fp16_scaler else None
    scales = []

    def build(state=None):
        model = Branchy(aligned=aligned).to(low)
        if impl == "torch":
            ddp = TorchDDP(model, find_unused_parameters=True)
        else:
            ddp = fastcoll.DDP(model, bucket_cap_mb=0.0004, first_bucket_mb=0.0002, find_unused_parameters=True,
                               comm_dtype=comm_dtype, main_grad_dtype=torch.float32 if sixteen else None)  # fmt: skip
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        if grads is not None:
            opt = fastcoll.ShardedOptimizer(opt, ddp, grads=grads, master_dtype=torch.float32 if sixteen else None)
        if state is not None:
            model.load_state_dict(state[0])
            opt.load_state_dict(state[1])
        return model, ddp, opt

    model, ddp, opt = build()
    for step in range(4):
        if step == resume_at:
            state = (ddp.module.state_dict(), opt.state_dict())  # both finish the parameters' all-gathers first
            if isinstance(ddp, fastcoll.DDP):
                ddp.close()
            model, ddp, opt = build(state)
            if scaler is not None:
                saved, scaler = scaler.state_dict(), torch.amp.GradScaler("cpu")
                scaler.load_state_dict(saved)
        scale = (lambda loss: loss) if scaler is None else scaler.scale
        loss_dtype = torch.float32 if fp16_scaler else low  # float16 outputs: the loss in float32, as amp does
        opt.zero_grad(set_to_none=not keep_zeros)
        with ddp.no_sync():
            scale(
                ddp(_batch(10 + step, rank, world).to(low), use_side=(step + rank) % 3 == 0).to(loss_dtype).pow(2).mean()
            ).backward()
        scale(ddp(_batch(step, rank, world).to(low), use_side=False).to(loss_dtype).pow(2).mean()).backward()
        if scaler is None:
            opt.step()
        else:
            scaler.unscale_(opt)
            opt.clip_grad_norm_(1.0)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        if keep_zeros and step == 1:
            opt.zero_grad(set_to_none=False)
            opt.step()
    return {**_final_params(model, ddp, opt), **({"scales": torch.tensor(scales)} if scaler is not None else {})}


def combined_worker(rank: int, world: int) -> None:
    # Against torch DDP + AdamW (float32 wire): 3 ranks sum in another order, so within rounding (2 as well: the
    # same comparison at both sizes).
    for keep_zeros in (False, True):
        ref = _combined_run("torch", None, rank, world, None, keep_zeros=keep_zeros)
        for grads in ("full", "sharded"):
            got = _combined_run("fastcoll", grads, rank, world, None, resume_at=2, keep_zeros=keep_zeros)
            what = f"no_sync x find_unused x checkpoint, grads={grads}, keep_zeros={keep_zeros}, vs torch DDP"
            _compare(ref, got, what, bitwise=False)
    # With a bfloat16 wire (torch DDP has no equal): against fastcoll.DDP + the plain AdamW; the parameters in
    # flat buffers this time (the staging path above). grads="full" reduces the same buffers: bitwise. The
    # padded buckets of grads="sharded" change where gloo's ring cuts its chunks, so some elements of these
    # sizes sum in another order at 3 ranks: within bfloat16 rounding (the same happens without the buffers).
    ref = _combined_run("fastcoll", None, rank, world, torch.bfloat16, aligned=True)
    for grads in ("full", "sharded"):
        got = _combined_run("fastcoll", grads, rank, world, torch.bfloat16, resume_at=2, aligned=True)
        what = f"no_sync x find_unused x comm_dtype x checkpoint, grads={grads}"
        if grads == "full":
            _compare(ref, got, what)
        else:
            for n, p in ref.items():
                assert torch.allclose(got[n], p, rtol=2e-3, atol=2e-4 * float(p.abs().max())), (what, n)


def combined_bf16_worker(rank: int, world: int) -> None:
    # bfloat16 parameters with float32 main gradients and masters (the guards in .grad between micro-batches and
    # after backward): against the same training without the checkpoint round trip, grads="full" (exact); the
    # reduce-scatter of grads="sharded" sums in another order: within bfloat16 rounding.
    ref = _combined_run("fastcoll", "full", rank, world, None, bf16=True)
    _check_bf16_round_trips(ref, rank, world, "bf16 main grads x no_sync x find_unused x checkpoint")


def _check_bf16_round_trips(ref: dict, rank: int, world: int, what: str, **kw) -> None:
    # Both grads modes with the checkpoint round trip against ``ref``: grads="full" bitwise, grads="sharded" (whose
    # reduce-scatter sums in another order) within 16-bit rounding. ``kw``: _combined_run's (bf16=True by default).
    for grads in ("full", "sharded"):
        got = _combined_run("fastcoll", grads, rank, world, None, resume_at=2, **(kw or {"bf16": True}))
        if grads == "full":
            _compare(ref, got, f"{what}, grads={grads}")
        else:
            for n, p in ref.items():
                assert torch.allclose(got[n].float(), p.float(), rtol=2e-2, atol=1e-2 * float(p.abs().max())), (what, grads, n)


def combined_bf16_eager_worker(rank: int, world: int) -> None:
    # The same, with every 16-bit gradient added into its main gradient as soon as it is final (its own hook, in the
    # no_sync micro-batches too) against the run where each waits for its bucket: the same sums in the same order.
    os.environ["FASTCOLL_EARLY_PACK_MIN_NUMEL"] = str(1 << 40)
    ref = _combined_run("fastcoll", "full", rank, world, None, bf16=True)
    os.environ["FASTCOLL_EARLY_PACK_MIN_NUMEL"] = "1"
    _check_bf16_round_trips(ref, rank, world, "bf16 main grads added as they come x no_sync x find_unused x checkpoint")


@pytest.mark.parametrize("world", [2, 3])
def test_combined_features_bf16_main_grads_added_as_they_come(world):
    """The bf16 combination with every 16-bit gradient added into its float32 main gradient by its own hook."""
    run_ranks(combined_bf16_eager_worker, world, timeout=280)


def combined_fp16_scaler_worker(rank: int, world: int) -> None:
    # float16 parameters, float32 main gradients and masters, torch's GradScaler (unscale_, opt.clip_grad_norm_,
    # step, update; the scaler's state in the checkpoint): against the same training without the round trip.
    # Its absolute reference (torch's GradScaler over float32 masters) is tests/test_main_grads.py's.
    ref = _combined_run("fastcoll", "full", rank, world, None, fp16_scaler=True)
    assert ref["scales"][0] < 2.0**24 and ref["scales"][-1] >= ref["scales"][1], ref["scales"]  # skipped, then stepped
    _check_bf16_round_trips(ref, rank, world, "fp16 GradScaler x no_sync x find_unused x checkpoint", fp16_scaler=True)


@pytest.mark.parametrize("world", [2, 3])
def test_combined_features_fp16_grad_scaler(world):
    """The combination with float16 parameters, float32 main gradients and masters, and torch's GradScaler."""
    run_ranks(combined_fp16_scaler_worker, world, timeout=280)


@pytest.mark.parametrize("world", [2, 3])
def test_combined_features_bf16_main_grads(world):
    """The combination above with bfloat16 parameters, float32 main gradients and float32 masters."""
    run_ranks(combined_bf16_worker, world, timeout=280)


@pytest.mark.parametrize("world", [2, 3])
def test_combined_features(world):
    """no_sync accumulation x find_unused_parameters (a branch some ranks take in no_sync micro-batches only)
    x comm_dtype x a checkpoint round trip mid-run, in both grads modes; at 2 ranks grads="sharded" reduce-scatters
    with one send and one receive (fastcoll.reducer.p2p), at 3 with an all-reduce."""
    run_ranks(combined_worker, world, timeout=280)
