"""Trial search: replay pre-screen, cheapest first, and the bound across EF settings (pure, no model)."""

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


def test_cheapest_first_skips_replay_failures_and_dearer_routes() -> None:
    table = cells({"sign": 0.5, "q4": 0.2, "q8": 0.95})
    calls = search(table, {("sign", False): 0.3, ("q8", False): 0.0, ("sign", True): 0.01})
    # EF off: sign fails its trial, q4 fails replay (cosine 0.2 < 0.3) so no trial, q8 passes.
    # EF on: only routes that could beat 12 bits are tried; sign passes.
    assert calls == [("sign", False), ("q8", False), ("sign", True)]
    assert table[("conv", "q4", False)]["screen"] == "replay"
    assert table[("conv", "q8", True)]["screen"] == "cheaper" and math.isnan(table[("conv", "q8", True)]["loss_delta"])


def test_second_ef_setting_is_bounded_by_the_first() -> None:
    table = cells({"sign": 0.5, "q4": 0.5, "q8": 0.95})
    calls = search(table, {("sign", False): 0.0})
    assert calls == [("sign", False)]  # nothing under EF can send fewer bytes than sign without EF
    assert table[("conv", "sign", True)]["screen"] == "bound"
    assert table[("conv", "q8", False)]["screen"] == "cheaper"


def test_ef_order_follows_the_optimizer_family() -> None:
    assert ef_order("adamw") == (False, True) and ef_order("sgd") == (True, False)


def test_a_trial_the_budget_has_no_room_for_is_not_run() -> None:
    table = cells({"sign": 0.5, "q4": 0.5, "q8": 0.95})
    calls: list[str] = []

    def run(region: str, route: str, ef: bool) -> bool:
        calls.append(route)
        return False

    n = search_phase(table, [("conv", 1000)], candidates=lambda r: ["q8", "q4", "sign"], order=(False, True),
                     tol=TOL, high_cosine=0.99, run=run, allow=lambda: len(calls) < 1)
    assert n == 1 and calls == ["sign"]
    assert table[("conv", "q4", False)]["screen"] == "budget" and table[("conv", "q8", True)]["screen"] == "budget"
