"""Cheap probes and the cost gate's verdict on real gloo ranks (W=2, a tiny MLP, a few steps).

Probe bytes are checked against an independent count: one region per probe in rotation, each
parameter of it sampled at most `PARAM_SAMPLES` times, all-reduced in FP32 (2(W-1)/W x 4 bytes
per element at W=2). The cost gate is checked with a cost model under which no codec pays."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nfab
from nfab.distributed import run_ranks
from nfab.profile.schema import Profile
from nfab.runtime.bindings import classify
from nfab.runtime.control.fidelity import param_stride
from nfab.wire.cost import CostModel, LinkCost
from nfab.wire.registry import REDUCERS

ROUTE = {"linear": "bq4", "norm": "bq4", "bias": "bq4"}
STEPS = 6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 600), nn.LayerNorm(600), nn.Linear(600, 4))


def _train(rank: int, world: int, cost: bool) -> dict:
    model = _model()
    ddp = DDP(model)
    prof = Profile.static(ROUTE)  # as a profile object: not explicit, so the cost gate applies
    # probes every 2nd step, uncapped: the rotation and the count are checked here, the budget in test_probes.py
    prof = prof.model_copy(update={"health": prof.health.model_copy(update={"probe_every": 2, "probe_budget": 0.0})})
    free_link = CostModel("gloo", world, LinkCost(1e-9, 1e15), LinkCost(1e-9, 1e15),
                          {k: 1.0 for k in REDUCERS}, source="test")  # any codec costs 1 s per element
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("nfab.api").addHandler(handler)
    rt = nfab.attach(ddp, prof, cost_model=free_link if cost else None)
    logging.getLogger("nfab.api").removeHandler(handler)
    g = torch.Generator().manual_seed(rank)
    stats = []
    for _ in range(STEPS):
        ddp(torch.randn(8, 16, generator=g)).square().mean().backward()
        stats.append(rt.step_stats())
        ddp.zero_grad()
    regions = {n: b.region for n, b in classify(model).items()}
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    return {"stats": stats, "lines": lines, "regions": regions, "sizes": sizes}


def test_probes_sample_one_region_in_rotation_and_are_counted_apart():
    out = run_ranks(_train, 2, False)[0]
    regions, sizes, stats = out["regions"], out["sizes"], out["stats"]
    lossy = sorted(set(regions.values()))
    assert lossy == ["bias", "linear", "norm"]
    # independently: every probe step (no optimizer: no dense probes) samples lossy[(step // 2) % 3]
    for st in stats:
        want = 0
        if st.step % 2 == 0:
            region = lossy[(st.step // 2) % len(lossy)]
            elements = sum(-(-n // param_stride(n)) for name, n in sizes.items() if regions[name] == region)
            want = 4 * elements  # W=2: an all-reduce sends its payload once
        assert st.probe_wire_bytes == want, (st.step, st.probe_wire_bytes, want)
        assert st.wire_bytes > st.probe_wire_bytes and not st.cost_gated
    # a probe's fidelity comes back the step after, for the one region it sampled
    assert [set(st.region_cosine) for st in stats[1::2]] == [{r} for r in lossy]


def test_cost_gate_keeping_fp32_everywhere_says_so_at_attach_and_every_step():
    out = run_ranks(_train, 2, True)[0]
    assert len(out["lines"]) == 1 and "keeps FP32 on every region" in out["lines"][0]
    assert "cost_model=None" in out["lines"][0] and "Gbit/s" in out["lines"][0]
    for st in out["stats"]:
        assert st.cost_gated and not st.fallback and st.fallback_reason.startswith("cost(")
        assert st.route_mix == {"fp32": 1.0} and st.probe_wire_bytes == 0
