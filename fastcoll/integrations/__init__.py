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
"""
