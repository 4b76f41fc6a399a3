"""`nfab.attach`: register nfab's communication hook on any DDP model, or its reduce-scatter on an FSDP2 model."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel

from nfab.attach_checks import absent_regions_warning, check_attach, sign_zero_warning
from nfab.config.attach import AttachConfig
from nfab.config.calibrated import calibrated_setting
from nfab.config.run import AUTO
from nfab.config.shipped import load_profile
from nfab.errors import NfabError
from nfab.profile.routes import RouteSpec
from nfab.profile.schema import Profile
from nfab.runtime.bindings import trained_module
from nfab.runtime.control.health import for_run
from nfab.runtime.control.moment import NoiseMoment
from nfab.runtime.control.optim import (
    LossScale,
    Preconditioner,
    is_adaptive,
    is_sharded,
    loss_scale_of,
    resolve_error_feedback,
    resolve_noise_moment,
)
from nfab.runtime.control.window import WINDOW_ROUTE, Window
from nfab.runtime.frontends import fsdp2
from nfab.runtime.frontends.ddp import Runtime, nfab_hook
from nfab.wire import cost as cost_mod

if TYPE_CHECKING:
    from nfab.runtime.frontends.fsdp import ShardedRuntime

log = logging.getLogger(__name__)


def attach(
    ddp_model: DistributedDataParallel | torch.nn.Module,
    profile: str | Path | Profile | None = None,
    *,
    config: AttachConfig | None = None,
    **options: Any,
) -> Runtime | ShardedRuntime:
    """Register nfab's hook on `ddp_model` (before its first backward) and return its Runtime.

    `ddp_model` may instead be an FSDP2 model (`fully_shard` on each block and on the root): nfab's
    reduce-scatter is installed on every FSDP2 module and the same runtime API comes back
    (`observe_loss`, `step_stats`, `state_dict`; what FSDP2 refuses: docs/api.md#fsdp2-fully_shard).
    Give either `profile` (a path, a shipped name or a `Profile`: its routes pass the cost gate) or
    `route=` (honoured as asked). The options (`route`, `optimizer`, `total_steps`, `cost_model`, ...)
    are `AttachConfig`'s fields, each with its default and meaning there: pass them as keywords, or
    as `config=` (keywords win over it). Every rank must call `attach` identically; a mistake it can
    see is one `NfabError` before anything is registered (`nfab.attach_checks`).
    """
    cfg = AttachConfig.of(config, **options)
    sharded = _is_fsdp2(ddp_model)
    if sharded:  # the front end is imported in `_attach_sharded`: an older torch attaches DDP without it
        fsdp2.require("nfab.attach on an FSDP2 model")
    elif not isinstance(ddp_model, DistributedDataParallel):
        raise NfabError("nfab.attach needs a torch.nn.parallel.DistributedDataParallel model or an FSDP2 "
                        "model (torch.distributed.fsdp.fully_shard)")
    auto = isinstance(profile, str) and profile == AUTO
    prof, explicit = _auto_start(cfg, sharded) if auto else _profile(profile, cfg.route)
    if not sharded and getattr(ddp_model, "_comm_hooks", None):
        raise NfabError("this DDP model already has a communication hook (nfab.attach called twice, or "
                        "register_comm_hook before it): DDP takes one, so attach once to a model without one")
    module = ddp_model if sharded else trained_module(ddp_model.module)
    note = check_attach(prof, module, explicit=explicit or auto, total_steps=cfg.total_steps,
                        model_signature=cfg.model_signature, optimizer=cfg.optimizer, sibling=cfg.sibling,
                        head_modules=cfg.head_modules)
    if note is not None and _rank(ddp_model) == 0:
        log.warning(note)
    prof = prof if explicit or auto else _widened(prof, cfg.total_steps)
    loss_scale = loss_scale_of(cfg.loss_scaler) if cfg.loss_scaler is not None else None
    if sharded:
        return _attach_sharded(ddp_model, prof, explicit, cfg, loss_scale, auto=auto)
    cm = cost_mod.resolve(cfg.cost_model, ddp_model.process_group, _grad_device(ddp_model))
    use_ef = resolve_error_feedback(cfg.error_feedback, cfg.optimizer)
    runtime = Runtime(ddp_model, prof, explicit=explicit, error_feedback=use_ef, total_steps=cfg.total_steps,
                      cost_model=cm, seed=cfg.seed, head_modules=cfg.head_modules, qsum_scale=cfg.qsum_scale,
                      coalesce=cfg.coalesce, hierarchy=cfg.hierarchy)
    runtime.loss_scale = loss_scale
    _warn(runtime, cfg, cm, explicit=explicit, error_feedback=use_ef, module=module,
          find_unused=bool(getattr(ddp_model, "find_unused_parameters", False)))
    _read_optimizer(runtime, cfg, explicit=explicit or auto, module=module, loss_scale=loss_scale)
    if auto:
        runtime.window = _window(runtime, module, cfg)
    ddp_model.register_comm_hook(runtime, nfab_hook)
    return runtime


def _auto_start(cfg: AttachConfig, sharded: bool) -> tuple[Profile, bool]:
    """What `attach(model, "auto")` runs on until its first window's end: the window route (FP32 under
    FSDP2, whose reduce-scatter carries no bf16), after what "auto" refuses."""
    from nfab.calibrate import inrun  # here: the calibrator (pandas, pyarrow) is not every attach's to pay for

    inrun.check(cfg)
    return Profile.static("fp32" if sharded else WINDOW_ROUTE), False


def _window(runtime: Runtime | ShardedRuntime, module: torch.nn.Module, cfg: AttachConfig) -> Window:
    """The in-run calibration windows `attach(model, "auto")` installs on a runtime."""
    from nfab.calibrate import inrun

    return inrun.window_for(runtime, module, cfg)


def _profile(profile: str | Path | Profile | None, route: RouteSpec | None) -> tuple[Profile, bool]:
    """The profile to run, and whether it is an explicit route (honoured as asked) rather than a profile."""
    if (profile is None) == (route is None):
        raise NfabError("give exactly one of profile= or route=")
    if route is not None:
        return Profile.static(route), True
    prof = load_profile(profile)
    calibrated_setting(prof)  # refused here as `nfab train` and `nfab profile check` refuse it
    return prof, False


def _widened(prof: Profile, total_steps: int | None) -> Profile:
    """A profile whose spike/jump thresholds were fitted on a shorter reference run, widened for this one."""
    run_steps = total_steps or calibrated_steps(prof, "run_steps")
    return prof.model_copy(update={"health": for_run(prof.health, calibrated_steps(prof), run_steps)})


def _attach_sharded(model: torch.nn.Module, prof: Profile, explicit: bool, cfg: AttachConfig,
                    loss_scale: LossScale | None, *, auto: bool = False) -> ShardedRuntime:
    """`attach` on an FSDP2 model: nfab's reduce-scatter on every FSDP2 module, after what FSDP2 refuses."""
    from nfab.runtime.frontends import fsdp as fsdp_front
    from nfab.runtime.frontends import fsdp_layout

    fsdp_layout.check_options(prof, explicit=explicit, error_feedback=cfg.error_feedback, hierarchy=cfg.hierarchy,
                              qsum_scale=cfg.qsum_scale)
    group = fsdp_layout.shard_group(model)
    cm = cost_mod.resolve(cfg.cost_model, group, _grad_device(model))
    runtime = fsdp_front.ShardedRuntime(model, prof, explicit=explicit, cost_model=cm, total_steps=cfg.total_steps,
                                        seed=cfg.seed, head_modules=cfg.head_modules, group=group)
    fsdp_front.install(runtime, model)
    if (not explicit and resolve_error_feedback(cfg.error_feedback, cfg.optimizer)
            and any(p.error_feedback for p in prof.phases) and torch.distributed.get_rank(group) == 0):
        log.warning("nfab: this profile's phases carry error feedback, which FSDP2 does not offer (a full-size "
                    "residual per rank): it runs without it, as it was not validated")
    if resolve_noise_moment(cfg.noise_moment, cfg.optimizer, static_route=explicit or auto,
                            calibrated_with=prof.noise_moment):
        runtime.moment = NoiseMoment(cfg.optimizer, dict(model.named_parameters()), loss_scale)
    if auto:
        runtime.window = _window(runtime, model, cfg)
    return runtime


