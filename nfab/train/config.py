"""Typed training config: YAML file + dotted `key=value` overrides -> `TrainConfig`.

Sections `model` and `data` take a `name` plus the builder's own options (checked
against the builder's signature by the registries, so an unknown option is an error
there); every other section is a fixed dataclass and an unknown key is a `ConfigError`.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from nfab.errors import ConfigError
from nfab.overrides import parse_value

OPTIMIZERS = ("auto", "sgd", "adamw")
SCHEDULES = ("cosine", "constant")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Which model to build; every key but `name` is a builder option (`width`, `size`, ...)."""

    name: str = "gpt"
    """Registry name (`resnet18`, `vit`, `gpt`) or `module.path:factory`."""
    options: dict[str, Any] = field(default_factory=dict)
    """Builder options, validated against the builder's signature."""


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Which data set to train and evaluate on, and the batch sizes."""

    name: str = "stdlib-text"
    """Registry name (`digits`, `stdlib-text`, ...) or `cifar10:PATH` / `text:PATH`."""
    batch_size: int = 16
    """Samples per rank per micro-batch (global batch = batch_size * world_size * accum_steps)."""
    eval_batch_size: int = 64
    """Samples per rank per evaluation batch."""
    eval_batches: int | None = None
    """At most this many evaluation batches per rank (None: the whole held-out split)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Builder options (`block_size`, `max_bytes`, ...)."""

    def __post_init__(self) -> None:
        _positive("data.batch_size", self.batch_size)
        _positive("data.eval_batch_size", self.eval_batch_size)
        if self.eval_batches is not None:
            _positive("data.eval_batches", self.eval_batches)


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """Optimizer; `auto` picks the model family's default (SGD momentum for CNNs, AdamW for Transformers)."""

    name: str = "auto"
    """`auto`, `sgd` or `adamw`."""
    lr: float | None = None
    """Peak learning rate (None: 0.05 for SGD, 3e-3 for AdamW)."""
    momentum: float = 0.9
    """SGD momentum."""
    weight_decay: float | None = None
    """Weight decay (None: 5e-4 for SGD, 0.01 for AdamW)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    grad_clip: float | None = None
    """Clip the global gradient norm to this (after communication); None: no clipping."""

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ConfigError(f"optim.name must be one of {OPTIMIZERS}, got {self.name!r}")
        if self.lr is not None and self.lr <= 0:
            raise ConfigError(f"optim.lr must be > 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {self.betas}")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ConfigError(f"optim.grad_clip must be > 0, got {self.grad_clip}")


@dataclass(kw_only=True, slots=True)
class ScheduleConfig:
    """Learning-rate schedule: linear warm-up, then cosine decay (or constant)."""

    name: str = "cosine"
    """`cosine` or `constant` (after warm-up)."""
    warmup_steps: int | None = None
    """Linear warm-up steps (None: 5% of the run)."""
    min_lr_ratio: float = 0.1
    """Cosine floor as a fraction of the peak lr."""

    def __post_init__(self) -> None:
        if self.name not in SCHEDULES:
            raise ConfigError(f"schedule.name must be one of {SCHEDULES}, got {self.name!r}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ConfigError(f"schedule.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"schedule.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


DDP_BUCKET_MB = 25.0
"""DDP's own default bucket cap, for plain FP32 runs."""
NFAB_BUCKET_MB = 4.0
"""Default bucket cap under nfab's hook: a compressed bucket is ~1/32 of its FP32 bytes on
the wire, and smaller buckets let it overlap backward (at 100 Mbit/s, resnet18 width 32:
1.14x of the no-communication floor with 4 MB, 1.39x with 25 MB; `nfab bench step`)."""


@dataclass(kw_only=True, slots=True)
class CommConfig:
    """Gradient communication: exactly one of `profile`, `route` or `fp32`."""

    profile: str | None = None
    """Path to an operating profile (profile.json)."""
    route: str | dict[str, str] | None = None
    """A route for every region (`sign`, `q8`, `fp32`, ...) or a dict region/glob -> route."""
    fp32: bool = False
    """Plain DDP, no nfab hook at all (the reference)."""
    error_feedback: bool = True
    """Add back what compression dropped on the next step (lossy routes)."""
    cost_model: str = "measure"
    """`measure` (a short collective benchmark at start, kept for resumes), `none`, or a JSON path."""
    bucket_cap_mb: float | None = None
    """DDP bucket size in MB; None: DDP's 25 for `fp32`, `NFAB_BUCKET_MB` under nfab's hook."""
    qsum_scale: str = "exact"
    """Shared q8/q4/q2 scales: `exact` (blocking MAX each step) or `delayed` (recent agreed max |x|)."""

    def __post_init__(self) -> None:
        if self.qsum_scale not in ("delayed", "exact"):
            raise ConfigError(f"comm.qsum_scale must be delayed or exact, got {self.qsum_scale!r}")
        if isinstance(self.route, str) and not self.route:
            raise ConfigError("comm.route must not be empty")
        if self.bucket_cap_mb is not None and self.bucket_cap_mb <= 0:
            raise ConfigError(f"comm.bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")

    @property
    def bucket_mb(self) -> float:
        """The DDP bucket cap this run uses (see `bucket_cap_mb`)."""
        if self.bucket_cap_mb is not None:
            return self.bucket_cap_mb
        return DDP_BUCKET_MB if self.fp32 else NFAB_BUCKET_MB

    def check_choice(self) -> None:
        given = [k for k, v in (("profile", self.profile), ("route", self.route), ("fp32", self.fp32 or None))
                 if v is not None]
        if len(given) != 1:
            raise ConfigError("give exactly one of --profile, --route or --fp32 "
                              f"(comm.profile / comm.route / comm.fp32); got {given or 'none'}")


