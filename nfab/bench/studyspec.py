"""What the study runs: its variants, settings and targets, and the row one run gives.

Pure data, shared by the harness that trains (`bench.userloop`, in a repository checkout), the
command that runs it (`nfab.bench.study`) and the renderer (`nfab.bench.studydocs`).

Settings: `resnet18` on digits (SGD), `gpt` nano on stdlib text (AdamW), and the held-out user
models nfab was not tuned on (`bench.heldout.*`): `heldout` (a GPT with `nn.MultiheadAttention`,
AdamW lr 3e-3, wd 0.1, batch 16, constant LR: the known case where static sign with error
feedback fails), `heldout2` (`nn.TransformerEncoder`), `heldout3` (RMSNorm, SwiGLU, plain Adam),
and the first one at W=8 and over 600 steps.
"""

from __future__ import annotations

import dataclasses
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
    note: str = ""

    def __post_init__(self) -> None:
        if self.metric not in ("loss", "accuracy"):
            raise ValueError(f"metric must be 'loss' or 'accuracy', got {self.metric!r}")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {self.optimizer!r}")
        if min(self.steps, self.world_size, self.batch_size, self.eval_samples) < 1:
            raise ValueError("steps, world_size, batch_size and eval_samples must be >= 1")


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
    health_events: list[str] = field(default_factory=list)
    """nfab variants: the health monitor's events (first 20)."""
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
MIN_RATIO = 8.0
"""Target: nfab's profile sends at least this many times fewer gradient bytes than FP32."""
MAX_LOSS_RISE = 0.01
"""Target (loss settings): final held-out loss at most 1.0 % above FP32."""
MAX_ACC_DROP = 0.01
"""Target (accuracy settings): at most 1.0 point below FP32."""
FAIL_LOSS_RISE = 0.05
"""A static variant 'measurably fails' a loss setting beyond +5 % loss (1 point of accuracy ... x5)."""
