"""Step benchmark: training-step time of communication variants, side by side in one run.

Every variant is its own DDP model with the same initial weights, fed the same batches,
on the same W gloo ranks. Steps are interleaved — step i of every variant runs before
step i+1 of any, in an order that rotates each step — and each timed step starts after a
barrier, so machine noise hits all variants alike. A step is zero_grad + forward +
backward (DDP's communication finishes inside backward) + optimizer step; its time is
the slowest rank's. Ratios are medians of per-step ratios (paired by step), which a
noisy machine disturbs much less than a ratio of medians.

Variants (`VARIANTS`): plain DDP (FP32 all-reduce), a hook that sends nothing (the
no-communication floor), PyTorch's fp16_compress_hook and powerSGD_hook (rank 2, one
bucket: on gloo it launches its second all-reduce from a future callback and aborts
with several buckets), and nfab with route fp32, static sign, or a profile (cost-gated
by the link nfab measures at attach time).

With `link` set, the ranks run inside a private network namespace whose loopback is
shaped to that rate (see `nfab.bench.netns`).
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations at registration.
import copy
import importlib
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

import nfab
from nfab.bench import netns
from nfab.data import build_dataset, make_loader
from nfab.distributed import run_ranks
from nfab.errors import ConfigError
from nfab.fsutil import atomic_write_text
from nfab.models import build_model
from nfab.profile.schema import Profile
from nfab.train.config import NFAB_BUCKET_MB
from nfab.validation import STRICT_DATACLASS, validate_dataclass

VARIANTS: dict[str, str] = {
    "plain": "DDP, FP32 all-reduce",
    "floor": "hook that sends nothing (no-communication floor)",
    "fp16": "torch fp16_compress_hook",
    "allreduce-hook": "torch allreduce_hook (a Python hook, same collective as plain)",
    "powersgd": "torch powerSGD_hook, rank 2, one bucket",
    "nfab-fp32": "nfab, route fp32",
    "nfab-sign": "nfab, static route sign",
    "nfab-profile": "nfab, profile (cost-gated)",
}
"""Variant name -> what it runs."""
STEP_VARIANTS: tuple[str, ...] = ("plain", "floor", "fp16", "powersgd", "nfab-sign", "nfab-profile")
DEFAULT_PROFILE = Path("calibrations/resnet18/profile.json")
POWERSGD_BUCKET_MB = 1000.0
"""PowerSGD's single bucket on gloo."""


