"""The hook's CPU per step on resnet18 width 32 (2.8M parameters, W=2 gloo on loopback, SGD,
4 MB buckets: three after DDP's rebuild) under the shipped resnet18 profile (its sign-on-conv
phases: signgather beside q8 norms and biases in every bucket), or a static route, or the
no-communication floor. Works against older checkouts too (what they lack reads as 0).

    OMP_NUM_THREADS=1 PYTHONPATH=CHECKOUT .venv/bin/python bench/hook_resnet.py STEPS [BUCKET_MB] [profile|floor|ROUTE]

Per rank, medians over the steps after the first three: the step's wall time (forward,
backward), thread CPU per step of every thread (/proc/self/task/*/schedstat: the training
thread, gloo's tcp loop and run loops; `all` is their sum), `hook+callback` (thread CPU inside
`Runtime.hook` and the callbacks — `_callback`, or `_finish_bucket` in older hooks — timed by
wrappers, the same measure on every checkout), and the Runtime's own `hook_ms` and phases.
Alternate PYTHONPATH between checkouts to compare them; `PROFILE` overrides the profile path.
"""
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from nfab.distributed import run_ranks

WARM = 3


def threads_ns() -> dict[int, tuple[str, int]]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        out[int(tid)] = (name, ns)
    return out


def _wrap_cpu(cls: type, names: tuple[str, ...], acc: dict[str, float]) -> None:
    """Accumulate thread CPU inside each named method that the class has."""
    for name in names:
        orig = getattr(cls, name, None)
        if orig is None:
            continue

        def timed(self, *a, _orig=orig, _name=name, **k):
            t = time.thread_time()
            try:
                return _orig(self, *a, **k)
            finally:
                acc[_name] = acc.get(_name, 0.0) + time.thread_time() - t
        setattr(cls, name, timed)


def _rank(rank: int, world: int, steps: int, bucket_mb: float, what: str) -> dict:
    import nfab
    from nfab.bench.step import load_profile_dict, no_comm_hook
    from nfab.models import build_model
    from nfab.profile import Profile
    from nfab.runtime import hook as hook_mod

    spec = build_model("resnet18", seed=0, num_classes=10, width=32, small_input=True, image_size=32)
    ddp = DDP(spec.module, bucket_cap_mb=bucket_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    acc: dict[str, float] = {}
    _wrap_cpu(hook_mod.Runtime, ("hook", "_callback", "_finish_bucket"), acc)
    rt = None
    if what == "floor":
        ddp.register_comm_hook(None, no_comm_hook)
    elif what == "profile":
        d = load_profile_dict(os.environ.get("PROFILE", "calibrations/resnet18/profile.json"))[0]
        d["model"]["signature"] = None  # the routes by region, on this width
        rt = nfab.attach(ddp, Profile.from_dict(d), cost_model=None, total_steps=steps)
    else:
        rt = nfab.attach(ddp, route=what, cost_model=None, total_steps=steps)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
    times = []
    for s in range(steps):
        if s == WARM:
            t0, _ = threads_ns(), acc.clear()
        torch.distributed.barrier()
        a = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        if rt is not None:
            rt.observe_loss(loss)
        b = time.perf_counter()
        loss.backward()
        c = time.perf_counter()
        opt.step()
        times.append((time.perf_counter() - a, b - a, c - b))
        if rt is not None:
            rt.step_stats()
    n = steps - WARM
    t1 = threads_ns()
    cpu = {f"{t1[k][0]}:{k}": (t1[k][1] - t0.get(k, ("", 0))[1]) / n / 1e6 for k in t1}
    ms = np.median(np.array(times[WARM:]), axis=0) * 1e3
    out = {"step_ms": round(ms[0], 1), "forward_ms": round(ms[1], 1), "backward_ms": round(ms[2], 1),
           "thread_cpu_ms": {k: round(v, 1) for k, v in cpu.items() if v > 0.2},
           "all_threads_ms": round(sum(cpu.values()), 1),
           "hook+callback_ms": round(1e3 * sum(acc.values()) / n, 2)}
    if rt is not None:
        h = list(rt.history)[WARM:]
        out["hook_ms"] = round(1e3 * float(np.median([getattr(s, "hook_time_s", 0.0) for s in h])), 2)
        out["phases"] = {k: round(1e3 * float(np.median([getattr(s, "hook_phases", {}).get(k, 0.0) for s in h])), 2)
                         for k in ("plan", "norm", "encode", "launch", "decode", "fold")}
    return out


if __name__ == "__main__":
    steps = int(sys.argv[1])
    mb = float(sys.argv[2]) if len(sys.argv) > 2 else 4.0
    what = sys.argv[3] if len(sys.argv) > 3 else "profile"
    for r, res in enumerate(run_ranks(_rank, 2, steps, mb, what, timeout_s=900)):
        print(r, what, json.dumps(res))
