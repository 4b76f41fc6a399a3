"""The calibration budget in steps: trials spread over the phases, validation gets the rest."""

from __future__ import annotations

from nfab.calibrate.budget import (
    REPLAY_SHARE,
    TRIAL_SHARE,
    VALIDATION_STEP_COST,
    trial_allowance,
    validation_allowance,
)


def test_trials_get_an_even_share_per_phase_and_at_least_one_trial() -> None:
    total = int(TRIAL_SHARE * 300)
    assert [trial_allowance(300, 20, p, 4) for p in range(4)] == [max(20, total * (p + 1) // 4) for p in range(4)]
    assert trial_allowance(10, 20, 0, 2) == 20  # a short run still affords one trial
    assert trial_allowance(300, 20, 3, 4, ratio=6.0) == int(2 * TRIAL_SHARE * 300)


def test_validation_gets_what_the_rest_left() -> None:
    full = validation_allowance(300, 0)
    assert full == int((3.0 - 1.0 - REPLAY_SHARE) * 300 / VALIDATION_STEP_COST)
    assert full >= 300  # one whole validation round always fits the default budget
    assert validation_allowance(300, 90) < full and validation_allowance(300, 10_000) == 0
