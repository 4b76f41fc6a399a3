"""The calibration budget in steps: trials spread over the phases, validation gets the rest."""

from __future__ import annotations

from nfab.calibrate.budget import (
    REPLAY_SHARE,
    TRIAL_SHARE,
    VALIDATION_STEP_COST,
    trial_allowance,
    trial_allowed,
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


def test_every_phase_gets_a_trial_and_a_second_after_a_rejection() -> None:
    # a 100-step calibration: the share (30 steps) holds one 20-step trial for four phases
    def allowed(phase: int, used: int, trials: int, passed: bool) -> bool:
        return trial_allowed(100, 20, phase, 4, used=used, phase_trials=trials, phase_passed=passed)

    assert allowed(3, used=200, trials=0, passed=False)  # the phase's first trial, whatever was spent
    assert allowed(3, used=200, trials=1, passed=False)  # a rejected candidate does not exhaust the phase
    assert not allowed(3, used=200, trials=1, passed=True)  # past that, only the share decides
    assert not allowed(3, used=200, trials=2, passed=False)
    assert allowed(3, used=0, trials=2, passed=True)  # the share still has room
