"""`nfab.calibrate`: calibrate the user's own training from Python, the call `nfab calibrate` is a layer over.

Every object the user hands over becomes the name the CLI would take: an importable function is
`module.path:name` (so the same setting from the CLI and from Python gives the same table and
profile), anything else (a lambda, a closure, a Dataset instance) is kept for this process under a
name of its own (`nfab.models.registry.name_for`). The setting is then built and checked exactly as
`nfab calibrate` builds it, and the same sweep, fit and validation run.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from nfab.calibrate.budget import BUDGET_RATIO
from nfab.calibrate.config import CalibrationConfig, make_config
from nfab.calibrate.sweep import CALIBRATION_FILE, PROFILE_FILE, Progress
from nfab.calibrate.sweep import calibrate as run_calibration
from nfab.calibrate.table import read_table
from nfab.calibrate.validate import TOL_VALIDATE, Validation
from nfab.config.optim import optimizer_config
from nfab.config.run import OptimConfig, ScheduleConfig
from nfab.errors import ConfigError, UserCodeError
from nfab.models.registry import name_for
from nfab.profile.schema import Profile

OptimizerArg = str | Mapping[str, Any] | OptimConfig | torch.optim.Optimizer | Callable[..., Any] | None
"""nfab's optimizer config (a name, a mapping of its keys), a torch optimizer, or a factory over parameters."""

HELD_OUT = 0.1
"""A Dataset instance given without `eval_data` holds out its last 10% (fixed, like nfab's file kinds)."""


@dataclass(frozen=True, slots=True)
class CalibrationResult:
    """What `nfab.calibrate` measured, fitted and validated."""

    table: pd.DataFrame
    """The calibration table (calibration.parquet's rows)."""
    meta: dict[str, Any]
    """The table's setting, reference run and timing (calibration.parquet's `nfab.meta`)."""
    profile: Profile
    """The fitted profile, tightened by validation where it ran."""
    validation: Validation | None
    """Validation's verdict (None with `validate=False`); `validation.passed` is what to check."""
    config: CalibrationConfig
    """The setting as resolved (what `nfab calibrate` would have run)."""
    table_path: Path | None
    profile_path: Path | None
    """Where the files are (None when `out` was not given)."""

    @property
    def passed(self) -> bool | None:
        return None if self.validation is None else self.validation.passed


def _model_name(model: str | Callable[..., nn.Module] | nn.Module) -> str:
    if isinstance(model, str):
        return model
    if isinstance(model, nn.Module):  # a built model: each virtual run starts from a copy of it
        built = model

        def copy_of_model() -> nn.Module:
            return copy.deepcopy(built)

        copy_of_model.__qualname__ = f"<copy of {type(model).__name__}>"
        return name_for(copy_of_model, "model")
    if callable(model):
        return name_for(model, "model")
    raise ConfigError(f"model must be a registry name, a module.path:factory or a factory, got {type(model).__name__}")


