"""Every model the benchmarks run, and the parameter shapes of ResNet-50, GPT-2 small and BERT-base.

Real models (:class:`ManyLayerMLP`, :class:`ConvBNNet`, :class:`Encoder`) and synthetic ones holding parameters of a
real model's shapes (``model_shapes.json``, or :class:`GPT2Shapes` for any width) whose forward is ``sum_i p_i.sum() *
x_i``: one read of every parameter, so a step is dominated by writing the gradients and synchronizing them.
:class:`ModelSpec` names one; :func:`build_model`, :func:`make_input` and :func:`loss_of` make it, its per-rank input
and its loss, identically on every rank and for every method.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

MiB = 1 << 20
FIRST_BUCKET_CAP = 1 * MiB
BUCKET_CAP = 25 * MiB
Shapes = List[Tuple[str, Tuple[int, ...]]]


@functools.lru_cache(maxsize=None)
def _shapes_file() -> Dict[str, Shapes]:
    raw = json.loads(Path(__file__).with_name("model_shapes.json").read_text())
    return {k: [(name, tuple(shape)) for name, shape in v] for k, v in raw.items() if not k.startswith("_")}


def model_shapes() -> Dict[str, Shapes]:
    """Parameter names and shapes, in registration order, of ``resnet50``, ``gpt2_small`` and ``bert_base``."""
    return dict(_shapes_file())


def ddp_buckets(
    params: Shapes, element_size: int = 4, first_cap: int = FIRST_BUCKET_CAP, cap: int = BUCKET_CAP
) -> List[Dict[str, Any]]:
    """torch DDP's bucket assignment: reverse parameter order; a bucket closes once its size reaches its cap.

    The first bucket's cap is ``first_cap``, every later one's ``cap``. Returns, in reduction order, dicts with
    ``index``, ``cap``, ``names``, ``shapes`` and ``bytes``.
    """
    buckets: List[Dict[str, Any]] = []
    params = list(params)[::-1]
    for i, (name, shape) in enumerate(params):
        if i == 0 or buckets[-1]["bytes"] >= buckets[-1]["cap"]:  # the last bucket reached its cap: open the next
            buckets.append({"index": len(buckets), "cap": cap if buckets else first_cap, "names": [], "shapes": [], "bytes": 0})
        b = buckets[-1]
        b["names"].append(name)
        b["shapes"].append(tuple(shape))
        b["bytes"] += math.prod(shape) * element_size
    return buckets


@dataclasses.dataclass(frozen=True)
class GPT2Shapes:
    """GPT-2's parameter shapes (Hugging Face's names and order) for a vocabulary, context, width and depth."""

    name: str
    label: str
    vocab: int = 50257
    ctx: int = 1024
    d: int = 768
    layers: int = 12

    def shapes(self) -> Shapes:
        d = self.d
        out: Shapes = [("wte.weight", (self.vocab, d)), ("wpe.weight", (self.ctx, d))]
        for i in range(self.layers):
            h = f"h.{i}."
            out += [
                (h + "ln_1.weight", (d,)), (h + "ln_1.bias", (d,)),
                (h + "attn.c_attn.weight", (d, 3 * d)), (h + "attn.c_attn.bias", (3 * d,)),
                (h + "attn.c_proj.weight", (d, d)), (h + "attn.c_proj.bias", (d,)),
                (h + "ln_2.weight", (d,)), (h + "ln_2.bias", (d,)),
                (h + "mlp.c_fc.weight", (d, 4 * d)), (h + "mlp.c_fc.bias", (4 * d,)),
                (h + "mlp.c_proj.weight", (4 * d, d)), (h + "mlp.c_proj.bias", (d,)),
            ]  # fmt: skip
        return out + [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]

    def numel(self) -> int:
        return sum(math.prod(s) for _, s in self.shapes())


GPT2_SMALL = GPT2Shapes("gpt2_small_bf16", "GPT-2 small shapes")
GPT2_QUICK = GPT2Shapes("gpt2_d256_bf16", "GPT-2 shapes, width 256", d=256)
GPT2_SMOKE = GPT2Shapes("gpt2_tiny_bf16", "GPT-2 shapes, tiny", vocab=512, ctx=64, d=32, layers=2)


# Models
class ManyLayerMLP(nn.Module):
    """``depth`` Linear(width, width) layers with tanh in between."""

    def __init__(self, width: int = 32, depth: int = 96):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class ConvBNNet(nn.Module):
    """conv3x3-BatchNorm-ReLU blocks (stride 2 where the width doubles), global pooling, a linear head."""

    def __init__(self, channels: Sequence[int] = (16, 32, 32, 64, 64, 128), classes: int = 10):
        super().__init__()
        blocks: List[nn.Module] = []
        cin = 3
        for c in channels:
            stride = 2 if c > cin and cin != 3 else 1
            blocks += [nn.Conv2d(cin, c, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()]
            cin = c
        self.features = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


class Encoder(nn.Module):
    """``layers`` nn.TransformerEncoderLayer blocks (12 parameters each), no dropout."""

    def __init__(self, d_model: int = 128, heads: int = 4, ff: int = 512, layers: int = 4):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=ff, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


class ShapeModel(nn.Module):
    """Parameters of given shapes; ``forward(x) = sum_i p_i.sum() * x[i]`` (one read of each parameter).

    The gradient of parameter i is ``x[i]`` everywhere. ``storage`` (tensors of the same shapes) shares the weights with
    another instance's, so several wrappers are timed on the same memory.
    """

    def __init__(self, shapes: Sequence[Sequence[int]], storage: Optional[Sequence[torch.Tensor]] = None, device: Any = "cpu"):
        super().__init__()
        storage = storage if storage is not None else filled(shapes, device=device)
        self.params = nn.ParameterList(nn.Parameter(t) for t in storage)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([p.sum() for p in self.params]) @ x


class ParamHolder(nn.Module):
    """One parameter in a module of its own; ``forward()`` returns its sum (``matmul``: a row-wise dot, see below)."""

    def __init__(self, weight: torch.Tensor, matmul: bool = False):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.matmul = matmul

    def forward(self) -> torch.Tensor:
        w = self.weight
        if not self.matmul or w.dim() < 2:
            return w.sum().float()
        # torch.linalg.vecdot is a product autocast runs in bfloat16 (casting the weight and caching the copy, as
        # for nn.Linear); one multiply-add per element both ways, where a bfloat16 GEMM is 10-25x slower on CPU.
        w2 = w if w.dim() == 2 else w.reshape(w.shape[0], -1)
        return torch.linalg.vecdot(w2, _ones(w2.shape[1], w.dtype, w.device)).sum().float()


@functools.lru_cache(maxsize=64)
def _ones(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.ones(n, dtype=dtype, device=device)


class LayeredShapeModel(nn.Module):
    """:class:`ShapeModel` with every parameter in its own module, called in registration order.

    Forward pre-hooks (ShardedOptimizer's waits for the parameters' all-gathers) then run before each parameter is read,
    as in a real model. ``matmul``: each holder's forward is a row-wise dot product with ones, which autocast runs in
    bfloat16 (the bfloat16 benchmark).
    """

    def __init__(self, shapes: Sequence[Sequence[int]], storage: Optional[Sequence[torch.Tensor]] = None, device: Any = "cpu",
                 dtype: torch.dtype = torch.float32, matmul: bool = False):  # fmt: skip
        super().__init__()
        storage = storage if storage is not None else filled(shapes, dtype, device)
        self.layers = nn.ModuleList(ParamHolder(t, matmul) for t in storage)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([m() for m in self.layers]) @ x


def filled(shapes: Sequence[Sequence[int]], dtype: torch.dtype = torch.float32, device: Any = "cpu") -> List[torch.Tensor]:
    """Tensors of ``shapes`` filled with 0.01: a synthetic model's weights."""
    return [torch.full(tuple(s), 0.01, dtype=dtype, device=device) for s in shapes]


