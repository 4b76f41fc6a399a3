"""Profile nfab's hook CPU on 2 gloo ranks (resnet18, profile routes, no cost gate).

    OMP_NUM_THREADS=1 py-spy record --subprocesses --threads -f raw -o hook.txt -- \
        .venv/bin/python bench/profile_hook.py --width 32 --steps 30

prints each variant's median hook CPU per step (Runtime's own hook_time_s) and step time.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import nfab
from nfab.distributed import run_ranks
from nfab.models import build_model
from nfab.profile.schema import Profile

PROFILE = "calibrations/resnet18/profile.json"


def _rank(rank: int, world_size: int, width: int, steps: int, route: str) -> dict:
    spec = build_model("resnet18", seed=0, num_classes=10, width=width, small_input=True, image_size=32)
    ddp = DDP(spec.module, bucket_cap_mb=4)
    if route.startswith("p"):  # one phase of the calibrated profile, as a static route
        phase = next(p for p in Profile.load(PROFILE).phases if p.name.startswith(route + "-"))
        rt = nfab.attach(ddp, route=dict(phase.routes), error_feedback=phase.error_feedback, cost_model=None)
    else:
        rt = nfab.attach(ddp, route=route, cost_model=None, total_steps=steps)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        rt.observe_loss(loss)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    rt.step_stats()
    hist = list(rt.history)[3:]
    return {"hook_ms": 1e3 * float(np.median([h.hook_time_s for h in hist])),
            "step_ms": 1e3 * float(np.median(times[3:])), "mix": hist[-1].route_mix, "buckets": hist[-1].buckets}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--route", default="p1", help="a route, or p0..p3: that phase of the resnet18 profile")
    a = ap.parse_args()
    res = run_ranks(_rank, 2, a.width, a.steps, a.route, timeout_s=600)
    print(json.dumps(res[0]))


if __name__ == "__main__":
    main()
