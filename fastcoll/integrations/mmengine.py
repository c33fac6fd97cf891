"""fastcoll for mmengine (OpenMMLab): a model wrapper, a strategy and a runner.

Importing this module registers, in mmengine's root registries (so every
OpenMMLab project's child registry finds them too):

* ``MODEL_WRAPPERS``: ``'FastCollDDP'`` -- :class:`FastCollDDP`, fastcoll.DDP
  with the ``train_step``/``val_step``/``test_step`` interface mmengine's loops
  call (what ``MMDistributedDataParallel`` is to torch DDP);
* ``STRATEGIES``: ``'FastCollDDPStrategy'`` -- :class:`FastCollDDPStrategy`, for
  ``FlexibleRunner``: initializes the process group with
  :func:`fastcoll.dist.init_dist` and wraps the model with :class:`FastCollDDP`;
* ``RUNNERS``: ``'FastCollRunner'`` -- :class:`FastCollRunner`, mmengine's
  ``Runner`` whose process-group set-up goes through
  :func:`fastcoll.dist.init_dist` and whose default wrapper is :class:`FastCollDDP`;
* ``EVALUATOR``: ``'FastCollEvaluator'`` -- :class:`FastCollEvaluator`, an
  ``Evaluator`` whose metrics gather their per-rank results with
  :func:`fastcoll.dist.collect_results`, which keeps results that are None
  (mmengine's ``collect_results`` silently drops them, so a metric that
  records None for "no prediction" sees fewer samples than the dataset has).

Switching an existing config is one line (plus the import)::

    custom_imports = dict(imports=['fastcoll.integrations.mmengine'], allow_failed_imports=False)
    model_wrapper_cfg = dict(type='FastCollDDP')      # Runner
    # or: strategy = dict(type='FastCollDDPStrategy')  # FlexibleRunner
    # or: runner_type = 'FastCollRunner'               # Runner, also on CPU-only torch

Why the runner and strategy exist: mmengine's own ``init_dist`` calls
``torch.cuda.set_device`` for the 'pytorch' launcher even on a CPU build of
torch (where that raises), and its 'slurm' path needs SLURM_LOCALID;
:func:`fastcoll.dist.init_dist` works on CPU and GPU. With the plain
``Runner``, initialize the process group yourself first
(``fastcoll.dist.init_dist('pytorch')``); the Runner then skips its own set-up.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, Optional, Sequence, Union

import torch
from torch import nn

try:
    import mmengine  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without mmengine
    raise ImportError("fastcoll.integrations.mmengine needs mmengine: pip install 'fastcoll[mmengine]'") from exc

from mmengine._strategy import DDPStrategy
from mmengine.device import get_device
from mmengine.evaluator import Evaluator
from mmengine.model import is_model_wrapper
from mmengine.model.utils import detect_anomalous_params as _detect_anomalous_params
from mmengine.optim import OptimWrapper
from mmengine.registry import EVALUATOR, MODEL_WRAPPERS, RUNNERS, STRATEGIES
from mmengine.runner import Runner

from .. import dist as fdist
from ..ddp import DDP

__all__ = ["FastCollDDP", "FastCollDDPStrategy", "FastCollRunner", "FastCollEvaluator", "setup_dist_from_cfg"]


def _on_accelerator(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` lives on a non-CPU device."""
    return any(t.device.type != "cpu" for t in list(module.parameters()) + list(module.buffers()))


