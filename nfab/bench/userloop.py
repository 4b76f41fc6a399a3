"""A user's own DDP training loop with `nfab.attach`: how nfab is judged on a model it never saw.

Not `nfab train`: this is the loop a user writes (their model, their AdamW, their data
sampling), with nfab added in two lines (`attach(ddp, route=..., optimizer=opt)` and
`runtime.observe_loss(loss)`). The defaults are the held-out setting of issue 14:
`nfab.bench.heldout:user_gpt` on stdlib text, W=4 gloo ranks, AdamW lr 3e-3 wd 0.1,
batch 16 per rank, constant LR, 300 steps, validation loss on the held-out 10% of bytes.

    python -m nfab.bench.userloop --out runs/u-fp32
    python -m nfab.bench.userloop --route sign --error-feedback on --out runs/u-sign-ef
    python -m nfab.bench.userloop --route 2d=bq3 --out runs/u-bq3

`--route 2d=R` puts the 2-D weights (regions linear, embedding, head, other) on route R
and keeps norms, biases and small tensors on fp32. Each run writes `metrics.parquet`
(one row per step: loss, bytes, per-region drift signal, health events) and
`summary.json` (val loss, bytes ratio, events) to `--out`, atomically, from rank 0.
Other studies (calibration's validation) reuse `run_user_loop` with a `UserLoopConfig`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import nfab
from nfab.data import build_dataset
from nfab.distributed import run_ranks
from nfab.errors import NfabError
from nfab.fsutil import atomic_write, atomic_write_json
from nfab.models.registry import load_factory
from nfab.profile.schema import Health, Profile
from nfab.validation import validate
from nfab.wire.contract import allreduce_factor

TWO_D_REGIONS = ("linear", "embedding", "head", "other")
"""Regions that hold the 2-D weights of a Transformer (norms, biases and small tensors stay fp32)."""


@dataclass(kw_only=True, slots=True)
class UserLoopConfig:
    """One run of the user's loop."""

    model: str = "nfab.bench.heldout:user_gpt"
    """`module:factory` of the user's model (built with `seed` on every rank)."""
    world_size: int = 4
    steps: int = 300
    batch_size: int = 16
    """Per rank (global batch = batch_size * world_size)."""
    lr: float = 3e-3
    weight_decay: float = 0.1
    seed: int = 0
    route: str | dict[str, str] | None = None
    """None: plain DDP (FP32, no nfab); otherwise `attach(route=...)`."""
    error_feedback: bool | str = "auto"
    pass_optimizer: bool = True
    """Give `attach` the optimizer (its family and second moment feed the defaults and the monitor)."""
    health: dict[str, Any] = field(default_factory=dict)
    """Overrides of the profile's `Health` thresholds (e.g. {"min_trend_cosine": 0} to only observe)."""
    eval_every: int = 100
    max_bytes: int = 2_000_000
    """Bytes of stdlib text (the last 10% are the validation split)."""
    eval_windows: int | None = None
    """Validation windows (None: the whole validation split)."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.steps < 1 or self.batch_size < 1:
            raise ValueError("world_size, steps and batch_size must be >= 1")


def health_with(overrides: dict[str, Any]) -> Health:
    """The default `Health` thresholds with `overrides` (validated: unknown keys are errors)."""
    return validate(Health, {**Health().model_dump(), **overrides}, where="health")


def two_d(route: str) -> dict[str, str]:
    """Route the 2-D weights' regions on `route`, everything else fp32."""
    return {r: route for r in TWO_D_REGIONS}


def parse_route(text: str | None) -> str | dict[str, str] | None:
    """`R` (every region), `2d=R`, or `region=R,region=R` (others fp32); None/'fp32-ddp': plain DDP."""
    if text is None or text == "fp32-ddp":
        return None
    if "=" not in text:
        return text
    out: dict[str, str] = {}
    for part in text.split(","):
        key, _, route = part.partition("=")
        out.update(two_d(route) if key == "2d" else {key: route})
    return out


def _evaluate(model: torch.nn.Module, data: Any, windows: int | None) -> float:
    """Mean next-byte cross-entropy over the validation windows (in order, batches of 256)."""
    n = len(data) if windows is None else min(windows, len(data))
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for start in range(0, n, 256):
            idx = range(start, min(n, start + 256))
            x = torch.stack([data[i][0] for i in idx])
            y = torch.stack([data[i][1] for i in idx])
            logits = model(x)
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"))
            count += y.numel()
    model.train()
    return total / count


