"""A profile's `provenance.calibrated`: the setting it was calibrated under, as a run config.

`nfab train --profile P` starts from this setting (model and options, data set and
options, optimizer with its clipping, batch size, accumulation, precision, schedule, length,
seed, W as ranks on one node), so the profile alone reproduces the run it was fitted for;
anything given explicitly overrides it (`recipe_changes` names what differs from the step the
profile was calibrated with). When the result no longer matches the profile's model signature,
`explain_mismatch` names the options that differ from the calibrated ones.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field
from torch import nn

from nfab.config.run import PrecisionName, ScheduleConfig, TrainConfig
from nfab.errors import ProfileError
from nfab.models import ModelSpec, model_signature
from nfab.models.registry import layout_differences
from nfab.profile.schema import Profile
from nfab.validation import FrozenModel, validate


class CalibratedOptimizer(FrozenModel):
    """The optimizer a sweep trained with, resolved (no `auto`, no defaults left open)."""

    name: Literal["sgd", "adamw"]
    lr: float
    momentum: float = 0.9
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    grad_clip: float | None = None
    warmup_steps: int | None = None
    """Profiles before the shared schedule kept the warm-up here (read when `schedule` is absent)."""
    min_lr_ratio: float | None = None
    """Profiles before the shared schedule kept the cosine floor here."""


class CalibratedSetting(FrozenModel):
    """`provenance.calibrated` of a profile written by `nfab calibrate` / `nfab fit`."""

    model: str | None = None
    """Model name (older profiles: the profile's `model.name`)."""
    model_options: dict[str, Any] = Field(default_factory=dict)
    dataset: str
    data_options: dict[str, Any] = Field(default_factory=dict)
    world_size: int = Field(ge=1)
    optimizer: CalibratedOptimizer
    schedule: ScheduleConfig | None = None
    steps: int = Field(ge=1)
    run_steps: int | None = Field(None, ge=1)
    """Steps of the training run the profile is for, when the calibration (`steps`) was shorter."""
    batch_size: int = Field(ge=1)
    accum_steps: int | None = Field(None, ge=1)
    """Micro-batches per optimizer step (profiles before it was recorded: None, trained as 1)."""
    precision: PrecisionName | None = None
    """The forward's autocast dtype (profiles before it was recorded: None, trained as fp32)."""
    seed: int = 0
    loss: str | None = None
    """The loss the step minimised, `module.path:fn`, or `default` (profiles before it: the default)."""
    eval_data: str | None = None
    """The held-out data, where it was not the training data's own held-out split."""
    collate: str | None = None
    """The user's collate function, where one was given."""
    parameters: tuple[str, ...] | None = None
    """The model's `name:shape` lines (its signature's), so a model that does not fit is named by them."""
    trial_steps: int | None = None
    ef_steps: int | None = None
    quick: bool | None = None
    command: str = ""
    nfab_version: str | None = None
    torch_version: str | None = None
    created: str | None = None

    def schedule_config(self) -> ScheduleConfig:
        if self.schedule is not None:
            return self.schedule
        o = self.optimizer
        return ScheduleConfig(name="cosine", warmup_steps=o.warmup_steps,
                              min_lr_ratio=o.min_lr_ratio if o.min_lr_ratio is not None else 0.1)


def calibrated_setting(profile: Profile, where: str = "profile") -> CalibratedSetting | None:
    """The typed calibrated setting, or None for a profile without one (hand-written, static)."""
    raw = profile.provenance.get("calibrated")
    if raw is None:
        return None
    try:
        return validate(CalibratedSetting, raw, where="provenance.calibrated", error=ProfileError)
    except ProfileError as exc:  # the file before the key path, not inside it ('unknown key 'profile p.json: ...'')
        raise ProfileError(f"{where}: {exc}") from None


def profile_base(profile: Profile, path: str) -> dict[str, Any]:
    """The run config (as a mapping) a profile reproduces; explicit config and flags go over it."""
    base: dict[str, Any] = {"comm": {"profile": path}}
    setting = calibrated_setting(profile, f"profile {path}")
    if setting is None:
        if profile.model.name != "any":
            base["model"] = {"name": profile.model.name}
        return base
    o = setting.optimizer
    base["model"] = {"name": setting.model or profile.model.name, **setting.model_options}
    base["data"] = {"name": setting.dataset, "batch_size": setting.batch_size, **setting.data_options}
    base["optim"] = {"name": o.name, "lr": o.lr, "momentum": o.momentum, "betas": list(o.betas),
                     "weight_decay": o.weight_decay, "grad_clip": o.grad_clip}
    base["schedule"] = setting.schedule_config().model_dump(mode="json")
    if setting.accum_steps is not None:  # older profiles: the run config's default, as they were calibrated
        base["accum_steps"] = setting.accum_steps
    if setting.precision is not None:
        base["precision"] = setting.precision
    if setting.eval_data is not None:
        base["data"]["eval"] = setting.eval_data
    if setting.collate is not None:
        base["data"]["collate"] = setting.collate
    if setting.loss not in (None, "default"):
        base["loss"] = setting.loss
    base["steps"] = setting.steps
    base["seed"] = setting.seed
    base["launch"] = {"nproc": setting.world_size}  # W: the profile's capacity and fit assume it
    return base


def _recipe(setting: CalibratedSetting) -> dict[str, Any]:
    """How the calibrated setting takes one optimizer step, by run-config key (None: not recorded)."""
    o = setting.optimizer
    return {"data.batch_size": setting.batch_size, "accum_steps": setting.accum_steps,
            "precision": setting.precision, "optim.name": o.name, "optim.lr": o.lr, "optim.momentum": o.momentum,
            "optim.betas": tuple(o.betas), "optim.weight_decay": o.weight_decay, "optim.grad_clip": o.grad_clip,
            **{f"schedule.{k}": v for k, v in setting.schedule_config().model_dump().items()}}


def recipe_changes(profile: Profile, cfg: TrainConfig) -> str | None:
    """One line naming where `cfg` (the resolved run) steps otherwise than `profile` was calibrated
    (batch, accumulation, precision, optimizer, clipping, schedule), else None. The explicit value wins;
    the line says so. Length, W and seed are not the step: `--steps` and `--nproc` change them freely."""
    setting = calibrated_setting(profile)
    if setting is None:
        return None
    diffs = []
    for key, calibrated in _recipe(setting).items():
        if calibrated is None:  # an older profile that did not record it
            continue
        value: Any = cfg
        for part in key.split("."):
            value = getattr(value, part)
        if isinstance(value, list):
            value = tuple(value)
        if value != calibrated:
            diffs.append(f"{key}={_show(value)} (calibrated: {_show(calibrated)})")
    if not diffs:
        return None
    return ("this run steps otherwise than the profile was calibrated, as given explicitly: " + ", ".join(diffs))


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)


