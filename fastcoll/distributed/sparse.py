"""Sums of sparse (COO) tensors over ranks, from dense all-gathers only.

Used by fastcoll.DDP for the gradients of ``nn.Embedding(sparse=True)`` and by
:func:`fastcoll.dist.allreduce_grads` for sparse gradients.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: Any) -> Any:
    """Async all-gather of equal-sized ``inp`` into ``out``.

    ``all_gather_single``, named ``all_gather_into_tensor`` before torch 2.13.
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, inp, group=group, async_op=True)


class SparseExchange:
    """The all-reduce (sum) of one sparse tensor, built from two dense all-gathers.

    Not ``dist.all_reduce`` on the sparse tensor: gloo's sparse all-reduce
    corrupts the heap now and then (glibc aborts with "malloc(): unaligned
    tcache chunk detected" in a gloo worker thread). torch DDP alone, training
    a model with sparse embeddings on 2 gloo ranks of a loaded 2-core machine,
    crashed that way within minutes; nothing crashed with this exchange in
    10+ minutes of the same stress. Steps: (1) all-gather every rank's number
    of rows; (2) when any rank has rows, all-gather one byte buffer per rank
    holding its row indices and values, padded to the largest count, so no
    collective moves zero bytes; every rank then sums the same concatenation
    in the same order, so all ranks end with identical, coalesced results.
    Only all-gathers of dense tensors are used, so any backend works.

    Args:
        grad: The local, coalesced sparse COO tensor (for DDP: already scaled).
        world_size: The number of ranks (> 1).
        all_gather: ``all_gather(out, inp, what)`` starts an all-gather of every rank's ``inp`` into ``out`` and
            returns its Work: the caller numbers and watches it (a stall guard).
        wait: ``wait(work, what)`` waits for such a Work (bounded by the caller's stall timeout).
        what: What is exchanged, for stall reports (the same on every rank).
    """

    def __init__(
        self,
        grad: torch.Tensor,
        world_size: int,
        all_gather: Callable[[torch.Tensor, torch.Tensor, str], Any],
        wait: Callable[[Any, str], Any],
        what: str,
    ):
        self.grad = grad
        self.world_size = world_size
        self._all_gather, self._wait, self.what = all_gather, wait, what
        self.nnz = torch.tensor([grad._nnz()], dtype=torch.int64, device=grad.device)  # kept until the gather is done
        self.counts = torch.empty(world_size, dtype=torch.int64, device=grad.device)
        self.work: Any = all_gather(self.counts, self.nnz, f"{what} (row counts)")
        self.rows: List[int] = []
        self.max_rows = 0
        self.layout: Tuple[int, int, int] = (0, 0, 0)  # (index bytes, value bytes, bytes per rank), see _layout
        self.local: Optional[torch.Tensor] = None
        self.gathered: Optional[torch.Tensor] = None

    def _layout(self, max_rows: int) -> Tuple[int, int, int]:
        """(index bytes, value bytes, bytes of one rank's buffer) for ``max_rows`` padded rows."""
        g = self.grad
        index_bytes = g.sparse_dim() * max_rows * 8
        row_numel = 1
        for d in g.shape[g.sparse_dim() :]:
            row_numel *= d
        value_bytes = max_rows * row_numel * g.element_size()
        return index_bytes, value_bytes, -(-(index_bytes + value_bytes) // 16) * 16  # 16-byte aligned per rank

    def _sections(self, buf: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Views of one rank's byte buffer: indices (sparse_dim, max_rows) and values (max_rows, *dense)."""
        g, max_rows = self.grad, self.max_rows
        index_bytes, value_bytes, _ = self.layout
        indices = buf[:index_bytes].view(torch.int64).view(g.sparse_dim(), max_rows)
        values = buf[index_bytes : index_bytes + value_bytes].view(g.dtype).view(max_rows, *g.shape[g.sparse_dim() :])
        return indices, values

    def start_gather(self) -> None:
        """Wait for the row counts, then start the all-gather of rows (none when no rank has any)."""
        self._wait(self.work, f"{self.what} (row counts)")
        self.rows = self.counts.tolist()
        self.max_rows = max(self.rows)
        self.work = None
        if self.max_rows == 0:
            return
        g = self.grad
        self.layout = self._layout(self.max_rows)
        local = torch.zeros(self.layout[2], dtype=torch.uint8, device=g.device)
        indices, values = self._sections(local)
        indices[:, : g._nnz()] = g._indices()
        values[: g._nnz()] = g._values()
        self.gathered = torch.empty(self.world_size * local.numel(), dtype=torch.uint8, device=g.device)
        self.local = local  # kept until the gather is done
        self.work = self._all_gather(self.gathered, local, f"{self.what} (rows)")

    def result(self) -> torch.Tensor:
        """Wait for the rows and return the summed, coalesced sparse gradient (after :meth:`start_gather`)."""
        g = self.grad
        if self.work is None:  # no rank had rows
            return g
        self._wait(self.work, f"{self.what} (rows)")
        self.work = None
        nbytes = self.layout[2]
        indices, values = [], []
        for r, n in enumerate(self.rows):
            if n > 0:
                i, v = self._sections(self.gathered[r * nbytes : (r + 1) * nbytes])
                indices.append(i[:, :n])
                values.append(v[:n])
        self.gathered = self.local = None
        total = torch.sparse_coo_tensor(torch.cat(indices, 1), torch.cat(values, 0), g.shape, check_invariants=False)
        return total.coalesce()


def empty_sparse_grad(p: torch.Tensor) -> torch.Tensor:
    """A sparse gradient of ``p`` with no rows (an embedding's layout: one sparse dimension)."""
    indices = torch.empty((1, 0), dtype=torch.long, device=p.device)
    values = torch.empty((0, *p.shape[1:]), dtype=p.dtype, device=p.device)
    return torch.sparse_coo_tensor(indices, values, p.shape, check_invariants=False)


def all_reduce_sparse(t: torch.Tensor, group: Any, world_size: int, what: str) -> torch.Tensor:
    """The sum of the sparse COO tensor ``t`` over ``group``, coalesced (a new tensor; ``t`` is unchanged).

    Its all-gathers are numbered and waited for under the group's stall protection (``what`` names them).
    """
    from .backends import finish_collective, start_collective

    def all_gather(out: torch.Tensor, inp: torch.Tensor, label: str) -> Any:
        return start_collective(lambda: all_gather_flat(out, inp, group), "all_gather", label, inp, group)

    x = SparseExchange(t.coalesce(), world_size, all_gather, lambda w, label: finish_collective(w, group, label, t.device), what)
    x.start_gather()
    return x.result()
