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


def test_every_phase_gets_two_trials_whatever_the_share() -> None:
    # a 100-step calibration: the share (30 steps) holds one 20-step trial for four phases
    def allowed(phase: int, used: int, trials: int) -> bool:
        return trial_allowed(100, 20, phase, 4, used=used, phase_trials=trials)

    assert allowed(3, used=200, trials=0)  # the phase's first trial, whatever was spent
    assert allowed(3, used=200, trials=1)  # and the bisection's second step
    assert not allowed(3, used=200, trials=2)  # past that, only the share decides
    assert allowed(3, used=0, trials=2)  # the share still has room
