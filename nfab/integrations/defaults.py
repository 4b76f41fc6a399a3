"""What a framework knows that `nfab.attach` would otherwise have to be told: run length and optimizer."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from nfab.config.attach import AttachConfig
from nfab.config.run import AUTO
from nfab.config.shipped import load_profile
from nfab.errors import NfabError
from nfab.profile.schema import Profile
from nfab.runtime.control.optim import torch_optimizer
from nfab.runtime.frontends.ddp import Runtime


def checked(profile: str | Path | Profile | None, route: str | dict[str, str] | None,
            where: str = "") -> Profile | str | None:
    """`profile` loaded (a path or a shipped name) and `route` parsed where the user hands them to an
    adapter, so a missing file or a bad route is one `NfabError` at that call: Lightning and the
    Trainer attach only inside `fit()` / `train()`, where it surfaced in dozens of framework frames.
    Returns the profile to attach with (None for a route; "auto" as it is: `nfab.attach(model, "auto")`)."""
    if (profile is None) == (route is None):
        raise NfabError(f"{where}give exactly one of profile= or route=")
    if route is not None:
        Profile.static(route)
        return None
    if isinstance(profile, str) and profile == AUTO:  # calibrated inside the run, when the framework attaches
        return AUTO
    return load_profile(profile)


def adapter_config(config: AttachConfig | None, route: str | dict[str, str] | None,
                   options: Mapping[str, Any]) -> AttachConfig:
    """What the user handed an adapter (`config=`, its `route` argument, `nfab.attach`'s keyword options)
    as one `AttachConfig`, validated at that call: keywords win over `config`."""
    return AttachConfig.of(config, **options, **({} if route is None else {"route": route}))


def attach_with_defaults(
    ddp_model: DistributedDataParallel | torch.nn.Module,
    profile: str | Path | Profile | None,
    config: AttachConfig,
    *,
    total_steps: int | None,
    optimizer: Any = None,
    loss_scaler: Any = None,
) -> Runtime:
    """`nfab.attach` (DDP or FSDP2 model) with the user's `config`, plus the framework's `total_steps` and optimizer.

    An option the user set always wins (`AttachConfig.unless_set`). The framework's optimizer is passed as
    `optimizer=` (unwrapped from Accelerate's `AcceleratedOptimizer`, whose `.optimizer` is
    the torch one): `error_feedback="auto"` needs it to tell SGD from Adam, the drift monitor
    reads its second moment, and the user of a Trainer never holds the optimizer before the
    Trainer builds it. The framework's fp16 loss scaler (a `GradScaler`, None without fp16) goes as
    `loss_scaler=`: the hook's gradients carry its scale (`nfab.attach`).
    """
    from nfab.api import attach

    known: dict[str, Any] = {"total_steps": total_steps}
    inner = torch_optimizer(optimizer)
    if isinstance(inner, torch.optim.Optimizer):
        known["optimizer"] = inner
    if loss_scaler is not None:
        known["loss_scaler"] = loss_scaler
    return attach(ddp_model, profile, config=config.unless_set(**known))
