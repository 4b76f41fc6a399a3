"""Route choice: sign picks its reducer by bytes or by the cost model; the gate falls back with a reason."""

from nfab.profile.schema import Profile
from nfab.runtime.control.controller import Controller
from nfab.runtime.core.plan import BucketPlan, Slice
from nfab.wire.cost import CostModel, LinkCost

PLAN = BucketPlan((1, 2), (Slice(0, 1 << 20, "conv.weight", "conv"), Slice(1 << 20, 64, "bn.weight", "norm")),
                  (1 << 20) + 64)


def _keys(ctl: Controller) -> dict[str, str]:
    routes = ctl.routes(PLAN, ctl.phase(0), frozenset())
    return {s.name: g.key for g in routes.groups for s in g.slices}


def test_sign_without_a_cost_model_takes_the_fewest_bytes():
    prof = Profile.static({"conv": "sign"})
    assert _keys(Controller(prof, 4, None, explicit=True))["conv.weight"] == "signgather"  # 3.0 vs 4.6 bits
    assert _keys(Controller(prof, 16, None, explicit=True))["conv.weight"] == "signscatter"  # 6.5 vs 10 vs 15 bits


def test_cost_gate_applies_to_profiles_not_to_explicit_routes():
    fast = CostModel("gloo", 4, LinkCost(1e-5, 5e9), LinkCost(1e-5, 5e9),
                     {"signgather": 3e-9, "signcount": 3e-9, "signscatter": 3e-9})
    prof = Profile.static({"conv": "sign"})
    gated = Controller(prof, 4, fast, explicit=False)
    assert _keys(gated)["conv.weight"] == "allreduce-fp32"
    assert ("cost", "conv") in gated.routes(PLAN, gated.phase(0), frozenset()).fallbacks
    assert _keys(Controller(prof, 4, fast, explicit=True))["conv.weight"] in ("signgather", "signcount", "signscatter")


def test_demoted_region_goes_fp32_with_a_health_reason():
    ctl = Controller(Profile.static({"conv": "sign"}), 4, None, explicit=True)
    routes = ctl.routes(PLAN, ctl.phase(0), frozenset({"conv"}))
    assert {g.key for g in routes.groups} == {"allreduce-fp32"} and ("health", "conv") in routes.fallbacks
