"""The one table of dtypes fastcoll handles, and the tensor properties the fused ops need.

Everything that asks "can the fused ops pack this tensor?" or "what do we
call this dtype in a message?" asks here. The C++ side has the same table in
``csrc/dtypes.h`` (an X-macro); ``tests/test_ops.py`` checks that the two agree.
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch

__all__ = [
    "SUPPORTED_DTYPES", "COMPLEX_DTYPES", "COMM_DTYPES", "dtype_name", "is_dense", "is_fusable", "check_comm_dtype",
    "as_real", "check_complex_wire", "check_comm_accum_dtype",
]  # fmt: skip

#: Floating dtypes the fused ops read and write (in the C++ table's order).
SUPPORTED_DTYPES: Tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

#: Complex dtypes the fused ops move as their real views (two of the matching floating dtype per element).
COMPLEX_DTYPES: Tuple[torch.dtype, ...] = (torch.complex64, torch.complex128)

#: Wire dtypes ``comm_dtype`` accepts (None: the gradients' own dtype).
COMM_DTYPES: Tuple[Optional[torch.dtype], ...] = (None, torch.float16, torch.bfloat16)

#: How messages list the supported dtypes.
SUPPORTED_NAMES = "float32, float16, bfloat16 and float64"


def dtype_name(dtype: torch.dtype) -> str:
    """The name Python users know a dtype by: ``float32``, ``int64``, ``bool``."""
    return str(dtype).replace("torch.", "")


def is_dense(t: torch.Tensor) -> bool:
    """True when ``t``'s elements fill ``numel`` consecutive memory slots, each once.

    Same rule as ATen's ``is_non_overlapping_and_dense``: sorted by stride,
    every dimension's stride equals the product of the sizes inside it.
    """
    if t.numel() <= 1:
        return True
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def is_fusable(t: torch.Tensor) -> bool:
    """Whether the fused ops can pack ``t`` as it is: strided, a supported dtype, dense."""
    return t.layout == torch.strided and t.dtype in SUPPORTED_DTYPES and is_dense(t)


def check_comm_dtype(comm_dtype: object, who: str = "fastcoll.DDP") -> None:
    """Raise ValueError unless ``comm_dtype`` is None, ``torch.float16`` or ``torch.bfloat16``."""
    if not any(comm_dtype is d for d in COMM_DTYPES):
        raise ValueError(f"{who}: comm_dtype must be None, torch.float16 or torch.bfloat16, got {comm_dtype!r}")


def as_real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as the floats it holds (``torch.view_as_real``; a 1-D one stays 1-D); others unchanged."""
    if not t.is_complex():
        return t
    real = torch.view_as_real(t)
    return real.view(-1) if t.dim() == 1 else real


def check_complex_wire(named: Iterable[Tuple[str, torch.Tensor]], comm_dtype: object, who: str = "fastcoll.DDP") -> None:
    """Raise ValueError naming the first complex tensor of ``named`` when ``comm_dtype`` is a 16-bit wire.

    A 16-bit real wire would carry complex gradients as real numbers (torch's compress hooks drop the imaginary
    parts); complex buckets are reduced in their own dtype.
    """
    if comm_dtype is None:
        return
    for n, p in named:
        if p.is_complex():
            raise ValueError(
                f"{who}: parameter '{n}' is {dtype_name(p.dtype)}, and comm_dtype={comm_dtype} would send its gradient "
                "as 16-bit real numbers; complex gradients are reduced in their own dtype: leave comm_dtype None "
                "(or freeze or wrap the complex parameters separately)"
            )


def check_comm_accum_dtype(comm_accum_dtype: object, comm_dtype: object, who: str = "fastcoll.DDP") -> None:
    """Raise ValueError unless ``comm_accum_dtype`` is None, or ``torch.float32`` with a 16-bit ``comm_dtype``."""
    if comm_accum_dtype is None:
        return
    if comm_accum_dtype is not torch.float32:
        raise ValueError(f"{who}: comm_accum_dtype must be None or torch.float32, got {comm_accum_dtype!r}")
    if not any(comm_dtype is d for d in COMM_DTYPES if d is not None):
        raise ValueError(
            f"{who}: comm_accum_dtype=torch.float32 sums 16-bit values received from every rank, so it needs "
            f"comm_dtype=torch.bfloat16 or torch.float16, got comm_dtype={comm_dtype!r}"
        )