@MODEL_WRAPPERS.register_module(name="FastCollDDP", force=True)
class FastCollDDP(DDP):
    """fastcoll.DDP with the step interface of mmengine's loops.

    Behaves like mmengine's ``MMDistributedDataParallel``: ``train_step``
    preprocesses the batch with the module's data preprocessor
    (``training=True``), runs the forward in ``mode='loss'`` through this
    wrapper (so the backward is synchronized) inside
    ``optim_wrapper.optim_context`` (which enters :meth:`no_sync` on
    gradient-accumulation iterations), parses the losses with the module's
    ``parse_losses`` and lets the optimizer wrapper do backward and step.
    ``val_step`` and ``test_step`` run on the bare module (no gradients, no
    synchronization).

    Args:
        module: The model, usually an ``mmengine.model.BaseModel``.
        detect_anomalous_params: Debugging aid: after each training forward,
            log the parameters that did not contribute to the loss (slow).
        device_ids: As for fastcoll.DDP, except that it is dropped for a module
            whose parameters are all on the CPU: mmengine's DDPStrategy always
            passes ``[LOCAL_RANK]``, which is meaningless (and refused by
            torch DDP and fastcoll.DDP) for CPU training.
        output_device: As for fastcoll.DDP; dropped with ``device_ids`` on CPU.
        **kwargs: Every other fastcoll.DDP argument (``broadcast_buffers``,
            ``find_unused_parameters``, ``bucket_cap_mb``, ``static_graph``,
            ``gradient_as_bucket_view``, ``first_bucket_mb``, ...).
    """

    def __init__(
        self,
        module: nn.Module,
        detect_anomalous_params: bool = False,
        device_ids: Optional[Sequence[Any]] = None,
        output_device: Any = None,
        **kwargs: Any,
    ):
        if not _on_accelerator(module):
            device_ids, output_device = None, None
        super().__init__(module, device_ids=device_ids, output_device=output_device, **kwargs)
        self.detect_anomalous_params = bool(detect_anomalous_params)

    def train_step(self, data: Union[dict, tuple, list], optim_wrapper: OptimWrapper) -> Dict[str, torch.Tensor]:
        """One training iteration: preprocess, synchronized forward in 'loss' mode, backward, step.

        Args:
            data: A batch from the dataloader.
            optim_wrapper: mmengine optimizer wrapper; it decides whether this
                iteration accumulates (no synchronization) or updates.

        Returns:
            The parsed loss values, for logging.
        """
        with optim_wrapper.optim_context(self):
            data = self.module.data_preprocessor(data, training=True)
            losses = self._run_forward(data, mode="loss")
        parsed_loss, log_vars = self.module.parse_losses(losses)
        if self.detect_anomalous_params:
            _detect_anomalous_params(parsed_loss, model=self)
        optim_wrapper.update_params(parsed_loss)
        return log_vars

    def val_step(self, data: Union[dict, tuple, list]) -> list:
        """Predictions of the bare module on a validation batch."""
        return self.module.val_step(data)

    def test_step(self, data: Union[dict, tuple, list]) -> list:
        """Predictions of the bare module on a test batch."""
        return self.module.test_step(data)

    def _run_forward(self, data: Union[dict, tuple, list], mode: str) -> Any:
        """Call this wrapper with the preprocessed batch unpacked as keyword or positional arguments."""
        if isinstance(data, dict):
            return self(**data, mode=mode)
        if isinstance(data, (list, tuple)):
            return self(*data, mode=mode)
        raise TypeError(f"FastCollDDP: the data preprocessor must return a dict, list or tuple, got {type(data).__name__}")


def _resolve_backend(backend: Optional[str]) -> Optional[str]:
    """mmengine configs default to NCCL; fall back to gloo (with a warning) when CUDA is unavailable."""
    if backend is not None and "nccl" in str(backend).lower() and not torch.cuda.is_available():
        warnings.warn(
            f"fastcoll: dist_cfg asks for backend {backend!r} but CUDA is not available; using 'gloo'",
            RuntimeWarning,
            stacklevel=3,
        )
        return "gloo"
    return backend


def setup_dist_from_cfg(launcher: str, backend: Optional[str] = None, **kwargs: Any) -> None:
    """Initialize the default process group from an mmengine ``dist_cfg``, through fastcoll.

    Does nothing when a process group already exists. Accepts what
    mmengine's ``init_dist`` accepts: ``timeout`` in seconds, ``init_backend``
    (only 'torch'), and ``init_process_group`` keyword arguments.

    Args:
        launcher: 'pytorch', 'slurm' or 'mpi'.
        backend: 'nccl', 'gloo', ... (None: NCCL with CUDA, else gloo); 'nccl'
            without CUDA falls back to gloo with a warning.
        **kwargs: ``port``, ``timeout`` and ``init_process_group`` arguments.

    Raises:
        ValueError: unknown launcher, missing launcher variables, or an
            ``init_backend`` other than 'torch'.
    """
    if fdist.is_distributed():
        return
    init_backend = kwargs.pop("init_backend", "torch")
    if init_backend != "torch":
        raise ValueError(f"fastcoll: init_backend {init_backend!r} is not supported; use 'torch'")
    fdist.init_dist(launcher, _resolve_backend(backend), **kwargs)


@STRATEGIES.register_module(name="FastCollDDPStrategy", force=True)
class FastCollDDPStrategy(DDPStrategy):
    """mmengine DDPStrategy that initializes through fastcoll and wraps with :class:`FastCollDDP`.

    It takes ``DDPStrategy``'s constructor arguments, with these meanings:

    * ``model_wrapper``: wrapper config; ``type`` defaults to ``'FastCollDDP'``.
      Without one, ``dict(type='FastCollDDP', broadcast_buffers=False)``
      is used (mmengine's default, kept for OpenMMLab compatibility).
    * ``sync_bn``: 'torch' or 'mmcv' to convert BatchNorm layers, as in mmengine.
    * other keywords: ``BaseStrategy``'s arguments.
    """

    def _setup_distributed(self, launcher: str = "pytorch", backend: Optional[str] = "nccl", **kwargs: Any) -> None:  # type: ignore[override]
        setup_dist_from_cfg(launcher, backend, **kwargs)

    def _wrap_model(self, model: nn.Module) -> nn.Module:
        if is_model_wrapper(model):
            return model
        model = self.convert_model(model.to(get_device()))
        cfg = dict(self.model_wrapper) if self.model_wrapper is not None else dict(broadcast_buffers=False)
        cfg.setdefault("type", "FastCollDDP")
        default_args: Dict[str, Any] = dict(module=model)
        if _on_accelerator(model):
            default_args["device_ids"] = [fdist.get_local_rank()]
        return MODEL_WRAPPERS.build(cfg, default_args=default_args)

    def model_state_dict(self) -> dict:
        """The bare model's state dict (on CPU): checkpoint keys carry no "module." prefix.

        mmengine's strategies save the wrapper's state dict; its loaders strip
        the prefix, but a plain ``model.load_state_dict`` would not. Saving the
        bare model's keys suits both (and matches what ``Runner`` saves).
        """
        from mmengine.runner import weights_to_cpu

        model = self.model.module if is_model_wrapper(self.model) else self.model
        return weights_to_cpu(model.state_dict())


