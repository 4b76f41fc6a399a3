"""The hook's CPU per step on 2 gloo ranks (resnet18, a profile phase's routes, no cost gate),
today's Runtime alone or paired A/B against an older one in one run.

Alone (the run to profile):

    OMP_NUM_THREADS=1 py-spy record --subprocesses --threads -f raw -o hook.txt -- \
        .venv/bin/python bench/hook_ab.py --route p1 --steps 30

Paired against an older Runtime:

    git show 8043964:nfab/runtime/hook.py | sed 's/fp32_wire_bytes/baseline_wire_bytes/g' > /tmp/oldhook/old_hook.py
    OMP_NUM_THREADS=1 .venv/bin/python bench/hook_ab.py --old /tmp/oldhook/old_hook.py --route p1 --steps 30

Each variant is a DDP copy of one resnet18 on the same 2 gloo ranks with its own Runtime,
stepped alternately (order rotating) on the same batches. Prints, for rank 0, each
variant's median per step of
- `cpu_ms`: CPU seconds of the threads running the hook bodies and the callbacks
  (`time.thread_time`, so a busy shared machine does not count its other processes);
- `hook_ms`: the Runtime's own `hook_time_s` (thread CPU of its timed phases);
- `step_ms`: the step's wall-clock time;
and, paired, the median of the per-step ratios new/old of each.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from nfab.distributed import run_ranks
from nfab.models import build_model
from nfab.profile.schema import Profile
from nfab.runtime.hook import Runtime, nfab_hook

PROFILE = "calibrations/resnet18/profile.json"
SKIP = 3
"""Untimed first steps (DDP rebuilds its buckets after step 0)."""


def _old_runtime(path: str):
    spec = importlib.util.spec_from_file_location("old_hook", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["old_hook"] = mod
    spec.loader.exec_module(mod)
    return mod.Runtime, mod.nfab_hook


def _timed(cls, hook, cpu: list[float]):
    """`cls` with its callback timed in thread CPU seconds, and a hook function timed likewise."""
    callback = "_callback" if hasattr(cls, "_callback") else "_finish_bucket"

    class Timed(cls):
        pass

    def timed_callback(self, *args):
        t0 = time.thread_time()
        try:
            return getattr(cls, callback)(self, *args)
        finally:
            cpu[-1] += time.thread_time() - t0

    setattr(Timed, callback, timed_callback)

    def timed_hook(state, bucket):
        t0 = time.thread_time()
        try:
            return hook(state, bucket)
        finally:
            cpu[-1] += time.thread_time() - t0

    # DDP checks the annotations as objects (this module's are strings)
    timed_hook.__annotations__ = {"state": object, "bucket": torch.distributed.GradBucket,
                                  "return": torch.futures.Future[torch.Tensor]}

    return Timed, timed_hook


def _rank(rank: int, world_size: int, old_path: str | None, width: int, steps: int, route: str) -> dict[str, Any]:
    spec = build_model("resnet18", seed=0, num_classes=10, width=width, small_input=True, image_size=32)
    if route.startswith("p"):  # one phase of the calibrated profile, as a static route
        phase = next(p for p in Profile.load(PROFILE).phases if p.name.startswith(route + "-"))
        prof, ef = Profile.static(dict(phase.routes)), phase.error_feedback
    else:
        prof, ef = Profile.static(route), True
    variants = {"new": (Runtime, nfab_hook)}
    if old_path is not None:
        variants = {"old": _old_runtime(old_path), **variants}
    runs = {}
    for name, (cls, hook) in variants.items():
        cpu: list[float] = []
        cls, hook = _timed(cls, hook, cpu)
        ddp = DDP(copy.deepcopy(spec.module), bucket_cap_mb=4)
        rt = cls(ddp, prof, explicit=True, error_feedback=ef, cost_model=None)
        ddp.register_comm_hook(rt, hook)
        runs[name] = (ddp, rt, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9), cpu, [])
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
    order = list(runs)
    for step in range(steps):
        for name in order[step % len(order):] + order[:step % len(order)]:  # rotate who goes first
            ddp, rt, opt, cpu, times = runs[name]
            cpu.append(0.0)
            torch.distributed.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp(x), y)
            rt.observe_loss(loss)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            rt.step_stats()
    per_step = {name: {"cpu": np.array(cpu[SKIP:]), "hook": np.array([h.hook_time_s for h in list(rt.history)[SKIP:]]),
                       "step": np.array(times[SKIP:])} for name, (_, rt, _, cpu, times) in runs.items()}
    out: dict[str, Any] = {f"{k}_ms_{name}": 1e3 * float(np.median(v))
                           for name, series in per_step.items() for k, v in series.items()}
    if "old" in per_step:
        out |= {f"{k}_ratio_new_over_old": float(np.median(per_step["new"][k] / per_step["old"][k]))
                for k in ("cpu", "hook", "step")}
    new = runs["new"][1]
    new_hist = list(new.history)[SKIP:]
    out["phases_new_ms"] = {k: 1e3 * float(np.median([h.hook_phases.get(k, 0.0) for h in new_hist]))
                            for k in ("plan", "norm", "encode", "launch", "decode", "fold")}
    out["buckets"], out["mix"] = new.history[-1].buckets, new.history[-1].route_mix
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", help="an older nfab/runtime/hook.py to pair against (default: today's alone)")
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--route", default="p1", help="a route, or p0..p3: that phase of the resnet18 profile")
    a = ap.parse_args()
    print(json.dumps(run_ranks(_rank, 2, a.old, a.width, a.steps, a.route, timeout_s=1200)[0], indent=1))


if __name__ == "__main__":
    main()
