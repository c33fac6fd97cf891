"""Complex parameters (spectral layers such as a Fourier neural operator's, complex-valued networks).

torch DDP averages a complex gradient as the pair of real numbers it is. fastcoll's buckets hold complex
gradients in their own dtype (a bucket never mixes dtypes) and the fused ops move them as their real views,
so every result here is compared with torch DDP's bitwise at 2 ranks: gradients after each backward and
parameters after each step, in the loops DDP users write (micro-batches under ``no_sync``, unused
parameters, static graphs, gradients as bucket views, buckets small enough to hold one parameter each),
and with ``ShardedOptimizer`` against torch DDP + the plain optimizer, a complex parameter straddling ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
from multiproc import run_ranks
from torch import nn

import fastcoll

pytestmark = pytest.mark.timeout(180)

STEPS = 4


class Spectral(nn.Module):
    """A real layer, then complex weights applied in frequency space (contiguous, transposed and complex128)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.modes = nn.Parameter(torch.randn(5, 8, dtype=torch.complex64) * 0.3)
        self.mix = nn.Parameter((torch.randn(8, 3, dtype=torch.complex64) * 0.3).t())  # not contiguous
        self.gain = nn.Parameter(torch.randn(3, dtype=torch.complex128))
        self.spare = nn.Parameter(torch.randn(3, dtype=torch.complex64))  # used in every other step only

    def forward(self, x: torch.Tensor, use_spare: bool = True) -> torch.Tensor:
        h = torch.fft.rfft(self.lin(x.to(self.lin.weight.dtype)).float(), dim=-1)  # [B, 5] complex64
        h = (h.unsqueeze(-1) * self.modes).sum(1) @ self.mix.t()  # [B, 3]
        h = h * self.gain
        if use_spare:
            h = h + self.spare
        return (h.abs() ** 2).mean()


#: What a worker returns where torch DDP itself cannot take complex parameters: there is no reference to compare with.
UNSUPPORTED = "torch DDP refuses complex parameters in this torch"


def _torch_ddp(module: nn.Module, **kw):
    """torch DDP around ``module``, or None where this torch's DDP refuses complex parameters (torch 2.6: its
    initial broadcast over gloo raises "Invalid scalar type"; fastcoll's works there)."""
    from torch.nn.parallel import DistributedDataParallel

    try:
        return DistributedDataParallel(module, **kw)
    except RuntimeError as e:
        if "Invalid scalar type" in str(e):
            return None
        raise


def _judge(results: list) -> None:
    """Every rank found no difference (or, where torch DDP cannot be the reference, skip)."""
    if any(UNSUPPORTED in r for r in results):
        pytest.skip(f"{UNSUPPORTED} ({torch.__version__}): no reference")
    for r, diffs in enumerate(results):
        assert diffs == [], f"rank {r}: {diffs[:6]}"


def _x(step: int, rank: int, micro: int = 0) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * step + 10 * rank + micro))


def _diffs(a: nn.Module, b: nn.Module, what: str) -> list:
    """Names of parameters (or of their gradients, ``what="grad"``) that differ in any bit."""
    out = []
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        x, y = (p.grad, q.grad) if what == "grad" else (p.detach(), q.detach())
        if (x is None) != (y is None) or (x is not None and (x.dtype != y.dtype or not torch.equal(x, y))):
            out.append(f"{what} {n}")
    return out


def against_torch_ddp(rank: int, world: int, kw: dict, micro: int, sometimes_unused: bool) -> list:
    base = Spectral()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    fc, td = fastcoll.DDP(ours, **kw), _torch_ddp(theirs, **kw)
    if td is None:
        return [UNSUPPORTED]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (fc, td)]
    diffs = []
    for step in range(STEPS):
        use_spare = not sometimes_unused or step % 2 == 0
        for k in range(micro):
            for m in (fc, td):
                ctx = m.no_sync() if k < micro - 1 else torch.enable_grad()
                with ctx:
                    m(_x(step, rank, k), use_spare).backward()
        diffs += [f"step {step}: {d}" for d in _diffs(ours, theirs, "grad")]
        for o in opts:
            o.step()
            o.zero_grad()
        diffs += [f"step {step}: {d}" for d in _diffs(ours, theirs, "param")]
    return diffs


@pytest.mark.parametrize(
    "kw, micro, unused",
    [
        ({}, 1, False),
        ({"gradient_as_bucket_view": True}, 2, False),
        ({"find_unused_parameters": True}, 2, True),
        ({"static_graph": True}, 1, False),
        ({"bucket_cap_mb": 0.0001, "gradient_as_bucket_view": True}, 1, False),  # one parameter per bucket
    ],
    ids=["plain", "bucket_view_no_sync", "find_unused_no_sync", "static_graph", "tiny_buckets"],
)
def test_complex_parameters_train_as_under_torch_ddp(kw, micro, unused):
    _judge(run_ranks(against_torch_ddp, 2, kw, micro, unused, timeout=120))


