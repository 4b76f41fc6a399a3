"""Trial search: replay pre-screen, bisection over the routes, and the bound across EF settings (pure, no model)."""

from __future__ import annotations

import math

from nfab.calibrate.search import Tolerances, ef_order, search_phase

TOL = Tolerances(cosine=0.3, loss=0.02)
BITS = {"fp32": 48.0, "bf16": 24.0, "q8": 12.0, "q4": 6.0, "sign": 3.0}


def cells(cosines: dict[str, float], numel: int = 1000) -> dict:
    out = {}
    for route, bits in BITS.items():
        for ef in (False, True):
            out[("conv", route, ef)] = {
                "region": "conv", "route": route, "error_feedback": ef, "numel": numel, "capacity_ok": True,
                "bits_per_element": bits, "cosine": 1.0 if route == "fp32" else cosines.get(route, 0.9),
                "rel_error": 0.1, "loss_delta": 0.0 if route == "fp32" else math.nan,
                "train_loss_delta": 0.0 if route == "fp32" else math.nan, "trial_steps": 0,
                "screen": "reference" if route == "fp32" else "no_trial"}
    return out


def search(table: dict, outcome: dict, order=(False, True)) -> list[tuple[str, bool]]:
    calls = []

    def run(region: str, route: str, ef: bool) -> bool:
        calls.append((route, ef))
        cell = table[(region, route, ef)]
        cell["loss_delta"] = cell["train_loss_delta"] = outcome[(route, ef)]
        cell["trial_steps"] = 20
        cell["screen"] = "trial"
        return outcome[(route, ef)] <= TOL.loss

    n = search_phase(table, [("conv", 1000)], candidates=lambda r: ["q8", "q4", "sign"], order=order, tol=TOL,
                     high_cosine=0.99, run=run)
    assert n == len(calls)
    return calls


def test_bisection_skips_replay_failures_and_starts_in_the_middle() -> None:
    table = cells({"sign": 0.5, "q4": 0.2, "q8": 0.95})
    calls = search(table, {("sign", False): 0.3, ("q8", False): 0.0, ("sign", True): 0.01})
    # EF off: q4 fails replay (cosine 0.2 < 0.3), so the chain is sign, q8: its middle, q8, passes,
    # then the cheaper half, sign, fails. EF on: q8 cannot beat 12 bits, sign can and passes.
    assert calls == [("q8", False), ("sign", False), ("sign", True)]
    assert table[("conv", "q4", False)]["screen"] == "replay"
    assert table[("conv", "q8", True)]["screen"] == "bound" and math.isnan(table[("conv", "q8", True)]["loss_delta"])


def test_a_rejected_middle_leaves_the_dearer_half_and_dominated_routes_get_no_trial() -> None:
    table = cells({"sign": 0.4, "q4": 0.8, "q8": 0.7})  # q8 is dearer than q4 and less faithful
    calls = search(table, {("q4", False): 0.1, ("q4", True): 0.1})
    assert calls == [("q4", False), ("q4", True)]  # chain sign, q4: q4 rejected, nothing dearer is left
    assert table[("conv", "q8", False)]["screen"] == "dominated"
    assert table[("conv", "sign", False)]["screen"] == "finer_failed"


def test_one_trial_goes_to_the_block_route_not_the_cheapest() -> None:
    """The CNN recipe's case: budget for one trial, candidates sign < bq2 < bq3 in bits and fidelity."""
    bits = {"fp32": 48.0, "bf16": 24.0, "bq3": 4.3, "bq2": 3.2, "sign": 1.6}
    table = {("conv", r, ef): {"region": "conv", "route": r, "error_feedback": ef, "numel": 1000,
                               "capacity_ok": True, "bits_per_element": b, "rel_error": 0.5,
                               "cosine": {"fp32": 1.0, "bf16": 1.0, "bq3": 0.95, "bq2": 0.85, "sign": 0.5}[r],
                               "loss_delta": 0.0 if r == "fp32" else math.nan, "trial_steps": 0}
             for r, b in bits.items() for ef in (True, False)}
    calls: list[tuple[str, bool]] = []

    def run(region: str, route: str, ef: bool) -> bool:
        calls.append((route, ef))
        return True

    search_phase(table, [("conv", 1000)], candidates=lambda r: ["bq3", "bq2", "sign"], order=(True, False),
                 tol=TOL, high_cosine=0.99, run=run, allow=lambda ef: not calls)
    assert calls == [("bq2", True)]
    assert table[("conv", "sign", True)]["screen"] == "budget"
    assert table[("conv", "bq3", True)]["screen"] == "cheaper"


def test_second_ef_setting_is_bounded_by_the_first() -> None:
    table = cells({"sign": 0.5, "q4": 0.5, "q8": 0.95})
    calls = search(table, {("q8", False): 0.0, ("sign", False): 0.0})
    assert calls == [("q8", False), ("sign", False)]  # nothing under EF can send fewer bytes than sign without EF
    assert table[("conv", "sign", True)]["screen"] == "bound"
    assert table[("conv", "q4", False)]["screen"] == "dominated"  # no more faithful than sign


def test_ef_order_follows_the_optimizer_family() -> None:
    assert ef_order("adamw") == (False, True) and ef_order("sgd") == (True, False)


def test_a_trial_the_budget_has_no_room_for_is_not_run() -> None:
    table = cells({"sign": 0.5, "q4": 0.5, "q8": 0.95})
    calls: list[str] = []

    def run(region: str, route: str, ef: bool) -> bool:
        calls.append(route)
        return False

    n = search_phase(table, [("conv", 1000)], candidates=lambda r: ["q8", "q4", "sign"], order=(False, True),
                     tol=TOL, high_cosine=0.99, run=run, allow=lambda ef: len(calls) < 1)
    assert n == 1 and calls == ["q8"]  # the middle of sign, q8 (q4 is dominated by sign)
    assert table[("conv", "sign", False)]["screen"] == "finer_failed"
    assert table[("conv", "sign", True)]["screen"] == "budget" and table[("conv", "q8", True)]["screen"] == "budget"
