"""A model nfab was not tuned on: `nfab.bench.heldout.user_gpt` (torch's nn.MultiheadAttention,
a head tied to the embedding) under AdamW on W gloo ranks, 1 MB buckets, text from torch's own
source, with a static route (e.g. sign on matrices and q8 on norms and biases: coalesced
buckets). Every step the ranks' parameters are compared bit for bit; prints rank 0's losses,
replica mismatches, skipped steps, the route mix and the median thread CPU inside the hook and
its callbacks (wrappers: the same measure on any checkout).

    OMP_NUM_THREADS=1 PYTHONPATH=CHECKOUT .venv/bin/python bench/hook_usergpt.py STEPS W ROUTE
"""
import json
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from nfab.distributed import run_ranks


def _rank(rank, world, steps, route):
    import nfab
    from nfab.bench.heldout import user_gpt
    from nfab.runtime import hook as H
    acc = [0.0]
    for name in ("hook", "_callback"):
        orig = getattr(H.Runtime, name)
        def timed(self, *a, _o=orig, **k):
            t = time.thread_time()
            try:
                return _o(self, *a, **k)
            finally:
                acc[0] += time.thread_time() - t
        setattr(H.Runtime, name, timed)
    torch.manual_seed(0)
    m = user_gpt()
    ddp = DDP(m, bucket_cap_mb=1)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    rt = nfab.attach(ddp, route=route, cost_model=None, total_steps=steps)
    text = open(torch.__file__.replace("__init__.py", "nn/modules/module.py"), "rb").read()
    data = torch.tensor(list(text[: 200_000]), dtype=torch.long)
    g = torch.Generator().manual_seed(rank)
    losses, mism, cpu = [], 0, []
    for s in range(steps):
        idx = torch.randint(0, data.numel() - 65, (8,), generator=g)
        x = torch.stack([data[i : i + 64] for i in idx])
        y = torch.stack([data[i + 1 : i + 65] for i in idx])
        opt.zero_grad(set_to_none=True)
        a = acc[0]
        logits = ddp(x)
        loss = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
        rt.observe_loss(loss)
        loss.backward()
        cpu.append(acc[0] - a)
        opt.step()
        rt.step_stats()
        flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        torch.distributed.all_gather(gathered, flat)
        mism += sum(not torch.equal(gathered[0].view(torch.int32), t.view(torch.int32)) for t in gathered[1:])
        losses.append(float(loss.detach()))
    mix = {}
    for s_ in list(rt.history)[-5:]:
        for k, v in (getattr(s_, "route_mix", None) or {}).items():
            mix[k] = round(v, 4)
    return {"first_loss": round(np.mean(losses[:5]), 3), "last_loss": round(np.mean(losses[-5:]), 3),
            "replica_mismatches": mism, "hook_cb_ms_median": round(1e3 * float(np.median(cpu[3:])), 2),
            "skipped": sum(bool(getattr(h, "skipped", False)) for h in rt.history), "mix": mix}

if __name__ == "__main__":
    steps, w, route = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    print(json.dumps(run_ranks(_rank, w, steps, route, timeout_s=900)[0]))