@dataclass(kw_only=True, slots=True)
class LaunchConfig:
    """How torchrun starts the ranks (one node with `nproc` ranks by default)."""

    nproc: int = 1
    """Ranks per node."""
    nnodes: int = 1
    """Nodes in the job."""
    node_rank: int = 0
    """This node's rank (multi-node, static rendezvous)."""
    rdzv_endpoint: str | None = None
    """host:port of node 0's rendezvous (multi-node)."""
    rdzv_backend: str | None = None
    """torchrun rendezvous backend (None: torchrun's default, `static`)."""
    max_restarts: int = 0
    """torchrun restarts after a worker failure; each resumes from the last checkpoint."""
    timeout_s: float = 300.0
    """Process-group timeout in seconds: a collective whose peer never arrives fails after this."""

    def __post_init__(self) -> None:
        _positive("launch.nproc", self.nproc)
        _positive("launch.nnodes", self.nnodes)
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"launch.node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.max_restarts < 0:
            raise ConfigError(f"launch.max_restarts must be >= 0, got {self.max_restarts}")
        if not self.timeout_s > 0:
            raise ConfigError(f"launch.timeout_s must be > 0, got {self.timeout_s}")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ConfigError("a multi-node run needs --rdzv-endpoint HOST:PORT")

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """One training run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    steps: int = 100
    """Optimizer steps."""
    accum_steps: int = 1
    """Micro-batches per optimizer step (all but the last under `ddp.no_sync()`)."""
    seed: int = 0
    """Seed for the model init, data order and the hook."""
    eval_every: int = 0
    """Evaluate every this many steps (0: only at the end)."""
    checkpoint_every: int = 0
    """Checkpoint every this many steps (0: only at the end)."""
    metrics_every: int = 10
    """Rewrite metrics.parquet every this many steps (and at every checkpoint and the end)."""
    run_dir: str | None = None
    """Where artifacts go (None: runs/<model>-<route or profile>-<timestamp>)."""
    resume: bool = False
    """Continue from the latest checkpoint in `run_dir`."""
    overwrite: bool = False
    """Replace whatever `run_dir` holds."""
    quiet: bool = False
    """No progress bar."""
    command: str = ""
    """The command line that started the run (recorded in summary.json)."""

    def __post_init__(self) -> None:
        _positive("steps", self.steps)
        _positive("accum_steps", self.accum_steps)
        for key in ("eval_every", "checkpoint_every", "metrics_every"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key} must be >= 0, got {getattr(self, key)}")
        if self.resume and self.overwrite:
            raise ConfigError("give at most one of --resume and --overwrite")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _positive(key: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{key} must be >= 1, got {value}")


_OPEN_SECTIONS = {"model": ModelConfig, "data": DataConfig}


def _check_type(where: str, value: Any, hint: Any) -> Any:
    """Check `value` against a simple type hint (int admitted for float); return it."""
    if hint is Any:
        return value
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            try:
                return _check_type(where, value, arg)
            except ConfigError:
                continue
        raise ConfigError(f"{where} must be {_hint_name(hint)}, got {value!r}")
    if hint is type(None):
        if value is None:
            return None
    elif origin in (list, dict):
        if isinstance(value, origin):
            return value
    elif hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(hint, type) and isinstance(value, hint):
        return value
    raise ConfigError(f"{where} must be {_hint_name(hint)}, got {value!r}")


def _hint_name(hint: Any) -> str:
    return str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")


def _build(cls: type, data: Any, where: str) -> Any:
    """Build dataclass `cls` from a mapping, refusing unknown keys and wrong types."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    data = dict(data)
    if cls in _OPEN_SECTIONS.values():
        options = dict(data.pop("options", None) or {})
        options.update({k: data.pop(k) for k in list(data) if k not in names})
        kwargs["options"] = options
    for key, value in data.items():
        dotted = f"{where}.{key}" if where else key
        if key not in names:
            raise ConfigError(f"unknown config key {dotted!r} (keys: {', '.join(sorted(names))})")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _build(hint, value, dotted)
        else:
            kwargs[key] = _check_type(dotted, value, hint)
    return cls(**kwargs)


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (["a", "b"], value parsed as YAML: numbers, bools, null, lists)."""
    key, sep, raw = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} must look like key=value (dotted keys for sections)")
    return key.split("."), parse_value(raw)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each dotted `key=value` in a nested mapping (a copy)."""
    out = json.loads(json.dumps(data))
    for item in overrides:
        keys, value = parse_override(item)
        node = out
        for k in keys[:-1]:
            nxt = node.setdefault(k, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: {k!r} is not a section")
            node = nxt
        node[keys[-1]] = value
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file into a mapping (one-line errors)."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config {p}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config {p} is not valid YAML{where}: {getattr(exc, 'problem', exc)}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config {p} must hold a mapping, got {type(data).__name__}")
    return data


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    """Validate a nested mapping into a `TrainConfig`."""
    return _build(TrainConfig, data, "")


def load_config(path: str | Path | None, overrides: list[str] | None = None,
                base: dict[str, Any] | None = None) -> TrainConfig:
    """A config file (or `base` mapping, or defaults) plus `key=value` overrides."""
    data = dict(base or {})
    if path is not None:
        data = read_yaml(path)
    return config_from_dict(apply_overrides(data, list(overrides or [])))
