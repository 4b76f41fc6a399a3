"""Validation: an FP32 profile reproduces the reference; a failing profile is tightened phase by phase."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from nfab.calibrate import make_config, validate
from nfab.calibrate.search import Tolerances
from nfab.calibrate.task import Task
from nfab.calibrate.trajectory import eval_points, run_reference
from nfab.calibrate.validate import final_gap, loss_floor, segments_of, tighten, validate_profile
from nfab.profile.schema import ModelRef, Phase, PhaseStart, Profile

TOL = Tolerances(cosine=0.3, loss=0.02)


def profile(*phases: tuple[float, dict[str, str], bool]) -> Profile:
    return Profile(model=ModelRef(name="resnet18"), phases=tuple(
        Phase(name=f"p{i}", start=PhaseStart(fraction=f), routes=r, error_feedback=ef)
        for i, (f, r, ef) in enumerate(phases)))


def table(rows: list[tuple[str, str, str, float, float]]) -> pd.DataFrame:
    """(phase, region, route, bits, cosine) rows without trials, EF off."""
    return pd.DataFrame([{"phase": p, "region": reg, "route": route, "error_feedback": False, "numel": 1000,
                          "bits_per_element": bits, "cosine": cos, "rel_error": 0.5, "capacity_ok": True,
                          "loss_delta": math.nan, "train_loss_delta": math.nan, "trial_steps": 0}
                         for p, reg, route, bits, cos in rows])


EVERY_GAP = 0.0
"""The tiny task's 16 held-out images resolve ln(10) / 16 = 0.14 nats, more than the gaps these tests
build to exercise tightening: they judge every gap (the resolution rule has its own tests below)."""


def tiny(steps: int = 8) -> Task:
    cfg = make_config("resnet18", steps=steps, phases=2, trial_steps=2, overrides={
        "model.width": 4, "batch_size": 8, "eval_samples": 16})
    return Task(cfg)


def test_an_fp32_profile_validates_to_the_reference_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation starts from the reference checkpoint before the first lossy step, and copies the
    reference's losses up to it: an all-FP32 profile would start at the last checkpoint and compare
    the reference with itself. Started from step 0, every step and evaluation is the validation's own."""
    task = tiny()
    ref = run_reference(task)
    prof = profile((0.0, {"conv": "fp32"}, False), (0.5, {"conv": "fp32"}, True))
    starts: list[int] = []
    given = validate.shared_start

    def from_zero(segments, ref, steps):  # noqa: ANN001, ANN202 - the signature of validate.shared_start
        starts.append(given(segments, ref, steps))
        return 0

    monkeypatch.setattr(validate, "shared_start", from_zero)
    out, v = validate_profile(task, ref, prof, table([]), tol=TOL, tolerance=0.0)
    assert starts == [7]  # left alone, it would have run one step of the eight
    assert v.passed and v.gap == 0.0 and len(v.rounds) == 1
    assert v.profile_eval == v.reference_eval == [ref.eval_loss[s] for s in eval_points(8)]
    assert out.evidence["validation"]["passed"] is True and out.phases == prof.phases


def test_a_failing_profile_is_tightened_in_flight_then_in_every_phase() -> None:
    task = tiny()
    ref = run_reference(task)
    rows = [(p, "conv", r, b, c) for p in ("p0", "p1") for r, b, c in
            (("fp32", 48.0, 1.0), ("q8", 12.0, 0.97), ("q4", 6.0, 0.6), ("sign", 3.0, 0.4))]
    prof = profile((0.0, {"conv": "sign"}, True), (0.5, {"conv": "sign"}, True))
    # an impossible tolerance: every round fails and tightens, until all is FP32
    out, v = validate_profile(task, ref, prof, table(rows).assign(error_feedback=True), tol=TOL,
                              held_out_resolution=EVERY_GAP, tolerance=-1.0,
                              max_rounds=20)
    first, second, third, fourth = v.rounds[:4]
    # in flight: from step 4 (the first eval past 40% of the run with two gaps) the run goes on tightened,
    # nothing is re-run; the phase in force is split where it tightens again
    assert (first.start_step, first.stopped_at, first.change) == (0, 4, "p1/conv: sign -> q4 from 4")
    assert (second.start_step, second.stopped_at, second.change) == (4, 6, "p1@6/conv: q4 -> q8 from 6")
    # that run ended failing: every lossy phase tightens and validation starts over
    assert third.stopped_at is None and fourth.start_step == 0
    assert third.change == "p0/conv: sign -> q4, p1/conv: q4 -> q8, p1@6/conv: q8 -> fp32"
    assert not v.passed and v.stopped == "nothing to tighten"
    assert [p.routes for p in out.phases] == [{"conv": "fp32"}]  # phases equal to the one before are merged
    assert out.evidence["p0"]["conv"]["tightened_from"] == "q8"
    # the last round is all FP32 again: it reproduces the reference exactly
    assert v.profile_eval == v.reference_eval and v.gap == 0.0


