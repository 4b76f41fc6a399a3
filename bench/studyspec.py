"""What the study runs: its variants, settings and targets, and the row one run gives.

Pure data, shared by the study in a repository checkout: the harness that trains (`bench.userloop`),
the command that runs it (`python -m bench.study`) and the renderer (`bench.studydocs`). Nothing in
`nfab/` imports it.

Settings: `resnet18` on digits (SGD), `gpt` nano on stdlib text (AdamW), and the held-out user
models nfab was not tuned on (`bench.heldout.*`): `heldout` (a GPT with `nn.MultiheadAttention`,
AdamW lr 3e-3, wd 0.1, batch 16, constant LR: the known case where static sign with error
feedback fails), `heldout2` (`nn.TransformerEncoder`), `heldout3` (RMSNorm, SwiGLU, plain Adam),
and the first one at W=8 and over 600 steps.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

SCHEMA = "nfab.bench.study"
VERSION = 2
VARIANTS: tuple[str, ...] = ("fp32", "bf16", "fp16", "powersgd-r2", "powersgd-r8", "sign", "sign-ef", "bq3", "bl6",
                             "bl5", "bq2", "bq2-nm", "bl5-nm", "profile", "profile-nm")
NOISE_MOMENT = "-nm"
"""Variant suffix: the same attach with `noise_moment=True` (the runtime's noise-corrected moment)."""
ROUTE_VARIANT = "route:"
"""Variant prefix for any static route outside the named set (`route:2d=bq3`, `route:sign`): the
harness's own command line uses it; `route-ef:` forces error feedback on."""
ROUTE_EF_VARIANT = "route-ef:"
PARALLEL = ("ddp", "fsdp")
FSDP_VARIANTS = ("fp32", "profile", "profile-nm", "bq3", "bl6", "bl5", "bq2", "bq2-nm", "bl5-nm", "sign")
"""Variants a `fsdp` setting runs (`route:SPEC` too): FSDP2 takes no DDP comm hook (fp16, PowerSGD)
and nfab refuses error feedback on it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Setting:
    """One study setting: model, data, optimizer, steps and world size, and the profile nfab brings."""

    name: str
    model: str
    dataset: str
    metric: str
    """`loss` (final held-out loss, lower is better) or `accuracy` (higher is better)."""
    profile: str | None
    """The calibrated profile the `profile` variant attaches (relative to the repository root)."""
    model_options: dict[str, Any] = field(default_factory=dict)
    routes_only: bool = False
    """Apply only the profile's routes, not its model check (tests shrink the model, so its
    parameter layout differs from the calibrated one by design; a real setting never does)."""
    data_options: dict[str, Any] = field(default_factory=dict)
    optimizer: str = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.0
    momentum: float = 0.9
    betas: tuple[float, float] = (0.9, 0.95)
    batch_size: int = 16
    """Per rank."""
    steps: int = 300
    world_size: int = 4
    eval_samples: int = 1024
    """Held-out samples evaluated at the end (the first ones of the test split, every rank a shard)."""
    classes: int = 0
    """A classifier's class count (0: not a classifier): its loss verdict allows at least what one of the
    `eval_samples` predictions moves the loss, ln(classes) / eval_samples nats (`studyverdict.loss_tolerance`)."""
    accum_steps: int = 1
    """Micro-batches per optimizer step; all but the last run under `ddp.no_sync()` (one all-reduce a step)."""
    grad_clip: float | None = None
    """`clip_grad_norm_` to this before `opt.step()` (None: no clipping)."""
    warmup_steps: int = 0
    """Linear warm-up steps, then `schedule`."""
    schedule: str = "constant"
    """After the warm-up: `constant`, or `cosine` down to `min_lr_ratio` x lr at the last step."""
    min_lr_ratio: float = 0.1
    decay_matrices_only: bool = False
    """Weight decay on tensors of 2 and more dimensions only (norms, biases and tokens get none)."""
    parallel: str = "ddp"
    """`ddp` (DistributedDataParallel) or `fsdp` (FSDP2: `fully_shard` on every block of the model's
    `nn.ModuleList`s, then on the root; accumulation with `set_requires_gradient_sync`)."""
    note: str = ""

    def __post_init__(self) -> None:
        if self.metric not in ("loss", "accuracy"):
            raise ValueError(f"metric must be 'loss' or 'accuracy', got {self.metric!r}")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {self.optimizer!r}")
        if min(self.steps, self.world_size, self.batch_size, self.eval_samples, self.accum_steps) < 1:
            raise ValueError("steps, world_size, batch_size, eval_samples and accum_steps must be >= 1")
        if self.parallel not in PARALLEL:
            raise ValueError(f"parallel must be one of {', '.join(PARALLEL)}, got {self.parallel!r}")
        if self.schedule not in ("constant", "cosine"):
            raise ValueError(f"schedule must be 'constant' or 'cosine', got {self.schedule!r}")

    def lr_at(self, step: int) -> float:
        """The learning rate of `step`: linear warm-up, then constant or cosine (nanoGPT's get_lr)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return self.lr
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.steps - 1 - self.warmup_steps))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass(slots=True)
class RunResult:
    """One (setting, variant) run, as rank 0 saw it."""

    setting: str
    variant: str
    ok: bool
    seed: int = 0
    """Model init, data order and rounding noise; the same for every variant of one seed."""
    steps: int = 0
    world_size: int = 0
    eval_loss: float | None = None
    eval_accuracy: float | None = None
    wire_mb: float | None = None
    """MB each rank sent over the run (10^6 bytes)."""
    fp32_mb: float | None = None
    """MB plain FP32 DDP sends for the same gradients."""
    ratio: float | None = None
    """fp32_mb / wire_mb."""
    fallback_steps: int | None = None
    """nfab variants: steps with a safety fallback (health, capacity, non-finite)."""
    probe_mb: float | None = None
    """nfab variants: of `wire_mb`, the fidelity probes' FP32 samples (shadow windows' apart)."""
    shadow_mb: float | None = None
    """nfab variants: of `wire_mb`, the FP32 samples of the alarms' shadow windows."""
    alarms: int | None = None
    """nfab variants: loss-spike / grad-norm-jump alarms (each opened an FP32 shadow window)."""
    false_alarms: int | None = None
    """nfab variants: alarms whose shadow found every region faithful (no demotion)."""
    health_events: list[str] = field(default_factory=list)
    """nfab variants: the health monitor's events (first 20)."""
    train_losses: list[float] | None = None
    """`fsdp` settings: rank 0's training loss at each step (the mean of its micro-batches), to check
    that route fp32 tracks plain FSDP2 step by step."""
    wall_s: float = 0.0
    error: str = ""


