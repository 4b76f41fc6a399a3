"""The hook on nfab's GPT nano (shipped bq2 profile, AdamW, W=2 gloo): every thread's CPU per
step (/proc/self/task/*/schedstat: the training thread, gloo's tcp loop and run loops), the
step's and backward's wall time, `hook_ms` and its phases; `cprofile` adds a thread-CPU cProfile
of rank 0's training thread (the hook bodies; callbacks on gloo threads are not in it).

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/hook_threads.py STEPS [time|cprofile|plain] [BUCKET_MB]

`plain` runs DDP without nfab. Alternate PYTHONPATH between two checkouts to compare them;
`agree_wall_ms_per_step` is the wall time inside a blocking `BlockQSum.agree` (0 where the
hook launches agreements asynchronously).
"""
import sys, time, json, os, cProfile, pstats, io
import numpy as np, torch, torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from nfab.distributed import run_ranks

def threads_ns():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f: ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{tid}/comm") as f: name = f.read().strip()
        except OSError: continue
        out[int(tid)] = (name, ns)
    return out

def _rank(rank, world, steps, profile, mode, bucket_mb=4.0):
    import nfab
    from nfab.models import build_model
    from nfab.wire import blockq
    agree_wall = []
    orig = blockq.BlockQSum.agree
    def timed(self, *a, **k):
        t = time.perf_counter(); r = orig(self, *a, **k); agree_wall.append(time.perf_counter() - t); return r
    blockq.BlockQSum.agree = timed
    spec = build_model("gpt", seed=0); m = spec.module
    ddp = DDP(m, bucket_cap_mb=bucket_mb)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    rt = None if mode == "plain" else nfab.attach(ddp, profile, optimizer=opt, cost_model=None, total_steps=300)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 96, (8, 64), generator=g)
    prof = cProfile.Profile(time.thread_time_ns, 1e-9) if mode == "cprofile" else None
    walls, bwds = [], []
    warm = 5
    for s in range(steps):
        if s == warm:
            t0 = threads_ns(); agree_wall.clear()
            if prof: prof.enable()
        ts = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        out = ddp(x); logits = out if isinstance(out, torch.Tensor) else out[0]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x.reshape(-1) % logits.shape[-1])
        if rt: rt.observe_loss(loss)
        tb = time.perf_counter(); loss.backward(); bwds.append(time.perf_counter() - tb)
        opt.step()
        if rt: rt.step_stats()
        walls.append(time.perf_counter() - ts)
    if prof: prof.disable()
    t1 = threads_ns(); n = steps - warm
    per_thread = {f"{t1[k][0]}:{k}": round((t1[k][1] - t0.get(k, ("", 0))[1]) / n / 1e6, 2) for k in t1}
    res = {"wall_ms": round(1e3 * float(np.median(walls[warm:])), 2), "bwd_ms": round(1e3 * float(np.median(bwds[warm:])), 2),
           "threads_ms_per_step": per_thread, "agree_calls_per_step": len(agree_wall) / n,
           "agree_wall_ms_per_step": round(1e3 * sum(agree_wall) / n, 3)}
    if rt:
        h = list(rt.history)[warm:]
        res["hook_ms"] = round(1e3 * float(np.median([x.hook_time_s for x in h])), 2)
        res["phases"] = {k: round(1e3 * float(np.median([x.hook_phases.get(k, 0) for x in h])), 3) for k in ("plan", "norm", "encode", "launch", "decode", "fold")}
        res["buckets"] = len(rt.plans)
        res["scale_rounds"] = h[-1].scale_rounds
        res["deferred_per_step"] = getattr(rt, "deferred_buckets", 0) / steps
    if prof and rank == 0:
        s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(60); res["cprofile"] = s.getvalue()
        s = io.StringIO(); st = pstats.Stats(prof, stream=s); st.sort_stats("cumulative").print_callees("hook.py.*\\((hook|_launch|_context|_callback|_finish|_finish_step)\\)"); st.print_callees("encode.py.*encode_group"); st.print_callees("decode.py.*(finish_bucket|_decode_group)"); res["cprofile_tot"] = s.getvalue()
    return res

if __name__ == "__main__":
    steps = int(sys.argv[1]); mode = sys.argv[2] if len(sys.argv) > 2 else "time"
    bmb = float(sys.argv[3]) if len(sys.argv) > 3 else 4.0
    r = run_ranks(_rank, 2, steps, "calibrations/gpt/profile.json", mode, bmb, timeout_s=900)
    for rk, res in enumerate(r):
        cp = res.pop("cprofile", None); cpt = res.pop("cprofile_tot", None)
        print(rk, json.dumps(res))
        if cp: print(cp[:12000]); print(cpt[:8000])