def _rank_loop(rank: int, world: int, cfg: UserLoopConfig) -> dict[str, Any] | None:
    torch.manual_seed(cfg.seed)
    model = load_factory(cfg.model)()
    train = build_dataset("stdlib-text", split="train", seed=cfg.seed, max_bytes=cfg.max_bytes)
    val = build_dataset("stdlib-text", split="test", seed=cfg.seed, max_bytes=cfg.max_bytes)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    runtime = None
    if cfg.route is not None:
        prof = Profile.static(cfg.route)
        if cfg.health:
            prof = prof.model_copy(update={"health": health_with(cfg.health)})
        # an explicit route, as a user gives it (no cost gate); the profile object carries health overrides
        runtime = nfab.attach(ddp, prof if cfg.health else None, route=None if cfg.health else cfg.route,
                              optimizer=opt if cfg.pass_optimizer else None, error_feedback=cfg.error_feedback,
                              cost_model=None, seed=cfg.seed)
    numel = sum(p.numel() for p in model.parameters())
    plain_bytes = allreduce_factor(world) * 4 * numel
    sampler = torch.Generator().manual_seed(cfg.seed * 7919 + rank)
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for step in range(cfg.steps):
        idx = torch.randint(len(train), (cfg.batch_size,), generator=sampler, device="cpu").tolist()
        x = torch.stack([train[i][0] for i in idx])
        y = torch.stack([train[i][1] for i in idx])
        logits = ddp(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        if runtime is not None:
            runtime.observe_loss(loss)
        loss.backward()
        st = runtime.step_stats() if runtime is not None else None
        opt.step()
        opt.zero_grad(set_to_none=True)
        row: dict[str, Any] = {"step": step, "loss": float(loss.detach()),
                               "wire_bytes": st.wire_bytes if st else plain_bytes,
                               "baseline_wire_bytes": st.baseline_wire_bytes if st else plain_bytes,
                               "route_mix": json.dumps(st.route_mix) if st else '{"fp32": 1.0}',
                               "fidelity_cosine": st.fidelity_cosine if st else None,
                               "region_cosine": json.dumps(st.region_cosine) if st else "{}",
                               "fallback_reason": st.fallback_reason if st else "",
                               "events": "; ".join(st.events) if st else "",
                               "val_loss": math.nan}
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            row["val_loss"] = _evaluate(model, val, cfg.eval_windows) if rank == 0 else math.nan
        rows.append(row)
    checksum = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().sum().reshape(1)
    sums = [torch.zeros(1, dtype=torch.float64, device="cpu") for _ in range(world)]
    dist.all_gather(sums, checksum)
    if rank != 0:
        return None
    events = [f"step {r['step']}: {r['events']}" for r in rows if r["events"]]
    return {"rows": rows, "events": events, "wall_s": time.perf_counter() - t_start,
            "replicas_identical": all(bool(s.eq(sums[0]).all()) for s in sums)}


def run_user_loop(cfg: UserLoopConfig, out: Path | None = None, timeout_s: float = 7200.0) -> dict[str, Any]:
    """Run the user's loop on `cfg.world_size` gloo ranks; the summary (and files in `out`)."""
    res = run_ranks(_rank_loop, cfg.world_size, cfg, timeout_s=timeout_s, pg_timeout_s=600.0)[0]
    rows = res["rows"]
    wire = sum(r["wire_bytes"] for r in rows)
    plain = sum(r["baseline_wire_bytes"] for r in rows)
    summary = {
        "config": asdict(cfg),
        "val_loss": rows[-1]["val_loss"],
        "val_curve": {r["step"] + 1: r["val_loss"] for r in rows if not math.isnan(r["val_loss"])},
        "wire_bytes": wire,
        "baseline_wire_bytes": plain,
        "bytes_ratio": plain / wire if wire else math.inf,
        "demotions": sum(e.count("fallback:") for e in res["events"]),
        "error_feedback_off": sum(e.count("ef_off:") for e in res["events"]),
        "events": res["events"],
        "fallback_steps": sum(1 for r in rows if r["fallback_reason"] and "health" in r["fallback_reason"]),
        "wall_s": res["wall_s"],
        "replicas_identical": res["replicas_identical"],
        "command": " ".join(sys.argv),
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / "metrics.parquet", lambda p: pd.DataFrame(rows).to_parquet(p, index=False))
        atomic_write_json(out / "summary.json", summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nfab.bench.userloop", description=__doc__.split("\n\n")[0])
    ap.add_argument("--route", default=None, help="R | 2d=R | region=R,...  (omit: plain FP32 DDP)")
    ap.add_argument("--error-feedback", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--no-optimizer", action="store_true", help="do not pass the optimizer to attach")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--health", default="{}", help='JSON overrides of Health, e.g. \'{"min_trend_cosine": 0}\'')
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    try:
        health = json.loads(a.health)
        ef: bool | str = {"auto": "auto", "on": True, "off": False}[a.error_feedback]
        cfg = UserLoopConfig(route=parse_route(a.route), error_feedback=ef, pass_optimizer=not a.no_optimizer,
                             steps=a.steps, world_size=a.world_size, seed=a.seed, health=health)
        health_with(health)
        if cfg.route is not None:
            Profile.static(cfg.route)  # unknown routes or regions: one line here, not a traceback per rank
    except (ValueError, TypeError, NfabError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    s = run_user_loop(cfg, a.out)
    keys = ("val_loss", "bytes_ratio", "demotions", "error_feedback_off", "fallback_steps", "wall_s",
            "replicas_identical")
    print(json.dumps({k: s[k] for k in keys}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
