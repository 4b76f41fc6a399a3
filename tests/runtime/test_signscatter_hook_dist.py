"""The DDP hook runs signscatter (two collectives launched from the hook body) on real gloo ranks.

A cost model that prices the other sign paths' codecs out makes `sign` pick signscatter at
W = 2 and 3; every sign gradient must be the independent majority vote, replicas identical.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))
import twins  # noqa: E402

import nfab  # noqa: E402
from nfab.distributed import run_ranks  # noqa: E402
from nfab.runtime.bindings import classify  # noqa: E402
from nfab.wire.cost import CostModel, LinkCost  # noqa: E402

ROUTE = {"norm": "fp32", "bias": "fp32", "small": "fp32", "conv": "sign", "linear": "sign",
         "embedding": "sign", "head": "sign", "other": "sign"}


def _run(rank: int, world_size: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = twins.Awkward()
    regions = {n: b.region for n, b in classify(model).items()}
    ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=0.05)
    link = LinkCost(1e-4, 1e9)
    cm = CostModel("gloo", world_size, link, link, {"signgather": 1.0, "signcount": 1.0}, source="test")
    rt = nfab.attach(ddp, route=ROUTE, error_feedback=False, cost_model=cm)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    report: dict = {"sign_mismatch": [], "replica_mismatch": [], "routes": {}}
    for step in range(steps):
        x, y = twins.batch(rank, step)
        local = twins.local_grads(model, [(x, y)])
        opt.zero_grad()
        twins.loss_fn(ddp, x, y).backward()
        for k, v in rt.step_stats().route_elements.items():
            report["routes"][k] = report["routes"].get(k, 0) + v
        for name, p in model.named_parameters():
            if name in local and ROUTE[regions[name]] == "sign":
                if not twins.sign_agrees(p.grad, local[name], world_size):
                    report["sign_mismatch"].append(f"{step}:{name}")
        opt.step()
        if not twins.replicas_equal(model, world_size):
            report["replica_mismatch"].append(step)
    return report


@pytest.mark.world_size(3)
@pytest.mark.parametrize("world_size", [2, 3])
def test_hook_runs_signscatter_exactly(world_size):
    reports = run_ranks(_run, world_size, 3, timeout_s=180)
    for rep in reports:
        assert rep["routes"].get("signscatter", 0) > 0, rep["routes"]
        assert not rep["sign_mismatch"], rep["sign_mismatch"][:5]
        assert not rep["replica_mismatch"]
