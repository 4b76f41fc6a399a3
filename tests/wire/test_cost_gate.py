"""The cost gate's pure parts: a declared link, the robust statistic, implausible fits, hysteresis."""

from __future__ import annotations

import pytest

from nfab.errors import ConfigError
from nfab.profile.schema import Profile
from nfab.runtime.control.controller import Controller
from nfab.runtime.core.plan import BucketPlan, Slice
from nfab.wire.cost import (
    DECLARED_LATENCY_S,
    GATE_MARGIN,
    CostModel,
    LinkCost,
    declared,
    fit_line,
    gate,
    implausible,
    parse_link,
    predicted_saving,
    trimmed_time,
)


@pytest.mark.parametrize(("spec", "bps", "latency"), [
    ("link:100mbit", 12.5e6, DECLARED_LATENCY_S),
    ("link:25gbit,20us", 25e9 / 8, 20e-6),
    ("LINK:1.5Gbit/s, 2ms", 1.5e9 / 8, 2e-3),
    ("link:800kbit,0.1s", 1e5, 0.1),
    ("link:10mbit,0us", 10e6 / 8, 0.0),
])
def test_a_declared_link_gives_its_bandwidth_and_latency(spec: str, bps: float, latency: float) -> None:
    link = parse_link(spec)
    assert link.bandwidth_bps == pytest.approx(bps) and link.latency_s == pytest.approx(latency)


@pytest.mark.parametrize("spec", ["link:", "link:100", "link:100mb", "link:0gbit", "link:-1gbit",
                                  "link:1gbit,", "link:1gbit,5", "link:1gbit,1h", "link:1gbit,1s",
                                  "link:1gbit,5us,7us", "link:10mbps", "100mbit"])
def test_a_bad_declaration_is_one_config_error_line(spec: str) -> None:
    with pytest.raises(ConfigError, match=r"cost model .*link:BANDWIDTH\[,LATENCY\]") as info:
        parse_link(spec)
    assert "\n" not in str(info.value)


def test_a_declared_model_prices_every_collective_at_the_link_and_no_codec() -> None:
    cm = declared("link:100mbit", 4, "gloo")
    assert cm.allreduce == cm.allgather == cm.reducescatter == LinkCost(DECLARED_LATENCY_S, 12.5e6)
    assert cm.codec_s_per_element == {} and not cm.implausible and "link:100mbit" in cm.source
    assert predicted_saving(cm, "signgather", 1 << 20, 4) > 0.9  # 100 Mbit/s: the bytes decide


def test_the_trimmed_time_ignores_the_slow_half_and_the_luckiest_call() -> None:
    # a neighbour took the core on half the calls: the figure is the quiet calls'
    samples = [0.5] + [1.0] * 9 + [5.0, 9.0, 7.0, 30.0] * 2 + [6.0, 6.0]
    assert trimmed_time(samples) == pytest.approx(1.0)
    assert trimmed_time([2.0]) == 2.0


def test_fits_no_link_could_produce_are_named() -> None:
    clean = fit_line([(b, 1e-4 + b / 1e9) for b in (1e3, 1e5, 1e6, 4e6)])
    assert implausible("all-reduce", clean, copy_bps=5e9) == []
    falling = fit_line([(1e3, 2e-3), (1e5, 1.9e-3), (1e6, 1.5e-3), (4e6, 1.2e-3)])  # bigger was faster: noise
    assert any("time falling with size" in p for p in implausible("all-reduce", falling, 5e9))
    negative = fit_line([(1e3, 1e-6), (1e5, 1e-5), (1e6, 3e-4), (4e6, 1.5e-3)])
    assert any(p.startswith("all-reduce latency -") for p in implausible("all-reduce", negative, 5e9))
    too_fast = fit_line([(b, 2e-3 + b / 1e12) for b in (1e3, 1e5, 1e6, 4e6)])  # 8000 Gbit/s on loopback
    assert any("over 2x a local copy" in p for p in implausible("all-gather", too_fast, 5e9))
    scattered = fit_line([(1e3, 1e-3), (1e5, 1e-4), (1e6, 3e-3), (4e6, 4e-3)])
    assert any("missing its points" in p for p in implausible("all-reduce", scattered, 5e9))


@pytest.mark.parametrize(("saving", "compressing", "after"), [
    (GATE_MARGIN, False, True),        # FP32 -> low bits at the whole margin
    (GATE_MARGIN - 0.01, False, False),
    (0.0, True, True),                 # inside the band: a compressing route stays compressing
    (-GATE_MARGIN + 0.01, True, True),
    (-GATE_MARGIN, True, False),       # back to FP32 only when dearer by the margin
    (0.0, False, False),               # inside the band: an FP32 route stays FP32
])
def test_the_gate_switches_only_across_the_margin(saving: float, compressing: bool, after: bool) -> None:
    assert gate(saving, compressing) is after


PLAN = BucketPlan((0,), (Slice(0, 1 << 20, "conv.weight", "conv"),), 1 << 20)


def _model(codec_s: float, implausible: tuple[str, ...] = ()) -> CostModel:
    link = LinkCost(1e-4, 1.25e9)
    codec = dict.fromkeys(("signgather", "signcount", "signscatter"), codec_s)
    return CostModel("gloo", 2, link, link, codec, implausible=implausible)


def _key(ctl: Controller) -> str:
    return ctl.routes(PLAN, ctl.phase(0), frozenset()).groups[0].key


def test_a_repriced_route_keeps_its_state_inside_the_band() -> None:
    """A noisy re-measurement that moves the saving around zero does not flip the route; crossing the
    margin does, and then that state sticks."""
    fp32_s = _model(0.0).time("allreduce-fp32", 1 << 20)

    def codec_for(saving: float) -> float:  # the codec time that leaves `saving` of FP32's time
        without = _model(0.0).time("signgather", 1 << 20, 2)
        return ((1 - saving) * fp32_s - without) / (1 << 20)

    ctl = Controller(Profile.static({"conv": "sign"}), 2, _model(codec_for(0.05)), explicit=False)
    assert _key(ctl) == "allreduce-fp32"  # 5% saved: not the margin
    ctl.reprice(_model(codec_for(0.30)))
    assert _key(ctl) == "signgather"  # 30%: switched
    for saving in (0.0, -0.1, 0.1, -0.05):  # a noisy figure either side of zero: stays switched
        ctl.reprice(_model(codec_for(saving)))
        assert _key(ctl) == "signgather", saving
    ctl.reprice(_model(codec_for(-0.3)))
    assert _key(ctl) == "allreduce-fp32"
    ctl.reprice(_model(codec_for(0.1)))
    assert _key(ctl) == "allreduce-fp32"


def test_an_implausible_measurement_keeps_fp32_everywhere() -> None:
    prof = Profile.static({"conv": "sign"})
    assert _key(Controller(prof, 2, _model(0.0), explicit=False)) == "signgather"
    bad = _model(0.0, ("all-reduce latency -20 us",))
    gated = Controller(prof, 2, bad, explicit=False)
    assert _key(gated) == "allreduce-fp32"
    assert ("cost", "conv") in gated.routes(PLAN, gated.phase(0), frozenset()).fallbacks
    assert gated.gated_everywhere({"conv.weight": "conv"}, {"conv.weight": 1 << 20})
    assert CostModel.from_dict(__import__("json").loads(bad.to_json())) == bad  # a resume keeps the verdict