def test_validation_starts_from_the_reference_where_the_profile_leaves_fp32() -> None:
    task = tiny()
    ref = run_reference(task)
    rows = [("p1", "conv", r, b, c) for r, b, c in (("fp32", 48.0, 1.0), ("q8", 12.0, 0.97), ("sign", 3.0, 0.4))]
    prof = profile((0.0, {"conv": "fp32"}, False), (0.5, {"conv": "sign"}, False))
    out, v = validate_profile(task, ref, prof, table(rows), tol=TOL,
                              held_out_resolution=EVERY_GAP, tolerance=-1.0, max_rounds=20)
    # the FP32 phase p0 (steps 0..3) is the reference itself: no round re-runs it
    assert v.rounds[0].start_step == 4 and all(r.start_step >= 4 for r in v.rounds)
    assert v.rounds[0].change == "p1@6/conv: sign -> q8 from 6"
    assert v.profile_eval[:5] == v.reference_eval[:5] and v.profile_eval == v.reference_eval
    assert v.stopped == "nothing to tighten" and [p.routes for p in out.phases] == [{"conv": "fp32"}]


def test_a_tightening_round_the_step_budget_has_no_room_for_is_not_run() -> None:
    task = tiny()
    ref = run_reference(task)
    rows = [(p, "conv", r, b, c) for p in ("p0", "p1") for r, b, c in
            (("fp32", 48.0, 1.0), ("q8", 12.0, 0.97), ("q4", 6.0, 0.6), ("sign", 3.0, 0.4))]
    prof = profile((0.0, {"conv": "sign"}, False), (0.5, {"conv": "sign"}, False))
    out, v = validate_profile(task, ref, prof, table(rows), tol=TOL,
                              held_out_resolution=EVERY_GAP, tolerance=-1.0, step_budget=12)
    # 8 steps ran (tightening twice in flight); starting over would take 8 more
    assert v.stopped == "budget" and [r.stopped_at for r in v.rounds] == [4, 6, None]
    assert v.rounds[-1].change.endswith("(not validated: budget)")
    assert [(p.name, p.routes["conv"]) for p in out.phases] == [("p0", "q4"), ("p1", "q8"), ("p1@6", "fp32")]


def test_tighten_moves_the_riskiest_region_of_every_lossy_phase() -> None:
    rows = [(p, reg, r, b, c) for p in ("p0", "p1", "p2") for reg in ("conv", "norm") for r, b, c in
            (("fp32", 48.0, 1.0), ("q8", 12.0, 0.99), ("sign", 3.0, 0.5))]
    prof = profile((0.0, {"conv": "sign", "norm": "sign"}, False), (0.3, {"conv": "fp32", "norm": "fp32"}, False),
                   (0.5, {"conv": "sign", "norm": "q8"}, False))
    frame = table(rows)
    frame.loc[frame["region"] == "norm", "numel"] = 10  # conv loses more: (1 - 0.5) x 1000 elements
    new, start, text = tighten(prof, frame, segments_of(prof, 100), 100, TOL)
    assert (start, text) == (0, "p0/conv: sign -> q8, p2/conv: sign -> q8")
    assert new.phases[0].routes == {"conv": "q8", "norm": "sign"} and new.phases[1] == prof.phases[1]
    assert new.phases[2].routes == {"conv": "q8", "norm": "q8"}
    # in flight from step 60: p0 and p1 are over, p2 is split there
    late, start, text = tighten(prof, frame, segments_of(prof, 100), 100, TOL, from_step=60)
    assert (start, text) == (60, "p2@60/conv: sign -> q8")
    assert [(p.name, p.start.fraction) for p in late.phases] == [("p0", 0.0), ("p1", 0.3), ("p2", 0.5), ("p2@60", 0.6)]
    assert late.phases[2] == prof.phases[2] and late.phases[3].routes == {"conv": "q8", "norm": "q8"}
    only_late = profile((0.0, {"conv": "fp32"}, False), (0.5, {"conv": "sign", "norm": "q8"}, False))
    assert tighten(only_late, frame.replace({"p2": "p1"}), segments_of(only_late, 100), 100, TOL)[1] == 50


