"""fastcoll.DDP, the drop-in for ``torch.nn.parallel.DistributedDataParallel``, one concern per module.

* :mod:`.wrapper`: :class:`DDP` itself: construction, forward, ``no_sync``;
* :mod:`.arguments`: construction checks (arguments, devices, process group, module);
* :mod:`.broadcast`: coalesced broadcasts (parameters at construction, buffers per forward);
* :mod:`.join`: uneven inputs (``join()``) and its collectives on joined ranks;
* :mod:`.comm_hooks`: ``register_comm_hook`` and torch's built-in hooks;
* :mod:`.health`: ``grad_norm``, ``clip_grad_norm_``, ``set_gradient_divisor``;
* :mod:`.inspection`: buckets, timeline, Chrome trace, tuning report;
* :mod:`.logging_data`: torch's ``_get_ddp_logging_data`` (sampled runtime statistics, the last error);
* :mod:`.replicas`: ``verify_replicas`` (checksums compared across ranks);
* :mod:`.pickling`: ``torch.save(model)`` and ``copy.deepcopy``;
* :mod:`.compile_support`: torch.compile (graph splitting at bucket boundaries).
"""

from .wrapper import DDP, DistributedDataParallel

__all__ = ["DDP", "DistributedDataParallel"]