def shape_input(n: int, rank: int, device: Any = "cpu") -> torch.Tensor:
    """A synthetic model's input: ``n`` weights of its parameters' terms, a different vector per rank."""
    return ((rank + 1) * torch.arange(1, n + 1, dtype=torch.float32) / n).to(device)


# Specs
@dataclasses.dataclass
class ModelSpec:
    """How to build one benchmarked model (``kind``: "mlp", "convbn", "encoder" or "shapes"), its input and its loss."""

    name: str
    label: str
    kind: str
    kwargs: Dict[str, Any]
    batch: int = 8
    note: str = ""

    @property
    def synthetic(self) -> bool:
        return self.kind == "shapes"


MLP96 = ModelSpec("mlp96", "MLP 96x(32x32)", "mlp", {"width": 32, "depth": 96}, batch=32)
CONVBN = ModelSpec("convbn", "conv+BN 6 blocks", "convbn", {"channels": (16, 32, 32, 64, 64, 128)}, batch=8)
ENCODER = ModelSpec("encoder", "encoder 4x d128", "encoder", {"d_model": 128, "heads": 4, "ff": 512, "layers": 4}, batch=8)
RESNET50 = ModelSpec("resnet50", "ResNet-50 shapes", "shapes", {"model": "resnet50"}, note="synthetic")
GPT2 = ModelSpec("gpt2_small", "GPT-2 small shapes", "shapes", {"model": "gpt2_small"}, note="synthetic")
# --smoke (tests): tiny versions
SMOKE_MLP = ModelSpec("mlp", "MLP 8 layers", "mlp", {"width": 8, "depth": 8}, batch=4)
SMOKE_CONVBN = ModelSpec("convbn", "conv+BN", "convbn", {"channels": (4, 8)}, batch=2)
SMOKE_ENCODER = ModelSpec("encoder", "encoder 1 layer", "encoder", {"d_model": 16, "heads": 2, "ff": 32, "layers": 1}, batch=2)
SMOKE_RESNET50 = ModelSpec("resnet50", "ResNet-50 shapes (24, x1/256)", "shapes", {"model": "resnet50", "limit": 24,
                                                                                    "divide": 256})  # fmt: skip
