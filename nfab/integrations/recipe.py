"""A framework's training recipe as `nfab.calibrate`'s keywords, and its loss as `loss(model, batch)`.

Calibrating from a framework (`nfab.integrations.transformers.calibrate`, `...lightning.calibrate`)
reads what the user already configured: batch size, accumulation, clipping, precision, seed, run
length and the optimizer. Only what has one meaning in nfab's config is taken (a torch AdamW or SGD,
a cosine or constant schedule); anything else is left to nfab's default and logged, and every
keyword the user passes to `calibrate` wins over what was read.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nfab.config.optim import optimizer_config

__all__ = ["optimizer_config", "named_loss", "run", "trainer_recipe"]

if TYPE_CHECKING:
    from nfab.calibrate.api import CalibrationResult

log = logging.getLogger(__name__)

ADAMW_OPTIMS = frozenset({"adamw_torch", "adamw_torch_fused", "adamw_apex_fused", "adamw_torch_xla",
                          "adamw_torch_npu_fused"})
"""`TrainingArguments.optim` values that are AdamW with full-precision state (the 8-bit and
any-precision ones are not nfab's AdamW)."""

SCHEDULES = {"cosine": {"name": "cosine", "min_lr_ratio": 0.0}, "constant": {"name": "constant"},
             "constant_with_warmup": {"name": "constant"}}
"""`TrainingArguments.lr_scheduler_type` values nfab's schedule has (the Trainer's cosine decays to 0)."""

LIGHTNING_PRECISION = {"bf16-mixed": "bf16", "bf16": "bf16", "16-mixed": "fp16", "16": "fp16",
                       "32-true": "fp32", "32": "fp32"}
"""Lightning's `Trainer(precision=)` values that are nfab's autocast precisions (bf16-true, 64 are not)."""


def trainer_recipe(args: Any, optimizer: Any = None) -> dict[str, Any]:
    """`nfab.calibrate` keywords from a Transformers `TrainingArguments` (and the optimizer the Trainer
    was given, which wins over `args.optim`)."""
    clip = args.max_grad_norm
    recipe: dict[str, Any] = {
        "batch_size": args.per_device_train_batch_size, "accum_steps": args.gradient_accumulation_steps,
        "grad_clip": float(clip) if clip is not None and clip > 0 else None, "seed": args.seed,
        "precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
        "steps": args.max_steps if args.max_steps > 0 else None,
    }
    optim = str(getattr(args.optim, "value", args.optim))
    if optimizer is not None:
        recipe["optimizer"] = optimizer_config(optimizer)
        if recipe["optimizer"] is None:
            log.info("nfab: the Trainer's %s has no nfab optimizer config; calibrating with nfab's (pass "
                     "optimizer=)", type(optimizer).__name__)
    elif optim in ADAMW_OPTIMS:
        recipe["optimizer"] = {"name": "adamw", "lr": args.learning_rate, "weight_decay": args.weight_decay,
                               "betas": [args.adam_beta1, args.adam_beta2]}
    elif optim == "sgd" and not args.optim_args:
        recipe["optimizer"] = {"name": "sgd", "lr": args.learning_rate, "weight_decay": args.weight_decay,
                               "momentum": 0.0}
    else:
        log.info("nfab: optim=%s has no nfab optimizer config; calibrating with nfab's (pass optimizer=)", optim)
    lr_type = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    schedule = SCHEDULES.get(lr_type)
    if schedule is None:
        log.info("nfab: lr_scheduler_type=%s is not nfab's; calibrating with nfab's cosine (pass schedule=)", lr_type)
    recipe["schedule"] = dict(schedule or {})
    recipe["warmup"] = float(args.warmup_steps)  # steps (>= 1) or a fraction of the run: resolved in `run`
    return recipe


def named_loss(fn: Callable[[nn.Module, Any], torch.Tensor], owner: type, method: str) -> Callable[..., Any]:
    """`fn` named as the framework method it calls (`MyTrainer.compute_loss`), for messages and
    `result.meta["loss"]`: the class in `owner`'s MRO that defines `method`."""
    defined = next((c for c in owner.__mro__ if method in vars(c)), owner)
    fn.__module__ = defined.__module__
    fn.__qualname__ = f"{defined.__qualname__}.{method}"
    return fn


def run(model: Any, data: Any, recipe: dict[str, Any], kwargs: dict[str, Any]) -> CalibrationResult:
    """`nfab.calibrate` with the framework's recipe under the user's keywords (a keyword given, not None,
    wins: `optimizer="auto"` is nfab's default optimizer)."""
    merged = {k: v for k, v in recipe.items() if v is not None and k != "warmup"}
    merged.update({k: v for k, v in kwargs.items() if v is not None})
    schedule = merged.get("schedule")
    if "warmup" in recipe and kwargs.get("schedule") is None and isinstance(schedule, dict):
        warmup, steps = recipe["warmup"], merged.get("steps")
        if warmup >= 1 or warmup == 0:
            schedule["warmup_steps"] = int(warmup)
        elif steps:
            schedule["warmup_steps"] = math.ceil(steps * warmup)
    from nfab.calibrate import api  # on call: attaching alone does not load the calibrator

    return api.calibrate(model, data, **merged)
