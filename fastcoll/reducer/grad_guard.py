"""What ``p.grad`` holds when the synchronized gradient is kept elsewhere: a :class:`ShardedGradient`.

When the buckets are reduce-scattered (``ShardedOptimizer(grads="sharded")``)
the synchronized gradient of a parameter exists only as ranges spread over
the ranks; with float32 main gradients (``fastcoll.DDP(main_grad_dtype=torch.float32)``)
it lives in a float32 bucket that a 16-bit ``.grad`` cannot hold
(:mod:`.kept_grads` keeps both). Leaving ``p.grad`` as None
would make ``torch.nn.utils.clip_grad_norm_`` return 0 and clip nothing, and
``GradScaler.unscale_`` unscale nothing: silently wrong. So each such
parameter's ``.grad`` is a :class:`ShardedGradient`: a tensor with the
gradient's shape and device, no data of its own, that applies to the
gradient values this rank holds the operations torch's optimizer-side code
performs on gradients, and refuses every other one with an error that names
the way to do what was asked:

* ``GradScaler.unscale_`` (``_amp_foreach_non_finite_check_and_unscale_``):
  on the values this rank holds, its non-finite flag then agreed by every
  rank when each holds a range (one all-reduce of the flag);
* in-place elementwise operations with scalar operands: ``mul_`` / ``div_``
  (clipping's ``_foreach_mul_``, averaging by hand), ``clamp_`` /
  ``clamp_min_`` / ``clamp_max_`` (``torch.nn.utils.clip_grad_value_``),
  ``nan_to_num_``, and their ``_foreach_`` forms: on the values this rank
  holds, which is what they do to those values in the whole gradient (an
  operand shaped like the gradient is refused: it would meet other elements);
* ``zero_()`` (``zero_grad(set_to_none=False)``, which also starts a new
  accumulation): on the values this rank holds;
* norms (``torch.nn.utils.clip_grad_norm_``, ``p.grad.norm()``): where this
  rank holds the whole gradient (main gradients with ``grads="full"``), the
  norm of those float32 values; with reduce-scattered buckets a norm would
  need the other ranks' ranges, so it raises with the advice given by whoever
  divided the buckets;
* any other operation: where this rank holds the whole gradient, on it, as a
  float32 tensor shaped like the parameter (reads, ``copy_``, operands shaped
  like the gradient, norms along dimensions; a change of shape is refused);
  with reduce-scattered buckets it raises.

Its ``dtype`` is that of the values it stands for: float32 over float32 main
gradients (a 16-bit parameter's gradient is stepped in float32), so that
``GradScaler.unscale_``, which refuses float16 gradients, unscales a float16
model's float32 main gradients. Autograd's own checks see the parameter's
dtype (a ``.grad`` must have it).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

__all__ = ["GradientBook", "ShardedGradient", "is_guard"]

#: Operations a guard answers with itself, without data.
_HARMLESS = {"detach.default", "alias.default", "detach_.default", "requires_grad_.default"}

MESSAGE = (
    "fastcoll: the synchronized gradient of {name} is not held in p.grad ({where}), so `{op}` cannot be computed "
    "on p.grad. {advice}"
)


class GradientBook:
    """Where the values behind each guarded parameter's ``.grad`` are, for :class:`ShardedGradient`.

    Args:
        held: ``held(i)``: the tensors holding this rank's values of parameter ``i``'s synchronized gradient.
        complete: Those tensors are the whole gradient (every rank holds it), so norms can be computed locally.
        reset: ``reset(i)``: parameter ``i``'s gradient was zeroed in place (``zero_()``): start its accumulation anew.
        names: Parameter names, for messages.
        where: What holds the gradients, for messages.
        advice: What to do instead, for messages.
        dtypes: Per parameter index, the dtype of its held values where it is not the parameter's (main gradients).
        agree: ``agree(found_inf)``: make GradScaler's non-finite flag of this rank's values every rank's verdict
            (in place, on every rank); None when every rank holds the whole gradients (``complete``).
        whole: ``whole(i)``: where every rank holds the whole gradients, parameter ``i``'s as a tensor shaped like
            it (a new view each call, or None: it has none); operations without a rule of their own then run on it.
    """

    def __init__(
        self,
        held: Callable[[int], List[torch.Tensor]],
        complete: bool,
        reset: Callable[[int], None],
        names: Sequence[str],
        where: str,
        advice: str,
        dtypes: Optional[Dict[int, torch.dtype]] = None,
        agree: Optional[Callable[[torch.Tensor], None]] = None,
        whole: Optional[Callable[[int], Optional[torch.Tensor]]] = None,
    ):
        self.held = held
        self.complete = complete
        self.reset = reset
        self.names = list(names)
        self.where = where
        self.advice = advice
        self.dtypes = dict(dtypes or {})
        self.agree = agree
        self.whole = whole

    def refuse(self, index: int, op: str) -> RuntimeError:
        return RuntimeError(MESSAGE.format(name=f"'{self.names[index]}'", where=self.where, op=op, advice=self.advice))


class ShardedGradient(torch.Tensor):
    """A data-less stand-in for parameter ``index``'s gradient (shape, device and strides of ``like``; its ``dtype``:
    that of the held values, see the module docstring)."""

    book: GradientBook
    index: int

    @staticmethod
    def __new__(cls, like: torch.Tensor, book: GradientBook, index: int) -> "ShardedGradient":
        t = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, like.shape, strides=like.stride(), dtype=_own_dtype(like), device=like.device, requires_grad=False
        )
        t.book = book
        t.index = index
        return t

    def __init__(self, like: torch.Tensor, book: GradientBook, index: int):
        pass

    @property
    def dtype(self) -> torch.dtype:  # type: ignore[override]
        return self.book.dtypes.get(self.index) or _own_dtype(self)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"ShardedGradient(shape={tuple(self.shape)}, dtype={self.dtype}: {self.book.where})"

    def __deepcopy__(self, memo: dict) -> "ShardedGradient":
        return ShardedGradient(self, self.book, self.index)

    def __reduce_ex__(self, proto: int) -> Any:
        raise self.book.refuse(self.index, "pickling")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.__name__
        handler = _HANDLERS.get(name)
        if handler is not None:
            return handler(func, args, kwargs)
        if name in _HARMLESS:
            return args[0]
        return _on_whole(func, args, kwargs)


def _on_whole(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` with each guard replaced by the whole gradient it stands for (an in-place result on a guard is that
    guard); raises for a guard whose book holds a range only (or no gradient)."""
    swapped: Dict[int, Any] = {}

    def swap(a: Any) -> Any:
        if is_guard(a):
            t = a.book.whole(a.index) if a.book.whole is not None else None
            if t is None:
                raise a.book.refuse(a.index, func.__name__.split(".")[0])
            swapped[id(t)] = a
            return t
        if isinstance(a, (list, tuple)) and any(is_guard(x) for x in a):
            return [swap(x) for x in a]
        return a

    out = func(*[swap(a) for a in args], **{k: swap(v) for k, v in kwargs.items()})
    guard = swapped.get(id(out)) if isinstance(out, torch.Tensor) else None
    if guard is None:
        return out
    if out.shape != guard.shape or out.stride() != guard.stride():  # (t_, squeeze_, ...: a .grad cannot change shape)
        raise guard.book.refuse(guard.index, func.__name__.split(".")[0] + ", which changes its shape,")
    return guard