SMOKE_GPT2 = ModelSpec("gpt2_small", "GPT-2 shapes (12, x1/4096)", "shapes", {"model": "gpt2_small", "limit": 12,
                                                                             "divide": 4096})  # fmt: skip
WARMUP = ModelSpec("warmup", "", "mlp", {"width": 4, "depth": 2}, batch=2)


def spec_shapes(spec: ModelSpec) -> List[Tuple[int, ...]]:
    """Parameter shapes of a synthetic spec (``limit``: the first ones; ``divide``: 1-D and that much smaller)."""
    entries, div = _shapes_file()[spec.kwargs["model"]][: spec.kwargs.get("limit")], spec.kwargs.get("divide", 1)
    return [s if div <= 1 else (max(1, math.prod(s) // div),) for _, s in entries]


def param_count(spec: ModelSpec) -> int:
    """Parameter elements of ``spec``'s model (without building the synthetic ones)."""
    if spec.synthetic:
        return sum(math.prod(s) for s in spec_shapes(spec))
    return sum(p.numel() for p in build_model(spec, "cpu").parameters())


def build_storage(spec: ModelSpec, device: str) -> List[torch.Tensor]:
    """Weights that every instance of ``spec``'s model built with them shares (parameters, then buffers).

    The wrappers timed side by side then compute on the same memory (two identical wrappers on separately allocated
    small models differed by up to 15% on the 2-core box).
    """
    if spec.synthetic:
        return filled(spec_shapes(spec), device=device)
    model = build_model(spec, device)
    return [t.detach() for t in (*model.parameters(), *model.buffers())]


def build_model(spec: ModelSpec, device: str, storage: Optional[List[torch.Tensor]] = None, layered: bool = False) -> nn.Module:
    """The model of ``spec`` with seed-0 weights; ``layered``: a synthetic one as :class:`LayeredShapeModel`."""
    torch.manual_seed(0)
    if spec.synthetic:
        shapes = spec_shapes(spec)
        return LayeredShapeModel(shapes, storage, device) if layered else ShapeModel(shapes, storage, device)
    model = {"mlp": ManyLayerMLP, "convbn": ConvBNNet, "encoder": Encoder}[spec.kind](**spec.kwargs).to(device)
    if storage is not None:
        for t, shared in zip((*model.parameters(), *model.buffers()), storage):
            t.data = shared
    return model


def make_input(spec: ModelSpec, rank: int, device: str) -> torch.Tensor:
    """This rank's input (a different one per rank, the same for every method)."""
    if spec.synthetic:
        return shape_input(len(spec_shapes(spec)), rank, device)
    kw, image = spec.kwargs, spec.kwargs.get("image", 16)
    dims = {"mlp": (kw.get("width", 32),), "convbn": (3, image, image), "encoder": (kw.get("seq", 32), kw.get("d_model", 128))}
    return torch.randn(spec.batch, *dims[spec.kind], generator=torch.Generator().manual_seed(1000 + rank)).to(device)


def loss_of(spec: ModelSpec, out: torch.Tensor) -> torch.Tensor:
    """The scalar loss of a model's output."""
    return out if spec.synthetic else out.square().mean()


def backward_step(spec: ModelSpec, wrapper: nn.Module, x: torch.Tensor, no_sync: bool = False) -> Callable[[], None]:
    """A step without optimizer: ``zero_grad(set_to_none=True)``, forward, loss, backward (``no_sync``: inside it)."""
    module, context = wrapper.module, wrapper.no_sync if no_sync else contextlib.nullcontext

    def step() -> None:
        module.zero_grad(set_to_none=True)
        with context():
            loss_of(spec, wrapper(x)).backward()

    return step


def train_step(
    wrapper: nn.Module, opt: Any, x: torch.Tensor, loss: Callable[[torch.Tensor], torch.Tensor] = lambda out: out,
    note: Callable[[str], None] = lambda phase: None, context: Callable[[], Any] = contextlib.nullcontext, micro: int = 1,
) -> Callable[[], None]:  # fmt: skip
    """One iteration: ``zero_grad(set_to_none=True)``, forward (in ``context()``), ``loss``, backward, ``opt.step()``.

    ``micro`` micro-batches of ``x`` each go forward and backward, all but the last under ``wrapper.no_sync()``.
    ``note(phase)`` runs after each phase ("zero_grad", "forward", "backward", "step").
    """

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        note("zero_grad")
        for k in range(micro):
            with wrapper.no_sync() if k < micro - 1 else contextlib.nullcontext():
                with context():
                    out = loss(wrapper(x))
                note("forward")
                out.backward()
                note("backward")
        opt.step()
        note("step")

    return step


def compare_grads(a: nn.Module, b: nn.Module, rtol: float) -> Dict[str, Any]:
    """Compare the ``.grad`` of two modules' parameters (same architecture).

    ``close``: the largest absolute difference is at most ``rtol`` times the largest gradient magnitude of ``b``
    (half-precision communication rounds small gradients to a grid set by the large ones).
    """
    equal = shapes_ok = True
    max_abs = scale = 0.0
    with torch.no_grad():
        for pa, pb in zip(a.parameters(), b.parameters()):
            ga, gb = pa.grad, pb.grad
            if ga is None or gb is None or ga.shape != gb.shape:
                if ga is not None or gb is not None:
                    equal = shapes_ok = False
                continue
            if ga.numel() == 0:
                continue
            scale = max(scale, float(gb.abs().max()))
            if not torch.equal(ga, gb):
                equal = False
                max_abs = max(max_abs, float((ga - gb).abs().max()))
    return {"equal": equal, "close": equal or (shapes_ok and max_abs <= rtol * scale), "max_abs_diff": max_abs,
            "max_abs_grad": scale}  # fmt: skip


# The optimizer every training benchmark uses

ADAMW: Dict[str, Any] = {"lr": 1e-3, "weight_decay": 0.01}


@functools.lru_cache(maxsize=None)
def adamw_kwargs(device: str, dtypes: Tuple[torch.dtype, ...] = (torch.float32,)) -> Dict[str, Any]:
    """:data:`ADAMW`, plus ``fused=True`` when torch's fused AdamW steps every one of ``dtypes`` on ``device``."""
    try:
        for dtype in dtypes:
            p = torch.zeros(2, dtype=dtype, device=device, requires_grad=True)
            p.grad = torch.ones_like(p)
            torch.optim.AdamW([p], fused=True).step()
    except (RuntimeError, ValueError, TypeError):
        return dict(ADAMW)
    return {**ADAMW, "fused": True}
