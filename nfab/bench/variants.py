"""What each bench variant registers on DDP: shared by `nfab bench step` and `nfab bench tta`, so
both compare the same things.

Plain DDP, a hook that sends nothing (the no-communication floor), torch's bf16 / fp16 compress
hooks and `powerSGD_hook` (one bucket: on gloo it launches its second all-reduce from a future
callback and aborts with several), and nfab with a static route or a profile.
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations at registration.
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

import nfab
from nfab.profile.schema import Profile
from nfab.wire.cost import is_declared

POWERSGD_BUCKET_MB = 1000.0
"""PowerSGD's single bucket on gloo."""
POWERSGD_START = 2
"""Steps PowerSGD all-reduces uncompressed before it compresses (torch's `start_powerSGD_iter`)."""
ROUTE_VARIANT = "nfab:"
"""Prefix of a variant that runs nfab with a static route (`nfab:q8`, `nfab:sign`)."""


def test_profile() -> Profile:
    """A stand-in profile when none is calibrated: sign on conv/linear/head, fp32 elsewhere."""
    return Profile.static({"conv": "sign", "linear": "sign", "head": "sign"}, model_name="resnet18")


def no_comm_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The no-communication floor: a completed future of the unchanged bucket."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def bf16_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's `bf16_compress_hook` itself, under another name: DDP refuses that name unless
    CUDA with NCCL >= 2.10 is present, though the hook (cast to bf16, all-reduce, divide, cast
    back) runs on gloo and CPU as well."""
    return default_hooks.bf16_compress_hook(state, bucket)  # type: ignore[arg-type]


def ddp_for(name: str, module: torch.nn.Module, nfab_bucket_mb: float) -> DDP:
    """`module` (not copied) in DDP with variant `name`'s bucket cap (one bucket for PowerSGD)."""
    if name == "powersgd":
        return DDP(module, bucket_cap_mb=POWERSGD_BUCKET_MB)
    if name.startswith("nfab-"):
        return DDP(module, bucket_cap_mb=nfab_bucket_mb)
    return DDP(module)


def attach_comm(name: str, ddp: DDP, *, total_steps: int, seed: int, cost_model: str,
                profile: dict[str, Any] | None, powersgd_rank: int = 2, powersgd_start: int = POWERSGD_START,
                optimizer: torch.optim.Optimizer | None = None, head_modules: tuple[str, ...] | None = None,
                loss_scaler: torch.amp.GradScaler | None = None) -> tuple[Any, Any]:
    """Register variant `name`'s communication on `ddp`: (nfab Runtime or None, torch hook state or None).

    Shared by `nfab bench step` and `nfab bench tta`, so both compare the same variants.
    `optimizer`, `head_modules` and `loss_scaler` (an fp16 recipe's) reach nfab's attach (it reads the
    optimizer's family; the hook's gradients carry the scaler's scale).
    """
    cm = cost_model if cost_model == "measure" or is_declared(cost_model) else None  # "none": decide by bytes
    nfab_kw: dict[str, Any] = {"total_steps": total_steps, "seed": seed, "cost_model": cm,
                               "optimizer": optimizer, "head_modules": head_modules, "loss_scaler": loss_scaler}
    if name == "floor":
        ddp.register_comm_hook(None, no_comm_hook)
    elif name == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "bf16":
        ddp.register_comm_hook(None, bf16_hook)
    elif name == "allreduce-hook":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif name == "powersgd":
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank,
                                   start_powerSGD_iter=powersgd_start)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
        return None, state
    elif name == "nfab-sign-2level":  # nodes from torchrun's LOCAL_WORLD_SIZE (W / --nodes per node)
        return nfab.attach(ddp, route="sign", hierarchy="auto", **nfab_kw), None
    elif name in ("nfab-fp32", "nfab-sign") or name.startswith(ROUTE_VARIANT):
        route = name.removeprefix(ROUTE_VARIANT).removeprefix("nfab-")
        return nfab.attach(ddp, route=route, **nfab_kw), None
    elif name == "nfab-profile":
        prof = Profile.from_dict(profile) if profile is not None else test_profile()
        return nfab.attach(ddp, prof, **nfab_kw), None
    return None, None


def on_bench_model(prof: dict[str, Any] | None, source: str) -> tuple[dict[str, Any] | None, str]:
    """A profile whose routes a bench applies to its own model (another width or input than it
    was calibrated on): the parameter layout differs by design, so attach must not refuse it."""
    if prof is not None and prof["model"].get("signature"):
        prof = {**prof, "model": {**prof["model"], "signature": None}}
        source += " (routes on the bench's model)"
    return prof, source