def _warn(runtime: Runtime, cfg: AttachConfig, cm: cost_mod.CostModel | None, *, explicit: bool,
          error_feedback: bool, module: torch.nn.Module, find_unused: bool) -> None:
    """The lines `attach` logs on a DDP model (rank 0): a route naming absent regions, sign votes meeting
    exact zeros, a cost model that keeps FP32 everywhere, a profile calibrated with the noise moment."""
    prof = runtime.profile
    if error_feedback and cfg.error_feedback is True and cfg.optimizer is not None and is_adaptive(cfg.optimizer):
        log.warning("error feedback forced on under adaptive %s: it can collapse training; the health "
                    "monitor demotes regions that drift", type(cfg.optimizer).__name__)
    absent = absent_regions_warning(cfg.route, runtime.regions) if cfg.route is not None else None
    if absent is not None and runtime.rank == 0:
        log.warning(absent)
    zeros = sign_zero_warning(prof, runtime.regions, error_feedback=error_feedback,
                              world_size=runtime.controller.world_size, find_unused=find_unused)
    if zeros is not None and runtime.rank == 0:
        log.warning(zeros)
    if cm is not None and runtime.rank == 0 and cm.implausible and not explicit and prof.fallback.cost_gate:
        log.warning(implausible_line(cm))
    elif cm is not None and runtime.rank == 0 and runtime.controller.gated_everywhere(
            runtime.regions, {n: p.numel() for n, p in module.named_parameters()}):
        log.warning(cost_gate_line(cm, runtime.controller.world_size))
    if cfg.optimizer is None and prof.noise_moment and cfg.noise_moment == "auto":
        log.warning("this profile was calibrated with the noise-corrected second moment: pass optimizer= "
                    "to run it as calibrated")


