"""The calibration's time split: every stage, the total and the ratio to the FP32 reference."""

from __future__ import annotations

import time

import pytest

from nfab.calibrate.timing import StageClock
from nfab.profile.evidence import describe_timing, describe_validation


def test_split_charges_each_stage_and_states_the_ratio() -> None:
    clock = StageClock()
    with clock.stage("reference"):
        time.sleep(0.3)
    with clock.stage("trials"):
        time.sleep(0.1)
    with clock.stage("trials"):
        time.sleep(0.1)
    split = clock.split()
    assert split["reference_s"] >= 0.29 and split["trials_s"] >= 0.19 and split["validation_s"] == 0.0
    assert split["total_s"] >= split["reference_s"] + split["trials_s"] - 0.02  # each rounded to 10 ms
    assert split["ratio"] == pytest.approx(split["total_s"] / split["reference_s"], rel=0.05)  # from unrounded
    text = describe_timing(split)
    assert text.startswith(f"total {split['total_s']:.0f} s = {split['ratio']:.2f}x the FP32 reference")
    assert f"reference {split['reference_s']:.1f} s" in text and f"trials {split['trials_s']:.1f} s" in text


def test_validation_line_names_changes_and_why_it_stopped() -> None:
    ev = {"passed": False, "gap": 0.034, "tolerance": 0.01, "steps": 300, "stopped": "budget",
          "rounds": [{"change": "p1/linear: sign -> q8"}, {"change": None}]}
    line = describe_validation(ev)
    assert line == ("validation over 300 steps: FAILED, gap +3.40% (tolerance 1.00%) after 2 round(s); "
                    "tightened p1/linear: sign -> q8; stopped: budget")
    assert describe_validation({"passed": None, "stopped": "refit"}) == "validation: none (refit)"


def test_split_has_wall_and_cpu_seconds_for_every_shown_stage() -> None:
    from nfab.profile.evidence import SHOWN

    clock = StageClock()
    with clock.stage("reference"):
        # CPU work long enough (0.3 s) that rounding each figure to 10 ms cannot move the ratio by 10 %:
        # a fixed amount of work took 10 ms on a fast runner and the rounded ratio read 2.0 against 1.0.
        start = time.process_time()
        while time.process_time() - start < 0.3:
            sum(i * i for i in range(10_000))
    split = clock.split()
    want = {f"{k}_s" for k in SHOWN} | {f"{k}_cpu_s" for k in SHOWN[:-1]} | {"total_s", "cpu_s", "ratio", "cpu_ratio"}
    assert set(split) == want
    assert split["cpu_ratio"] == pytest.approx(split["cpu_s"] / split["reference_cpu_s"], rel=0.1)


def test_validation_line_says_when_it_was_judged_against_the_references_noise() -> None:
    ev = {"passed": True, "gap": 0.4, "tolerance": 0.01, "steps": 150, "noise": 0.305, "judged_tolerance": 0.915,
          "judged_by": "noise", "rounds": [{"change": None}]}
    assert describe_validation(ev) == (
        "validation over 150 steps: passed only within FP32's own noise, not at the 1.00% tolerance: gap +40.00%, "
        "while FP32's own held-out loss moves 30.5% between evaluations on this data, so no gap under 91.5% can be "
        "told from noise; after 1 round(s)")
    failed = describe_validation({**ev, "passed": False, "gap": 1.2})
    assert failed.startswith("validation over 150 steps: FAILED, beyond FP32's own noise: gap +120.00%")
