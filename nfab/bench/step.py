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
shaped to that rate (see `nfab.bench.netns`). With `nodes=2` they run as 2 emulated nodes of
W/2 ranks, network namespaces joined by a veth pair shaped to that rate (see
`nfab.bench.nodes`). Either way every row also carries the bytes that crossed the shaped
link per timed step, counted by the interfaces' tx counters, beside the bytes the cost model
predicts for it (`nfab.bench.linkbytes`).

A variant `nfab:ROUTE` (e.g. `nfab:q8`) is nfab with that static route. With
`parallel="fsdp"` every variant runs under FSDP2 instead (`FSDP_VARIANTS`, `nfab.bench.fsdpstep`).
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations at registration.
import contextlib
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
from torch.nn.parallel import DistributedDataParallel as DDP

import nfab
from nfab.bench import host, linkbytes, netns, nodes
from nfab.bench.variants import (  # noqa: F401 - re-exported: fsdpstep and the CLIs read them here
    POWERSGD_BUCKET_MB,
    POWERSGD_START,
    ROUTE_VARIANT,
    attach_comm,
    bf16_hook,
    ddp_for,
    no_comm_hook,
    on_bench_model,
    test_profile,
)
from nfab.config.optim import autocast
from nfab.data import build_dataset, make_loader
from nfab.distributed import run_ranks
from nfab.errors import ConfigError
from nfab.fsutil import atomic_write_text
from nfab.models import build_model
from nfab.profile.schema import Profile
from nfab.runtime.frontends import fsdp2
from nfab.train.config import NFAB_BUCKET_MB
from nfab.train.setup import clip_and_step, loss_fn
from nfab.validation import STRICT_DATACLASS, validate_dataclass

VARIANTS: dict[str, str] = {
    "plain": "DDP, FP32 all-reduce",
    "floor": "hook that sends nothing (no-communication floor)",
    "fp16": "torch fp16_compress_hook",
    "bf16": "torch bf16_compress_hook (bf16 DDP: the honest baseline)",
    "allreduce-hook": "torch allreduce_hook (a Python hook, same collective as plain)",
    "powersgd": "torch powerSGD_hook, rank 2, one bucket",
    "nfab-fp32": "nfab, route fp32",
    "nfab-sign": "nfab, static route sign",
    "nfab-sign-2level": "nfab, static route sign, two-level (hierarchy auto: node-local + across nodes)",
    "nfab-profile": "nfab, profile (cost-gated)",
}
"""Variant name -> what it runs."""
STEP_VARIANTS: tuple[str, ...] = ("plain", "floor", "bf16", "fp16", "powersgd", "nfab-sign", "nfab-profile")
DEFAULT_PROFILE = Path("calibrations/resnet18/profile.json")


FSDP_VARIANTS: dict[str, str] = {
    "plain": "FSDP2, FP32 reduce-scatter",
    "bf16": "FSDP2, bf16 reduce-scatter (MixedPrecisionPolicy reduce_dtype)",
    "floor": "FSDP2, reduce-scatter that sends nothing (no-communication floor)",
    "nfab-fp32": "nfab on FSDP2, route fp32",
    "nfab-sign": "nfab on FSDP2, static route sign",
    "nfab-profile": "nfab on FSDP2, profile (cost-gated)",
}
"""Variant name -> what it runs under `parallel="fsdp"` (`nfab.bench.fsdpstep`)."""
FSDP_STEP_VARIANTS: tuple[str, ...] = ("plain", "bf16", "floor", "nfab-profile")
PARALLEL = ("ddp", "fsdp")

COST_MODELS = ("measure", "none")


