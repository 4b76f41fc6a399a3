"""Paired A/B of the hook's CPU per step: an older Runtime against today's, in one run.

    git show 8043964:nfab/runtime/hook.py | sed 's/fp32_wire_bytes/baseline_wire_bytes/g' > /tmp/oldhook/old_hook.py
    OMP_NUM_THREADS=1 .venv/bin/python bench/hook_ab.py --old /tmp/oldhook/old_hook.py --route p1 --steps 30

Two DDP copies of one resnet18 on the same 2 gloo ranks, one per Runtime, stepped
alternately (order rotating) on the same batches; prints, for rank 0, the median of
per-step ratios new/old of
- `cpu`: CPU seconds of the threads running the hook bodies and the callbacks
  (`time.thread_time`, so a busy shared machine does not count its other processes);
- `hook`: the Runtime's own wall-clock `hook_time_s`;
- `step`: the step's wall-clock time.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from nfab.distributed import run_ranks
from nfab.models import build_model
from nfab.profile.schema import Profile
from nfab.runtime.hook import Runtime, nfab_hook

PROFILE = "calibrations/resnet18/profile.json"


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


def _rank(rank: int, world_size: int, old_path: str, width: int, steps: int, route: str) -> dict:
    spec = build_model("resnet18", seed=0, num_classes=10, width=width, small_input=True, image_size=32)
    if route.startswith("p"):
        phase = next(p for p in Profile.load(PROFILE).phases if p.name.startswith(route + "-"))
        prof, ef = Profile.static(dict(phase.routes)), phase.error_feedback
    else:
        prof, ef = Profile.static(route), True
    old_cls, old_hook = _old_runtime(old_path)
    runs, cpus = [], []
    for cls, hook in ((old_cls, old_hook), (Runtime, nfab_hook)):
        cpu: list[float] = []
        cls, hook = _timed(cls, hook, cpu)
        ddp = DDP(copy.deepcopy(spec.module), bucket_cap_mb=4)
        rt = cls(ddp, prof, explicit=True, error_feedback=ef, cost_model=None)
        ddp.register_comm_hook(rt, hook)
        runs.append((ddp, rt, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9), []))
        cpus.append(cpu)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
    for step in range(steps):
        for i in ((0, 1) if step % 2 == 0 else (1, 0)):
            ddp, rt, opt, times = runs[i]
            cpus[i].append(0.0)
            torch.distributed.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp(x), y)
            rt.observe_loss(loss)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            rt.step_stats()
    skip = 3
    hook = [[h.hook_time_s for h in list(r[1].history)[skip:]] for r in runs]
    step_t = [r[3][skip:] for r in runs]
    cpu = [np.array(c[skip:]) for c in cpus]
    new_hist = list(runs[1][1].history)[skip:]
    return {
        "cpu_ms_old": 1e3 * float(np.median(cpu[0])), "cpu_ms_new": 1e3 * float(np.median(cpu[1])),
        "cpu_ratio_new_over_old": float(np.median(cpu[1] / cpu[0])),
        "hook_ms_old": 1e3 * float(np.median(hook[0])), "hook_ms_new": 1e3 * float(np.median(hook[1])),
        "hook_ratio_new_over_old": float(np.median(np.array(hook[1]) / np.array(hook[0]))),
        "step_ratio_new_over_old": float(np.median(np.array(step_t[1]) / np.array(step_t[0]))),
        "phases_new_ms": {k: 1e3 * float(np.median([h.hook_phases.get(k, 0.0) for h in new_hist]))
                          for k in ("plan", "norm", "encode", "launch", "decode", "fold")},
        "buckets": runs[1][1].history[-1].buckets, "mix": runs[1][1].history[-1].route_mix,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--route", default="p1", help="a route, or p0..p3: that phase of the resnet18 profile")
    a = ap.parse_args()
    print(json.dumps(run_ranks(_rank, 2, a.old, a.width, a.steps, a.route, timeout_s=1200)[0], indent=1))


if __name__ == "__main__":
    main()
