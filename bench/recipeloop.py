"""A recipe-style user loop (issue 31): the user's own DDP loop, as nanoGPT writes it, with nfab in two lines.

Each recipe is a held-out model (`bench.heldout.recipe_*`) with the loop its family is trained
with: gradient accumulation (the first micro-batch under `ddp.no_sync()`), `clip_grad_norm_`
before `opt.step()`, linear warm-up then cosine to 0.1x, weight decay on matrices only,
AdamW betas (0.9, 0.95) or SGD momentum. The recipe's settings are read from its calibration
config (`bench/heldout/recipe_*.yaml`), so the profile is calibrated for the run it guards.

    PYTHONPATH=. python -m bench.recipeloop --recipe gpt --variants fp32,profile \
        --profile bench/calibrations/recipe-gpt/profile.json

Variants: `fp32` (plain DDP), `profile` (`attach(profile, optimizer=opt, cost_model=None,
total_steps=steps)`: quality and bytes, no cost gate on loopback), `profile-measured` (the same
with attach's default measured cost model), `route:R` (a static route for every region).
Bytes per rank and step come from `StepStats` (probe bytes included, and reported apart);
FP32's are 2(W-1)/W x 4 bytes x parameters per optimizer step. One JSON line per variant.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import nfab
from nfab.config.files import read_yaml
from nfab.data import build_dataset
from nfab.distributed import run_ranks
from nfab.models.registry import load_factory
from nfab.wire.registry import allreduce_factor

RECIPES = {"gpt": "bench/heldout/recipe_gpt.yaml", "cnn": "bench/heldout/recipe_cnn.yaml",
           "vit": "bench/heldout/recipe_vit.yaml"}
"""Recipe name -> its calibration config (the run setting the loop reads)."""


@dataclass(kw_only=True, slots=True)
class RecipeRun:
    """One variant of one recipe."""

    recipe: str
    variant: str
    profile: str | None = None
    world_size: int = 4
    steps: int | None = None
    """None: the recipe's own `steps`."""
    seed: int = 0
    eval_every: int = 100


