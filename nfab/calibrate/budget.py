"""The calibration budget, counted in simulated steps (never the clock).

A calibration may cost `BUDGET_RATIO` x its own FP32 reference run. The stages are capped in
steps, not seconds, so the same inputs give the same profile on a quiet or a loaded machine:
- the reference run is the unit (its `steps` steps);
- replay and the FP32 continuations' captures cost about `REPLAY_SHARE` of it (not capped);
- short trials get `TRIAL_SHARE` of it, spread over the phases (a phase may use what earlier
  phases left; a trial that does not fit is not run: `screen = "budget"`). Whatever the share,
  every phase may run two trials under each EF setting it searches (`PHASE_TRIALS`), the first
  two steps of the search's bisection (search.py): after a rejection the dearer half, after a
  pass the cheaper one. Per EF setting: resnet18's warm-up end rejected bq4 and bl6 with EF
  (+107%, +104%), and two trials per phase in all left EF off untried (bf16 on conv). A 100-step
  calibration's share (30 steps) held one 20-step trial for four phases: the rejected candidate
  left three phases to replay fidelity alone, and a passing one left the cheaper routes untried
  (on the CNN recipe bl6 at 5.6 bits passed where bl5 at 5.2 was never tried). A rejected trial
  usually stops early (about half its steps), so the guarantee costs up to 2 x phases x trial
  steps per EF setting (the second setting is searched only while it can beat the first's
  bytes), typically less; validation then has less left for tightening rounds;
- validation gets the rest; one of its steps costs `VALIDATION_STEP_COST` reference steps (the
  reducers' replay on top of the forward and backward pass). The first round always runs
  whole; a tightening round runs only if it fits.
Measured on 2 cores (2026-11-30): held-out GPT replay 0.14x, validation step 1.34x (bq3
everywhere); resnet18 replay 0.35x, validation step 1.4x. Since 2026-12-01 (blockq replay sums
levels, replays without EF decode no locals; CPU, loaded machine): held-out GPT replay 0.05x,
validation step 1.18x (bq2 everywhere); resnet18 replay 0.3-0.45x, validation step 0.95-1.2x. The
constants stay where they were: a tightening round is admitted only when it fits at 1.35.
"""

from __future__ import annotations

BUDGET_RATIO = 3.0
"""Default cap on the whole calibration's cost, in FP32-reference runs."""
TRIAL_SHARE = 0.3
"""Short trials' share of the budget, in reference runs."""
REPLAY_SHARE = 0.2
"""What replay and the continuations' captures are assumed to cost, in reference runs."""
VALIDATION_STEP_COST = 1.35
"""One validation step in reference steps."""


def trial_allowance(steps: int, trial_steps: int, phase: int, phases: int, ratio: float = BUDGET_RATIO) -> int:
    """Trial steps phases 0..`phase` may have used in all: an even share each, at least one trial's worth."""
    total = TRIAL_SHARE * ratio / BUDGET_RATIO * steps
    return max(trial_steps, int(total * (phase + 1) / phases))


PHASE_TRIALS = 2
"""Trials every phase may run under each EF setting whatever the share: the bisection's first two
steps (a rejected candidate does not exhaust the phase, a passing one does not end its search)."""


def trial_allowed(steps: int, trial_steps: int, phase: int, phases: int, *, used: int, phase_trials: int,
                  ratio: float = BUDGET_RATIO) -> bool:
    """May phase `phase` run one more trial under an EF setting (`phase_trials` of the phase's trials
    ran under it), `used` trial steps having run so far in all? The first PHASE_TRIALS always, any
    further one while the share (`trial_allowance`) has room."""
    if phase_trials < PHASE_TRIALS:
        return True
    return used + trial_steps <= trial_allowance(steps, trial_steps, phase, phases, ratio)


def validation_allowance(steps: int, trial_steps_run: int, ratio: float = BUDGET_RATIO) -> int:
    """Validation steps that fit in what the reference, replay and trials left of the budget."""
    left = (ratio - 1.0 - REPLAY_SHARE) * steps - trial_steps_run
    return max(0, int(left / VALIDATION_STEP_COST))
