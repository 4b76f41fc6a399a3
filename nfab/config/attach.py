"""`nfab.attach`'s options as one typed record: every option, its default and its meaning.

    nfab.attach(ddp, route="bq2", optimizer=opt)                          # keywords ...
    nfab.attach(ddp, config=AttachConfig(route="bq2", optimizer=opt))     # ... or the record: the same call

Keywords are validated into an `AttachConfig` (over `config=` where both are given), so a mistake
is one `NfabError` line at the call. The integrations carry one `AttachConfig` from the user to
`attach`, and fill in what the framework knows (run length, optimizer, loss scaler) only where the
user set nothing (`AttachConfig.unless_set`).

The optimizer and the loss scaler are live objects of the user's loop, not values: they are checked
for the methods nfab calls, and the record holding them is frozen but not meant to be written to a file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import ConfigDict, ValidationError, field_validator, model_validator

from nfab.errors import ConfigError, NfabError
from nfab.profile.routes import RouteSpec, parse_route
from nfab.runtime.control.optim import torch_optimizer
from nfab.runtime.core.hierarchy import Hierarchy, parse
from nfab.runtime.core.scales import QSUM_SCALES
from nfab.validation import FrozenModel, describe
from nfab.wire.cost import CostModel, is_declared, parse_link

_SCALER_METHODS = ("is_enabled", "get_scale")
"""What `nfab.runtime.control.optim.loss_scale_of` calls on a loss scaler."""


class AttachConfig(FrozenModel):
    """Every option of `nfab.attach` but the model and the profile (docs/api.md#options)."""

    model_config = ConfigDict(strict=True, arbitrary_types_allowed=True)

    route: RouteSpec | None = None
    """A static route instead of a profile: one route for every region (`"sign"`), `"conv:sign,*.bias:fp32"`,
    or a dict from region class / parameter-name glob to route; unnamed regions stay fp32. Honoured as
    asked except where reducer capacity makes it impossible (a profile's routes pass the cost gate).
    Kept parsed (`nfab.profile.routes.parse_route`)."""
    optimizer: torch.optim.Optimizer | None = None
    """The optimizer that steps the model (a framework's wrapper is unwrapped to the torch one it holds).
    nfab reads whether it is adaptive (`error_feedback`, `noise_moment`) and, for the health monitor
    and the block routes, each coordinate's second moment: probes measure fidelity, and block routes
    round, where the optimizer acts."""
    error_feedback: bool | Literal["auto"] = "auto"
    """"auto": on only for a known non-adaptive optimizer (SGD), off for adaptive ones and without an
    optimizer (error feedback under Adam-style optimizers collapsed training in nfab's measurements).
    True forces it on (a warning under an adaptive optimizer), False off. A profile phase can still turn
    it off. Refused as True on FSDP2 (it would keep a full-size gradient per rank)."""
    total_steps: int | None = None
    """Hook steps the run will take. Needed by a profile whose phases start at fractions of the run;
    widens a profile's health thresholds for a run longer than its calibration; budgets the early probes."""
    cost_model: str | Path | CostModel | None = "measure"
    """"measure" (a collective measurement of about a second, agreed by all ranks), a declared link
    "link:100mbit" / "link:25gbit,20us" (nothing measured), a path to a JSON from `nfab bench wire --cost`,
    a `CostModel`, or None (no cost gate; sign picks by bytes). A route compresses where it is modelled
    at least 15% cheaper than FP32 (`nfab.wire.cost.gate`); a measurement no real link could give keeps
    FP32 everywhere, with one warning."""
    seed: int = 0
    """Seeds nfab's own generators (stochastic rounding, drawn per seed, rank, step and parameter); never
    the user's streams."""
    head_modules: tuple[str, ...] | None = None
    """Module-name prefixes that form region `head`; None: the shallowest module named `head`, `lm_head`,
    `classifier` or `fc` outside a numbered stack."""
    model_signature: str | None = None
    """The model signature a profile is checked against; None: computed from the wrapped module."""
    sibling: bool = False
    """Attach a profile calibrated on a sibling model (the same region classes, other sizes: a small
    model calibrated for a big one): its region routes carry over, and attach logs which parameters
    differ instead of refusing the other layout. A profile routing a region class the model lacks is
    still refused. False (the default): the signature check."""
    qsum_scale: Literal["exact", "delayed"] = "exact"
    """How q8/q4/q2 slices summed on the wire agree their shared scale: "exact" (a blocking MAX all-reduce
    in the hook, what calibrate replays) or "delayed" (the max of the slice's agreed max |x| over its last
    16 qsum steps, carried by the control word: never blocks, but elements above it saturate for a step).
    Refused as "delayed" on FSDP2."""
    coalesce: bool = True
    """Send a bucket with a signgather group as ONE all-gather (control word and every group's payload)
    where that is modelled cheaper than a collective per group (always at W=2); False keeps one per group."""
    hierarchy: Hierarchy | str | int | None = None
    """Reduce lossy routes in two levels (node-local reduce-scatter, the route across nodes, node-local
    all-gather): "auto" (nodes from torchrun's LOCAL_WORLD_SIZE), ranks per node (8), "NODESxLOCAL"
    ("64x8", checked against the world size), a `Hierarchy`; None / "flat": the flat path. Consecutive
    global ranks share a node (`nfab.runtime.core.hierarchy`). Refused on FSDP2."""
    noise_moment: bool | Literal["auto"] = "auto"
    """Take the block routes' rounding noise out of the optimizer's second moment before each step
    (`nfab.runtime.control.moment`): under Adam the noise inflates v and acts like a lower learning rate.
    "auto": on under an adaptive, unsharded optimizer for a static route and for a profile calibrated
    with it (`Profile.noise_moment`); True forces it (needs `optimizer`), False off."""
    calibration_out: Path | None = None
    """With `profile="auto"`: the folder rank 0 writes the in-run calibration's `calibration.parquet` and
    `profile.json` to, rewritten at each window's end (a later run attaches that profile; `nfab report`
    reads the table). None: nothing written."""
    calibration_window: int | None = None
    """With `profile="auto"`: steps per calibration window; None: 2% of `total_steps`, at least 4 (8
    without `total_steps`). Windows open at the start and at each third of the run."""
    loss_scaler: Any = None
    """The `torch.amp.GradScaler` (or `ShardedGradScaler`) the loop scales its loss with, if any: the
    hook's gradients are then S times the optimizer's, and nfab rounds and corrects in unscaled units
    (the scale read on the device, no host sync). A non-finite step's buckets are NaN, as plain DDP's."""

    def __init__(self, **options: Any) -> None:
        try:
            super().__init__(**options)
        except ValidationError as exc:
            raise ConfigError(_line(exc)) from None

    @classmethod
    def of(cls, config: AttachConfig | None = None, **options: Any) -> AttachConfig:
        """`config` (default: every default) with `options` set over it, validated."""
        if config is not None and not isinstance(config, AttachConfig):
            raise NfabError(f"config must be an nfab AttachConfig, got {type(config).__name__}")
        given = {k: getattr(config, k) for k in config.model_fields_set} if config is not None else {}
        return cls(**{**given, **options}) if options or config is None else config

    def unless_set(self, **defaults: Any) -> AttachConfig:
        """This config with `defaults` for the options it does not set: what a framework knows (its run
        length, optimizer, loss scaler) never overrides what the user passed, None included."""
        return AttachConfig.of(self, **{k: v for k, v in defaults.items() if k not in self.model_fields_set})

    @field_validator("route", mode="before")
    @classmethod
    def _route(cls, v: Any) -> Any:
        try:
            return None if v is None else parse_route(v)
        except NfabError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("optimizer", mode="before")
    @classmethod
    def _optimizer(cls, v: Any) -> Any:
        v = torch_optimizer(v)
        if v is not None and not isinstance(v, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(v).__name__}")
        return v

    @field_validator("error_feedback", "noise_moment", mode="before")
    @classmethod
    def _auto_or_bool(cls, v: Any, info: Any) -> Any:
        if not isinstance(v, bool) and v != "auto":
            raise ValueError(f"{info.field_name} must be 'auto', True or False, got {v!r}")
        return v

    @field_validator("total_steps", "calibration_window", mode="before")
    @classmethod
    def _positive_steps(cls, v: Any, info: Any) -> Any:
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{info.field_name} must be a positive integer, got {v!r}")
        return v

    @field_validator("cost_model", mode="before")
    @classmethod
    def _cost_model(cls, v: Any) -> Any:
        if not (v is None or isinstance(v, str | Path | CostModel)):
            raise ValueError(f"cost_model must be 'measure', 'link:...', a JSON path, a CostModel or None, got "
                             f"{type(v).__name__}")
        if is_declared(v):
            try:
                parse_link(str(v))  # a malformed declaration is refused before any collective
            except NfabError as exc:
                raise ValueError(str(exc)) from None
        return v

    @field_validator("seed", mode="before")
    @classmethod
    def _seed(cls, v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"seed must be an int, got {v!r}")
        return v

    @field_validator("head_modules", mode="before")
    @classmethod
    def _head_modules(cls, v: Any) -> Any:
        if v is None:
            return v
        if isinstance(v, str) or not isinstance(v, tuple | list) or not all(isinstance(h, str) for h in v):
            raise ValueError(f"head_modules must be a tuple of module names, got {v!r}")
        return tuple(v)

    @field_validator("qsum_scale", mode="before")
    @classmethod
    def _qsum_scale(cls, v: Any) -> Any:
        if v not in QSUM_SCALES:
            raise ValueError(f"qsum_scale must be one of {', '.join(QSUM_SCALES)}, got {v!r}")
        return v

    @field_validator("hierarchy", mode="before")
    @classmethod
    def _hierarchy(cls, v: Any) -> Any:
        try:
            parse(v)  # a malformed spec is refused before any collective
        except NfabError as exc:
            raise ValueError(str(exc)) from None
        return v

    @field_validator("calibration_out", mode="before")
    @classmethod
    def _calibration_out(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, str | Path):
            raise ValueError(f"calibration_out must be a folder path, got {type(v).__name__}")
        return None if v is None else Path(v)

    @field_validator("loss_scaler", mode="before")
    @classmethod
    def _loss_scaler(cls, v: Any) -> Any:
        if v is not None and not all(callable(getattr(v, m, None)) for m in _SCALER_METHODS):
            raise ValueError(f"loss_scaler must be a torch.amp.GradScaler, got {type(v).__name__}")
        return v

    @model_validator(mode="after")
    def _moment_needs_optimizer(self) -> AttachConfig:
        if self.noise_moment is True and self.optimizer is None:
            raise ValueError("noise_moment=True needs optimizer= (it corrects that optimizer's second moment)")
        return self


def _line(exc: ValidationError) -> str:
    """One line for what `AttachConfig` refused: a validator's own sentence, an unknown option, else pydantic's."""
    first = exc.errors(include_url=False)[0]
    if first["type"] == "value_error":
        return str(first["msg"]).removeprefix("Value error, ")
    if first["type"] == "unexpected_keyword_argument" or first["type"] == "extra_forbidden":
        return (f"nfab.attach has no option {first['loc'][0]!r} (options: {', '.join(AttachConfig.model_fields)})")
    return describe(exc, cls=AttachConfig)