@RUNNERS.register_module(name="FastCollRunner", force=True)
class FastCollRunner(Runner):
    """mmengine ``Runner`` that sets up distribution with fastcoll.

    Differences from ``Runner``: with a launcher other than 'none', the
    process group is initialized by :func:`setup_dist_from_cfg` (CPU or GPU;
    the config's ``env_cfg.dist_cfg`` is honoured, and 'nccl' falls back to
    gloo without CUDA), and when no ``model_wrapper_cfg`` is given the model
    is wrapped with :class:`FastCollDDP` (``broadcast_buffers=False`` and the
    config's ``find_unused_parameters``, like ``Runner``'s default). Select it
    in a config with ``runner_type = 'FastCollRunner'``.
    """

    def setup_env(self, env_cfg: Dict) -> None:
        if self.distributed and not fdist.is_distributed():
            setup_dist_from_cfg(self.launcher, **dict(env_cfg.get("dist_cfg", {})))
        super().setup_env(env_cfg)

    def wrap_model(self, model_wrapper_cfg: Optional[Dict], model: nn.Module) -> nn.Module:
        if model_wrapper_cfg is None and self.distributed and not is_model_wrapper(model):
            model_wrapper_cfg = dict(
                type="FastCollDDP",
                broadcast_buffers=False,
                find_unused_parameters=self.cfg.get("find_unused_parameters", False),
            )
        return super().wrap_model(model_wrapper_cfg, model)


def _to_cpu(data: Any) -> Any:
    """Tensors and data elements (anything with ``.to``) moved to the CPU, through lists, tuples and dicts."""
    if isinstance(data, torch.Tensor) or (hasattr(data, "to") and hasattr(data, "metainfo")):
        return data.to("cpu")
    if isinstance(data, list):
        return [_to_cpu(d) for d in data]
    if isinstance(data, tuple):
        return tuple(_to_cpu(d) for d in data)
    if isinstance(data, dict):
        return {k: _to_cpu(v) for k, v in data.items()}
    return data


@EVALUATOR.register_module(name="FastCollEvaluator", force=True)
class FastCollEvaluator(Evaluator):
    """mmengine ``Evaluator`` whose metrics gather results with :func:`fastcoll.dist.collect_results`.

    Same configuration as ``Evaluator`` (``val_evaluator = dict(type='FastCollEvaluator',
    metrics=[...])``) and the same results, except that per-sample results
    that are None are kept. Each metric's ``collect_device`` ('cpu': through
    a shared directory, ``collect_dir`` if set; 'gpu': through tensors on the
    backend's device) and ``prefix`` are honoured; ``compute_metrics`` runs on
    rank 0 and its output is broadcast to every rank.
    """

    def evaluate(self, size: int) -> dict:
        metrics: Dict[str, Any] = {}
        for metric in self.metrics:
            result = self._evaluate_metric(metric, size)
            clash = sorted(set(result) & set(metrics))
            if clash:
                raise ValueError(f"FastCollEvaluator: several metrics produce {clash}; give the metrics different prefixes")
            metrics.update(result)
        return metrics

    @staticmethod
    def _evaluate_metric(metric: Any, size: int) -> dict:
        device = "gpu" if getattr(metric, "collect_device", "cpu") == "gpu" else "cpu"
        tmpdir = getattr(metric, "collect_dir", None) if device == "cpu" else None
        if not metric.results:
            warnings.warn(
                f"FastCollEvaluator: {type(metric).__name__} has no results on rank {fdist.get_rank()}; "
                "does its process() append to self.results?",
                RuntimeWarning,
                stacklevel=3,
            )
        gathered = fdist.collect_results(metric.results, size, device=device, tmpdir=tmpdir)
        out: Optional[dict] = None
        if fdist.get_rank() == 0:
            out = metric.compute_metrics(_to_cpu(gathered))
            if metric.prefix:
                out = {f"{metric.prefix}/{k}": v for k, v in out.items()}
        out = fdist.broadcast(out, src=0)
        metric.results.clear()
        return out