def describe(variant: str, parallel: str = "ddp") -> str:
    """What a variant runs (VARIANTS, FSDP_VARIANTS, or `nfab:ROUTE`)."""
    if variant.startswith(ROUTE_VARIANT):
        return f"nfab, static route {variant.removeprefix(ROUTE_VARIANT)}"
    return (FSDP_VARIANTS if parallel == "fsdp" else VARIANTS)[variant]


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
    """A tc rate (`1gbit`, `100mbit`) to shape the ranks' loopback (or, with nodes=2, the
    inter-node link, each direction) to, or None."""
    nodes: int = 1
    """Emulated nodes: 1, or 2 network namespaces of W/2 ranks joined by the shaped link."""
    delay: str | None = None
    """One-way delay on the inter-node link (`1ms`; nodes=2 only; needs tc netem)."""
    cost_model: str = "measure"
    """nfab variants' cost model: `measure` (at attach, on the live link) or `none` (routes
    and coalescing decided by bytes alone: the same decisions on any link)."""
    nfab_bucket_mb: float = NFAB_BUCKET_MB
    """DDP bucket cap for the nfab variants (nfab train's default under the hook): smaller
    compressed buckets overlap backward more. The other variants keep DDP's 25."""
    profile: dict[str, Any] | None = None
    """The profile (as its JSON dict) for `nfab-profile`; None: `test_profile()`."""
    profile_source: str = "test profile (conv/linear/head sign)"
    parallel: str = "ddp"
    """`ddp`, or `fsdp`: every variant under FSDP2 (`FSDP_VARIANTS`, `nfab.bench.fsdpstep`)."""

    def __post_init__(self) -> None:
        if self.parallel not in PARALLEL:
            raise ConfigError(f"parallel must be one of {', '.join(PARALLEL)}, got {self.parallel!r}")
        known = FSDP_VARIANTS if self.parallel == "fsdp" else VARIANTS
        if self.parallel == "fsdp" and self.variants == STEP_VARIANTS:
            object.__setattr__(self, "variants", FSDP_STEP_VARIANTS)
        if self.parallel == "fsdp" and self.nodes > 1:
            raise ConfigError("--parallel fsdp runs on one emulated node (--nodes 1)")
        if self.parallel == "fsdp":
            fsdp2.require("--parallel fsdp")
        unknown = [v for v in self.variants if v not in known and not v.startswith(ROUTE_VARIANT)]
        if unknown:
            raise ConfigError(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(known)}")
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
        for v in self.variants:
            if v.startswith(ROUTE_VARIANT):
                Profile.static(v.removeprefix(ROUTE_VARIANT))  # an unknown route: one line here
        nodes.check_nodes(self.nodes)
        if self.nodes > 1 and self.link is None:
            raise ConfigError("--nodes 2 needs --link RATE (the inter-node link's rate)")
        if self.nodes > 1 and self.world_size % self.nodes:
            raise ConfigError(f"--nodes {self.nodes} needs a world size divisible by it, got {self.world_size}")
        if self.delay is not None:
            if self.nodes < 2:
                raise ConfigError("--delay applies to the inter-node link: it needs --nodes 2")
            object.__setattr__(self, "delay", nodes.check_delay(self.delay))
        if self.cost_model not in COST_MODELS:
            raise ConfigError(f"cost_model must be one of {', '.join(COST_MODELS)}, got {self.cost_model!r}")
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
@dataclass(slots=True)
class Run:
    """One variant's model, optimizer and hook state on this rank."""

    name: str
    ddp: DDP
    """The wrapped model: DDP, or the FSDP2 root under `parallel="fsdp"`."""
    opt: torch.optim.Optimizer
    runtime: Any = None
    """nfab's Runtime for nfab variants."""
    state: Any = None
    """A torch hook's state (kept alive for PowerSGD)."""
    times: list[float] = field(default_factory=list)
    loss: float = float("nan")
    link_bytes: int = 0
    """Bytes this node sent on the shaped link during the timed steps (node's first rank only)."""
    scaler: torch.amp.GradScaler | None = None
    """The fp16 recipe's loss scaler (`Recipe.precision`), told to nfab's attach; None otherwise."""


@dataclass(frozen=True, slots=True)
class Recipe:
    """What a training config's step does around forward, backward and the optimizer step, as
    `nfab train` does it (`recipe_step`): a nanoGPT-style recipe clips, accumulates and autocasts."""

    grad_clip: float | None = None
    accum_steps: int = 1
    precision: str = "fp32"

    @classmethod
    def of(cls, tc: Any) -> "Recipe":
        """The recipe of a `TrainConfig`."""
        return cls(tc.optim.grad_clip, tc.accum_steps, tc.precision)


def build_run(name: str, module: torch.nn.Module, cfg: BenchConfig) -> Run:
    """Wrap a copy of `module` in DDP and attach variant `name`'s communication."""
    ddp = ddp_for(name, copy.deepcopy(module), cfg.nfab_bucket_mb)
    run = Run(name, ddp, torch.optim.SGD(ddp.parameters(), lr=cfg.lr, momentum=0.9))
    run.runtime, run.state = attach_comm(name, ddp, total_steps=cfg.warmup + cfg.steps, seed=cfg.seed,
                                         cost_model=cfg.cost_model, profile=cfg.profile)
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


def train_step(run: Run, x: torch.Tensor, y: torch.Tensor, task: str = "classification") -> float:
    """One timed training step (after a barrier, so ranks start together); seconds."""
    return recipe_step(run, [(x, y)], task)