def _read_optimizer(runtime: Runtime, cfg: AttachConfig, *, explicit: bool, module: torch.nn.Module,
                    loss_scale: LossScale | None) -> None:
    """What a DDP runtime takes from `optimizer=`: the preconditioner the probes and block routes read,
    and the noise moment's correction; neither from an optimizer whose state differs across ranks."""
    optimizer = cfg.optimizer
    if optimizer is None:
        return
    if is_sharded(optimizer):  # its state differs across ranks: never decide from it
        log.warning("%s shards its state: the drift monitor compares probes without preconditioning",
                    type(optimizer).__name__)
        return
    runtime.preconditioner = Preconditioner(optimizer, dict(module.named_parameters()))
    if cfg.noise_moment is True and not is_adaptive(optimizer):
        log.warning("noise_moment=True under %s: it keeps no second moment, nothing to correct",
                    type(optimizer).__name__)
    elif resolve_noise_moment(cfg.noise_moment, optimizer, static_route=explicit,
                              calibrated_with=runtime.profile.noise_moment):
        runtime.moment = NoiseMoment(optimizer, dict(module.named_parameters()), loss_scale)


def cost_gate_line(cm: cost_mod.CostModel, world_size: int) -> str:
    """The one line attach logs when the cost model keeps FP32 everywhere: the link figure and the override."""
    return (f"nfab: the {cm.source} cost model keeps FP32 on every region (all-reduce {cm.link_line()} at "
            f"W={world_size}): compression does not pay on this link, so nothing is compressed "
            "(StepStats.cost_gated). To compress anyway pass cost_model=None, or declare the target link: "
            "cost_model=\"link:100mbit\" (comm.cost_model=link:100mbit)")


def implausible_line(cm: cost_mod.CostModel) -> str:
    """The one line attach logs when the measured figures are implausible and the gate keeps FP32."""
    return (f"nfab: the link measurement is implausible ({'; '.join(cm.implausible)}), so every region stays "
            "FP32 (StepStats.cost_gated), the choice that is always correct. Measure again on a quieter machine, "
            "or declare the link: cost_model=\"link:100mbit\" (comm.cost_model=link:100mbit)")


def calibrated_steps(prof: Profile, key: str = "steps") -> int | None:
    """Steps of the reference run a calibrated profile's health thresholds were fitted over
    (`run_steps`: of the training run it was calibrated for, when that was longer)."""
    steps = (prof.provenance or {}).get("calibrated", {}).get(key)
    return int(steps) if isinstance(steps, int | float) and steps > 0 else None


def _rank(model: torch.nn.Module) -> int:
    """This process's rank in the model's group (DDP's process group; FSDP2's default group)."""
    return torch.distributed.get_rank(getattr(model, "process_group", None))


def _grad_device(ddp_model: torch.nn.Module):
    """The device the model's gradients live on (the cost model measures there)."""
    param = next((p for p in ddp_model.parameters() if p.requires_grad), None)
    return param.device if param is not None else "cpu"


def _is_fsdp2(model: object) -> bool:
    """An FSDP2 root (`fully_shard`); FSDP1 (`FullyShardedDataParallel`) is refused with its reason."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):
        raise NfabError("nfab.attach supports FSDP2 (torch.distributed.fsdp.fully_shard), not FSDP1 "
                        "(FullyShardedDataParallel): its flat-parameter comm hooks are not wired")
    return fsdp2.is_fsdp2(model)
