"""`CalibrationConfig`: what one calibration sweep measures, and the run setting it trains under.

The setting is the same typed `TrainConfig` `nfab train` reads, from the same files:
`nfab calibrate resnet18` starts from the shipped `resnet18-digits` config, `--config X`
from X, a user model (`module:factory`) from its declared task and optimizer family.
Nothing here copies a default: optimizer and schedule defaults are resolved by
`nfab.config.optim`, model options are fitted to the data set by `nfab.config.pairing`.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator

from nfab.config.files import config_from_dict, merge, read_yaml, set_dotted
from nfab.config.optim import resolve_optim
from nfab.config.pairing import default_data, resolve_pairing
from nfab.config.run import OptimConfig, ScheduleConfig, TrainConfig
from nfab.config.shipped import DEFAULT_CONFIGS
from nfab.errors import ConfigError
from nfab.models.options import accepted_options
from nfab.models.registry import MODELS
from nfab.overrides import parse_kv
from nfab.validation import StrictModel, describe
from nfab.wire.routes import BLOCK_ROUTES, ROUTES


def _redundant(route: str) -> bool:
    """A route a default sweep leaves out: fp16 (bf16's twin on the wire), 8-bit block routes (dearer
    than q8, and q8 already passes where 8 bits are needed), and the coarser-block variants
    (`-128`, `-256`) of a block route: they save ~2 % of its bits for a clearly lower fidelity, so the
    fit (which takes the most faithful route within BITS_SLACK of the cheapest) would not choose them."""
    return route == "fp16" or route.startswith("bq8") or (route in BLOCK_ROUTES and route.endswith(("-128", "-256")))


DEFAULT_ROUTES: tuple[str, ...] = tuple(r for r in ROUTES if not _redundant(r))
"""Routes a sweep measures unless told otherwise (`routes=` names others): every route of the registry
but the redundant ones, so a newly registered reducer is a candidate at once."""

QUICK_TRIAL_ROUTES: tuple[str, ...] = ("sign", "q8")
"""Routes `--quick` trials: the cheapest lossy route and the safest cheap one."""

class CalibrationConfig(StrictModel):
    """One sweep: the run setting (model, data, optimizer, schedule, length), W virtual ranks, routes, phases."""

    setting: TrainConfig
    """The run a profile is calibrated for (optimizer resolved: no `auto`, lr and decay explicit)."""
    world_size: int = Field(4, ge=1)
    """Virtual ranks (data shards) whose gradients are replayed."""
    routes: tuple[str, ...] = DEFAULT_ROUTES
    """Routes measured (fp32 is always measured: it is the reference)."""
    phases: int = Field(4, ge=1)
    """Phase points (checkpoints) at most."""
    trial_steps: int = Field(20, ge=1)
    """Steps of each short trial from a phase checkpoint."""
    ef_steps: int = Field(3, ge=1)
    """Consecutive reference steps replayed with carried error-feedback residuals."""
    quick: bool = False
    """Trial only QUICK_TRIAL_ROUTES on the regions that carry the bytes."""
    trial_min_share: float = Field(0.005, ge=0, le=1)
    """Regions holding less than this fraction of the elements get no trials (they pass on
    fidelity alone, which needs a very high cosine)."""
    eval_samples: int = Field(256, ge=1)
    """Held-out samples in the fixed batch that scores the trials."""
    threads: int = Field(1, ge=1)
    """torch intra-op threads for the sweep (1: robust on a shared 2-core machine)."""
    run_steps: int | None = Field(None, ge=1)
    """Steps of the training run the profile is for when the calibration is shorter (the config's
    `steps` before `--steps` shortened it). The profile records it: `attach` widens the loss-spike and
    grad-norm-jump thresholds, fitted on the shorter reference, for the longer run."""
    noise_moment: bool = True
    """Under an adaptive optimizer, trials and validation take block-scaled rounding noise out of
    its second moment as `attach` does by default (runtime/moment.py); the profile records it."""

    @field_validator("routes")
    @classmethod
    def _routes(cls, routes: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [r for r in routes if r not in ROUTES]
        if unknown:
            raise ValueError(f"unknown route {unknown[0]!r}; routes are {', '.join(ROUTES)}")
        return tuple(routes)

    @model_validator(mode="after")
    def _fits(self) -> CalibrationConfig:
        if self.phases > self.setting.steps:
            raise ValueError(f"calibrate: {self.phases} phases do not fit in {self.setting.steps} steps")
        return self

    # ---- the setting, under the names the sweep uses ---------------------------------
    @property
    def model(self) -> str:
        return self.setting.model.name

    @property
    def model_options(self) -> dict[str, Any]:
        return self.setting.model.options

    @property
    def dataset(self) -> str:
        return self.setting.data.name

    @property
    def data_options(self) -> dict[str, Any]:
        return self.setting.data.options

    @property
    def optimizer(self) -> OptimConfig:
        return self.setting.optim

    @property
    def schedule(self) -> ScheduleConfig:
        return self.setting.schedule

    @property
    def batch_size(self) -> int:
        return self.setting.data.batch_size

    @property
    def accum_steps(self) -> int:
        return self.setting.accum_steps

    @property
    def grad_clip(self) -> float | None:
        return self.setting.optim.grad_clip

    @property
    def precision(self) -> str:
        return self.setting.precision

    @property
    def steps(self) -> int:
        return self.setting.steps

    @property
    def seed(self) -> int:
        return self.setting.seed

    @property
    def all_routes(self) -> tuple[str, ...]:
        """fp32 first (the reference), then the other measured routes in ROUTES order."""
        return ("fp32",) + tuple(r for r in ROUTES if r in self.routes and r != "fp32")

    def trial_routes(self) -> tuple[str, ...]:
        """Lossy routes that get short trials (bf16/fp16 pass on fidelity alone)."""
        wanted = QUICK_TRIAL_ROUTES if self.quick else ("sign", "q2", "q4", "q8")
        return tuple(r for r in self.all_routes if r in wanted)


QUICK: dict[str, Any] = {"phases": 2, "trial_steps": 10, "trial_min_share": 0.01}
"""What `--quick` changes unless set explicitly: fewer phases, shorter trials, big regions only."""

_SWEEP_FIELDS = set(CalibrationConfig.model_fields) - {"setting"}
_ALIASES: dict[str, str] = {
    "batch_size": "data.batch_size", "lr": "optim.lr", "momentum": "optim.momentum",
    "weight_decay": "optim.weight_decay", "betas": "optim.betas", "grad_clip": "optim.grad_clip",
    "warmup_steps": "schedule.warmup_steps", "min_lr_ratio": "schedule.min_lr_ratio",
    "steps": "steps", "seed": "seed", "optimizer": "optim.name", "accum_steps": "accum_steps",
    "precision": "precision", "loss": "loss", "eval_data": "data.eval", "collate": "data.collate",
}
"""Plain keys that name a setting field (`lr=0.1` is `optim.lr=0.1`)."""


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`["a=1", "model.width=8"]` -> {"a": 1, "model.width": 8}; malformed items are errors."""
    return parse_kv(items)


