"""fastcoll inside training frameworks.

Each submodule needs its framework installed and registers fastcoll with it
when imported; none of them is imported by ``import fastcoll``:

* :mod:`fastcoll.integrations.mmengine` (``pip install 'fastcoll[mmengine]'``):
  the ``'FastCollDDP'`` model wrapper, the ``'FastCollDDPStrategy'`` strategy
  and the ``'FastCollRunner'`` runner, registered in mmengine's root registries.
  One line in a config: ``custom_imports = dict(imports=['fastcoll.integrations.mmengine'])``
  plus ``model_wrapper_cfg = dict(type='FastCollDDP')``.
* :mod:`fastcoll.integrations.lightning` (``pip install 'fastcoll[lightning]'``):
  ``Trainer(strategy="fastcoll_ddp")`` and ``Fabric(strategy="fastcoll_ddp")``.
* :mod:`fastcoll.integrations.accelerate` (``pip install 'fastcoll[huggingface]'``):
  ``FastCollAccelerator()`` in place of ``accelerate.Accelerator()``; its
  ``prepare()`` wraps models in fastcoll.DDP (and optimizers in
  fastcoll.ShardedOptimizer with ``FastCollKwargs(sharded_optimizer=True)``).
* :mod:`fastcoll.integrations.transformers` (``pip install 'fastcoll[huggingface]'``):
  ``FastCollTrainer`` in place of ``transformers.Trainer`` (or
  ``FastCollTrainerMixin`` for a Trainer subclass). See docs/integrations/huggingface.md.

Libraries that recognize torch DDP by ``isinstance`` need no module here:
``fastcoll.DDP`` subclasses ``torch.nn.parallel.DistributedDataParallel``, so
``torch.distributed.checkpoint``'s state-dict functions, ``torch.optim.swa_utils``,
mmengine (``is_model_wrapper``, its checkpoints), accelerate and transformers
(``unwrap_model``, ``save_model``, ``save_pretrained``, ``trigger_sync_in_backward``)
and timm (``unwrap_model``, its tasks' ``no_sync``) treat it as torch DDP. The
plain ``accelerate.Accelerator.prepare`` wraps any model in torch DDP, a
``fastcoll.DDP`` too (gradients stay right but are reduced twice): use
``FastCollAccelerator``, whose ``prepare`` wraps in fastcoll.DDP and keeps a
model the user wrapped in fastcoll.DDP as it is.
"""