def _data_name(data: Any, what: str, held_out: bool) -> str:
    """A data argument as a data-set name; a Dataset instance becomes a factory of its splits."""
    if isinstance(data, str):
        return data
    if isinstance(data, Dataset) or (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        n = len(data)
        cut = n - int(HELD_OUT * n) if held_out else n
        whole = data

        def splits(split: str) -> Any:
            if split == "train":
                return Subset(whole, range(cut)) if cut < n else whole
            return Subset(whole, range(cut, n)) if held_out else whole

        splits.__qualname__ = f"<{type(data).__name__}>"
        return name_for(splits, what)
    if callable(data):
        return name_for(data, what)
    raise ConfigError(f"{what} must be a data-set name, a factory f(split=...) or a map-style Dataset, "
                      f"got {type(data).__name__}")


def _optimizer(value: Any, model: str, options: dict[str, Any]) -> Any:
    """`optimizer=` as nfab's config: a torch optimizer, or a factory over parameters, is read back
    (`optimizer_config`: AdamW, Adam without L2, SGD) from one built over the model on the meta device."""
    if value is None or isinstance(value, str | Mapping | OptimConfig):
        return value
    built = value
    if not isinstance(value, torch.optim.Optimizer) and callable(value):
        from nfab.models import build_model

        params = [p for p in build_model(model, device="meta", **options).module.parameters() if p.requires_grad]
        try:
            built = value(params)
        except Exception as exc:  # the user's factory: one line
            raise UserCodeError(f"optimizer factory raised {type(exc).__name__}: {exc}") from exc
    mapped = optimizer_config(built)
    if mapped is None:
        raise ConfigError(f"optimizer {type(getattr(built, 'optimizer', built)).__name__} has no equivalent in "
                          "nfab's optimizer config (AdamW, Adam without weight decay, SGD without Nesterov; one lr "
                          "for every group): give optimizer={'name': ..., 'lr': ...}")
    return mapped


def _section(value: Any, kind: type[OptimConfig] | type[ScheduleConfig], prefix: str) -> dict[str, Any]:
    """`optimizer=` / `schedule=` as dotted overrides: a name, a mapping of the section's keys, or the section."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {f"{prefix}.name": value}
    if isinstance(value, kind):
        value = value.model_dump(exclude_unset=True)
    if isinstance(value, Mapping):
        return {f"{prefix}.{k}": list(v) if isinstance(v, tuple) else v for k, v in value.items()}
    raise ConfigError(f"{prefix} must be a name, a mapping of {kind.__name__} keys or a {kind.__name__}, got "
                      f"{type(value).__name__}")


def calibrate(model: str | Callable[..., nn.Module] | nn.Module, data: Any, *, loss: Any = None,
              eval_data: Any = None, collate: Callable[[list[Any]], Any] | str | None = None,
              optimizer: OptimizerArg = None,
              schedule: str | Mapping[str, Any] | ScheduleConfig | None = None, world_size: int = 4,
              steps: int | None = None, batch_size: int | None = None, accum_steps: int | None = None,
              grad_clip: float | None = None, precision: str | None = None, seed: int | None = None,
              config: str | None = None, out: str | Path | None = None, quick: bool = False,
              routes: tuple[str, ...] | None = None, validate: bool = True, tol_validate: float = TOL_VALIDATE,
              budget: float = BUDGET_RATIO, overwrite: bool = False, progress: Progress | None = None,
              **options: Any) -> CalibrationResult:
    """Calibrate the user's training and fit its profile (`nfab calibrate` from Python).

    `model`: a factory returning a fresh `nn.Module` (a registry name, `module.path:factory`, or a built
    module, copied for each virtual run). `data`: a factory `f(split="train" | "val")` returning a
    map-style Dataset, a Dataset (its last 10% held out unless `eval_data` is given), or a name as the CLI
    takes it (`digits`, `tokens:PATH`, `npz:PATH`, `module.path:factory`). `loss(model, batch) -> scalar`
    is called with the batch as the loader yields it (default: the loss the output carries, else
    cross-entropy: `nfab.loss`). `optimizer`: nfab's config (a name, a mapping of its keys), or a torch
    optimizer / a factory over parameters that maps onto it (AdamW, SGD); `schedule`: nfab's config.
    `options` are the CLI's `KEY=VALUE` overrides (`width=8`, `phases=2`, `optim.lr=0.1`). With `out`, the
    table and profile are written there as `nfab calibrate --out` writes them. `budget` caps the whole
    calibration at that many FP32 reference runs (trials and validation's tightening rounds share it).
    """
    overrides: dict[str, Any] = dict(options)
    model_name = _model_name(model)
    from nfab.config.pairing import model_option_names

    takes = model_option_names(model_name) if callable(optimizer) else ()
    model_options = {k: v for k, v in options.items() if takes is None or k in takes}  # None: any keyword
    overrides.update(_section(_optimizer(optimizer, model_name, model_options), OptimConfig, "optim"))
    overrides.update(_section(schedule, ScheduleConfig, "schedule"))
    held_out = eval_data is None
    named = {"loss": None if loss is None else loss if isinstance(loss, str) else name_for(loss, "loss"),
             "eval_data": None if eval_data is None else _data_name(eval_data, "data", held_out=False),
             "collate": None if collate is None else collate if isinstance(collate, str) else name_for(collate,
                                                                                                        "collate"),
             "batch_size": batch_size, "accum_steps": accum_steps, "grad_clip": grad_clip,
             "precision": precision, "seed": seed}
    overrides.update({k: v for k, v in named.items() if v is not None})
    cfg = make_config(model_name, dataset=_data_name(data, "data", held_out), config=config,
                      overrides=overrides, world_size=world_size, steps=steps, quick=quick or None, routes=routes)
    target = Path(out) if out is not None else None
    if target is not None and not overwrite:
        held = [n for n in (CALIBRATION_FILE, PROFILE_FILE) if (target / n).exists()]
        if held:
            raise ConfigError(f"{target} already holds a calibration ({', '.join(held)}): pass overwrite=True")
    command = f"nfab.calibrate({cfg.model!r}, {cfg.dataset!r}, world_size={world_size})"
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="nfab-calibrate-") as tmp:
        where = target if target is not None else Path(tmp)
        try:
            done = run_calibration(cfg, where, progress=progress, command=command, validate=validate,
                                   tol_validate=tol_validate, budget_ratio=budget)
        finally:
            torch.set_num_threads(threads)
        table, meta = read_table(done.table_path)
    return CalibrationResult(table, meta, done.profile, done.validation, cfg,
                             done.table_path if target is not None else None,
                             done.profile_path if target is not None else None)