def synced_at_start(rank: int, world: int) -> dict:
    model = Spectral()
    with torch.no_grad():
        model.modes.mul_(rank + 1)  # ranks start apart: the wrapper must give every rank rank 0's values
    model.register_buffer("phase", torch.full((3,), complex(rank, -rank)))
    ddp = fastcoll.DDP(model)
    at_start = (model.modes.detach().clone(), model.phase.clone())
    model.phase.fill_(complex(7 * rank, 1))
    ddp(_x(0, rank))  # broadcast_buffers: rank 0's buffers before each forward
    return {"modes": at_start[0], "phase_at_start": at_start[1], "phase": model.phase.clone()}


def test_complex_parameters_and_buffers_start_from_rank_0():
    res = run_ranks(synced_at_start, 2, timeout=120)
    want = Spectral().modes.detach()
    for r in res:
        assert torch.equal(r["modes"], want)
        assert torch.equal(r["phase_at_start"], torch.zeros(3, dtype=torch.complex64))
        assert torch.equal(r["phase"], torch.full((3,), complex(0, 1)))


def health(rank: int, world: int) -> dict:
    base = Spectral()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    ddp = fastcoll.DDP(ours, compute_grad_norm=True, check_nonfinite=True)
    ddp(_x(0, rank)).backward()
    theirs(_x(0, rank)).backward()
    for q in theirs.parameters():  # the average torch DDP would hold
        torch.distributed.all_reduce(q.grad)
        q.grad.div_(world)
    norm = ddp.clip_grad_norm_(0.5)
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5)
    pairs = zip(ours.named_parameters(), theirs.parameters())
    clipped = {n: torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7) for (n, p), q in pairs}
    ours.zero_grad()
    loss = ddp(_x(1, rank))
    if rank == 1:  # a NaN in one imaginary part on one rank
        nan = torch.tensor(complex(1, float("nan")))
        ours.modes.register_hook(lambda g: g.index_put((torch.tensor([2]), torch.tensor([3])), nan))
    try:
        loss.backward()
        blame = None
    except fastcoll.NonFiniteGradError as e:
        blame = str(e)
    return {"norm": float(norm), "want": float(want), "clipped": clipped, "blame": blame}


def test_grad_norm_clipping_and_nan_blame_see_complex_gradients():
    for r in run_ranks(health, 2, timeout=120):
        assert r["norm"] == pytest.approx(r["want"], rel=1e-6)
        assert all(r["clipped"].values()), r["clipped"]
        assert r["blame"] is not None and "modes" in r["blame"] and "rank 1" in r["blame"], r["blame"]


def refused_16_bit_wire(rank: int, world: int) -> str:
    try:
        fastcoll.DDP(Spectral(), comm_dtype=torch.bfloat16)
    except ValueError as e:
        return str(e)
    return "built"


def test_a_16_bit_wire_is_refused_with_complex_parameters():
    for msg in run_ranks(refused_16_bit_wire, 2, timeout=120):
        assert "'modes'" in msg and "complex64" in msg and "comm_dtype" in msg, msg


def sharded_against_torch(rank: int, world: int, grads: str) -> list:
    base = Spectral()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    # Tiny buckets: "modes" (40 complex elements, 320 bytes) is divided between the two ranks' ranges.
    fc = fastcoll.DDP(ours, bucket_cap_mb=0.0004, first_bucket_mb=0.0002)
    td = _torch_ddp(theirs)
    if td is None:
        return [UNSUPPORTED]
    opt = fastcoll.ShardedOptimizer(torch.optim.AdamW(ours.parameters(), lr=0.05, weight_decay=0.1), fc, grads=grads)
    ref = torch.optim.AdamW(theirs.parameters(), lr=0.05, weight_decay=0.1)
    diffs = []
    for step in range(STEPS):
        for m, o in ((fc, opt), (td, ref)):
            o.zero_grad()
            m(_x(step, rank)).backward()
        if grads == "sharded":
            got, want = float(opt.clip_grad_norm_(1e9)), float(torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1e9))
            diffs += [f"norm {step}: {got} vs {want}"] if abs(got - want) > 1e-6 * want else []
        opt.step()
        ref.step()
        opt.finish_param_sync()
        diffs += [f"step {step}: {d}" for d in _diffs(ours, theirs, "param")]
    full = opt.state_dict()
    sd, want = full["state"], ref.state_dict()["state"]
    for k, st in want.items():
        for key, v in st.items():
            got = sd[k][key]
            if got.dtype != v.dtype or not torch.equal(got, v):
                diffs.append(f"state {k} {key}: {got.dtype} vs {v.dtype}")
    # Resumed: a new model and optimizer (buckets of another size) load the state and take the next step.
    again = copy.deepcopy(ours)
    fc2 = fastcoll.DDP(again, bucket_cap_mb=0.0003, first_bucket_mb=0.0001)
    opt2 = fastcoll.ShardedOptimizer(torch.optim.AdamW(again.parameters(), lr=0.05, weight_decay=0.1), fc2, grads=grads)
    opt2.load_state_dict(full)
    for m, o in ((fc2, opt2), (td, ref)):
        o.zero_grad()
        m(_x(STEPS, rank)).backward()
        o.step()
    opt2.finish_param_sync()
    return diffs + [f"resumed: {d}" for d in _diffs(again, theirs, "param")]


