"""fit_profile on hand-made tables: cheapest route within tolerance, fp32 fallback, EF, W range."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from nfab.calibrate.fit import ADAPTIVE_COSINE, BITS_SLACK, fit_health, fit_profile, world_range
from nfab.errors import NfabError
from nfab.profile.schema import Profile

NAN = math.nan
BITS = {"fp32": 48.0, "bf16": 24.0, "q8": 12.0, "q4": 6.0, "q2": 3.0, "sign": 3.1}


def row(phase: str, step: int, region: str, route: str, ef: bool, cosine: float, loss_delta: float,
        capacity_ok: bool = True, numel: int = 1000) -> dict:
    return {"model": "toy", "world_size": 4, "phase": phase, "step": step, "phase_fraction": step / 100,
            "region": region, "route": route, "error_feedback": ef, "bits_per_element": BITS[route],
            "cosine": cosine, "loss_delta": loss_delta, "capacity_ok": capacity_ok, "numel": numel}


def table() -> pd.DataFrame:
    rows = []
    for ef in (False, True):
        for phase, step in (("p0-start", 0), ("p1-trend", 40)):
            rows.append(row(phase, step, "conv", "fp32", ef, 1.0, 0.0, numel=100_000))
            rows.append(row(phase, step, "norm", "fp32", ef, 1.0, 0.0, numel=100))
            rows.append(row(phase, step, "norm", "bf16", ef, 0.99999, NAN, numel=100))  # no trial, passes on cosine
            rows.append(row(phase, step, "norm", "q4", ef, 0.8, NAN, numel=100))  # no trial, cosine too low
            rows.append(row(phase, step, "conv", "q2", ef, NAN, NAN, capacity_ok=False, numel=100_000))
            rows.append(row(phase, step, "conv", "bf16", ef, 0.99999, NAN, numel=100_000))
    # p0: sign passes only with EF, q8 passes both ways; p1: q8 passes, sign never
    rows += [row("p0-start", 0, "conv", "sign", False, 0.6, 0.05, numel=100_000),
             row("p0-start", 0, "conv", "sign", True, 0.6, 0.01, numel=100_000),
             row("p0-start", 0, "conv", "q8", False, 0.99, 0.001, numel=100_000),
             row("p0-start", 0, "conv", "q8", True, 0.99, 0.001, numel=100_000),
             row("p1-trend", 40, "conv", "sign", False, 0.5, 0.5, numel=100_000),
             row("p1-trend", 40, "conv", "sign", True, 0.5, 0.9, numel=100_000),
             row("p1-trend", 40, "conv", "q8", False, 0.98, 0.01, numel=100_000),
             row("p1-trend", 40, "conv", "q8", True, 0.98, 0.03, numel=100_000)]
    return pd.DataFrame(rows)


def test_fit_picks_cheapest_route_within_tolerances() -> None:
    p = fit_profile(table(), tol_cosine=0.3, tol_loss=0.02)
    p0, p1 = p.phases
    assert (p0.name, p0.start.fraction, p0.error_feedback) == ("p0-start", 0.0, True)
    assert p0.routes == {"conv": "sign", "norm": "bf16"}
    assert (p1.name, p1.start.fraction, p1.error_feedback) == ("p1-trend", 0.4, False)
    assert p1.routes == {"conv": "q8", "norm": "bf16"}
    assert p.evidence["p0-start"]["conv"] == {"route": "sign", "bits_per_element": 3.1, "cosine": 0.6,
                                              "loss_delta": 0.01}
    assert p.world_size.min == 1 and p.world_size.max == 255  # q8 caps W; sign and bf16 do not


def test_fit_falls_back_to_fp32_when_nothing_meets_the_tolerances() -> None:
    p = fit_profile(table(), tol_cosine=0.999, tol_loss=0.0001)
    for phase in p.phases:
        assert phase.routes["conv"] == "bf16"  # q2 is over capacity, sign and q8 fail, bf16 is near-exact
        assert phase.routes["norm"] == "bf16"
    strict = fit_profile(table(), tol_cosine=0.99999999, tol_loss=0.0, high_cosine=1.01)
    assert all(r == "fp32" for ph in strict.phases for r in ph.routes.values())
    assert not any(ph.error_feedback for ph in strict.phases)
    assert strict.world_size.max == 1 << 16


def test_looser_cosine_tolerance_admits_more() -> None:
    p = fit_profile(table(), tol_cosine=0.3, tol_loss=1.0)
    assert [ph.routes["conv"] for ph in p.phases] == ["sign", "sign"]
    tight = fit_profile(table(), tol_cosine=0.7, tol_loss=1.0)
    assert [ph.routes["conv"] for ph in tight.phases] == ["q8", "q8"]


def test_profile_json_round_trip() -> None:
    meta = {"model": "toy", "signature": "ab" * 32, "model_options": {"width": 4}, "world_size": 4,
            "reference": {"loss": [2.3, 2.0, 1.8, 1.9, 1.2] * 5, "grad_norm": [1.0, 0.9, 1.4, 0.8, 0.7] * 5}}
    p = fit_profile(table(), meta=meta, provenance={"calibration_sha256": "00" * 32})
    back = Profile.from_dict(json.loads(p.to_json()))
    assert back == p
    assert p.model.signature == "ab" * 32
    assert p.provenance["calibrated"]["model_options"] == {"width": 4}
    assert {"nfab_version", "torch_version", "command", "created"} <= set(p.provenance)


def test_health_thresholds_come_from_the_reference_run() -> None:
    calm = fit_health({"loss": [1.0] * 30, "grad_norm": [1.0] * 30}, None)
    assert calm.loss_spike_ratio == 1.5 and calm.grad_norm_jump == 2.0  # floors
    spiky = fit_health({"loss": [1.0] * 20 + [3.0] + [1.0] * 9, "grad_norm": [1.0] * 20 + [4.0] + [1.0] * 9}, 0.6)
    assert spiky.loss_spike_ratio == pytest.approx(4.5) and spiky.grad_norm_jump == pytest.approx(6.0)
    assert spiky.min_fidelity_cosine == pytest.approx(0.3)


def test_world_range() -> None:
    assert world_range({"q4", "sign"}).max == 15
    assert world_range({"q2"}).max == 3
    assert world_range({"fp32", "bf16", "sign"}).max == 1 << 16


def test_missing_columns_are_one_error() -> None:
    with pytest.raises(NfabError, match="missing column"):
        fit_profile(table().drop(columns=["cosine"]))


def test_a_trial_must_not_hurt_the_training_loss_either() -> None:
    t = table()
    t["train_loss_delta"] = math.nan
    sel = (t["phase"] == "p0-start") & (t["route"] == "sign") & t["error_feedback"]
    t.loc[sel, "train_loss_delta"] = 0.5  # held-out fine (0.01), training loss 50 % worse
    p = fit_profile(t, tol_cosine=0.3, tol_loss=0.02)
    assert p.phases[0].routes["conv"] == "q8"


def test_a_held_out_delta_is_judged_down_to_one_held_out_prediction() -> None:
    t = table()
    p1_sign = (t["phase"] == "p1-trend") & (t["route"] == "sign") & ~t["error_feedback"].astype(bool)
    t.loc[p1_sign, "loss_delta"] = 0.04  # above the 2% tolerance ...
    assert fit_profile(t, tol_cosine=0.3, tol_loss=0.02).phases[1].routes["conv"] == "q8"
    t["loss_resolved"] = math.nan
    t.loc[p1_sign, "loss_resolved"] = 0.05  # ... but under what one held-out prediction moves
    assert fit_profile(t, tol_cosine=0.3, tol_loss=0.02).phases[1].routes["conv"] == "sign"
    t.loc[p1_sign, "loss_resolved"] = 0.01  # a finer resolution leaves the tolerance in charge
    assert fit_profile(t, tol_cosine=0.3, tol_loss=0.02).phases[1].routes["conv"] == "q8"


def test_under_adamw_replay_fidelity_decides_without_trials() -> None:
    # sign passed its short trial (p0, EF on) but its replay cosine 0.6 is under the adaptive bar;
    # q8 at cosine 0.98 passes on replay alone, as a route without a trial would
    t = table()
    t["optimizer"] = "adamw"
    t.loc[t["route"] == "q8", "loss_delta"] = math.nan
    p = fit_profile(t, tol_cosine=0.3, tol_loss=0.02)
    assert [ph.routes["conv"] for ph in p.phases] == ["q8", "q8"]
    assert p.provenance["adaptive_optimizer"] is True and p.provenance["tol_cosine"] == ADAPTIVE_COSINE
    assert fit_profile(t.assign(optimizer="sgd"), tol_cosine=0.3, tol_loss=0.02).phases[0].routes["conv"] == "sign"
    # meta names the optimizer when the table's column does not
    assert fit_profile(table(), meta={"optimizer": {"name": "adamw"}}).phases[0].routes["conv"] == "q8"


def test_the_most_faithful_of_nearly_equally_cheap_routes_is_chosen() -> None:
    rows = [row("p0", 0, "conv", "fp32", False, 1.0, 0.0), row("p0", 0, "conv", "q8", False, 0.9, 0.0),
            row("p0", 0, "conv", "q4", False, 0.6, 0.0)]
    rows[2]["bits_per_element"] = 12.0 * (1 - BITS_SLACK / 2)  # q4 sends 2.5 % fewer bits, q8 is more faithful
    assert fit_profile(pd.DataFrame(rows)).phases[0].routes["conv"] == "q8"
    rows[2]["bits_per_element"] = 12.0 * (1 - 2 * BITS_SLACK)  # 10 % fewer bits: the cheaper one wins
    assert fit_profile(pd.DataFrame(rows)).phases[0].routes["conv"] == "q4"


def test_under_adamw_sign_is_never_chosen_even_above_the_bar() -> None:
    # sign's replay cosine (0.9) clears the adaptive bar and it is the cheapest route, but under
    # Adam it would replace every coordinate's magnitude in the second moment: q8 is chosen
    t = table()
    t["optimizer"] = "adamw"
    t.loc[t["route"] == "sign", "cosine"] = 0.9
    t.loc[t["route"] == "q8", "loss_delta"] = math.nan
    p = fit_profile(t, tol_cosine=0.3, tol_loss=0.02)
    assert all(ph.routes["conv"] == "q8" for ph in p.phases)
    assert fit_profile(t.assign(optimizer="sgd"), tol_cosine=0.3, tol_loss=0.02).phases[0].routes["conv"] == "sign"
