"""The typed run config shared by `nfab train` and `nfab calibrate`.

One pydantic model per section; unknown keys and wrongly typed values are errors
(validated strictly from YAML / JSON / overrides by `nfab.validation.validate`).
Sections `model` and `data` take a `name` plus the builder's own options, which the
registries check against the builder's signature.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from nfab.errors import ConfigError, NfabError
from nfab.profile.routes import RouteSpec, parse_route
from nfab.validation import StrictModel

OptimizerName = Literal["auto", "sgd", "adamw"]
ScheduleName = Literal["cosine", "constant"]
ParallelName = Literal["ddp", "fsdp"]
PrecisionName = Literal["fp32", "bf16", "fp16"]


class _OpenSection(StrictModel):
    """A section whose keys beyond its own fields are builder options (collected into `options`)."""

    options: dict[str, Any] = Field(default_factory=dict)
    """Builder options, validated against the builder's signature when it is built."""

    @model_validator(mode="before")
    @classmethod
    def _collect_options(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        own = set(cls.model_fields)
        options = data.get("options") or {}
        if not isinstance(options, dict):
            return data
        options = {**options, **{k: v for k, v in data.items() if k not in own}}
        return {**{k: v for k, v in data.items() if k in own}, "options": options}


class ModelConfig(_OpenSection):
    """Which model to build; every key but `name` is a builder option (`width`, `size`, ...)."""

    name: str = "gpt"
    """Registry name (`resnet18`, `vit`, `gpt`) or `module.path:factory`."""


class DataConfig(_OpenSection):
    """Which data set to train and evaluate on, and the batch sizes."""

    name: str = "stdlib-text"
    """Registry name (`digits`, `stdlib-text`, ...), a file `KIND:PATH` (`tokens:`, `npz:`, `npy:`, `parquet:`,
    `text:`, `cifar10:`), or the user's `module.path:factory` (called with `split="train"` / `"val"`)."""
    eval: str | None = None
    """The held-out data, named as `name` is (None: `name`'s own held-out split)."""
    collate: str | None = None
    """`module.path:fn` that collates a list of samples into a batch (None: torch's `default_collate`)."""
    batch_size: int = Field(16, ge=1)
    """Samples per rank per micro-batch (global batch = batch_size * world_size * accum_steps)."""
    eval_batch_size: int = Field(64, ge=1)
    """Samples per rank per evaluation batch."""
    eval_batches: int | None = Field(None, ge=1)
    """At most this many evaluation batches per rank (None: the whole held-out split)."""


class OptimConfig(StrictModel):
    """Optimizer; `auto` picks the model's declared family (SGD momentum for CNNs, AdamW for Transformers)."""

    name: OptimizerName = "auto"
    """`auto`, `sgd` or `adamw`."""
    lr: float | None = Field(None, gt=0)
    """Peak learning rate (None: 0.05 for SGD, 3e-3 for AdamW)."""
    momentum: float = Field(0.9, ge=0)
    """SGD momentum."""
    weight_decay: float | None = Field(None, ge=0)
    """Weight decay (None: 5e-4 for SGD, 0.01 for AdamW); never on 1-D tensors (norms, biases) under AdamW."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    grad_clip: float | None = Field(None, gt=0)
    """Clip the global gradient norm to this (after communication); None: no clipping."""

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError(f"betas must be two numbers in [0, 1), got {list(v)}")
        return v


class ScheduleConfig(StrictModel):
    """Learning-rate schedule: linear warm-up, then cosine decay (or constant)."""

    name: ScheduleName = "cosine"
    """`cosine` or `constant` (after warm-up)."""
    warmup_steps: int | None = Field(None, ge=0)
    """Linear warm-up steps (None: 5% of the run)."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Cosine floor as a fraction of the peak lr."""


AUTO = "auto"
"""The profile that calibrates inside the run: `nfab.attach(model, "auto")`, `comm.profile=auto`, an
adapter's `profile="auto"` (here, where importing it costs no torch)."""
IN_RUN_DIR = "calibration"
"""The run dir's folder where `comm.profile=auto` writes the table and the profile it fitted (`nfab report`
reads it with the run)."""
DDP_BUCKET_MB = 25.0
"""DDP's own default bucket cap, for plain FP32 runs."""
NFAB_BUCKET_MB = 4.0
"""Default bucket cap under nfab's hook: a compressed bucket is ~1/32 of its FP32 bytes on
the wire, and smaller buckets let it overlap backward (at 100 Mbit/s, resnet18 width 32:
1.14x of the no-communication floor with 4 MB, 1.39x with 25 MB; `nfab bench step`)."""


class CommConfig(StrictModel):
    """Gradient communication: exactly one of `profile`, `route` or `fp32`."""

    profile: str | None = None
    """Operating profile: a path to profile.json or a shipped profile's name (`resnet18`), or `auto`:
    calibrate inside the run (`attach(model, "auto")`: the run dir's `calibration/` gets the table and
    the profile it fitted)."""
    route: str | dict[str, str] | None = None
    """A route for every region (`sign`, `q8`, ...), `conv:sign,*.bias:fp32`, or a mapping region/glob -> route."""
    fp32: bool = False
    """Plain DDP, no nfab hook at all (the reference)."""
    error_feedback: bool | Literal["auto"] = "auto"
    """Add back what compression dropped on the next step (lossy routes): `auto` (on for SGD,
    off for adaptive optimizers such as AdamW, where it collapsed training), true or false."""
    cost_model: str = "measure"
    """`measure` (a collective benchmark of about a second at start, kept for resumes), `none` (no cost
    gate), a declared link `link:100mbit` / `link:25gbit,20us` (nothing measured), or a JSON path."""
    calibration_window: int | None = Field(None, ge=1)
    """With `profile: auto`: steps per in-run calibration window (None: 2% of the run, at least 4)."""
    bucket_cap_mb: float | None = Field(None, gt=0)
    """DDP bucket size in MB; None: DDP's 25 for `fp32`, `NFAB_BUCKET_MB` under nfab's hook."""
    qsum_scale: Literal["exact", "delayed"] = "exact"
    """Shared q8/q4/q2 scales: `exact` (blocking MAX each step) or `delayed` (recent agreed max |x|)."""
    noise_moment: bool | Literal["auto"] = "auto"
    """Take block-scaled routes' rounding noise out of Adam's second moment before each step
    (runtime/moment.py): `auto` (on under an adaptive optimizer for a static route, or for a
    profile calibrated with it), true or false (`attach(noise_moment=)`)."""
    hierarchy: str | int | None = None
    """Two-level reduction: `auto` (nodes from torchrun's LOCAL_WORLD_SIZE), ranks per node (`8`),
    `NODESxLOCAL` (`64x8`, checked against the world size), or None / `flat`. Lossy routes then
    reduce node-local, run across nodes at W = nodes, and all-gather node-local."""

    @field_validator("hierarchy")
    @classmethod
    def _hierarchy(cls, v: str | int | None) -> str | int | None:
        from nfab.runtime.core.hierarchy import parse

        try:
            parse(v)
        except NfabError as exc:
            raise ValueError(str(exc)) from None
        return v

    @field_validator("cost_model")
    @classmethod
    def _cost_model(cls, v: str) -> str:
        from nfab.wire.cost import is_declared, parse_link

        if is_declared(v):
            try:
                parse_link(v)
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        return v

    @field_validator("route")
    @classmethod
    def _route(cls, v: str | dict[str, str] | None) -> RouteSpec | None:
        if v is None:
            return None
        try:
            return parse_route(v, "comm.route")
        except ConfigError as exc:
            raise ValueError(str(exc).removeprefix("comm.route: ")) from None

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


class LaunchConfig(StrictModel):
    """How torchrun starts the ranks (one node with `nproc` ranks by default)."""

    nproc: int = Field(1, ge=1)
    """Ranks per node."""
    nnodes: int = Field(1, ge=1)
    """Nodes in the job."""
    node_rank: int = Field(0, ge=0)
    """This node's rank (multi-node, static rendezvous)."""
    rdzv_endpoint: str | None = None
    """host:port of node 0's rendezvous (multi-node)."""
    rdzv_backend: str | None = None
    """torchrun rendezvous backend (None: torchrun's default, `static`)."""
    max_restarts: int = Field(0, ge=0)
    """torchrun restarts after a worker failure; each resumes from the last checkpoint."""
    timeout_s: float = Field(300.0, gt=0)
    """Process-group timeout in seconds: a collective whose peer never arrives fails after this."""

    @model_validator(mode="after")
    def _nodes(self) -> LaunchConfig:
        if not self.node_rank < self.nnodes:
            raise ValueError(f"launch.node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("a multi-node run needs --rdzv-endpoint HOST:PORT")
        return self

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes


class TrainConfig(StrictModel):
    """One training run (and, for `nfab calibrate`, the setting a sweep trains under)."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    comm: CommConfig = Field(default_factory=CommConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    parallel: ParallelName = "ddp"
    """The data-parallel wrapper: `ddp` (replicated model, gradient all-reduce) or `fsdp` (PyTorch's
    FSDP2: `fully_shard` per Transformer block, then the root; gradient reduce-scatter). A profile
    or route applies unchanged: it names regions and bits, not the wrapper."""
    loss: str | None = None
    """The loss a step minimises, `module.path:fn` with `fn(model, batch) -> scalar tensor` (None: the loss
    the model's output carries, else cross-entropy: `nfab.loss`)."""
    steps: int = Field(100, ge=1)
    """Optimizer steps."""
    accum_steps: int = Field(1, ge=1)
    """Micro-batches per optimizer step (all but the last under `ddp.no_sync()`)."""
    precision: PrecisionName = "fp32"
    """The forward's and loss's autocast dtype (`torch.autocast`): `bf16`, or `fp16` with a
    `torch.amp.GradScaler` that nfab is told of (`attach(loss_scaler=)`; its state is checkpointed).
    Parameters, gradients and buckets stay fp32. `nfab calibrate` autocasts the same way (without a
    loss scaler)."""
    seed: int = 0
    """Seed for the model init, data order and the hook."""
    eval_every: int = Field(0, ge=0)
    """Evaluate every this many steps (0: only at the end)."""
    checkpoint_every: int = Field(0, ge=0)
    """Checkpoint every this many steps (0: only at the end)."""
    metrics_every: int = Field(10, ge=0)
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

    @model_validator(mode="after")
    def _flags(self) -> TrainConfig:
        if self.resume and self.overwrite:
            raise ValueError("give at most one of --resume and --overwrite")
        if self.parallel == "fsdp":
            from nfab.runtime.frontends import fsdp2

            fsdp2.require("parallel fsdp")
            from nfab.profile.schema import Profile
            from nfab.runtime.frontends import fsdp_layout

            # what the FSDP2 front end refuses, refused here: before the ranks start and the run dir is made
            if self.comm.bucket_cap_mb is not None:
                raise ValueError("comm.bucket_cap_mb sizes DDP's buckets: FSDP2 reduce-scatters per module "
                                 "(fully_shard unit), so drop it or train with parallel=ddp")
            route = self.comm.route
            fsdp_layout.check_options(Profile.static(route if route is not None else "fp32"),
                                      explicit=route is not None, error_feedback=self.comm.error_feedback,
                                      hierarchy=self.comm.hierarchy, qsum_scale=self.comm.qsum_scale)
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)