def test_profile() -> Profile:
    """A stand-in profile when none is calibrated: sign on conv/linear/head, fp32 elsewhere."""
    return Profile.static({"conv": "sign", "linear": "sign", "head": "sign"}, model_name="resnet18")


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """One side-by-side run (JSON-able: it crosses into spawned ranks and the namespace)."""

    __pydantic_config__ = STRICT_DATACLASS

    variants: tuple[str, ...] = STEP_VARIANTS
    """Variants to time (names in `VARIANTS`); `plain` is always included (the ratio base)."""
    model: str = "resnet18"
    width: int = 64
    """ResNet stem width (64 = torchvision; 32 has 2.8M parameters)."""
    batch: int = 16
    """Samples per rank per step."""
    steps: int = 20
    """Timed steps per variant."""
    warmup: int = 3
    """Untimed steps first: DDP rebuilds buckets after step 1, PowerSGD compresses from step 2."""
    image_size: int = 32
    data: str = "synthetic-images"
    """`synthetic-images` or `digits` (resized to image_size, 3 channels)."""
    seed: int = 0
    world_size: int = 2
    lr: float = 0.01
    link: str | None = None
    """A tc rate (`1gbit`, `100mbit`) to shape the ranks' loopback to, or None."""
    nfab_bucket_mb: float = NFAB_BUCKET_MB
    """DDP bucket cap for the nfab variants (nfab train's default under the hook): smaller
    compressed buckets overlap backward more. The other variants keep DDP's 25."""
    profile: dict[str, Any] | None = None
    """The profile (as its JSON dict) for `nfab-profile`; None: `test_profile()`."""
    profile_source: str = "test profile (conv/linear/head sign)"

    def __post_init__(self) -> None:
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown:
            raise ConfigError(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
        if "plain" not in self.variants:
            object.__setattr__(self, "variants", ("plain", *self.variants))
        if self.model != "resnet18":
            raise ConfigError(f"bench supports model resnet18 (image data), got {self.model!r}")
        if self.data not in ("synthetic-images", "digits"):
            raise ConfigError(f"bench data must be synthetic-images or digits, got {self.data!r}")
        for key in ("width", "batch", "steps", "image_size", "world_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.warmup < 0:
            raise ConfigError(f"warmup must be >= 0, got {self.warmup}")
        if self.link is not None:
            object.__setattr__(self, "link", netns.check_rate(self.link))
        if self.profile is not None:
            Profile.from_dict(self.profile)  # validate here, in one line, not inside a rank

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["variants"] = list(self.variants)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BenchConfig":
        """Validate strictly: unknown keys and wrongly typed values are one-line `ConfigError`s."""
        return validate_dataclass(cls, d, where="bench")


# ---- variants -----------------------------------------------------------------------
def no_comm_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The no-communication floor: a completed future of the unchanged bucket."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


@dataclass(slots=True)
class Run:
    """One variant's model, optimizer and hook state on this rank."""

    name: str
    ddp: DDP
    opt: torch.optim.Optimizer
    runtime: Any = None
    """nfab's Runtime for nfab variants."""
    state: Any = None
    """A torch hook's state (kept alive for PowerSGD)."""
    times: list[float] = field(default_factory=list)
    loss: float = float("nan")


def build_run(name: str, module: torch.nn.Module, cfg: BenchConfig) -> Run:
    """Wrap a copy of `module` in DDP and attach variant `name`'s communication."""
    module = copy.deepcopy(module)
    if name == "powersgd":
        ddp = DDP(module, bucket_cap_mb=POWERSGD_BUCKET_MB)
    elif name.startswith("nfab-"):
        ddp = DDP(module, bucket_cap_mb=cfg.nfab_bucket_mb)
    else:
        ddp = DDP(module)
    run = Run(name, ddp, torch.optim.SGD(ddp.parameters(), lr=cfg.lr, momentum=0.9))
    total = cfg.warmup + cfg.steps
    if name == "floor":
        ddp.register_comm_hook(None, no_comm_hook)
    elif name == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "allreduce-hook":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif name == "powersgd":
        run.state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)
        ddp.register_comm_hook(run.state, psgd.powerSGD_hook)
    elif name == "nfab-fp32":
        run.runtime = nfab.attach(ddp, route="fp32", total_steps=total, seed=cfg.seed)
    elif name == "nfab-sign":
        run.runtime = nfab.attach(ddp, route="sign", total_steps=total, seed=cfg.seed)
    elif name == "nfab-profile":
        prof = Profile.from_dict(cfg.profile) if cfg.profile is not None else test_profile()
        run.runtime = nfab.attach(ddp, prof, total_steps=total, seed=cfg.seed)
    return run


def batches(cfg: BenchConfig, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's batches (seeded; the same for every variant), at most warmup+steps of them."""
    ds = build_dataset(cfg.data, split="train", seed=cfg.seed, image_size=cfg.image_size, channels=3)
    loader = make_loader(ds, batch_size=cfg.batch, rank=rank, world_size=cfg.world_size, seed=cfg.seed)
    out = []
    for x, y in loader:
        out.append((x, y))
        if len(out) >= cfg.warmup + cfg.steps:
            break
    return out


def prepare(rank: int, cfg: BenchConfig) -> tuple[list[Run], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Every variant's Run from one seeded model, and this rank's batches."""
    spec = build_model(cfg.model, seed=cfg.seed, num_classes=10, width=cfg.width, small_input=True,
                       image_size=cfg.image_size)
    return [build_run(name, spec.module, cfg) for name in cfg.variants], batches(cfg, rank)


def train_step(run: Run, x: torch.Tensor, y: torch.Tensor) -> float:
    """One timed training step (after a barrier, so ranks start together); seconds."""
    dist.barrier()
    t0 = time.perf_counter()
    run.opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(run.ddp(x), y)
    if run.runtime is not None:
        run.runtime.observe_loss(loss)
    loss.backward()
    run.opt.step()
    dt = time.perf_counter() - t0
    run.loss = float(loss.detach())
    return dt


def time_runs(runs: list[Run], data: list[tuple[torch.Tensor, torch.Tensor]], cfg: BenchConfig) -> None:
    """Interleave the variants step by step (rotating order); fills each run's `times`."""
    for step in range(cfg.warmup + cfg.steps):
        x, y = data[step % len(data)]
        k = step % len(runs)
        for run in runs[k:] + runs[:k]:
            dt = train_step(run, x, y)
            if step >= cfg.warmup:
                run.times.append(dt)


def slowest_rank_times(runs: list[Run]) -> dict[str, list[float]]:
    """Per step, the slowest rank's time (MAX across ranks), per variant."""
    t = torch.tensor([r.times for r in runs], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {r.name: t[i].tolist() for i, r in enumerate(runs)}


def nfab_info(run: Run, warmup: int) -> dict[str, Any] | None:
    """What nfab did: routes, wire bytes against FP32, fallbacks, hook CPU time, its cost model."""
    rt = run.runtime
    if rt is None:
        return None
    hist = list(rt.history)[warmup:] or list(rt.history)
    last = hist[-1]
    cm = rt.controller.cost_model
    return {
        "route_mix": last.route_mix,
        "wire_bytes_per_step": float(np.mean([h.wire_bytes for h in hist])),
        "fp32_wire_bytes_per_step": float(np.mean([h.fp32_wire_bytes for h in hist])),
        "fallback_reasons": sorted({h.fallback_reason for h in hist if h.fallback_reason}),
        "hook_ms_median": 1e3 * float(np.median([h.hook_time_s for h in hist])),
        "buckets": last.buckets,
        "cost_model": None if cm is None else json.loads(cm.to_json()),
    }


def rank_main(rank: int, world_size: int, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """One rank of `nfab bench step` (run under `run_ranks`)."""
    cfg = BenchConfig.from_dict(cfg_dict)
    runs, data = prepare(rank, cfg)
    time_runs(runs, data, cfg)
    times = slowest_rank_times(runs)
    nparams = sum(p.numel() for p in runs[0].ddp.parameters())
    return {
        "parameters": nparams,
        "times_s": times,
        "loss": {r.name: r.loss for r in runs},
        "nfab": {r.name: info for r in runs if (info := nfab_info(r, cfg.warmup)) is not None},
    }


# ---- running and summarising --------------------------------------------------------
def _timeout(cfg: BenchConfig) -> float:
    per_step = 0.05 * cfg.width / 64 * cfg.batch  # generous seconds per variant step
    return 120.0 + (cfg.warmup + cfg.steps) * len(cfg.variants) * max(per_step, 0.2) * 10


def run_local(cfg_dict: dict[str, Any], rank_fn: Any = rank_main) -> dict[str, Any]:
    """Run the ranks on this network namespace's loopback; rank 0's result."""
    cfg = BenchConfig.from_dict(cfg_dict)
    results = run_ranks(rank_fn, cfg.world_size, cfg.to_dict(), timeout_s=_timeout(cfg), pg_timeout_s=600)
    out = results[0]
    out["link"] = None
    return out


def _run_local_target(payload: dict[str, Any]) -> dict[str, Any]:
    return run_local(payload)


def run(cfg: BenchConfig, target: str = "nfab.bench.step:_run_local_target") -> dict[str, Any]:
    """Run the benchmark (shaped link when `cfg.link`); the raw per-step result dict."""
    if cfg.link is None:
        module, _, name = target.partition(":")
        return getattr(importlib.import_module(module), name)(cfg.to_dict())
    return netns.run_shaped(cfg.link, target, cfg.to_dict(), timeout_s=_timeout(cfg) + 60)


@dataclass(frozen=True, slots=True)
class Row:
    """One variant's summary."""

    variant: str
    description: str
    median_ms: float
    p10_ms: float
    p90_ms: float
    ratio_to_plain: float
    """Median over steps of (this variant's step time / plain's at the same step)."""
    ratio_to_floor: float | None
    """Same, against the no-communication floor (None without a floor variant)."""
    steps: int


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median of per-step ratios a[i] / b[i]."""
    return float(np.median(np.asarray(a) / np.asarray(b)))


def summarize(raw: dict[str, Any]) -> list[Row]:
    """Median, p10-p90 and paired ratios per variant."""
    times: dict[str, list[float]] = raw["times_s"]
    plain, floor = times["plain"], times.get("floor")
    rows = []
    for name, ts in times.items():
        ms = 1e3 * np.asarray(ts)
        rows.append(Row(
            variant=name, description=VARIANTS[name],
            median_ms=float(np.median(ms)), p10_ms=float(np.percentile(ms, 10)), p90_ms=float(np.percentile(ms, 90)),
            ratio_to_plain=paired_ratio(ts, plain),
            ratio_to_floor=None if floor is None else paired_ratio(ts, floor),
            steps=len(ts),
        ))
    return rows


def report(cfg: BenchConfig, raw: dict[str, Any], command: str = "") -> dict[str, Any]:
    """The JSON document: config, link, summary rows, nfab details and raw step times."""
    return {
        "nfab_version": nfab.__version__,
        "torch_version": torch.__version__,
        "command": command or " ".join(sys.argv),
        "config": cfg.to_dict(),
        "parameters": raw["parameters"],
        "link": raw.get("link"),
        "rows": [asdict(r) for r in summarize(raw)],
        "nfab": raw["nfab"],
        "loss": raw["loss"],
        "times_s": raw["times_s"],
        **{k: v for k, v in raw.items() if k.startswith("breakdown")},
    }


def write_json(path: str | Path, doc: dict[str, Any]) -> Path:
    """Write a report atomically."""
    return atomic_write_text(path, json.dumps(doc, indent=2) + "\n")


def load_profile_dict(path: str | Path | None) -> tuple[dict[str, Any] | None, str]:
    """The profile for `nfab-profile`: `path`, else DEFAULT_PROFILE if present, else the test profile."""
    if path is None and DEFAULT_PROFILE.exists():
        path = DEFAULT_PROFILE
    if path is None:
        return None, "test profile (conv/linear/head sign)"
    return Profile.load(path).to_dict(), str(path)