def _setting_base(model: str, config: str | None, dataset: str | None) -> dict[str, Any]:
    """The config file (given, or the model's shipped one), with MODEL and --dataset over it."""
    if config is not None:
        data = read_yaml(config)
    elif model in DEFAULT_CONFIGS:
        data = read_yaml(DEFAULT_CONFIGS[model])
    else:
        data = {}
    data = merge(data, {"model": {"name": model}})
    if dataset is not None:
        data = merge(data, {"data": {"name": dataset}})
    elif "name" not in (data.get("data") or {}):
        options = {k: v for k, v in (data.get("model") or {}).items() if k != "name"}
        data = merge(data, {"data": {"name": default_data(model, options)}})
    return data


def _data_keys(dataset: str) -> tuple[str, ...]:
    from nfab.data.registry import DATASETS, PATH_DATASETS

    kind, sep, _ = dataset.partition(":")
    builder = (PATH_DATASETS if sep else DATASETS).get(kind)
    keys = accepted_options(builder) if builder is not None else ()
    return tuple(k for k in (keys or ()) if k not in ("split", "seed", "path"))


def make_config(model: str, *, dataset: str | None = None, config: str | None = None,
                overrides: dict[str, Any] | None = None, **fields_: Any) -> CalibrationConfig:
    """The setting (config file, MODEL, --dataset), then explicit fields (CLI flags), then `key=value` overrides.

    A dotted key sets the setting (`model.width`, `data.max_bytes`, `optim.lr`); a plain key is a
    sweep field (`phases`), a setting alias (`lr`, `batch_size`, `steps`), else a model and/or
    data option (`width`, `image_size`).
    """
    if model not in MODELS and ":" not in model:
        raise ConfigError(f"unknown model {model!r}; choose one of {sorted(MODELS)} or give module.path:factory")
    setting = _setting_base(model, config, dataset)
    configured_steps = setting.get("steps")
    sweep: dict[str, Any] = {}
    given = {k: v for k, v in fields_.items() if v is not None}
    for key, value in given.items():
        if key == "steps":
            setting["steps"] = value
        else:
            sweep[key] = value
    model_keys = accepted_options(MODELS[model]) if model in MODELS else None
    data_name = setting["data"]["name"]
    for key, value in (overrides or {}).items():
        if "." in key:
            set_dotted(setting, key.split("."), value, key)
        elif key in _SWEEP_FIELDS:
            sweep[key] = value
        elif key in _ALIASES:
            set_dotted(setting, _ALIASES[key].split("."), value, key)
        else:
            to_model = model_keys is None or key in model_keys
            to_data = key in _data_keys(data_name)
            if not (to_model or to_data) or (model_keys is None and not to_data and ":" not in model):
                raise ConfigError(f"unknown option {key!r}: not a calibrate, optimizer, model or data option")
            if to_model and (model_keys is not None or not to_data):
                setting["model"][key] = value
            if to_data:
                setting["data"][key] = value
    steps = setting.get("steps", configured_steps)  # `steps=abc` is validation's to name (int() crashed on it)
    if isinstance(configured_steps, int) and isinstance(steps, int) and configured_steps > steps:
        sweep.setdefault("run_steps", configured_steps)
    if sweep.get("quick"):
        explicit = set(given) | set(overrides or {})
        sweep.update({k: v for k, v in QUICK.items() if k not in explicit})
    cfg = config_from_dict(setting, where="calibrate")
    pair = resolve_pairing(cfg.model.name, cfg.model.options, cfg.data.name, cfg.data.options, cfg.seed)
    cfg.model.options = pair.model_options
    cfg.data.options = pair.data_options
    cfg.optim = resolve_optim(cfg.optim, pair.spec.optimizer)
    if isinstance(sweep.get("routes"), list):
        sweep["routes"] = tuple(sweep["routes"])
    try:
        return CalibrationConfig.model_validate({"setting": cfg, **sweep}, strict=True)
    except ValidationError as exc:
        raise ConfigError(describe(exc, "calibrate")) from None
