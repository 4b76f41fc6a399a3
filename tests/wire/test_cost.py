"""Cost model: a robust line fit, clamped, and the admission rule."""

import pytest

from nfab.wire.cost import MAX_BANDWIDTH_BPS, CostModel, LinkCost, default_cost_model, fit_link


def test_fit_recovers_a_clean_line():
    pts = [(b, 1e-4 + b / 1e8) for b in (1e3, 1e5, 1e6)]
    link = fit_link(pts)
    assert link.latency_s == pytest.approx(1e-4, rel=1e-6)
    assert link.bandwidth_bps == pytest.approx(1e8, rel=1e-6)


def test_fit_clamps_noise_that_claims_infinite_bandwidth():
    link = fit_link([(1e3, 5e-4), (1e5, 4e-4), (1e6, 3e-4)])  # bigger was faster: noise
    assert link.bandwidth_bps == MAX_BANDWIDTH_BPS and link.latency_s > 0


def test_compression_is_admitted_only_where_it_pays():
    slow = CostModel("gloo", 4, LinkCost(1e-4, 12.5e6), LinkCost(1e-4, 12.5e6), {"signcount": 2e-9})
    fast = CostModel("gloo", 4, LinkCost(1e-5, 5e9), LinkCost(1e-5, 5e9), {"signcount": 2e-9})
    n = 1 << 22
    assert slow.cheaper_than_fp32("signcount", n)  # 100 Mbit/s: bytes dominate
    assert not fast.cheaper_than_fp32("signcount", n)  # fast link: the codec is the cost
    assert CostModel.from_dict(__import__("json").loads(slow.to_json())) == slow
    assert default_cost_model(4).source == "default"
