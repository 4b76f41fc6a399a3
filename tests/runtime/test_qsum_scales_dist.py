"""qsum inside the hook on real gloo ranks: every q8/q4 slice checked against an independent
computation from all ranks' local gradients.

Two ways a qsum slice travels:
- summed on the wire (its own all-reduce): every rank encodes with one shared scale —
  agreed now by a blocking MAX (`exact`) or the max of recent agreed maxima (`delayed`,
  which saturates when gradients outgrow it);
- gathered (its bucket coalesced into one all-gather beside a signgather slice): every
  rank encodes with its own max |x|, and every rank decodes each row with that row's scale.
"""

from __future__ import annotations

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
from nfab.runtime.frontends.ddp import AMAX_HISTORY  # noqa: E402
from nfab.wire.cost import CostModel, LinkCost  # noqa: E402

SUMMED = {"conv": "q8", "linear": "q4", "norm": "q8", "bias": "q8"}
GATHERED = {**SUMMED, "embedding": "sign", "head": "sign"}
LEVELS = {"q8": 255, "q4": 15}
SPIKE_STEP = 3
"""The loss is scaled up at this step: gradients outgrow the delayed scales and saturate."""


def _qsum_in_hook(rank: int, world_size: int, steps: int, mode: str) -> dict:
    torch.manual_seed(0)
    model = twins.Awkward()
    regions = {n: b.region for n, b in classify(model).items()}
    gathered = mode == "gathered"
    # gathered: one bucket holding the sign-routed embedding, so every qsum slice rides the
    # coalesced all-gather (a slow-latency link model makes that pay at W=3 as well)
    ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=100 if gathered else 0.02)
    slow = CostModel("gloo", world_size, LinkCost(1e-2, 1e9), LinkCost(1e-2, 1e9), source="test")
    routes = GATHERED if gathered else SUMMED
    rt = nfab.attach(ddp, route=routes, error_feedback=False, cost_model=slow if gathered else None,
                     qsum_scale="exact" if gathered else mode)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.02)
    history: dict[str, list[float]] = {}
    out: dict = {"bad": [], "saturated": [], "expected_saturated": [], "rounds": [], "replicas": [], "checked": 0,
                 "collectives": []}
    for step in range(steps):
        x, y = twins.batch(rank, step)
        factor = 8.0 if step == SPIKE_STEP else 1.0
        local = twins.local_grads(model, [(x, y)], scale=factor)
        opt.zero_grad()
        (factor * twins.loss_fn(ddp, x, y)).backward()
        st = rt.step_stats()
        out["saturated"].append(st.saturated_slices)
        out["rounds"].append(st.scale_rounds)
        out["collectives"].append(st.collectives / st.buckets)
        expected_sat = 0
        for name, p in model.named_parameters():
            route = routes.get(regions.get(name, ""), "fp32")
            if name not in local or route not in LEVELS:
                continue
            every = [torch.empty_like(local[name]) for _ in range(world_size)]
            dist.all_gather(every, local[name])
            own = [float(g.abs().max()) for g in every]
            amax = max(own)
            levels = LEVELS[route] // world_size  # steps per rank
            past = history.setdefault(name, [])
            if gathered:  # each rank's own scale: nothing clips; the mean of W roundings
                expected = torch.stack(every).mean(0)
                bound = sum(2 * s / levels for s in own) / world_size
            else:
                scale = amax if (mode == "exact" or not past) else max(past[-AMAX_HISTORY:])
                expected_sat += int(amax > scale)
                expected = torch.stack([g.clamp(-scale, scale) for g in every]).mean(0)
                bound = 2 * scale / levels  # one level of one rank
            past.append(amax)
            err = float((p.grad - expected).abs().max())
            if not err <= bound * (1 + 1e-5) + 1e-7:
                out["bad"].append(f"{step}:{name}: error {err:.3g} > {bound:.3g}")
            out["checked"] += 1
        out["expected_saturated"].append(expected_sat)
        opt.step()
        out["replicas"].append(twins.replicas_equal(model, world_size))
    out["state_amax"] = sorted(rt.state_dict()["amax"])
    return out


@pytest.mark.world_size(3)
@pytest.mark.parametrize("world_size,mode", [(2, "delayed"), (3, "delayed"), (2, "exact"), (2, "gathered"),
                                             (3, "gathered")])
def test_qsum_slices_match_an_independent_reduction(world_size, mode):
    steps = 6
    res = run_ranks(_qsum_in_hook, world_size, steps, mode, timeout_s=180)
    for r in res:
        assert r["bad"] == []
        assert all(r["replicas"])
        assert r["checked"] >= 4 * steps
        assert r["saturated"] == r["expected_saturated"] == res[0]["saturated"]
    r = res[0]
    if mode == "gathered":  # one all-gather per bucket, never a scale round, never saturated
        assert r["collectives"][1:] == [1.0] * (steps - 1)
        assert sum(r["rounds"]) == 0 and sum(r["saturated"]) == 0
        return
    assert r["rounds"][0] > 0  # the first step agrees exactly (blocking)
    if mode == "delayed":
        assert r["rounds"][1:] == [0] * (steps - 1)  # then never blocks again
        assert r["saturated"][SPIKE_STEP] > 0  # the spike outgrew the history ...
        assert r["saturated"][SPIKE_STEP + 1] == 0  # ... and the next scale covers it
        assert r["state_amax"]  # the history is checkpointed
    else:
        assert all(n > 0 for n in r["rounds"]) and sum(r["saturated"]) == 0