def test_tighten_moves_the_regions_that_hold_most_of_the_risk() -> None:
    """conv alone holds 62% of the phase's risk (< RISK_SHARE): norm moves too; bias (1%) stays."""
    rows = [("p0", reg, r, b, c) for reg in ("conv", "norm", "bias") for r, b, c in
            (("fp32", 48.0, 1.0), ("q8", 12.0, 0.99), ("sign", 3.0, 0.5))]
    frame = table(rows)
    frame.loc[frame["region"] == "norm", "numel"] = 600
    frame.loc[frame["region"] == "bias", "numel"] = 16
    prof = profile((0.0, {"conv": "sign", "norm": "sign", "bias": "sign"}, False))
    new, start, text = tighten(prof, frame, segments_of(prof, 100), 100, TOL)
    assert text == "p0/conv: sign -> q8, p0/norm: sign -> q8" and start == 0
    assert new.phases[0].routes == {"conv": "q8", "norm": "q8", "bias": "sign"}
    assert new.evidence["p0"]["norm"]["tightened_from"] == "sign" and "bias" not in new.evidence.get("p0", {})


def test_final_gap_averages_the_last_quarter_and_floors_the_denominator() -> None:
    ref = {0: 2.0, 50: 1.0, 75: 0.2, 100: 0.1}
    assert final_gap(ref, {0: 2.0, 50: 1.0, 75: 0.3, 100: 0.2}, 100, floor=0.5) == pytest.approx(0.1 / 0.5)
    assert final_gap(ref, {0: 2.0, 50: 1.0}, 100, floor=0.5) == math.inf  # stopped before the window


def test_the_floor_comes_from_early_training_not_the_untrained_loss() -> None:
    # the held-out user GPT starts at ~68 nats (tied head): a floor from step 0 hid a +4% gap as +0.5%
    ref = {0: 68.0, 25: 4.27, 150: 2.52, 225: 2.38, 250: 2.29, 275: 2.20, 300: 2.16}
    val = {0: 68.0, 25: 4.29, 150: 2.53, 225: 2.45, 250: 2.36, 275: 2.31, 300: 2.25}
    assert loss_floor(ref) == pytest.approx(0.25 * 4.27)
    assert final_gap(ref, val, 300, loss_floor(ref)) == pytest.approx(sum(val[s] for s in (225, 250, 275, 300))
                                                                      / sum(ref[s] for s in (225, 250, 275, 300)) - 1)


def test_in_flight_tightening_waits_for_40_percent_and_needs_two_evaluations_to_come() -> None:
    from nfab.calibrate.validate import _Trigger

    ref = {s: 2.0 for s in range(0, 301, 25)}
    fired = []
    for late_from in (0, 275):
        trig = _Trigger(ref, floor=0.5, tolerance=0.01, steps=300, enabled=True)
        fired.append([s for s in range(25, 300, 25) if trig(s, 2.1 if s >= late_from else 2.0)])
    assert fired[0][0] == 125  # 5 % above FP32 from the start: the first eval past 40 % of the run
    assert fired[1] == []  # above tolerance only at 275: too late to show in the final window
    assert _Trigger(ref, floor=0.5, tolerance=9.0, steps=300, enabled=False)(50, math.inf)  # divergence stops