def recipe_step(run: Run, batches: list[tuple[torch.Tensor, torch.Tensor]], task: str = "classification",
                recipe: Recipe = Recipe()) -> float:
    """One timed optimizer step of `recipe` over its micro-`batches` (after a barrier); seconds.

    As `nfab train` steps: every micro-batch but the last under DDP's `no_sync` (the gradients
    accumulate locally and go out once), the loss under autocast (bf16, fp16) and divided by the
    micro-batches, scaled by the run's GradScaler (fp16), the gradient clipped unscaled, and the
    scaler's step (it skips an overflowed step). Why: time to accuracy is the user's recipe's; a
    bench that trained without its clipping or accumulation would time another recipe."""
    dist.barrier()
    t0 = time.perf_counter()
    run.opt.zero_grad(set_to_none=True)
    scaler, n = run.scaler, len(batches)
    losses = []
    for i, (x, y) in enumerate(batches):
        last = i == n - 1
        with contextlib.nullcontext() if last else run.ddp.no_sync():
            with autocast(recipe.precision, x.device.type):
                loss = loss_fn(task, run.ddp(x), y)
            losses.append(loss.detach())
            if last and run.runtime is not None:
                run.runtime.observe_loss(losses[0] if n == 1 else torch.stack(losses).mean())
            part = loss if n == 1 else loss / n
            (part if scaler is None else scaler.scale(part)).backward()
    clip_and_step(run.opt, run.ddp.parameters(), recipe.grad_clip, scaler)
    dt = time.perf_counter() - t0
    run.loss = float(losses[0] if n == 1 else torch.stack(losses).mean())
    return dt


def time_runs(runs: list[Run], data: list[tuple[torch.Tensor, torch.Tensor]], cfg: BenchConfig,
              counter: linkbytes.TxCounter | None = None) -> None:
    """Interleave the variants step by step (rotating order); fills each run's `times`.

    With a `counter` (shaped link), each timed step is closed by a barrier and the bytes
    the link carried between its opening and closing barriers are added to the run's
    `link_bytes` (the two barriers' few hundred bytes included).
    """
    for step in range(cfg.warmup + cfg.steps):
        x, y = data[step % len(data)]
        k = step % len(runs)
        for run in runs[k:] + runs[:k]:
            timed = step >= cfg.warmup
            if counter is not None and timed:
                dist.barrier()
                before = counter.read()
            dt = train_step(run, x, y)
            if counter is not None and timed:
                dist.barrier()
                run.link_bytes += counter.read() - before
            if timed:
                run.times.append(dt)


def slowest_rank_times(runs: list[Run]) -> dict[str, list[float]]:
    """Per step, the slowest rank's time (MAX across ranks), per variant."""
    t = torch.tensor([r.times for r in runs], dtype=torch.float64, device="cpu")
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
        "baseline_wire_bytes_per_step": float(np.mean([h.baseline_wire_bytes for h in hist])),
        "intra_node_bytes_per_step": float(np.mean([h.intra_node_bytes for h in hist])),
        "inter_node_bytes_per_step": float(np.mean([h.inter_node_bytes for h in hist])),
        "fallback_reasons": sorted({h.fallback_reason for h in hist if h.fallback_reason}),
        "hook_ms_median": 1e3 * float(np.median([h.hook_time_s for h in hist])),
        "buckets": last.buckets,
        "cost_model": None if cm is None else json.loads(cm.to_json()),
    }


def link_bytes_per_step(runs: list[Run], cfg: BenchConfig) -> dict[str, float]:
    """Bytes across the shaped link per timed step, per variant: every node's count, summed."""
    t = torch.tensor([float(r.link_bytes) for r in runs], dtype=torch.float64, device="cpu")
    dist.all_reduce(t)
    return {r.name: float(t[i]) / cfg.steps for i, r in enumerate(runs)}


