"""What :class:`fastcoll.DDP` shows of its synchronization: buckets, timeline, Chrome trace, tuning report."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch.distributed as dist

__all__ = ["SyncInspection"]


class SyncInspection:
    """Expects the wrapper's ``reducer`` and ``process_group``."""

    def bucket_info(self) -> List[Dict[str, Any]]:
        """Each bucket, in reduction order: ``index``, parameter ``names`` (relative to ``.module``),
        ``dtype``, ``device``, ``numel``, ``bytes`` (of the gradients), ``comm_dtype`` and
        ``comm_bytes`` (what one all-reduce of it carries), ``sparse`` and ``packed_early``.
        Reflects the rebuilt (and, with ``bucket_cap_mb="auto"``, the tuned) layout."""
        return self.reducer.bucket_info()

    def memory_usage(self) -> Dict[str, int]:
        """Bytes of the buffers fastcoll holds for this model now, beyond its parameters and ``.grad`` tensors, by kind.

        ``buckets`` (the flat gradient buckets: float32 with ``main_grad_dtype``, in ``comm_dtype`` when it is
        narrower, unless ``gradient_as_bucket_view=True``, where they hold the ``.grad`` views), ``comm_buffers``
        (then the separate wire buffers of ``comm_dtype``), and once a :class:`fastcoll.ShardedOptimizer` divides the buckets,
        ``grad_ranges`` (this rank's ranges of the reduced gradients, ``grads="sharded"``) and
        ``param_stages`` (the parameters' all-gather stages). Each storage is counted once; the optimizer's
        own (masters, state, the ZeRO-2 pool) are :meth:`fastcoll.ShardedOptimizer.memory_usage`'s.
        """
        return self.reducer.memory_usage()

    def sync_timeline(self) -> List[Dict[str, Any]]:
        """The last synchronized iterations' events (up to 8), oldest first.

        Per iteration: times in microseconds relative to the start of backward
        (the first gradient hook): ``forward_start_us``, ``backward_end_us``
        (the end of backward compute), ``finalize_start_us`` /
        ``finalize_end_us``, ``exposed_sync_us`` (end of backward compute to
        the last gradient written back: the synchronization the backward did
        not hide) and ``step_us``; and per bucket: gradient-ready times of its
        first and last parameter, pack start/end, collective issued/completed,
        write-back start/end; with ``record_timeline=False`` the iteration-level
        times only (each bucket's event times None).

        Raises:
            RuntimeError: No synchronized iteration has completed on this rank yet.
        """
        self._recorded("sync_timeline()")
        return self.reducer.timeline.iterations()

    def export_chrome_trace(self, path: Union[str, Path]) -> Path:
        """Write the recorded iterations as a Chrome / Perfetto trace (JSON ``traceEvents``); returns the path.

        Events are named after their bucket (``bucket 3 pack``, ``bucket 3
        all-reduce``, ``bucket 3 write-back``), one track per kind, with this
        rank as the process; traces of several ranks can be loaded together.

        Raises:
            RuntimeError: No synchronized iteration has completed on this rank yet, or the wrapper was built with
                ``record_timeline=False`` (no bucket events to show); nothing is written.
        """
        self._recorded("export_chrome_trace()")
        if not self.reducer.timeline.enabled:
            raise RuntimeError(
                "fastcoll.DDP.export_chrome_trace(): this wrapper was built with record_timeline=False, so no bucket "
                "events were recorded; build it with record_timeline=True (the default) to export a trace"
            )
        rank = dist.get_rank(self.process_group)
        return self.reducer.timeline.export_chrome_trace(path, rank=rank)

    def verify_replicas(self, buffers: Optional[bool] = None) -> None:
        """Check that the model replicas are bitwise equal on every rank (a collective: every rank calls it).

        Checksums of every synchronized parameter and buffer (one fused pass,
        :func:`fastcoll.ops.checksum`) and one all-gather; on any difference
        every rank raises :class:`fastcoll.ReplicaMismatchError` naming the
        first differing tensors (up to 10) and which ranks hold which version.
        ``DDP(..., verify_replicas_every=N)`` runs it at the start of every
        N-th synchronized iteration's forward, after the buffer broadcast.

        Args:
            buffers: Check the buffers too (None: when ``broadcast_buffers``).
                BatchNorm running statistics differ between ranks after each
                forward until the next one broadcasts them: between steps,
                pass ``buffers=False`` for such a model.
        """
        from .replicas import verify_replicas

        gather = self.reducer.param_gather
        if gather is not None:
            gather.finish()  # the parameters' all-gathers first: the replicas are whole only then
        verify_replicas(self, buffers=buffers)

    def tuning_report(self) -> List[Dict[str, Any]]:
        """With ``bucket_cap_mb="auto"``: every candidate layout with its measured median step and
        exposed synchronization times, and which one was chosen (while the tuning runs: the candidates so far,
        none chosen).

        Raises:
            RuntimeError: The wrapper was not built with ``bucket_cap_mb="auto"``, or its tuning has not started yet
                (it starts at the first synchronized forward after the ready-order rebuild).
        """
        report = self.reducer.tuning_report()
        if report is None:
            raise RuntimeError(
                "fastcoll.DDP.tuning_report(): there is no tuning to report: this wrapper was built without "
                "bucket_cap_mb='auto'; pass it to tune the bucket layout while training"
            )
        if not report:
            raise RuntimeError(
                "fastcoll.DDP.tuning_report(): the tuning has not started yet: it starts at the first synchronized "
                "forward after the buckets are rebuilt in gradient-ready order (the second synchronized iteration's); "
                "call it after training has run for a while"
            )
        return report

    def _recorded(self, what: str) -> None:
        """Raise unless this rank has completed a synchronized iteration (the timeline has something to show)."""
        if not self.reducer.timeline.committed:
            raise RuntimeError(
                f"fastcoll.DDP.{what}: no synchronized iteration has completed on this rank yet (iterations under "
                "no_sync() are not recorded); call it after a forward and backward outside no_sync()"
            )
