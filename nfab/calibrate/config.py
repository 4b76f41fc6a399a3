"""`CalibrationConfig`: what one calibration sweep measures, with per-model defaults.

The defaults pair each registered model with the data set, options and optimizer its
shipped training config uses, so a profile fitted here carries the same model
signature as the run that loads it. `key=value` overrides are converted once, here,
at the boundary: `model.KEY` and `data.KEY` go to the builders, plain keys set a field
of this config (or, when no field has that name, a model or data option).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from nfab.errors import ConfigError
from nfab.models.options import accepted_options
from nfab.models.registry import MODELS
from nfab.overrides import parse_kv
from nfab.wire.codecs import ROUTES

DEFAULT_ROUTES: tuple[str, ...] = ("fp32", "bf16", "q8", "q4", "q2", "sign")
"""Routes a sweep measures unless told otherwise (fp16 is bf16's twin on the wire)."""

QUICK_TRIAL_ROUTES: tuple[str, ...] = ("sign", "q8")
"""Routes `--quick` trials: the cheapest lossy route and the safest cheap one."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerConfig:
    """The optimizer and schedule the sweep trains with (as the training config does)."""

    name: str = "sgd"
    """`sgd` (with momentum) or `adamw`: the family decides how error feedback behaves."""
    lr: float = 0.05
    """Peak learning rate (after the linear warm-up)."""
    momentum: float = 0.9
    """SGD momentum (ignored by AdamW)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas (ignored by SGD)."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) or L2 (SGD) weight decay."""
    warmup_steps: int | None = None
    """Linear warm-up steps (None: 5 % of the steps), then cosine decay to `min_lr_ratio` x lr."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""

    def __post_init__(self) -> None:
        if self.name not in ("sgd", "adamw"):
            raise ConfigError(f"optimizer must be 'sgd' or 'adamw', got {self.name!r}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("optimizer: lr must be > 0 and min_lr_ratio in [0, 1]")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ConfigError(f"optimizer: warmup_steps must be >= 0, got {self.warmup_steps}")
        if len(tuple(self.betas)) != 2:
            raise ConfigError(f"optimizer: betas must be two numbers, got {self.betas!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibrationConfig:
    """One sweep: model, data, W virtual ranks, routes, phases and trial lengths."""

    model: str
    """Registry name or `module.path:factory`."""
    dataset: str
    """Data set registry name (`digits`, `stdlib-text`, ...)."""
    model_options: dict[str, Any] = field(default_factory=dict)
    """Builder options; they decide the model signature the profile is made for."""
    data_options: dict[str, Any] = field(default_factory=dict)
    """Data set builder options."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    world_size: int = 4
    """Virtual ranks (data shards) whose gradients are replayed."""
    batch_size: int = 32
    """Per-rank batch size (global batch = batch_size x world_size)."""
    routes: tuple[str, ...] = DEFAULT_ROUTES
    """Routes measured (fp32 is always measured: it is the reference)."""
    steps: int = 150
    """Length of the FP32 reference trajectory."""
    phases: int = 4
    """Phase points (checkpoints) at most."""
    trial_steps: int = 20
    """Steps of each short trial from a phase checkpoint."""
    ef_steps: int = 3
    """Consecutive reference steps replayed with carried error-feedback residuals."""
    quick: bool = False
    """Trial only QUICK_TRIAL_ROUTES on the regions that carry the bytes."""
    trial_min_share: float = 0.005
    """Regions holding less than this fraction of the elements get no trials (they pass on
    fidelity alone, which needs a very high cosine)."""
    eval_samples: int = 256
    """Held-out samples in the fixed batch that scores the trials."""
    seed: int = 0
    threads: int = 1
    """torch intra-op threads for the sweep (1: robust on a shared 2-core machine)."""

    def __post_init__(self) -> None:
        unknown = [r for r in self.routes if r not in ROUTES]
        if unknown:
            raise ConfigError(f"unknown route {unknown[0]!r}; routes are {', '.join(ROUTES)}")
        for key in ("world_size", "batch_size", "steps", "phases", "trial_steps", "ef_steps", "eval_samples",
                    "threads"):
            if getattr(self, key) < 1:
                raise ConfigError(f"calibrate: {key} must be >= 1, got {getattr(self, key)}")
        if self.phases > self.steps:
            raise ConfigError(f"calibrate: {self.phases} phases do not fit in {self.steps} steps")

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

_DEFAULTS: dict[str, dict[str, Any]] = {
    # Mirrors configs/resnet18-digits.yaml: resnet18 width 16, small_input, 10 classes, digits 8x8, SGD.
    "resnet18": dict(
        dataset="digits",
        model_options={"width": 16, "small_input": True, "num_classes": 10, "in_channels": 1},
        data_options={},
        optimizer=OptimizerConfig(name="sgd", lr=0.05, momentum=0.9, weight_decay=5e-4, warmup_steps=10,
                                  min_lr_ratio=0.0),
        batch_size=32, steps=150,
    ),
    # Mirrors configs/vit-digits.yaml: ViT nano on 8x8 digits, 2x2 patches (16 tokens + class token).
    "vit": dict(
        dataset="digits",
        model_options={"size": "nano", "image_size": 8, "patch_size": 2, "num_classes": 10, "in_channels": 1},
        data_options={},
        optimizer=OptimizerConfig(name="adamw", lr=2e-3, weight_decay=0.05, warmup_steps=15, min_lr_ratio=0.1),
        batch_size=32, steps=200,
    ),
    # Mirrors configs/gpt-nano-stdlib.yaml: 2-layer GPT (d=128) on byte-level stdlib text, AdamW 3e-3.
    "gpt": dict(
        dataset="stdlib-text",
        model_options={"size": "nano"},
        data_options={"block_size": 64, "max_bytes": 2_000_000},
        optimizer=OptimizerConfig(name="adamw", lr=3e-3, weight_decay=0.01, warmup_steps=10, min_lr_ratio=0.1),
        batch_size=16, steps=300, eval_samples=64,
    ),
}


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`["a=1", "model.width=8"]` -> {"a": 1, "model.width": 8}; malformed items are errors."""
    return parse_kv(items)


_FIELDS = {f.name for f in dataclasses.fields(CalibrationConfig)} - {"model", "model_options", "data_options",
                                                                     "optimizer", "dataset", "routes"}
_OPT_FIELDS = {f.name for f in dataclasses.fields(OptimizerConfig)}


def make_config(model: str, *, dataset: str | None = None, overrides: dict[str, Any] | None = None,
                **fields_: Any) -> CalibrationConfig:
    """The model's defaults, then explicit fields (CLI flags), then `key=value` overrides.

    A plain key is a config field, an optimizer field (`lr`, `momentum`, ...), else a model
    and/or data option (`image_size` goes to both builders when both take it).
    """
    if model not in MODELS and ":" not in model:
        raise ConfigError(f"unknown model {model!r}; choose one of {sorted(MODELS)} or give module.path:factory")
    base = dict(_DEFAULTS.get(model, {"dataset": None}))
    if dataset is not None and dataset != base.get("dataset"):
        base["data_options"] = {}
        base["dataset"] = dataset
    if base.get("dataset") is None:
        raise ConfigError(f"no default data set for model {model!r}: pass --dataset")
    base = {**base, **{k: v for k, v in fields_.items() if v is not None}}
    model_opts = dict(base.pop("model_options", {}))
    data_opts = dict(base.pop("data_options", {}))
    optim = dataclasses.asdict(base.pop("optimizer", OptimizerConfig()))
    model_keys = accepted_options(MODELS[model]) if model in MODELS else None
    for key, value in (overrides or {}).items():
        prefix, _, name = key.partition(".")
        if name and prefix == "model":
            model_opts[name] = value
        elif name and prefix == "data":
            data_opts[name] = value
        elif name and prefix in ("optim", "optimizer"):
            optim[name] = value
        elif key in _FIELDS:
            base[key] = value
        elif key in _OPT_FIELDS:
            optim[key] = value
        else:
            to_model = model_keys is None or key in model_keys
            to_data = key in _data_keys(base["dataset"])
            if not (to_model or to_data):
                raise ConfigError(f"unknown option {key!r}: not a calibrate, optimizer, model or data option")
            if to_model and (model_keys is not None or not to_data):
                model_opts[key] = value
            if to_data:
                data_opts[key] = value
    if base.get("quick"):
        explicit = {k for k, v in fields_.items() if v is not None} | set(overrides or {})
        base.update({k: v for k, v in QUICK.items() if k not in explicit})
    try:
        return CalibrationConfig(model=model, model_options=model_opts, data_options=data_opts,
                                 optimizer=OptimizerConfig(**optim), **base)
    except TypeError as exc:
        raise ConfigError(f"calibrate: {exc}") from exc


def _data_keys(dataset: str) -> tuple[str, ...]:
    from nfab.data.registry import DATASETS, PATH_DATASETS

    kind, sep, _ = dataset.partition(":")
    builder = (PATH_DATASETS if sep else DATASETS).get(kind)
    keys = accepted_options(builder) if builder is not None else ()
    return tuple(k for k in (keys or ()) if k not in ("split", "seed", "path"))
