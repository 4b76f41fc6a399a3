"""The FSDP2 front end's cost gate prices a row group as this front end reduces it (no ranks)."""

from __future__ import annotations

from nfab.profile.schema import Profile
from nfab.runtime.control.controller import Controller
from nfab.runtime.core.shards import build_layout
from nfab.runtime.frontends.fsdp_layout import ShardCost
from nfab.wire.cost import CostModel, LinkCost


def _cost(bandwidth_bps: float, latency_s: float) -> CostModel:
    link = LinkCost(latency_s, bandwidth_bps)
    return CostModel("gloo", 8, link, link, reducescatter=link)


def test_gate_keeps_bq3_on_a_slow_link_and_sends_a_small_group_fp32_where_latency_rules():
    layout = build_layout([("blocks.0.fc.weight", "linear", 1 << 18, 8 << 18),
                           ("blocks.0.norm.weight", "norm", 128, 1024)], 8)
    prof = Profile.static({"linear": "bq3", "norm": "bq3"})
    slow = ShardCost(_cost(12.5e6, 1e-4))  # 100 Mbit/s: bytes rule
    fast = ShardCost(_cost(1e12, 1e-3))  # a fast link with a long latency: the extra rounds rule
    assert slow.cheaper_than_fp32("blockq-bq3", 1 << 18, 8)
    assert not fast.cheaper_than_fp32("blockq-bq3", 128, 8)
    for cost, want in ((slow, {"blockq-bq3"}), (fast, {"allreduce-fp32"})):
        ctl = Controller(prof, 8, cost, explicit=False)
        routes = ctl.routes(layout.plan(), ctl.phase(0), frozenset())
        assert {g.key for g in routes.groups} == want
        assert bool(routes.fallbacks) == (want == {"allreduce-fp32"})
    # at 100 Mbit/s the modelled bq3 time is the all-to-all of ~3.4 bits, not FP32's 32
    ratio = slow.time("allreduce-fp32", 1 << 18, 8) / slow.time("blockq-bq3", 1 << 18, 8)
    assert 7.0 < ratio < 10.0, ratio


def test_qsum_priced_as_its_lanes_reduce_scatter_plus_one_scale_round():
    """q8 on FSDP2: a row's bytes at 1/4 of FP32's plus one blocking MAX round of its scales. A big
    group at 100 Mbit/s goes q8 (~4x less time); a small one where latency rules stays FP32. A bench
    records the gate's link constants (`to_json`: the base model's)."""
    slow, fast = ShardCost(_cost(12.5e6, 1e-4)), ShardCost(_cost(1e12, 1e-3))
    ratio = slow.time("allreduce-fp32", 1 << 18, 8) / slow.time("qsum-q8", 1 << 18, 8)
    assert 3.5 < ratio < 4.0, ratio
    assert not fast.cheaper_than_fp32("qsum-q8", 128, 8)
    assert slow.to_json() == slow.base.to_json()
