"""The one optimizer construction and the one LR schedule, for `nfab train` and `nfab calibrate`.

A profile is only as good as the setting it was calibrated under, so calibration and
training build the optimizer the same way (same parameter groups, same weight-decay
exemptions) and follow the same schedule: both call these functions.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from nfab.config.run import OptimConfig, ScheduleConfig

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""`precision`'s autocast dtype (fp32: no autocast), for `nfab train`, `nfab calibrate` and the benches."""


def autocast(precision: str, device_type: str) -> torch.autocast:
    """The forward's autocast context at `precision` on `device_type` (fp32: a disabled one)."""
    dtype = AUTOCAST.get(precision)
    return torch.autocast(device_type, dtype=dtype or torch.float32, enabled=dtype is not None)

DEFAULT_LR = {"sgd": 0.05, "adamw": 3e-3}
DEFAULT_WEIGHT_DECAY = {"sgd": 5e-4, "adamw": 0.01}


def resolve_optim(cfg: OptimConfig, family: str) -> OptimConfig:
    """`cfg` with `auto`, lr and weight decay made explicit (`family`: the model's declared optimizer)."""
    name = family if cfg.name == "auto" else cfg.name
    return cfg.model_copy(update={
        "name": name,
        "lr": cfg.lr if cfg.lr is not None else DEFAULT_LR[name],
        "weight_decay": cfg.weight_decay if cfg.weight_decay is not None else DEFAULT_WEIGHT_DECAY[name],
    })


def parameter_groups(module: nn.Module, weight_decay: float, exempt_1d: bool) -> list[dict]:
    """Trainable parameters in model order; with `exempt_1d`, norms and biases (1-D) get no decay."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not exempt_1d:
        return [{"params": params, "weight_decay": weight_decay}]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def build_optimizer(module: nn.Module, cfg: OptimConfig, family: str) -> torch.optim.Optimizer:
    """SGD momentum with L2 on every tensor (CNN default) or AdamW without decay on 1-D tensors."""
    r = resolve_optim(cfg, family)
    assert r.lr is not None and r.weight_decay is not None  # resolved above
    if r.name == "sgd":
        return torch.optim.SGD(parameter_groups(module, r.weight_decay, exempt_1d=False), lr=r.lr,
                               momentum=r.momentum)
    return torch.optim.AdamW(parameter_groups(module, r.weight_decay, exempt_1d=True), lr=r.lr,
                             betas=tuple(r.betas))


def lr_factor(step: int, total_steps: int, cfg: ScheduleConfig) -> float:
    """Multiplier of the peak lr at `step`: linear warm-up, then cosine to `min_lr_ratio` (or flat)."""
    warmup = warmup_steps(total_steps, cfg)
    if step < warmup:
        return (step + 1) / warmup
    if cfg.name == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total_steps - warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def warmup_steps(total_steps: int, cfg: ScheduleConfig) -> int:
    """The schedule's warm-up length (None in the config: 5% of the run)."""
    return cfg.warmup_steps if cfg.warmup_steps is not None else int(0.05 * total_steps)


def optimizer_config(optimizer: Any) -> dict[str, Any] | None:
    """nfab's optimizer config for a torch AdamW (or Adam without L2), or SGD; None where it does not map.

    Every param group must share lr and betas (or momentum); weight decay is the largest group's
    (nfab's AdamW never decays 1-D tensors, the usual split of a decay and a no-decay group). An
    optimizer wrapped by a framework (`AcceleratedOptimizer`, Lightning's) is read through `.optimizer`.
    """
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, torch.optim.Optimizer) or not inner.param_groups:
        return None
    groups = inner.param_groups

    def shared(key: str) -> Any:
        values = {repr(g.get(key)) for g in groups}
        return groups[0].get(key) if len(values) == 1 else None

    lr = shared("lr")
    decay = max(float(g.get("weight_decay", 0.0)) for g in groups)
    if lr is None:
        return None
    kind = type(inner)
    if kind is torch.optim.AdamW or (kind is torch.optim.Adam and decay == 0.0):
        betas = shared("betas")
        if betas is None or groups[0].get("amsgrad"):
            return None
        return {"name": "adamw", "lr": float(lr), "weight_decay": decay, "betas": [float(b) for b in betas]}
    if kind is torch.optim.SGD:
        momentum = shared("momentum")
        if momentum is None or groups[0].get("nesterov") or groups[0].get("dampening"):
            return None
        return {"name": "sgd", "lr": float(lr), "momentum": float(momentum), "weight_decay": decay}
    return None
