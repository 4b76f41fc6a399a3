"""The hook's CPU per step on nfab's GPT nano under a profile (default: the shipped
calibrations/gpt, bq2 on every region) with AdamW and `attach(optimizer=)`, W gloo ranks.

    OMP_NUM_THREADS=1 .venv/bin/python bench/hook_gpt.py STEPS [PROFILE] [W]

Prints rank 0's route mix, the median `hook_time_s` (thread CPU of the hook's timed phases)
and the median of each phase, over the steps after the first three. Run it with
PYTHONPATH pointing at two checkouts, alternately, to compare them.
"""
import sys, time, json
import numpy as np, torch, torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from nfab.distributed import run_ranks

def _rank(rank, world, steps, profile):
    import nfab
    from nfab.models import build_model
    spec = build_model("gpt", seed=0)
    m = spec.module
    ddp = DDP(m, bucket_cap_mb=4)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    rt = nfab.attach(ddp, profile, optimizer=opt, cost_model=None, total_steps=300)
    g = torch.Generator().manual_seed(rank)
    vocab = getattr(m, "vocab_size", None) or 256
    x = torch.randint(0, 96, (8, 64), generator=g)
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        out = ddp(x)
        logits = out if isinstance(out, torch.Tensor) else out[0]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x.reshape(-1) % logits.shape[-1])
        rt.observe_loss(loss); loss.backward(); opt.step(); rt.step_stats()
    h = list(rt.history)[3:]
    return {"params": sum(p.numel() for p in m.parameters()), "mix": h[-1].route_mix,
            "hook_ms": 1e3 * float(np.median([x.hook_time_s for x in h])),
            "phases": {k: round(1e3 * float(np.median([x.hook_phases.get(k, 0) for x in h])), 2) for k in ("plan", "norm", "encode", "launch", "decode", "fold")}}

if __name__ == "__main__":
    print(json.dumps(run_ranks(_rank, int(sys.argv[3]) if len(sys.argv) > 3 else 2, int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "calibrations/gpt/profile.json", timeout_s=900)[0]))