def layout_mismatch(profile: Profile, spec: ModelSpec) -> str | None:
    """`explain_mismatch`'s line when `spec`'s parameter layout is not the one `profile` was fitted for,
    else None (also for a profile without a signature: hand-written or static)."""
    if not profile.model.signature:
        return None
    signature = model_signature(spec.module)
    if signature == profile.model.signature:
        return None
    return explain_mismatch(profile, spec.name, dict(spec.options), signature, spec.module)


def explain_mismatch(profile: Profile, model: str, options: dict[str, Any], signature: str,
                     module: nn.Module | None = None) -> str:
    """One line: the profile does not fit this model, and which options differ from the calibrated ones."""
    setting = calibrated_setting(profile)
    head = (f"profile was made for model {profile.model.name!r} with another parameter layout "
            f"(signature {(profile.model.signature or '')[:12]}…, this model {signature[:12]}…)")
    if setting is None:
        return head
    calibrated_model = setting.model or profile.model.name
    if model != calibrated_model:
        return f"{head}: it was calibrated for model {calibrated_model}, this run builds {model}"
    if setting.parameters and module is not None:
        return f"{head}: {layout_differences(list(setting.parameters), module)}"
    calibrated = {k: v for k, v in setting.model_options.items() if k != "task"}
    mine = {k: v for k, v in options.items() if k != "task"}
    keys = sorted(k for k in set(calibrated) | set(mine) if calibrated.get(k) != mine.get(k))
    if not keys:
        return head
    diff = ", ".join(f"model.{k}={_show(mine.get(k))} (calibrated: {_show(calibrated.get(k))})" for k in keys)
    return f"{head}: options differ from the calibrated setting: {diff}"