def test_reference_noise_is_the_largest_late_rise_of_fp32s_own_held_out_loss() -> None:
    from nfab.calibrate.validate import reference_noise

    gpt = {0: 68.0, 150: 2.544, 175: 2.470, 200: 2.398, 225: 2.408, 250: 2.303, 275: 2.227, 300: 2.179}
    assert reference_noise(gpt, 300, floor=1.07) == pytest.approx((2.408 - 2.398) / 2.398)
    digits = {0: 2.5, 12: 0.32, 48: 0.16, 60: 0.066, 72: 0.09, 84: 0.085, 150: 0.059}  # from 40 %: 60 on
    assert reference_noise(digits, 150, floor=0.08) == pytest.approx((0.09 - 0.066) / 0.08)
    assert reference_noise({0: 3.0, 50: 2.0, 100: 1.0}, 100, floor=0.5) == 0.0


def test_a_reference_noisier_than_the_tolerance_is_judged_against_its_noise() -> None:
    from nfab.calibrate.validate import NOISE_FACTOR, judged_tolerance

    assert judged_tolerance(0.01, 0.004) == 0.01  # the held-out GPT: quiet, the tolerance as given
    assert judged_tolerance(0.01, 0.305) == pytest.approx(NOISE_FACTOR * 0.305)  # resnet18 / digits
    assert judged_tolerance(0.01, math.nan) == 0.01 and judged_tolerance(-1.0, 0.0) == -1.0


def test_a_gap_under_one_held_out_predictions_worth_is_judged_at_the_resolution() -> None:
    from nfab.calibrate.validate import gap_denominator, judged_tolerance, resolution

    # the CNN recipe: 256 held-out digits, FP32 at ~0.036 late, denominator floored at 0.385
    nats = resolution(10, 256)
    assert nats == pytest.approx(math.log(10) / 256)
    ref = {0: 2.44, 8: 1.54, 72: 0.0473, 80: 0.0399, 88: 0.0369, 96: 0.0346, 100: 0.0337}
    denominator = gap_denominator(ref, 100, floor=0.385)
    assert denominator == 0.385  # the final window's mean (0.036) is under the floor
    judged = judged_tolerance(0.01, 0.003, nats / denominator)
    assert judged == pytest.approx(0.02335, abs=1e-4) and 0.0145 < judged  # its failed +1.45% is one digit's worth
    # a language model's held-out loss (256 x 64 byte tokens, ~2.4 nats) resolves far under 1 %: unchanged
    gpt = resolution(256, 256 * 64) / gap_denominator({250: 2.4, 275: 2.39, 300: 2.38}, 300, floor=0.6)
    assert gpt < 2e-4 and judged_tolerance(0.01, 0.004, gpt) == 0.01
    # noise above both still wins; no prediction (or one class) resolves nothing
    assert judged_tolerance(0.01, 0.305, 0.0233) == pytest.approx(3 * 0.305)
    assert resolution(1, 256) == 0.0 and resolution(10, 0) == 0.0 and judged_tolerance(0.01, 0.0, math.nan) == 0.01
    assert math.isinf(gap_denominator({0: 2.0}, 100, floor=0.5))  # no eval in the final window


def test_describe_validation_says_when_the_resolution_judged() -> None:
    from nfab.calibrate.validate import Round, Validation
    from nfab.profile.evidence import describe_validation

    v = Validation(tolerance=0.01, steps=100, resolution=0.009, resolved=0.0234, judged=0.0234)
    v.rounds.append(Round(start_step=0, stopped_at=None, gap=0.0145, passed=True, seconds=1.0))
    ev = v.to_evidence()
    assert v.judged_by == "resolution" and ev["judged_by"] == "resolution" and ev["resolution"] == 0.009
    assert "one held-out prediction moves the loss by 0.0090 nats, so judged at 2.3%" in describe_validation(ev)
    noisy = Validation(tolerance=0.01, steps=100, noise=0.3, resolved=0.0234, judged=0.9)
    assert noisy.judged_by == "noise"