def _own_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a tensor has for autograd (a guard's ``dtype`` attribute may say its held values')."""
    return torch.Tensor.dtype.__get__(t)  # type: ignore[attr-defined]


def is_guard(t: Any) -> bool:
    """Whether ``t`` is a :class:`ShardedGradient`."""
    return type(t) is ShardedGradient


def _flat_args(args: Sequence[Any]) -> List[Any]:
    out: List[Any] = []
    for a in args:
        if isinstance(a, (list, tuple)):
            out.extend(a)
        else:
            out.append(a)
    return out


def _expand(tensors: Sequence[Any]) -> List[torch.Tensor]:
    """Each guard replaced by the tensors holding its values (plain tensors kept)."""
    out: List[torch.Tensor] = []
    for t in tensors:
        out.extend(t.book.held(t.index) if is_guard(t) else [t])
    return out


def _unscale(func: Any, args: tuple, kwargs: dict) -> None:
    """GradScaler's unscale and non-finite check, on the held values; with ranges, the flag agreed by every rank
    (each checked its own range, torch's check reads the whole gradients: one rank's overflow skips every rank's step)."""
    grads, found_inf, inv_scale = args
    held = _expand(grads)
    if held:
        func(held, found_inf, inv_scale)
    guard = next((t for t in grads if is_guard(t)), None)
    if guard is not None and guard.book.agree is not None:
        guard.book.agree(found_inf)


def _operands_are_scalars(func: Any, guard: Any, operands: Sequence[Any]) -> None:
    """Raise unless every operand (besides the guard itself) is a number, None or a one-element tensor.

    The held values are a range of the flattened gradient: an operand shaped like the gradient
    would meet the wrong elements (or broadcast across them), so only scalars apply elementwise.
    """
    for o in _flat_args(operands):
        if is_guard(o) or (isinstance(o, torch.Tensor) and o.numel() != 1):
            raise guard.book.refuse(guard.index, func.__name__.split(".")[0] + " with a tensor operand")


def _elementwise(func: Any, args: tuple, kwargs: dict) -> Any:
    """An in-place elementwise operation with scalar operands (``mul_``, ``div_``, ``clamp_``, ``nan_to_num_``, ...):
    on each tensor holding this rank's values, which is what it does to those values in the whole gradient."""
    self = args[0]
    if not is_guard(self) or self.book.whole is not None:  # a guard as an operand, or one holding the whole gradient
        return _on_whole(func, args, kwargs)
    _operands_are_scalars(func, self, list(args[1:]) + list(kwargs.values()))
    for h in self.book.held(self.index):
        func(h, *args[1:], **kwargs)
    return self


def _foreach_elementwise(func: Any, args: tuple, kwargs: dict) -> None:
    """The ``_foreach_`` form of :func:`_elementwise`: one scalar for all tensors, or one per tensor."""
    tensors, rest = args[0], args[1:]
    if all(t.book.whole is not None for t in tensors if is_guard(t)):
        return _on_whole(func, args, kwargs)
    per_tensor = bool(rest) and isinstance(rest[0], (list, tuple))
    guards = [t for t in tensors if is_guard(t)]
    if guards and not per_tensor:  # one set of operands for all: checked once
        _operands_are_scalars(func, guards[0], list(rest) + list(kwargs.values()))
    held, operands = [], []  # (nothing is written before every guard's values and operands passed)
    for i, t in enumerate(tensors):
        if is_guard(t):
            if per_tensor:
                _operands_are_scalars(func, t, [rest[0][i]])
            mine = t.book.held(t.index)
        else:
            mine = [t]
        held.extend(mine)
        if per_tensor:
            operands.extend([rest[0][i]] * len(mine))
    if held:
        func(held, *((operands,) + rest[1:] if per_tensor else rest), **kwargs)
    return None


def _zero(func: Any, args: tuple, kwargs: dict) -> Any:
    self = args[0]
    self.book.reset(self.index)
    return self


def _foreach_zero(func: Any, args: tuple, kwargs: dict) -> None:
    plain = [t for t in args[0] if not is_guard(t)]
    for t in args[0]:
        if is_guard(t):
            t.book.reset(t.index)
    if plain:
        func(plain)


def _norm_of(t: Any, ord: Any) -> torch.Tensor:
    if not is_guard(t):
        return torch.linalg.vector_norm(t, ord)
    book = t.book
    if not book.complete:
        raise book.refuse(t.index, "a norm")
    held = book.held(t.index)
    if not held:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(h, ord) for h in held]), ord)