def rank_main(rank: int, world_size: int, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """One rank of `nfab bench step` (run under `run_ranks`)."""
    cfg = BenchConfig.from_dict(cfg_dict)
    runs, data = prepare(rank, cfg)
    shaped = cfg.link is not None
    counter = linkbytes.TxCounter(nodes.IFACE if cfg.nodes > 1 else "lo") if shaped else None
    if counter is not None and linkbytes.local_rank() != 0:
        counter = linkbytes.TxCounter(None)  # one reader per node: its first rank
    time_runs(runs, data, cfg, counter)
    times = slowest_rank_times(runs)
    nparams = sum(p.numel() for p in runs[0].ddp.parameters())
    infos = {r.name: info for r in runs if (info := nfab_info(r, cfg.warmup)) is not None}
    out: dict[str, Any] = {
        "parameters": nparams,
        "times_s": times,
        "loss": {r.name: r.loss for r in runs},
        "params_sha256": {r.name: linkbytes.params_digest(r.ddp.module) for r in runs},
        "nfab": infos,
    }
    if shaped:
        measured = link_bytes_per_step(runs, cfg)
        module = runs[0].ddp.module
        out["wire_bytes"] = {
            r.name: {"measured_wire_bytes_per_step": measured[r.name],
                     "modelled_wire_bytes_per_step": linkbytes.modelled_link_bytes(
                         r.name, module, world_size, cfg.nodes, infos.get(r.name))}
            for r in runs
        }
    return out


# ---- running and summarising --------------------------------------------------------
def _timeout(cfg: BenchConfig) -> float:
    """A hang guard, generous: W ranks share this machine's cores, so a step slows with W."""
    per_step = 0.05 * cfg.width / 64 * cfg.batch * max(1.0, cfg.world_size / 2)  # seconds per variant step
    return 300.0 + (cfg.warmup + cfg.steps) * len(cfg.variants) * max(per_step, 0.2) * 20


def run_local(cfg_dict: dict[str, Any], rank_fn: Any = rank_main) -> dict[str, Any]:
    """Run the ranks on this network namespace's loopback; rank 0's result."""
    cfg = BenchConfig.from_dict(cfg_dict)
    results = run_ranks(rank_fn, cfg.world_size, cfg.to_dict(), timeout_s=_timeout(cfg), pg_timeout_s=600)
    out = results[0]
    out["link"] = None
    return out


def _run_local_target(payload: dict[str, Any]) -> dict[str, Any]:
    return run_local(payload)


def _run_node_target(payload: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    """One emulated node's ranks (under `nfab.bench.nodes`); its first rank's result."""
    cfg = BenchConfig.from_dict(payload)
    results = run_ranks(rank_main, cfg.world_size, cfg.to_dict(), timeout_s=_timeout(cfg), pg_timeout_s=600,
                        ranks=range(*node["ranks"]), master_addr=node["master_addr"], port=node["port"],
                        group_rank=node["index"])
    return results[0]


def run(cfg: BenchConfig, target: str = "nfab.bench.step:_run_local_target") -> dict[str, Any]:
    """Run the benchmark (shaped link when `cfg.link`, 2 nodes when `cfg.nodes`); the raw result dict."""
    if cfg.nodes > 1:
        assert cfg.link is not None
        return nodes.run_on_nodes("nfab.bench.step:_run_node_target", cfg.to_dict(), cfg.world_size, cfg.link,
                                  cfg.delay, timeout_s=_timeout(cfg) + 120)
    if cfg.parallel == "fsdp":
        target = "nfab.bench.fsdpstep:_run_local_target"
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
    measured_wire_bytes_per_step: float | None = None
    """Bytes that crossed the shaped link per timed step (tx counters; None without a link)."""
    modelled_wire_bytes_per_step: float | None = None
    """The cost model's prediction of the same bytes (None without a link, or no model)."""
    ratio_to_bf16: float | None = None
    """Median of per-step ratios against bf16 DDP, the honest baseline (None without a bf16 variant)."""


def paired_ratio(a: list[float], b: list[float]) -> float:
    """Median of per-step ratios a[i] / b[i]."""
    return float(np.median(np.asarray(a) / np.asarray(b)))


def summarize(raw: dict[str, Any]) -> list[Row]:
    """Median, p10-p90 and paired ratios per variant."""
    times: dict[str, list[float]] = raw["times_s"]
    plain, floor, bf16 = times["plain"], times.get("floor"), times.get("bf16")
    wire = raw.get("wire_bytes", {})
    rows = []
    for name, ts in times.items():
        ms = 1e3 * np.asarray(ts)
        rows.append(Row(
            variant=name, description=describe(name, raw.get("parallel", "ddp")),
            median_ms=float(np.median(ms)), p10_ms=float(np.percentile(ms, 10)), p90_ms=float(np.percentile(ms, 90)),
            ratio_to_plain=paired_ratio(ts, plain),
            ratio_to_floor=None if floor is None else paired_ratio(ts, floor),
            steps=len(ts),
            **wire.get(name, {}),
            ratio_to_bf16=None if bf16 is None else paired_ratio(ts, bf16),
        ))
    return rows


def report(cfg: BenchConfig, raw: dict[str, Any], command: str = "") -> dict[str, Any]:
    """The JSON document: config, link, summary rows, nfab details and raw step times."""
    return {
        "nfab_version": nfab.__version__,
        "torch_version": torch.__version__,
        "machine": host.describe(),
        "command": command or " ".join(sys.argv),
        "config": cfg.to_dict(),
        "parameters": raw["parameters"],
        "link": raw.get("link"),
        "rows": [asdict(r) for r in summarize(raw)],
        "nfab": raw["nfab"],
        "loss": raw["loss"],
        "params_sha256": raw.get("params_sha256", {}),
        **{k: raw[k] for k in ("parallel", "reduce_scatter_bytes") if k in raw},
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