SETTINGS: dict[str, Setting] = {
    "resnet18": Setting(
        name="resnet18", model="resnet18", dataset="digits", metric="accuracy",
        model_options={"width": 16, "small_input": True, "num_classes": 10, "in_channels": 1},
        optimizer="sgd", lr=0.05, weight_decay=5e-4, batch_size=32, steps=150, eval_samples=360,
        profile="calibrations/resnet18/profile.json", note="resnet18 width 16 on 8x8 digits, SGD momentum 0.9"),
    "gpt": Setting(
        name="gpt", model="gpt", dataset="stdlib-text", metric="loss", model_options={"size": "nano"},
        data_options={"max_bytes": 2_000_000}, optimizer="adamw", lr=3e-3, weight_decay=0.01, batch_size=16,
        steps=300, profile="calibrations/gpt/profile.json", note="nfab's GPT nano (2 layers, d=128), AdamW"),
    "heldout": Setting(
        name="heldout", model="bench.heldout.gpt:user_gpt", dataset="stdlib-text", metric="loss",
        data_options={"max_bytes": 2_000_000}, optimizer="adamw", lr=3e-3, weight_decay=0.1, batch_size=16,
        steps=300, profile="bench/calibrations/heldout/profile.json",
        note="user-style GPT nfab was not tuned on (nn.MultiheadAttention, tied head), AdamW wd 0.1"),
}
# a second user model, written after the control work had been measured on the first: nothing was chosen on it
SETTINGS["heldout2"] = Setting(
    name="heldout2", model="bench.heldout.encoder:user_lm", dataset="stdlib-text", metric="loss",
    data_options={"max_bytes": 2_000_000}, optimizer="adamw", lr=1e-3, weight_decay=0.05, batch_size=16,
    steps=300, profile="bench/calibrations/heldout2/profile.json",
    note="a second user model (torch's nn.TransformerEncoder, untied head), AdamW lr 1e-3 wd 0.05")