def lr_at(step: int, peak: float, warmup: int, total: int, floor: float) -> float:
    """Linear warm-up to `peak`, then cosine to `floor * peak` at `total` (nanoGPT's get_lr)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def _optimizer(model: torch.nn.Module, optim: dict[str, Any]) -> torch.optim.Optimizer:
    """Decay on matrices only (2-D and up); norms, biases and the class token get none."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": optim["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if optim["name"] == "sgd":
        return torch.optim.SGD(groups, lr=optim["lr"], momentum=optim.get("momentum", 0.9))
    return torch.optim.AdamW(groups, lr=optim["lr"], betas=tuple(optim.get("betas", (0.9, 0.95))))


def _batch(data: Any, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([data[i][0] for i in idx]), torch.stack([torch.as_tensor(data[i][1]) for i in idx])


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _evaluate(model: torch.nn.Module, data: Any) -> float:
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(data), 256):
            x, y = _batch(data, list(range(start, min(len(data), start + 256))))
            total += float(_loss(model(x), y)) * y.numel()
            count += y.numel()
    model.train()
    return total / count


def _rank(rank: int, world: int, run: RecipeRun) -> dict[str, Any] | None:
    cfg = read_yaml(RECIPES[run.recipe])
    steps = run.steps or int(cfg["steps"])
    data_opts = {k: v for k, v in cfg["data"].items() if k not in ("name", "batch_size")}
    train = build_dataset(cfg["data"]["name"], split="train", seed=run.seed, **data_opts)
    val = build_dataset(cfg["data"]["name"], split="test", seed=run.seed, **data_opts)
    torch.manual_seed(run.seed)
    model = load_factory(cfg["model"]["name"])()
    ddp = DistributedDataParallel(model)
    opt = _optimizer(model, cfg["optim"])
    runtime = None
    if run.variant.startswith("profile"):
        runtime = nfab.attach(ddp, run.profile, optimizer=opt, total_steps=steps, seed=run.seed,
                              cost_model="measure" if run.variant == "profile-measured" else None)
    elif run.variant.startswith("route:"):
        runtime = nfab.attach(ddp, route=run.variant.removeprefix("route:"), optimizer=opt, cost_model=None,
                              seed=run.seed)
    accum, clip, bs = int(cfg.get("accum_steps", 1)), cfg["optim"].get("grad_clip"), int(cfg["data"]["batch_size"])
    sched, peak = cfg["schedule"], float(cfg["optim"]["lr"])
    plain = allreduce_factor(world) * 4 * sum(p.numel() for p in model.parameters())
    sampler = torch.Generator().manual_seed(run.seed * 7919 + rank)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, peak, int(sched["warmup_steps"]), steps, float(sched["min_lr_ratio"]))
        total = 0.0
        for micro in range(accum):
            x, y = _batch(train, torch.randint(len(train), (bs,), generator=sampler).tolist())
            # every micro-batch but the last accumulates locally: one all-reduce per step
            with ddp.no_sync() if micro < accum - 1 else contextlib.nullcontext():
                loss = _loss(ddp(x), y) / accum
                if runtime is not None and micro == accum - 1:
                    runtime.observe_loss(loss * accum)
                loss.backward()
            total += float(loss.detach())
        st = runtime.step_stats() if runtime is not None else None
        pre_clip = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)) if clip else math.nan
        opt.step()
        opt.zero_grad(set_to_none=True)
        row = {"step": step, "loss": total, "pre_clip_norm": pre_clip,
               "wire_bytes": st.wire_bytes if st else plain,
               "baseline_wire_bytes": st.baseline_wire_bytes if st else plain,
               "probe_wire_bytes": st.probe_wire_bytes if st else 0, "cost_gated": bool(st and st.cost_gated),
               "health_fallback": bool(st and "health" in st.fallback_reason),
               "alarms": st.alarms if st else 0, "false_alarms": st.false_alarms if st else 0,
               "events": "; ".join(st.events) if st else "", "val_loss": math.nan}
        if (step + 1) % run.eval_every == 0 or step + 1 == steps:
            row["val_loss"] = _evaluate(model, val)
        rows.append(row)
    checksum = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().sum().reshape(1)
    sums = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(sums, checksum)
    if rank != 0:
        return None
    wire, base = sum(r["wire_bytes"] for r in rows), sum(r["baseline_wire_bytes"] for r in rows)
    probe = sum(r["probe_wire_bytes"] for r in rows)
    return {**asdict(run), "steps": steps, "val_loss": rows[-1]["val_loss"],
            "val_curve": {r["step"] + 1: r["val_loss"] for r in rows if not math.isnan(r["val_loss"])},
            "bytes_ratio": base / wire, "bytes_ratio_bf16": base / 2 / wire,
            "probe_share": probe / max(wire - probe, 1),  # of the bytes sent besides the probes
            "health_fallback_steps": sum(r["health_fallback"] for r in rows),
            "cost_gated_steps": sum(r["cost_gated"] for r in rows),
            "alarms": rows[-1]["alarms"], "false_alarms": rows[-1]["false_alarms"],
            "events": [f"{r['step']}: {r['events']}" for r in rows if r["events"]],
            "max_pre_clip_norm": max(r["pre_clip_norm"] for r in rows), "wall_s": round(time.perf_counter() - t0, 1),
            "replicas_identical": all(bool(s.eq(sums[0]).all()) for s in sums)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", choices=sorted(RECIPES), required=True)
    ap.add_argument("--variants", default="fp32,profile")
    ap.add_argument("--profile")
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for variant in args.variants.split(","):
        run = RecipeRun(recipe=args.recipe, variant=variant, profile=args.profile, world_size=args.world_size,
                        steps=args.steps, seed=args.seed)
        res = run_ranks(_rank, run.world_size, run, timeout_s=7200.0, pg_timeout_s=600.0)[0]
        print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