@pytest.mark.parametrize("grads", ["full", "sharded"])
def test_sharded_optimizer_steps_complex_parameters_as_torch(grads):
    _judge(run_ranks(sharded_against_torch, 2, grads, timeout=150))


def main_grads_beside_complex(rank: int, world: int, grads: str) -> list:
    """A bfloat16 layer with float32 main gradients and masters beside complex parameters, which keep their own."""
    base = Spectral()
    base.lin.to(torch.bfloat16)
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    fc = fastcoll.DDP(ours, main_grad_dtype=torch.float32, bucket_cap_mb=0.0004, first_bucket_mb=0.0002)
    td = _torch_ddp(theirs)
    if td is None:
        return [UNSUPPORTED]
    opt = fastcoll.ShardedOptimizer(torch.optim.AdamW(ours.parameters(), lr=0.05), fc, grads=grads, master_dtype=torch.float32)
    ref = torch.optim.AdamW(theirs.parameters(), lr=0.05)
    fc(_x(0, rank)).backward()
    td(_x(0, rank)).backward()
    cplx = [(n, p, q) for (n, p), q in zip(ours.named_parameters(), theirs.parameters()) if p.is_complex()]
    diffs = [f"grad {n}" for n, p, q in cplx if grads == "full" and not torch.equal(p.grad, q.grad)]
    opt.step()
    ref.step()
    opt.finish_param_sync()
    # The first step: the complex parameters' updates depend on their own gradients only (the bf16 layer's
    # differ from torch's bf16 run by design: float32 main gradients and masters).
    return diffs + [f"step {n}" for n, p, q in cplx if not torch.equal(p, q)]


@pytest.mark.parametrize("grads", ["full", "sharded"])
def test_complex_parameters_beside_main_gradients(grads):
    _judge(run_ranks(main_grads_beside_complex, 2, grads, timeout=150))


def with_torch_hook(rank: int, world: int, hook_name: str) -> list:
    """torch's hooks see a complex bucket as torch DDP shows it (buffer(): its floats) and give torch's gradients."""
    import warnings

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    base = Spectral()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    fc, td = fastcoll.DDP(ours), _torch_ddp(theirs)
    if td is None:
        return [UNSUPPORTED]
    seen: dict = {"fastcoll": [], "torch": []}

    def recording(who: str):
        def hook(state, bucket):
            seen[who].append((bucket.buffer().dtype, bucket.buffer().numel()))
            return getattr(default_hooks, hook_name)(state, bucket)

        return hook

    fc.register_comm_hook(None, recording("fastcoll"))
    td.register_comm_hook(None, recording("torch"))
    diffs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own: its compress hook casts the float buffer, nothing complex
        for step in range(2):
            for m in (fc, td):
                m(_x(step, rank)).backward()
            diffs += [f"step {step}: {d}" for d in _diffs(ours, theirs, "grad")]
            ours.zero_grad()
            theirs.zero_grad()
    if sorted(map(str, seen["fastcoll"])) != sorted(map(str, seen["torch"])):
        diffs.append(f"buffers {seen}")
    return diffs


@pytest.mark.parametrize("hook_name", ["allreduce_hook", "fp16_compress_hook"])
def test_torch_comm_hooks_on_complex_buckets(hook_name):
    _judge(run_ranks(with_torch_hook, 2, hook_name, timeout=120))


def builtin_fp16_refused(rank: int, world: int) -> str:
    ddp = fastcoll.DDP(Spectral())
    try:
        ddp._register_builtin_comm_hook(torch.distributed.BuiltinCommHookType.FP16_COMPRESS)
    except ValueError as e:
        return str(e)
    return "taken"


def test_the_builtin_fp16_hook_is_refused_with_complex_parameters():
    for msg in run_ranks(builtin_fp16_refused, 2, timeout=120):
        assert "'modes'" in msg and "comm_dtype" in msg, msg


def combined(rank: int, world: int) -> list:
    """3 ranks: micro-batches under no_sync, a parameter unused in every other step (find_unused_parameters) and
    uneven inputs under join(): the last rank runs out of batches one step early."""
    base = Spectral()
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    fc, td = fastcoll.DDP(ours, find_unused_parameters=True), _torch_ddp(theirs, find_unused_parameters=True)
    if td is None:
        return [UNSUPPORTED]
    steps = STEPS - 1 if rank == world - 1 else STEPS
    for m in (fc, td):
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        with m.join():
            for step in range(steps):
                use_spare = step % 2 == 0
                with m.no_sync():
                    m(_x(step, rank, 0), use_spare).backward()
                m(_x(step, rank, 1), use_spare).backward()
                opt.step()
                opt.zero_grad()
    diffs = []
    for (n, p), q in zip(ours.named_parameters(), theirs.parameters()):
        if not torch.allclose(p, q, rtol=1e-5, atol=1e-6):  # 3 ranks: fastcoll multiplies by 1/3, torch divides by 3
            diffs.append(f"{n}: {(p - q).abs().max().item():.3g}")
    return diffs


def test_complex_parameters_in_combination_at_3_ranks():
    _judge(run_ranks(combined, 3, timeout=150))
