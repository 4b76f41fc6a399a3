"""`nfab.attach`: register nfab's communication hook on any DDP model, or its reduce-scatter on an FSDP2 model."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel

from nfab.attach_checks import absent_regions_warning, check_attach, sign_zero_warning
from nfab.config.calibrated import calibrated_setting
from nfab.config.shipped import load_profile
from nfab.errors import NfabError
from nfab.profile.schema import Profile
from nfab.runtime.bindings import trained_module
from nfab.runtime.control.health import for_run
from nfab.runtime.control.moment import NoiseMoment
from nfab.runtime.control.optim import (
    ERROR_FEEDBACK_CHOICES,
    Preconditioner,
    is_adaptive,
    is_sharded,
    loss_scale_of,
    resolve_error_feedback,
    torch_optimizer,
)
from nfab.runtime.core.hierarchy import Hierarchy, parse
from nfab.runtime.core.scales import QSUM_SCALES
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
    route: str | dict[str, str] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    error_feedback: bool | str = "auto",
    total_steps: int | None = None,
    cost_model: str | Path | cost_mod.CostModel | None = "measure",
    seed: int = 0,
    head_modules: tuple[str, ...] | None = None,
    model_signature: str | None = None,
    qsum_scale: str = "exact",
    coalesce: bool = True,
    hierarchy: Hierarchy | str | int | None = None,
    noise_moment: bool | str = "auto",
    loss_scaler: Any = None,
) -> Runtime | ShardedRuntime:
    """Register nfab's hook on `ddp_model` (before its first backward) and return its Runtime.

    `ddp_model` may instead be an FSDP2 model (`fully_shard` on each block and on the root): nfab's
    reduce-scatter is installed on every FSDP2 module and the same runtime API comes back
    (`observe_loss`, `step_stats`, `state_dict`). There the routes fp32, sign, q8/q4/q2 and the block
    routes run as asked (bf16 and fp16 go FP32), error feedback is not offered (it would keep a
    full-size gradient per rank), `hierarchy` is refused, and `noise_moment` corrects each rank's
    shard of Adam's second moment from its shard's agreed block scales.

    Give either `profile` (a path or a `Profile`) or `route` (a route for every region,
    or a dict from region class / parameter-name glob to route; unnamed regions stay
    fp32). A profile's routes pass the cost gate (fallback to FP32 where compression is
    modelled not to pay); an explicit route is honoured as asked, except where reducer
    capacity makes it impossible.

    `optimizer`: the optimizer that steps `ddp_model`'s parameters. nfab reads two things
    from it: whether it is adaptive (Adam, AdamW, ...: see `error_feedback`), and, for the
    health monitor, each coordinate's second moment, so that probes measure fidelity
    where the optimizer acts (slow-divergence detection; see runtime/health.py).

    `error_feedback`: "auto" (default) is on only for a known non-adaptive optimizer (SGD)
    and off for adaptive ones or when no optimizer is given: error feedback under Adam-style
    optimizers collapsed training in nfab's measurements. True forces it on (a warning is
    logged under an adaptive optimizer), False off. A profile phase can still turn it off.

    `cost_model`: "measure" (default: a collective measurement of about a second, agreed by all
    ranks), a declared link "link:100mbit" / "link:25gbit,20us" (its bandwidth and latency, nothing
    measured), a path to a JSON from `nfab bench wire --cost`, a `CostModel`, or None (no cost gate;
    sign picks by bytes). A route compresses where it is modelled at least 15% cheaper than FP32
    (`cost.gate`); a measurement no real link could give keeps FP32 everywhere, with one warning.
    Every rank must call `attach` identically.

    `noise_moment`: take the block-scaled routes' rounding noise out of the optimizer's second
    moment before each step (runtime/moment.py): under Adam the noise inflates v and acts like a
    lower learning rate (static bq2 on a held-out model: +1.64% over FP32 without, +0.32% with,
    three seeds). "auto" (default) turns it on when `optimizer` is adaptive and its state is not
    sharded, for a static `route` and for a profile calibrated with it (`Profile.noise_moment`,
    what `nfab calibrate` writes under an adaptive optimizer); a profile calibrated without it
    runs as it was validated. True forces it on (needs `optimizer=`), False off.

    `loss_scaler`: the `torch.amp.GradScaler` (or `ShardedGradScaler`) the loop scales its loss with,
    if any. The gradients the hook sees are then S times the optimizer's: block routes round in the
    optimizer's preconditioned space and the noise moment corrects its v, both in unscaled units, so
    nfab divides by S there (read on the device, no host sync). Without it, under fp16 loss scaling
    (S = 65536 at the start) block routes under Adam clip and the correction is lost. Skipping an
    overflowed step needs nothing: a non-finite step's buckets are NaN, as plain DDP's.

    `qsum_scale`: how q8/q4/q2 slices summed on the wire agree their shared scale —
    "exact" (default: a blocking MAX all-reduce in the hook, what calibrate replays) or
    "delayed" (the max of the slice's agreed max |x| over its last 16 qsum steps, carried
    by the control word: the hook never blocks, but elements above it saturate for a
    step). Slices that travel in a coalesced all-gather need no agreement at all: each
    rank encodes with its own scale.

    `coalesce`: a bucket with a signgather group goes out as ONE all-gather (control word
    and every group's payload) when that is modelled cheaper than a collective per group
    (always at W=2). False keeps one collective per group (for A/B comparisons).

    `hierarchy`: reduce lossy routes in two levels — node-local reduce-scatter in the
    bucket's dtype, the route across nodes at W = nodes (the same local rank on every node),
    node-local all-gather. "auto" takes the nodes from torchrun's LOCAL_WORLD_SIZE; an int
    is ranks per node; "NODESxLOCAL" (e.g. "64x8") is checked against the world size; a
    `Hierarchy` says the same in code; None / "flat" (default) is the flat path. Consecutive
    global ranks share a node. Sign becomes a majority of node sums, not of ranks
    (`nfab.runtime.core.hierarchy`); capacity, reducer choice and the cost gate see W = nodes.
    FP32 slices stay one plain all-reduce. One node, or one rank per node, runs flat.
    """
    if noise_moment not in ("auto", True, False) or not isinstance(noise_moment, bool | str):
        raise NfabError(f"noise_moment must be 'auto', True or False, got {noise_moment!r}")
    if noise_moment is True and optimizer is None:
        raise NfabError("noise_moment=True needs optimizer= (it corrects that optimizer's second moment)")
    called = ("is_enabled", "get_scale")  # what loss_scale_of calls
    if loss_scaler is not None and not all(callable(getattr(loss_scaler, m, None)) for m in called):
        raise NfabError(f"loss_scaler must be a torch.amp.GradScaler, got {type(loss_scaler).__name__}")
    loss_scale = loss_scale_of(loss_scaler) if loss_scaler is not None else None
    if qsum_scale not in QSUM_SCALES:
        raise NfabError(f"qsum_scale must be one of {', '.join(QSUM_SCALES)}, got {qsum_scale!r}")
    if error_feedback not in ERROR_FEEDBACK_CHOICES or not isinstance(error_feedback, bool | str):
        raise NfabError(f"error_feedback must be 'auto', True or False, got {error_feedback!r}")
    optimizer = torch_optimizer(optimizer)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise NfabError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    parse(hierarchy)  # a malformed spec is refused before any collective
    if not (cost_model is None or isinstance(cost_model, str | Path | cost_mod.CostModel)):
        raise NfabError(f"cost_model must be 'measure', 'link:...', a JSON path, a CostModel or None, got "
                        f"{type(cost_model).__name__}")
    if cost_mod.is_declared(cost_model):
        cost_mod.parse_link(str(cost_model))  # a malformed declaration is refused before any collective
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise NfabError(f"seed must be an int, got {seed!r}")
    if head_modules is not None:
        if isinstance(head_modules, str) or not all(isinstance(h, str) for h in head_modules):
            raise NfabError(f"head_modules must be a tuple of module names, got {head_modules!r}")
        head_modules = tuple(head_modules)
    sharded = _is_fsdp2(ddp_model)
    if sharded:  # the front end is imported here: an older torch attaches DDP without it (fsdp2.py)
        fsdp2.require("nfab.attach on an FSDP2 model")
        from nfab.runtime.frontends import fsdp as fsdp_front
        from nfab.runtime.frontends import fsdp_layout
    if not sharded and not isinstance(ddp_model, DistributedDataParallel):
        raise NfabError("nfab.attach needs a torch.nn.parallel.DistributedDataParallel model or an FSDP2 "
                        "model (torch.distributed.fsdp.fully_shard)")
    if (profile is None) == (route is None):
        raise NfabError("give exactly one of profile= or route=")
    if route is not None:
        prof = Profile.static(route)
        explicit = True
    else:
        prof = load_profile(profile)
        calibrated_setting(prof)  # refused here as `nfab train` and `nfab profile check` refuse it
        explicit = False
    if not sharded and getattr(ddp_model, "_comm_hooks", None):
        raise NfabError("this DDP model already has a communication hook (nfab.attach called twice, or "
                        "register_comm_hook before it): DDP takes one, so attach once to a model without one")
    module = ddp_model if sharded else trained_module(ddp_model.module)
    check_attach(prof, module, explicit=explicit, total_steps=total_steps, model_signature=model_signature,
                 optimizer=optimizer)
    if not explicit:  # spike/jump thresholds fitted on a shorter reference run: widened for this one
        run_steps = total_steps or calibrated_steps(prof, "run_steps")
        prof = prof.model_copy(update={"health": for_run(prof.health, calibrated_steps(prof), run_steps)})
    if sharded:
        fsdp_layout.check_options(prof, explicit=explicit, error_feedback=error_feedback, hierarchy=hierarchy,
                                  qsum_scale=qsum_scale)
    group = fsdp_layout.shard_group(ddp_model) if sharded else ddp_model.process_group
    if cost_model == "measure":
        cm = cost_mod.measure(group, device=_grad_device(ddp_model))
    elif cost_mod.is_declared(cost_model):
        cm = cost_mod.declared(str(cost_model), torch.distributed.get_world_size(group),
                               torch.distributed.get_backend(group))
    elif isinstance(cost_model, str | Path):
        cm = cost_mod.CostModel.load(cost_model)
    else:
        cm = cost_model
    if sharded:
        runtime = fsdp_front.ShardedRuntime(ddp_model, prof, explicit=explicit, cost_model=cm,
                                            total_steps=total_steps, seed=seed, head_modules=head_modules,
                                            group=group)
        fsdp_front.install(runtime, ddp_model)
        if (not explicit and resolve_error_feedback(error_feedback, optimizer)
                and any(p.error_feedback for p in prof.phases) and torch.distributed.get_rank(group) == 0):
            log.warning("nfab: this profile's phases carry error feedback, which FSDP2 does not offer (a full-size "
                        "residual per rank): it runs without it, as it was not validated")
        if optimizer is not None and _corrects_moment(noise_moment, prof, explicit, optimizer):
            runtime.moment = NoiseMoment(optimizer, dict(ddp_model.named_parameters()), loss_scale)
        return runtime
    use_ef = resolve_error_feedback(error_feedback, optimizer)
    if use_ef and optimizer is not None and error_feedback is True and is_adaptive(optimizer):
        log.warning("error feedback forced on under adaptive %s: it can collapse training; the health "
                    "monitor demotes regions that drift", type(optimizer).__name__)
    runtime = Runtime(ddp_model, prof, explicit=explicit, error_feedback=use_ef,
                      total_steps=total_steps, cost_model=cm, seed=seed, head_modules=head_modules,
                      qsum_scale=qsum_scale, coalesce=coalesce, hierarchy=hierarchy)
    runtime.loss_scale = loss_scale
    absent = absent_regions_warning(route, runtime.regions) if route is not None else None
    if absent is not None and runtime.rank == 0:
        log.warning(absent)
    zeros = sign_zero_warning(prof, runtime.regions, error_feedback=use_ef, world_size=runtime.controller.world_size,
                              find_unused=bool(getattr(ddp_model, "find_unused_parameters", False)))
    if zeros is not None and runtime.rank == 0:
        log.warning(zeros)
    if cm is not None and runtime.rank == 0 and cm.implausible and not explicit and prof.fallback.cost_gate:
        log.warning(implausible_line(cm))
    elif cm is not None and runtime.rank == 0 and runtime.controller.gated_everywhere(
            runtime.regions, {n: p.numel() for n, p in module.named_parameters()}):
        log.warning(cost_gate_line(cm, runtime.controller.world_size))
    if optimizer is None and prof.noise_moment and noise_moment == "auto":
        log.warning("this profile was calibrated with the noise-corrected second moment: pass optimizer= "
                    "to run it as calibrated")
    if optimizer is not None and is_sharded(optimizer):  # its state differs across ranks: never decide from it
        log.warning("%s shards its state: the drift monitor compares probes without preconditioning",
                    type(optimizer).__name__)
    elif optimizer is not None:
        runtime.preconditioner = Preconditioner(optimizer, dict(module.named_parameters()))
        if noise_moment is True and not is_adaptive(optimizer):
            log.warning("noise_moment=True under %s: it keeps no second moment, nothing to correct",
                        type(optimizer).__name__)
        elif _corrects_moment(noise_moment, prof, explicit, optimizer):
            runtime.moment = NoiseMoment(optimizer, dict(module.named_parameters()), loss_scale)
    ddp_model.register_comm_hook(runtime, nfab_hook)
    return runtime


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


def _corrects_moment(noise_moment: bool | str, prof: Profile, explicit: bool,
                     optimizer: torch.optim.Optimizer) -> bool:
    """Whether to correct an adaptive, unsharded optimizer's second moment: asked for, or "auto" on a
    static route or a profile calibrated with the correction."""
    if noise_moment == "auto":
        return is_adaptive(optimizer) and (explicit or prof.noise_moment)
    return bool(noise_moment)


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