def _foreach_norm(func: Any, args: tuple, kwargs: dict) -> List[torch.Tensor]:
    ord = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dtype = kwargs.get("dtype")
    out = [_norm_of(t, ord) for t in args[0]]
    return [n.to(dtype) if dtype is not None else n for n in out]


def _vector_norm(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    self = args[0]
    if self.book.whole is not None:
        return _on_whole(func, args, kwargs)
    ord = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    if dim not in (None, [], ()) or keepdim:
        raise self.book.refuse(self.index, "a norm along a dimension")
    n = _norm_of(self, ord)
    dtype = kwargs.get("dtype")
    return n.to(dtype) if dtype is not None else n


#: In-place elementwise operations whose operands are scalars (:func:`_elementwise`), and their ``_foreach_`` forms.
_ELEMENTWISE = ("mul_", "div_", "clamp_", "clamp_min_", "clamp_max_", "nan_to_num_")

_HANDLERS = {
    "_amp_foreach_non_finite_check_and_unscale_.default": _unscale,
    **{f"{op}.{o}": _elementwise for op in _ELEMENTWISE for o in ("default", "Scalar", "Tensor", "Scalar_mode", "Tensor_mode")},
    **{
        f"_foreach_{op}.{o}": _foreach_elementwise
        for op in ("mul_", "div_", "clamp_min_", "clamp_max_")
        for o in ("Scalar", "Tensor", "List", "ScalarList")
    },
    "zero_.default": _zero,
    "_foreach_zero_.default": _foreach_zero,
    "_foreach_norm.Scalar": _foreach_norm,
    "linalg_vector_norm.default": _vector_norm,
}
