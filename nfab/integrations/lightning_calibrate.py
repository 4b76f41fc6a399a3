"""Calibrate a Lightning training from the objects the user already built, in either Lightning namespace.

`calibrate(module, datamodule)` reads what `trainer.fit(module, datamodule)` would train: the
module (copied now: each virtual run starts from a copy, and the loss calls `training_step` on that
copy), the datamodule's train / val loaders after `prepare_data()` and `setup("fit")` as Lightning
calls them (their datasets, collate functions and batch size), and the optimizer
`configure_optimizers()` returns where nfab's config has the same one. A Lightning `Trainer` given as
`trainer=` adds its clipping, accumulation, precision and `max_steps`. Nothing here imports a
namespace: `nfab.integrations.lightning` and `nfab.integrations.pytorch_lightning` both export it.
The profile it writes goes to `NfabDDPStrategy(result.profile_path)`.
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from nfab.errors import ConfigError
from nfab.integrations.recipe import LIGHTNING_PRECISION, named_loss, optimizer_config, run

if TYPE_CHECKING:
    from nfab.calibrate.api import CalibrationResult

log = logging.getLogger(__name__)

LIGHTNING_PACKAGES = ("lightning.", "pytorch_lightning.", "lightning_fabric.")
"""Where Lightning's own (default) hooks are defined: a hook from elsewhere is the user's."""


def calibrate(module: Any, datamodule: Any = None, *, train_dataloaders: DataLoader | None = None,
              val_dataloaders: DataLoader | Sequence[DataLoader] | None = None, trainer: Any = None,
              out: str | Path | None = None, world_size: int = 4, steps: int | None = None,
              **kwargs: Any) -> CalibrationResult:
    """Calibrate `trainer.fit(module, datamodule)`'s training; `NfabDDPStrategy(result.profile_path)` trains with it.

    The loaders as `Trainer.fit` takes them: `train_dataloaders` / `val_dataloaders`, else the datamodule's,
    else the module's own `train_dataloader()` / `val_dataloader()` (without a val loader the train set's
    last 10% is held out). The loss is `training_step(batch, 0)`: its tensor, or its dict's `"loss"`.
    `out`, `world_size`, `steps` and `kwargs` go to `nfab.calibrate` and win over what was read.
    """
    if not getattr(module, "automatic_optimization", True):
        raise ConfigError(f"{type(module).__name__} optimizes manually (automatic_optimization=False): its "
                          "training_step steps its own optimizer, so it gives nfab no loss to calibrate with")
    train, val = _loaders(module, datamodule, train_dataloaders, val_dataloaders)
    recipe: dict[str, Any] = {"batch_size": train.batch_size, "collate": train.collate_fn,
                              "eval_data": None if val is None else _dataset(val, "val"),
                              "loss": lightning_loss(module), "optimizer": _optimizer(module)}
    if trainer is not None:
        recipe.update(trainer_settings(trainer))
    kwargs.update(out=out, world_size=world_size, steps=steps)
    with warnings.catch_warnings():  # `self.log` in training_step: no Trainer collects it during calibration
        warnings.filterwarnings("ignore", message=r".*self\.log\(\)` but the `self\.trainer` reference")
        return run(copy.deepcopy(module).cpu(), _dataset(train, "train"), recipe, kwargs)


def lightning_loss(module: Any) -> Any:
    """`training_step` as `loss(model, batch)`, called on the model nfab built (a copy of `module`)."""

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        out = model.training_step(batch, 0)  # type: ignore[operator]
        value = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"{type(model).__name__}.training_step returned {type(out).__name__}, not a loss "
                              "tensor or a dict with 'loss' (a skipped step gives calibration no gradient)")
        return value

    return named_loss(loss, type(module), "training_step")


def trainer_settings(trainer: Any) -> dict[str, Any]:
    """What a Lightning Trainer fixes of the step: norm clipping, accumulation, autocast precision, max_steps."""
    settings: dict[str, Any] = {"accum_steps": int(trainer.accumulate_grad_batches)}
    clip = trainer.gradient_clip_val
    named = trainer.gradient_clip_algorithm
    algorithm = "norm" if named is None else str(getattr(named, "value", named))  # None: Lightning's norm
    if clip and algorithm == "norm":
        settings["grad_clip"] = float(clip)
    elif clip:
        log.info("nfab: gradient_clip_algorithm=%s is not nfab's (norm clipping); calibrating unclipped", algorithm)
    precision = LIGHTNING_PRECISION.get(str(trainer.precision))
    if precision is None:
        log.info("nfab: precision=%s is not an autocast nfab has; calibrating in fp32", trainer.precision)
    settings["precision"] = precision
    if trainer.max_steps and trainer.max_steps > 0:
        settings["steps"] = int(trainer.max_steps)
    return settings


def _overridden(obj: Any, hook: str) -> bool:
    fn = getattr(type(obj), hook, None)
    return fn is not None and not (getattr(fn, "__module__", None) or "").startswith(LIGHTNING_PACKAGES)


def _loaders(module: Any, datamodule: Any, train: Any, val: Any) -> tuple[DataLoader, DataLoader | None]:
    """The train and val loaders `Trainer.fit` would use (the first val loader of several)."""
    source = datamodule if datamodule is not None else module
    if train is None and datamodule is not None:
        datamodule.prepare_data()
        datamodule.setup("fit")
    if train is None:
        if not _overridden(source, "train_dataloader"):
            raise ConfigError(f"{type(source).__name__} has no train_dataloader(): give a datamodule or "
                              "train_dataloaders=")
        train = source.train_dataloader()
    if val is None and _overridden(source, "val_dataloader"):
        val = source.val_dataloader()
    if isinstance(val, Sequence) and not isinstance(val, DataLoader):
        val = val[0] if val else None
    for loader, what in ((train, "train"), (val, "val")):
        if loader is not None and not isinstance(loader, DataLoader):
            raise ConfigError(f"nfab calibrates from a torch DataLoader; the {what} loader is "
                              f"{type(loader).__name__}")
    return train, val


def _dataset(loader: DataLoader, what: str) -> Any:
    if isinstance(loader.dataset, IterableDataset):
        raise ConfigError(f"nfab calibrates from a map-style dataset (len and indexing); the {what} loader's "
                          f"is an IterableDataset")
    return loader.dataset


def _optimizer(module: Any) -> dict[str, Any] | None:
    """nfab's config for the one optimizer `configure_optimizers()` returns, where it maps (else None)."""
    try:
        conf = module.configure_optimizers()
    except Exception as exc:  # e.g. a schedule reading self.trainer, which calibration has not
        log.info("nfab: %s.configure_optimizers() raised %s; calibrating with nfab's optimizer (pass optimizer=)",
                 type(module).__name__, type(exc).__name__)
        return None
    found = _single(conf)
    mapped = optimizer_config(found) if found is not None else None
    if mapped is None:
        log.info("nfab: %s.configure_optimizers() gives no single torch AdamW / SGD; calibrating with nfab's "
                 "optimizer (pass optimizer=)", type(module).__name__)
    return mapped


def _single(conf: Any) -> Any:
    """The optimizer in any of `configure_optimizers`' return shapes, None unless there is exactly one."""
    if isinstance(conf, Mapping):
        conf = conf.get("optimizer")
    if isinstance(conf, Sequence) and len(conf) == 2 and isinstance(conf[0], Sequence):
        conf = conf[0]  # ([optimizers], [schedulers])
    if isinstance(conf, Sequence):
        found = [c.get("optimizer") if isinstance(c, Mapping) else c for c in conf]
        return found[0] if len(found) == 1 else None
    return conf
