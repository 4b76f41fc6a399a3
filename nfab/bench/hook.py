"""Hook benchmark: nfab's hook beside plain DDP and PyTorch's fp16 hook, and where its time goes.

The step timing is `nfab.bench.step`'s (same model init, data and seed; variants
interleaved step by step; paired ratios). Variants: plain DDP, nfab route fp32 (the
target: within 5% of plain), nfab route sign, and PyTorch's fp16_compress_hook.

Then a breakdown of nfab's own hook CPU per step, from the hook itself: the Runtime
times its real phases per bucket (`StepStats.hook_phases`: plan, norm, encode, launch in
the hook body; decode in the callbacks; fold at the step boundary), and this reports their
medians over the timed steps for each nfab variant. Beside them, `allreduce`: the payload
all-reduce alone on the fp32 plan's real bucket sizes (what plain DDP's collectives cost),
timed in rounds on the live group.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from nfab.bench import step as step_mod
from nfab.bench.step import BenchConfig, Run

HOOK_VARIANTS: tuple[str, ...] = ("plain", "allreduce-hook", "nfab-fp32", "nfab-sign", "fp16")
"""`allreduce-hook` (PyTorch's Python allreduce hook) separates the cost of any Python hook
from the cost of nfab's own work."""


def hook_config(**kw: Any) -> BenchConfig:
    """A BenchConfig for the hook benchmark (resnet18 width 16 on loopback by default)."""
    kw.setdefault("width", 16)
    kw.setdefault("steps", 30)
    return BenchConfig(variants=HOOK_VARIANTS, **kw)


def _median_ms(fn, rounds: int) -> float:
    ts = []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))


def phase_medians(run: Run, warmup: int) -> dict[str, float]:
    """Median ms per step of each hook phase the Runtime timed, and of their sum (`hook_cpu`)."""
    hist = list(run.runtime.history)[warmup:] or list(run.runtime.history)
    names = sorted({k for h in hist for k in h.hook_phases})
    out = {k: 1e3 * float(np.median([h.hook_phases.get(k, 0.0) for h in hist])) for k in names}
    out["hook_cpu"] = 1e3 * float(np.median([h.hook_time_s for h in hist]))
    return out


def breakdown(runs: list[Run], warmup: int, rounds: int = 20) -> dict[str, Any]:
    """The hook's own phase timings per nfab variant, and the bare all-reduce on the fp32 plan's buckets."""
    nfab_runs = [r for r in runs if r.runtime is not None]
    out: dict[str, Any] = {"phases_ms_per_step": {r.name: phase_medians(r, warmup) for r in nfab_runs}}
    fp32 = next((r for r in nfab_runs if r.name == "nfab-fp32"), None)
    if fp32 is None:
        return out
    rt = fp32.runtime
    n_buckets = rt.history[-1].buckets if rt.history else 0
    # plans are kept in insertion order: the last n_buckets are the rebuilt, current ones
    sizes = [p.numel for p in list(rt.plans.values())[-n_buckets:]] if n_buckets else []
    if not sizes:
        sizes = [sum(p.numel() for p in fp32.ddp.parameters())]
    bufs = [torch.randn(n, device="cpu") for n in sizes]

    def allreduce() -> None:
        for b in bufs:
            dist.all_reduce(b, async_op=True).wait()

    out["allreduce"] = float(np.median([_median_ms(allreduce, 1) for _ in range(rounds)]))
    out["buckets"] = len(sizes)
    out["bucket_numel"] = sizes
    return out


def rank_main(rank: int, world_size: int, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """One rank of `nfab bench hook`: the step timing, then the fp32 hook breakdown."""
    cfg = BenchConfig.from_dict(cfg_dict)
    runs, data = step_mod.prepare(rank, cfg)
    step_mod.time_runs(runs, data, cfg)
    times = step_mod.slowest_rank_times(runs)
    parts = breakdown(runs, cfg.warmup)
    return {
        "parameters": sum(p.numel() for p in runs[0].ddp.parameters()),
        "times_s": times,
        "loss": {r.name: r.loss for r in runs},
        "nfab": {r.name: info for r in runs if (info := step_mod.nfab_info(r, cfg.warmup)) is not None},
        "breakdown_ms_per_step": parts,
    }


def _run_local_target(payload: dict[str, Any]) -> dict[str, Any]:
    return step_mod.run_local(payload, rank_fn=rank_main)


def run(cfg: BenchConfig) -> dict[str, Any]:
    """Run the hook benchmark; the raw result (see `nfab.bench.step.report` for the document)."""
    return step_mod.run(cfg, target="nfab.bench.hook:_run_local_target")
