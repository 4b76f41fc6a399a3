"""Hook benchmark: nfab's hook beside plain DDP and PyTorch's fp16 hook, and where its time goes.

The step timing is `nfab.bench.step`'s (same model init, data and seed; variants
interleaved step by step; paired ratios). Variants: plain DDP, nfab route fp32 (the
target: within 5% of plain), nfab route sign, and PyTorch's fp16_compress_hook.

Then a breakdown on the real bucket sizes of nfab's fp32 plan, each part timed in
interleaved rounds on the live group (medians, milliseconds per step, summed over
buckets):
- `allreduce`: the payload all-reduce alone (what plain DDP pays);
- `allreduce+ctrl`: the payload all-reduce and nfab's control-word all-gather, both
  launched async, then both waited (what the collectives cost nfab);
- `ctrl_allgather`: the control-word all-gather alone (its latency);
- `norm_pass`: one `vector_norm` over the bucket plus the `float()` that syncs it — the
  hook does two (the local |g|^2 before launch, the reduced |g|^2 in the callback);
- `prescale`: `mul_(1/W)` over the bucket (DDP does the same division);
- `allreduce_launch_only`: the time the async all-reduce call itself takes to return;
- and from the runtime itself, `hook_cpu`: median seconds per step spent in nfab's hook
  body and callback (Runtime's own `hook_time_s`).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from nfab.bench import step as step_mod
from nfab.bench.step import BenchConfig, Run
from nfab.wire.reducers import all_gather_flat

HOOK_VARIANTS: tuple[str, ...] = ("plain", "allreduce-hook", "nfab-fp32", "nfab-sign", "fp16")
"""`allreduce-hook` (PyTorch's Python allreduce hook) separates the cost of any Python hook
from the cost of nfab's own work."""
_CTRL_NUMEL = 4  # the fp32 route's control word: nonfinite, |g|^2, loss, has_loss


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


def breakdown(run: Run, rounds: int = 20) -> dict[str, Any]:
    """Time the parts of nfab's fp32 hook on its real bucket sizes (see the module doc)."""
    rt = run.runtime
    n_buckets = rt.history[-1].buckets if rt.history else 0
    # plans are kept in insertion order: the last n_buckets are the rebuilt, current ones
    sizes = [p.numel for p in list(rt.plans.values())[-n_buckets:]] if n_buckets else []
    if not sizes:
        sizes = [sum(p.numel() for p in run.ddp.parameters())]
    w = dist.get_world_size()
    bufs = [torch.randn(n) for n in sizes]
    ctrl = torch.zeros(_CTRL_NUMEL)
    gathered = torch.empty(w * _CTRL_NUMEL)

    def allreduce() -> None:
        for b in bufs:
            dist.all_reduce(b, async_op=True).wait()

    def launch() -> None:
        works = []
        t0 = time.perf_counter()
        for b in bufs:
            works.append(dist.all_reduce(b, async_op=True))
        launch_s.append(time.perf_counter() - t0)
        for wk in works:
            wk.wait()

    launch_s: list[float] = []

    def ctrl_allgather() -> None:
        for _ in bufs:
            all_gather_flat(gathered, ctrl, async_op=True).wait()

    def both() -> None:
        for b in bufs:
            a = dist.all_reduce(b, async_op=True)
            c = all_gather_flat(gathered, ctrl, async_op=True)
            a.wait()
            c.wait()

    def norm_pass() -> None:
        for b in bufs:
            float(torch.linalg.vector_norm(b))

    def prescale() -> None:
        for b in bufs:
            b.mul_(1.0)

    parts = {"allreduce": allreduce, "allreduce+ctrl": both, "ctrl_allgather": ctrl_allgather,
             "norm_pass": norm_pass, "prescale": prescale, "launch": launch}
    samples: dict[str, list[float]] = {k: [] for k in parts}
    for _ in range(rounds):  # interleave the parts round by round
        for k, fn in parts.items():
            samples[k].append(_median_ms(fn, 1))
    hist = list(rt.history)[1:] or list(rt.history)
    out = {k: float(np.median(v)) for k, v in samples.items()}
    out["allreduce_launch_only"] = 1e3 * float(np.median(launch_s))
    out["hook_cpu"] = 1e3 * float(np.median([h.hook_time_s for h in hist]))
    out["buckets"] = len(sizes)
    out["bucket_numel"] = sizes
    return out


def rank_main(rank: int, world_size: int, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """One rank of `nfab bench hook`: the step timing, then the fp32 hook breakdown."""
    cfg = BenchConfig.from_dict(cfg_dict)
    runs, data = step_mod.prepare(rank, cfg)
    step_mod.time_runs(runs, data, cfg)
    times = step_mod.slowest_rank_times(runs)
    fp32 = next((r for r in runs if r.name == "nfab-fp32"), None)
    parts = breakdown(fp32) if fp32 is not None else {}
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
