"""Exact scale agreement launched early (`runtime/agreement.py`), on real gloo ranks.

The hook launches a bucket's scale agreements as one MAX all-reduce per dtype before its
groups encode, and completes a non-last bucket from the next hook body. The same training
with `overlap_agreement = False` (each group agrees blocking as it encodes: the path before)
must give the same gradients bit for bit at every step, with identical replicas; FP32
slices must equal a plain all_reduce of the ranks' local gradients; and buckets must really
have been launched late (else the test would compare the blocking path with itself).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))
import twins  # noqa: E402

import nfab  # noqa: E402
from nfab.distributed import run_ranks  # noqa: E402
from nfab.runtime.bindings import classify  # noqa: E402

# block routes of two sizes (one uint8 batch), exact q8 (one fp32 batch), sign and fp32 beside them
ROUTES = {"conv": "bq3-128", "linear": "bq2", "embedding": "q8", "head": "q8", "norm": "fp32", "bias": "q4",
          "small": "sign", "other": "bq2"}


def _train(rank: int, world_size: int, steps: int, bucket_mb: float, error_feedback: bool) -> dict:
    torch.manual_seed(0)
    base = twins.Awkward()
    models = [base, copy.deepcopy(base)]
    ddps = [DDP(m, find_unused_parameters=True, bucket_cap_mb=bucket_mb) for m in models]
    opts = [torch.optim.AdamW(d.parameters(), lr=1e-3) for d in ddps]
    rts = [nfab.attach(d, route=ROUTES, cost_model=None, optimizer=o, error_feedback=error_feedback)
           for d, o in zip(ddps, opts, strict=True)]
    rts[1].overlap_agreement = False
    regions = {n: b.region for n, b in classify(base).items()}
    out: dict = {"same": [], "fp32_ok": [], "replicas": [], "rounds": [], "mix": None}
    for step in range(steps):
        x, y = twins.batch(rank, step)
        local = twins.local_grads(base, [(x, y)])
        stats = []
        for ddp, opt, rt in zip(ddps, opts, rts, strict=True):
            opt.zero_grad()
            twins.loss_fn(ddp, x, y).backward()
            stats.append(rt.step_stats())
        grads = [{n: p.grad for n, p in m.named_parameters() if p.grad is not None} for m in models]
        out["same"].append(grads[0].keys() == grads[1].keys() and all(
            torch.equal(grads[0][n].view(torch.int32), grads[1][n].view(torch.int32)) for n in grads[0]))
        ok = True
        for n, g in local.items():  # FP32 slices: a plain all_reduce of the local gradients
            if ROUTES.get(regions.get(n, ""), "fp32") == "fp32":
                ref = g * (1.0 / world_size)
                dist.all_reduce(ref)
                # the same sum in another order (the word's all-gather vs gloo's ring at W=3) may differ
                # in its last bits: bound by the summands' magnitude, not the (possibly cancelled) sum
                mag = g.abs() * (1.0 / world_size)
                dist.all_reduce(mag)
                ok &= bool(((grads[0][n] - ref).abs() <= world_size * torch.finfo(torch.float32).eps * mag).all())
        out["fp32_ok"].append(ok)
        out["rounds"].append((stats[0].scale_rounds, stats[1].scale_rounds))
        out["mix"] = stats[0].route_mix
        for opt in opts:
            opt.step()
        out["replicas"].append(twins.replicas_equal(models[0], world_size) and all(
            torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True)))
    out["deferred"] = (rts[0].deferred_buckets, rts[1].deferred_buckets)
    return out


@pytest.mark.world_size(3)
@pytest.mark.parametrize("world_size,bucket_mb,ef", [(2, 0.01, False), (3, 0.01, True), (2, 100.0, False)])
def test_early_agreement_matches_blocking_agreement_bit_for_bit(world_size, bucket_mb, ef):
    steps = 4
    for r in run_ranks(_train, world_size, steps, bucket_mb, ef, timeout_s=240):
        assert all(r["same"]) and all(r["replicas"]) and all(r["fp32_ok"])
        assert {"bq2", "bq3-128", "q8"} <= set(r["mix"])
        overlap, blocking = r["deferred"]
        assert blocking == 0
        # small buckets: non-last buckets wait for their agreement behind the next bucket's backward;
        # one bucket: it is the last, agreed in its own hook body (launched before its groups encode)
        assert overlap > 0 if bucket_mb < 1 else overlap == 0
        # batched per bucket (one uint8 + one fp32 MAX at most) where each group agreed on its own
        assert all(0 < a <= b for a, b in r["rounds"])
