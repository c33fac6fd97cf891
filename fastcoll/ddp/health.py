"""The gradient-health methods of :class:`fastcoll.DDP`: ``grad_norm``, ``clip_grad_norm_``, ``set_gradient_divisor``.

The work happens in the reducer (:mod:`fastcoll.reducer.health`): the norm is
fused into the write-back of each bucket, so clipping is a single scaling pass.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import ops

__all__ = ["GradHealthMethods"]


class GradHealthMethods:
    """Expects the wrapper's ``reducer``, ``module``, ``require_backward_grad_sync`` and ``parameters_to_ignore``."""

    def set_gradient_divisor(self, divisor: Any) -> None:
        """Divide the summed gradients of the following synchronized backwards by ``divisor``.

        The next synchronized backward's gradients are the sum over ranks of the
        local gradients divided by ``divisor`` (instead of averaged over the
        world size), until this is called again. The factor is folded into the
        fused pack: no extra pass. Typical use, a loss summed over tokens::

            tokens = torch.tensor(float(batch_tokens), device=dev)
            dist.all_reduce(tokens)              # the global token count
            model.set_gradient_divisor(tokens)   # read on the device: no host synchronization
            loss_sum.backward()

        With ``comm_dtype``, each rank's share (its gradient divided by
        ``divisor``) is cast to the 16-bit wire dtype before the all-reduce sums
        the shares; a divisor at least as large as the number of ranks keeps
        every share and every partial sum as small as the result itself is
        (for same-signed gradients) rather than ``world_size`` times larger.
        Comm hooks, which divide by the world size themselves, get the pack
        pre-scaled by ``world_size / divisor``.

        Args:
            divisor: A positive float, a 1-element tensor (any device; read
                at the start of each backward), or None for the default (the
                world size, or the join divisor under ``join()``).

        Raises:
            ValueError: not a positive finite number, a 1-element real tensor or None.
        """
        self.reducer.set_gradient_divisor(divisor)

    def _unsynced_grads(self) -> List[torch.Tensor]:
        """Gradients of trainable parameters the reducer does not synchronize (excluded by name)."""
        ignored = self.parameters_to_ignore
        return [p.grad for n, p in self.module.named_parameters() if n in ignored and p.grad is not None]

    def grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the gradients the last synchronized backward produced.

        A 0-dim float32 tensor on the parameters' device, computed from the
        sums of squares fused into the write-back of each bucket and summed in
        bucket order, so it is bitwise identical on every rank and needs no
        host synchronization. Parameters whose ``.grad`` is None are left out,
        as torch's ``get_total_norm`` leaves them out. Where no write-back
        exists (``gradient_as_bucket_view=True`` with the bucket reduced in
        place and nothing to scale) one read pass of that bucket computes its
        share; gradients of parameters excluded from synchronization, and
        gradients kept by parameters unused on every rank, are read once too.

        Raises:
            RuntimeError: ``compute_grad_norm=True`` was not given, no
                synchronized backward produced the current gradients, they
                changed since, or this is called inside ``no_sync()``.
        """
        if not self.require_backward_grad_sync:
            raise RuntimeError(
                "fastcoll.DDP.grad_norm: called inside no_sync(): the gradients are being accumulated locally "
                "and are not synchronized yet; call it after the synchronized backward that follows no_sync()"
            )
        norm = self.reducer.health.current_norm(self.reducer.params)
        extra = self._unsynced_grads()
        if extra:
            sq = ops.sum_of_squares([g if g.is_contiguous() else g.contiguous() for g in extra])
            norm = (norm.double().square() + sq.to(norm.device)).sqrt().to(torch.float32)
        return norm

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: Optional[bool] = None
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` with the norm already computed.

        Same contract and return value (the total norm before clipping) and the
        same clip coefficient, ``max_norm / (norm + 1e-6)`` clamped at 1. With
        ``compute_grad_norm=True`` and ``norm_type=2`` the norm comes from
        :meth:`grad_norm`, so only the scaling pass remains (a multi-tensor
        multiply per device and dtype); otherwise torch's function runs.

        Raises:
            RuntimeError: ``error_if_nonfinite`` and the norm is NaN or infinite
                (before anything is scaled), or as :meth:`grad_norm`.
        """
        if float(norm_type) != 2.0 or not self.reducer.health.compute_norm:
            return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type, error_if_nonfinite, foreach)
        total = self.grad_norm()
        if error_if_nonfinite and bool(~torch.isfinite(total)):
            raise RuntimeError(
                f"fastcoll.DDP.clip_grad_norm_: the total norm of order 2.0 of the gradients is {total.item()}, so they "
                "cannot be clipped; pass error_if_nonfinite=False to scale them by it anyway"
            )
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        groups: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = defaultdict(list)
        for p in self.parameters():
            if p.grad is not None:
                groups[(p.grad.device, p.grad.dtype)].append(p.grad)
        with torch.no_grad():
            for (device, _), grads in groups.items():
                c = coef.to(device)
                dense = [g for g in grads if not g.is_sparse]
                if dense and foreach is not False:
                    torch._foreach_mul_(dense, c)
                else:
                    for g in dense:
                        g.mul_(c)
                for g in grads:
                    if g.is_sparse:
                        g.mul_(c)
        self.reducer.health.scaled(self.reducer.params, coef)
        return total
