"""Gradient health, fused into the reduction: the global gradient norm, non-finite gradients, the divisor.

With ``compute_grad_norm`` (or ``check_nonfinite``) each bucket's write-back
also writes the sum of squares of the values it stores into the gradients
(:func:`fastcoll.ops.unflatten_scale` with ``sumsq``) into the bucket's slot
of one float64 vector; at the end of backward the slots are summed in bucket
order. Every rank holds the same reduced values and sums them in the same
fixed order, so the norm is bitwise identical on every rank, and it never
leaves the device (no host synchronization).

With ``check_nonfinite`` each bucket's pack raises the bucket's flag when a
local gradient (or its cast to the wire dtype) is NaN or ±Inf. At the end
of backward the flags are read (one small device-to-host copy), this rank's
offending parameters are counted while their local values are still in the
gradients, the buckets are written back, and if the reduced total is not
finite, which every rank sees alike since a NaN or Inf anywhere reaches
every rank through the sum, every rank raises :class:`NonFiniteGradError`
with one message built from every rank's findings (gathered only then: no
extra collective when everything is finite).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .. import ops
from ..errors import NonFiniteGradError
from .bucket import GradBucket

__all__ = ["GradHealth", "NonFiniteGradError", "inverse_divisor"]

Divisor = Union[float, torch.Tensor, None]


def inverse_divisor(divisor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """1/divisor as a 1-element float32 tensor on ``device``, computed there (no host synchronization)."""
    return torch.reciprocal(divisor.detach().reshape(1).to(device=device, dtype=torch.float64)).to(torch.float32)


def check_divisor(divisor: Any) -> Divisor:
    """Validate a user divisor: a positive finite float, a 0-dim (or 1-element) floating/integer tensor, or None."""
    if divisor is None:
        return None
    if isinstance(divisor, torch.Tensor):
        if divisor.numel() != 1 or divisor.is_complex() or divisor.dtype == torch.bool:
            raise ValueError(
                f"fastcoll.DDP.set_gradient_divisor: a tensor divisor must hold one real number, got shape "
                f"{tuple(divisor.shape)} dtype {divisor.dtype}"
            )
        return divisor
    if isinstance(divisor, bool) or not isinstance(divisor, (int, float)) or not (0 < float(divisor) < float("inf")):
        raise ValueError(
            "fastcoll.DDP.set_gradient_divisor: divisor must be a positive finite number, a 1-element tensor or None; "
            f"got {divisor!r}"
        )
    return float(divisor)


class GradHealth:
    """Norm slots, non-finite flags and the validity of the last computed norm, for one reducer.

    Args:
        compute_norm: Keep the global gradient norm of every synchronized backward.
        check_nonfinite: Raise :class:`NonFiniteGradError` on non-finite synchronized gradients.
        device: The parameters' device.
    """

    def __init__(self, compute_norm: bool, check_nonfinite: bool, device: torch.device):
        self.compute_norm = compute_norm
        self.check_nonfinite = check_nonfinite
        self.device = device
        self.sums: Optional[torch.Tensor] = None  # one float64 slot per bucket, plus one for gradients outside the buckets
        self.flags: Optional[torch.Tensor] = None  # one int32 flag per bucket
        # 1-element views of ``sums`` / ``flags`` per bucket position, made once per layout (the hot path only indexes)
        self._slots: List[Optional[torch.Tensor]] = []
        self._flag_views: List[Optional[torch.Tensor]] = []
        self.norm: Optional[torch.Tensor] = None  # the last synchronized backward's norm (0-dim float32)
        self._snapshot: Optional[List[Tuple[int, int]]] = None  # (id, version) of each gradient when the norm was taken
        self.blame: List[Tuple[int, List[Tuple[str, int]]]] = []  # this rank's findings: (bucket, [(name, count)])
        #: The tensors whose versions the norm's snapshot records (the kept ranges when sharded; else the .grad).
        self.watched: Optional[Callable[[], List[Optional[torch.Tensor]]]] = None

    @property
    def active(self) -> bool:
        return self.compute_norm or self.check_nonfinite

    def resize(self, n_buckets: int) -> None:
        """Allocate the slots for a layout of ``n_buckets`` buckets."""
        if self.active:
            self.sums = torch.zeros(n_buckets + 1, dtype=torch.float64, device=self.device)
        if self.check_nonfinite:
            self.flags = torch.zeros(max(n_buckets, 1), dtype=torch.int32, device=self.device)
        self._slots = [None if self.sums is None else self.sums[i : i + 1] for i in range(n_buckets + 1)]
        self._flag_views = [None if self.flags is None else self.flags[i : i + 1] for i in range(max(n_buckets, 1))]

    def begin_iteration(self) -> None:
        self._snapshot = None
        self.norm = None
        self.blame = []
        if self.flags is not None:
            self.flags.zero_()
        if self.sums is not None:
            self.sums.zero_()

    def flag(self, pos: int) -> Optional[torch.Tensor]:
        return self._flag_views[pos] if self._flag_views else None

    def slot(self, pos: int) -> Optional[torch.Tensor]:
        return self._slots[pos] if self._slots else None

    # --------------------------------------------------------- end of backward

    def find_local_nonfinite(self, buckets: Sequence[GradBucket]) -> None:
        """Before write-back: count this rank's non-finite local gradients in the buckets whose pack raised a flag."""
        if self.flags is None:
            return
        raised = self.flags.tolist()  # the one host read of the check
        for b in buckets:
            if not raised[b.pos]:
                continue
            found = []
            for name, p in zip(b.names, b.params):
                g = p.grad
                if g is not None:
                    vals = g._values() if g.is_sparse else g
                    bad = int((~torch.isfinite(vals)).sum().item())
                    if bad:
                        found.append((name, bad))
            self.blame.append((b.pos, found))

    def add_outside(self, grads: Sequence[torch.Tensor]) -> None:
        """Add the squares of gradients the write-backs did not produce (kept gradients of unused parameters)."""
        dense = [g if g.is_contiguous() else g.contiguous() for g in grads if g.numel()]
        if self.sums is not None and dense:
            ops.sum_of_squares(dense, out=self.sums[-1:])

    def finish(
        self, params: Sequence[torch.Tensor], over_ranks: Optional[Callable[[torch.Tensor], None]] = None
    ) -> Optional[torch.Tensor]:
        """After every write-back: the norm (kept, with a snapshot of the gradients it describes).

        Args:
            params: The reducer's parameters.
            over_ranks: Sums a 1-element tensor over the ranks in place (sharded gradients: each rank
                summed its own ranges); None when every rank already holds every reduced value.

        Returns:
            The total sum of squares when non-finite values must be checked (the caller reads it), else None.
        """
        if self.sums is None:
            return None
        total = self.sums.sum().reshape(1)
        if over_ranks is not None:
            over_ranks(total)
        total = total.reshape(())
        if self.compute_norm:  # the check alone needs only the total
            self.norm = total.sqrt().to(torch.float32)
            self._snapshot = self._versions(params)
        return total if self.check_nonfinite else None

    # ------------------------------------------------------------- the norm

    def _versions(self, params: Sequence[torch.Tensor]) -> List[Tuple[int, int]]:
        # Once per backward over every parameter: each .grad read once (a None gradient gets id(None), -1);
        # with sharded gradients, the kept ranges instead (the .grad are not the reduced values).
        grads = self.watched() if self.watched is not None else [p.grad for p in params]
        return [(id(g), -1 if g is None else g._version) for g in grads]

    def refresh_snapshot(self, params: Sequence[torch.Tensor]) -> None:
        """Record the gradients' versions again (after writes that keep the norm valid)."""
        if self._snapshot is not None:
            self._snapshot = self._versions(params)

    def current_norm(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """The norm of the last synchronized backward, if the gradients have not changed since.

        Raises:
            RuntimeError: ``compute_grad_norm`` is off, no synchronized backward
                ran yet, or the gradients changed since (zeroed, modified).
        """
        if not self.compute_norm:
            raise RuntimeError(
                "fastcoll.DDP.grad_norm: the gradient norm is not computed; construct the wrapper with "
                "compute_grad_norm=True (the norm is then fused into the gradient write-back)"
            )
        if self.norm is None or self._snapshot is None:
            raise RuntimeError(
                "fastcoll.DDP.grad_norm: no synchronized backward has produced the current gradients yet; "
                "call it after loss.backward() outside no_sync()"
            )
        if self._versions(params) != self._snapshot:
            raise RuntimeError(
                "fastcoll.DDP.grad_norm: the gradients changed since the last synchronized backward (zeroed, "
                "reassigned or modified in place), so its norm no longer describes them; call grad_norm() / "
                "clip_grad_norm_() right after backward, before touching the gradients"
            )
        return self.norm

    def scaled(self, params: Sequence[torch.Tensor], factor: torch.Tensor) -> None:
        """The gradients were multiplied by ``factor`` (clipping): keep the norm valid for them."""
        if self.norm is not None:
            self.norm = self.norm * factor.to(self.norm.dtype)
            self._snapshot = self._versions(params)

    # ------------------------------------------------------------- the error

    def raise_nonfinite(self, comm: Any, group: Any, buckets: Sequence[GradBucket], iteration: int) -> None:
        """Every rank gets here alike (the same reduced values): gather every rank's findings, raise one message."""
        from ..distributed.objects import all_gather_object_gpu

        per_rank = all_gather_object_gpu(self.blame, rank_zero_return_only=False, group=group) if comm.active else [self.blame]
        names = {b.pos: b.names for b in buckets}
        wire = ", ".join(sorted({str(b.comm.dtype).replace("torch.", "") for b in buckets if not b.sparse}))
        raise self.error(iteration, per_rank, names, wire)

    @staticmethod
    def error(
        iteration: int, per_rank: List[List[Tuple[int, List[Tuple[str, int]]]]], bucket_names: Dict[int, List[str]], wire: str
    ) -> NonFiniteGradError:
        """The same message on every rank, from every rank's findings (rank order)."""
        parts = []
        for rank, findings in enumerate(per_rank):
            if not findings:
                continue
            items = []
            for pos, found in findings:
                if found:
                    shown = found[:5]
                    items += [f"'{n}' ({c} non-finite)" for n, c in shown]
                    if len(found) > 5:
                        items.append(f"... ({len(found)} parameters in bucket {pos})")
                else:
                    names = ", ".join(f"'{n}'" for n in bucket_names.get(pos, [])[:5])
                    items.append(f"bucket {pos} ({names}): finite locally, but its share overflowed on the cast to {wire}")
            parts.append(f"rank {rank}: " + ", ".join(items))
        if parts:
            cause = "non-finite local gradients on " + "; ".join(parts)
        else:
            cause = f"no rank's local gradients were non-finite: the reduction overflowed ({wire} on the wire, or the comm hook)"
        return NonFiniteGradError(
            f"fastcoll.DDP: the synchronized gradients of iteration {iteration} are not finite: {cause}. "
            "They are left as reduced: zero them and skip the optimizer step to go on."
        )