def test_describe_validation_says_when_it_covered_part_of_the_run_the_profile_is_for() -> None:
    """A calibration shorter than its run (`--steps` below the config's) validates the shorter run: the
    recipe ViT passed or failed at 100 steps where its 300-step runs ended elsewhere. The line says what
    was validated; a calibration at the run's own length reads as before."""
    from nfab.calibrate.validate import Round, Validation
    from nfab.profile.evidence import describe_validation

    short = Validation(tolerance=0.01, steps=100, run_steps=300)
    short.rounds.append(Round(start_step=0, stopped_at=None, gap=0.004, passed=True, seconds=1.0))
    assert short.to_evidence()["run_steps"] == 300
    assert describe_validation(short.to_evidence()).startswith("validation over 100 steps of a 300-step run: passed")
    whole = Validation(tolerance=0.01, steps=300)
    whole.rounds.append(Round(start_step=0, stopped_at=None, gap=0.004, passed=True, seconds=1.0))
    assert describe_validation(whole.to_evidence()).startswith("validation over 300 steps: passed")
    assert describe_validation({**whole.to_evidence(), "run_steps": None}).startswith("validation over 300 steps:")


def _noisy(ref_eval: dict[int, float], val: list[float], steps: list[int], gap: float, rise: float) -> dict[int, float]:
    """A synthetic FP32 held-out curve: `val` lowered by `gap` (so the profile sits about `gap` above
    it), with one late rise of `rise` between steps 4 and 5 of 8 (noise, not training); without a
    rise, never rising at all."""
    out = {s: (v / (1 + gap) if s > 0 else ref_eval[s]) for s, v in zip(steps, val, strict=True)}
    if rise:
        out[5] = out[4] * (1 + rise)
    else:
        for a, b in zip(steps, steps[1:], strict=False):
            out[b] = min(out[b], out[a])
    return out


def test_validation_on_a_noisy_reference_passes_in_one_round_and_says_why() -> None:
    from nfab.profile.evidence import describe_validation

    task = tiny()
    ref = run_reference(task)
    rows = [(p, "conv", r, b, c) for p in ("p0", "p1") for r, b, c in
            (("fp32", 48.0, 1.0), ("q8", 12.0, 0.97), ("q4", 6.0, 0.6), ("sign", 3.0, 0.4))]
    prof = profile((0.0, {"conv": "sign"}, False), (0.5, {"conv": "sign"}, False))
    _, plain = validate_profile(task, ref, prof, table(rows), tol=TOL, tolerance=10.0)  # the profile's own curve
    # the same profile 10 % above FP32, where FP32's own loss jumps 50 % late: a 1 % tolerance is noise
    # (built to be 0.5: out[5] = out[4] * 1.5 read back as a ratio can land one ulp below it)
    ref.eval_loss = _noisy(ref.eval_loss, plain.profile_eval, plain.eval_steps, gap=0.10, rise=0.5)
    out, v = validate_profile(task, ref, prof, table(rows), tol=TOL,
                              held_out_resolution=EVERY_GAP, tolerance=0.01)
    assert v.noise >= 0.5 - 1e-9 and v.judged_by == "noise" and v.judged == pytest.approx(3 * v.noise)
    assert v.passed and len(v.rounds) == 1 and v.rounds[0].stopped_at is None  # no tightening on noise
    assert v.gap == pytest.approx(0.10, rel=1e-4) and out.phases == prof.phases
    ev = out.evidence["validation"]
    assert ev["judged_by"] == "noise" and ev["judged_tolerance"] == pytest.approx(v.judged, abs=1e-6)
    assert "passed only within FP32's own noise" in describe_validation(ev)
    # a quiet reference with the same 10 % gap: judged at the tolerance, so it fails and tightens
    ref.eval_loss = _noisy(ref.eval_loss, plain.profile_eval, plain.eval_steps, gap=0.10, rise=0.0)
    _, quiet = validate_profile(task, ref, prof, table(rows), tol=TOL,
                              held_out_resolution=EVERY_GAP, tolerance=0.01, max_rounds=2)
    assert quiet.noise == 0.0 and quiet.judged_by == "tolerance" and quiet.judged == 0.01
    assert not quiet.rounds[0].passed and quiet.rounds[0].change is not None
