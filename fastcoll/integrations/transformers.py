"""fastcoll for the transformers ``Trainer``: ``FastCollTrainer`` (or :class:`FastCollTrainerMixin` for a Trainer subclass).

One line changes::

    from fastcoll.integrations.transformers import FastCollTrainer

    trainer = FastCollTrainer(model=model, args=args, train_dataset=ds)  # instead of Trainer(...)
    # with the sharded optimizer, float32 main gradients and master weights for a bf16 model:
    from fastcoll.integrations.accelerate import FastCollKwargs
    trainer = FastCollTrainer(
        model=model, args=args, train_dataset=ds,
        fastcoll=FastCollKwargs(sharded_optimizer=True, grads="sharded", main_grad_dtype=torch.float32,
                                master_dtype=torch.float32),
    )

    # a Trainer subclass of your own (or another library's, e.g. trl's SFTTrainer):
    class MyTrainer(FastCollTrainerMixin, SFTTrainer): ...

The Trainer builds its ``Accelerator`` in ``create_accelerator_and_postprocess``
from the ``TrainingArguments`` (``ddp_find_unused_parameters``,
``ddp_bucket_cap_mb``, ``ddp_static_graph``, ``ddp_broadcast_buffers``,
mixed precision, ``torch_compile``, ...), then passes the model to its
``prepare()``. The mixin lets it, then turns that accelerator into a
:class:`~fastcoll.integrations.accelerate.FastCollAccelerator`
(:func:`~fastcoll.integrations.accelerate.adopt`): the model is wrapped in
fastcoll.DDP with the same arguments, the optimizer the Trainer creates
(``create_optimizer``, ``optim=...``) is wrapped in fastcoll.ShardedOptimizer
if asked, and the scheduler (``create_scheduler``, built after ``prepare()``)
steps the sharded optimizer's groups. ``max_grad_norm`` goes through
``Accelerator.clip_grad_norm_``. Checkpoints: the sharded optimizer's
``state_dict()`` is a collective (each rank holds 1/N of the state), so every
rank computes it and the saving rank writes it; the file is the plain torch
optimizer's state dict (loadable at any world size, or by the plain
optimizer).

FSDP and DeepSpeed (``fsdp=...``, ``deepspeed=...``) stay the plain
Trainer's: with them, ``FastCollTrainer`` raises a ValueError at construction.
"""

from __future__ import annotations

import contextlib
from typing import Any, Generator, Optional

from transformers import Trainer

from ..optim import ShardedOptimizer
from .accelerate import FastCollKwargs, adopt

__all__ = ["FastCollTrainer", "FastCollTrainerMixin"]


class FastCollTrainerMixin:
    """Mix into a ``transformers.Trainer`` (sub)class, before it, to train on fastcoll.DDP.

    Args:
        *args: The Trainer's positional arguments.
        fastcoll: fastcoll's options (:class:`~fastcoll.integrations.accelerate.FastCollKwargs`).
        **kwargs: The Trainer's keyword arguments.
    """

    accelerator: Any
    optimizer: Any

    def __init__(self, *args: Any, fastcoll: Optional[FastCollKwargs] = None, **kwargs: Any):
        self._fastcoll_options = fastcoll  # read by create_accelerator_and_postprocess, inside Trainer.__init__
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's own accelerator, made a FastCollAccelerator (see the module docstring)."""
        super().create_accelerator_and_postprocess()  # type: ignore[misc]
        args = self.args  # type: ignore[attr-defined]
        asked = {"fsdp": args.fsdp or args.fsdp_plugin_args, "deepspeed": args.deepspeed}
        adopt(self.accelerator, self._fastcoll_options, [f"TrainingArguments.{k}" for k, v in asked.items() if v])

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The Trainer's save, with the sharded optimizer's (collective) state dict computed on every rank."""
        if self._fastcoll_sharded() is None:
            return super()._save_optimizer_and_scheduler(output_dir)  # type: ignore[misc]
        state = self.optimizer.state_dict()  # every rank: the gather is a collective
        with _state_dict_returning(self.optimizer, state):
            return super()._save_optimizer_and_scheduler(output_dir)  # type: ignore[misc]

    def _fastcoll_sharded(self) -> Optional[ShardedOptimizer]:
        opt = getattr(self, "optimizer", None)
        while opt is not None and not isinstance(opt, ShardedOptimizer) and hasattr(opt, "optimizer"):
            opt = opt.optimizer
        return opt if isinstance(opt, ShardedOptimizer) else None


class FastCollTrainer(FastCollTrainerMixin, Trainer):
    """``transformers.Trainer`` on fastcoll.DDP (optionally with fastcoll.ShardedOptimizer); see the module docstring."""


@contextlib.contextmanager
def _state_dict_returning(optimizer: Any, state: Any) -> Generator[None, None, None]:
    """``optimizer.state_dict()`` returns ``state`` (already computed) inside the block."""
    optimizer.state_dict = lambda: state
    try:
        yield
    finally:
        del optimizer.state_dict