# a third, written after the noise-corrected moment was worked out on heldout2: plain Adam (beta2 0.999)
SETTINGS["heldout3"] = Setting(
    name="heldout3", model="bench.heldout.swiglu:user_swiglu", dataset="stdlib-text", metric="loss",
    data_options={"max_bytes": 2_000_000}, optimizer="adamw", lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999),
    batch_size=16, steps=300, profile="bench/calibrations/heldout3/profile.json",
    note="a third user model (RMSNorm, SwiGLU, SDPA attention, tied head), plain Adam lr 1e-3 (beta2 0.999)")
# the held-out profile (calibrated at W=4 over 300 steps) where it was not calibrated: twice the
# ranks, twice the steps
SETTINGS["heldout-w8"] = dataclasses.replace(SETTINGS["heldout"], name="heldout-w8", world_size=8,
                                             note="the held-out GPT at W=8, its profile calibrated at W=4")
SETTINGS["heldout-w8c"] = dataclasses.replace(SETTINGS["heldout"], name="heldout-w8c", world_size=8,
                                              profile="bench/calibrations/heldout-w8/profile.json",
                                              note="the held-out GPT at W=8, its profile calibrated at W=8")
SETTINGS["heldout-600"] = dataclasses.replace(SETTINGS["heldout"], name="heldout-600", steps=600,
                                              note="the held-out GPT over 600 steps, its profile calibrated over 300")
# recipe-style held-out models (issue 31): clipping, accumulation, warm-up + cosine, decay on matrices
# only; each profile calibrated over 100 steps of its 300-step run (bench/heldout/recipe_*.yaml)
_RECIPE = {"accum_steps": 2, "grad_clip": 1.0, "schedule": "cosine", "min_lr_ratio": 0.1, "decay_matrices_only": True,
           "steps": 300}
SETTINGS["recipe-gpt"] = Setting(
    name="recipe-gpt", model="bench.heldout.recipe_gpt:recipe_gpt", dataset="stdlib-text", metric="loss",
    data_options={"max_bytes": 2_000_000}, optimizer="adamw", lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95),
    batch_size=16, warmup_steps=20, profile="bench/calibrations/recipe-gpt/profile.json", **_RECIPE,
    note="nanoGPT-style recipe (bias-free LayerNorm, fused qkv, SDPA, tied head), AdamW (0.9, 0.95) wd 0.1, "
         "warm-up 20 + cosine, 2 micro-batches, clip 1.0")
SETTINGS["recipe-vit"] = Setting(
    name="recipe-vit", model="bench.heldout.recipe_vit:recipe_vit", dataset="digits", metric="loss",
    optimizer="adamw", lr=2e-3, weight_decay=0.05, betas=(0.9, 0.95), batch_size=16, warmup_steps=20,
    eval_samples=360, classes=10, profile="bench/calibrations/recipe-vit/profile.json", **_RECIPE,
    note="a small ViT on digits, AdamW (0.9, 0.95) wd 0.05, warm-up 20 + cosine, 2 micro-batches, clip 1.0")
SETTINGS["recipe-cnn"] = Setting(
    name="recipe-cnn", model="bench.heldout.recipe_cnn:recipe_cnn", dataset="digits", metric="loss",
    optimizer="sgd", lr=0.05, weight_decay=5e-4, batch_size=16, warmup_steps=10, eval_samples=360, classes=10,
    profile="bench/calibrations/recipe-cnn/profile.json", **_RECIPE,
    note="ResNet-style CNN with BatchNorm on digits, SGD momentum 0.9, warm-up 10 + cosine, 2 micro-batches, clip 1.0")
MIN_RATIO = 8.0
"""Target: nfab's profile sends at least this many times fewer gradient bytes than FP32."""
MAX_LOSS_RISE = 0.01
"""Target (loss settings): final held-out loss at most 1.0 % above FP32."""
MAX_ACC_DROP = 0.01
"""Target (accuracy settings): at most 1.0 point below FP32."""
FAIL_LOSS_RISE = 0.05
"""A static variant 'measurably fails' a loss setting beyond +5 % loss (1 point of accuracy ... x5)."""
