"""Which regions a step's fidelity probe samples: a pure function of agreed state.

A probe all-reduces an FP32 sample of the lossy regions beside their low-bit payload. It is
control, and control must stay a small share of the bytes compression saves
(`StepStats.probe_wire_bytes`): on issue 31's GPT recipe, probing every lossy region on every
10th step (and every step of the first 20) made a 10%-of-FP32 route cost 31% FP32 on probe
steps. So a probe samples ONE lossy region, the next probe the next one (rotation), and the
interval doubles while the run stays quiet (no health event for 4 intervals), up to
`probe_spacing_max` times `probe_every`.

The budget (`Health.probe_budget`, 5%) holds over the run for every probe but a shadow's:
- a regular probe is skipped when it would take the run's probe bytes past the budget's share
  of the other bytes sent so far (`over_budget`; the next probe is estimated by the last one);
- the early dense probes and a probation's (every step, for the drift monitor) are safety that
  cannot wait for the bytes to accrue: they may borrow from the run's future, up to
  `DENSE_SHARE` of the budget of the bytes the whole run will send (projected from the steps so
  far over its length, `horizon`), and the regular probes then pause until the share is earned
  back. Without a known length (`attach(total_steps=)`) they are not budgeted: there is no future
  to borrow against, and budgeting them on the bytes sent so far starves the drift monitor in its
  first steps (sign + EF under AdamW was no longer demoted). On the recipe ViT (seed 1) the
  unbudgeted dense probes and shadows had made the run's probes 5.4% of the other bytes;
- one exception: while error feedback runs in a lossy region, the dense probes watch every region
  whatever the budget (the combination that bent training for good within ~20 steps under Adam,
  and that the drift monitor must catch from a few probes: budgeted, sign + EF starved it, since
  sign's payload is tiny beside a 512-element sample per parameter). They are counted as probes;
  a run that forces error feedback may spend more than the budget there;
- an alarm's shadow window probes every lossy region whatever the budget: it must answer for all
  of them, now. Its samples are counted apart (`StepStats.shadow_wire_bytes`, in `wire_bytes`
  too), neither charged to the probe budget nor counted in its base: an alarm's cost is reported
  as its own, so a run with false alarms shows what they cost.

Everything here is a function of the step and the health state every rank holds bit for bit,
so every rank samples the same regions and launches the same probe collective.
"""

from __future__ import annotations

from nfab.profile.schema import Health
from nfab.runtime.control.health import HealthState

QUIET_INTERVALS = 4
"""Intervals without a health event before the probe interval doubles."""
DENSE_SHARE = 0.5
"""Of the run's projected probe budget, what dense and probation probes may spend ahead of the bytes
(half: the projection assumes later steps send as much as the earlier ones, and a later phase on a
cheaper route sends less)."""


def probe_interval(step: int, cfg: Health, state: HealthState) -> int:
    """Steps between regular probes at `step`: `probe_every`, doubled for each further
    QUIET_INTERVALS intervals without a health event, up to `probe_spacing_max` times."""
    quiet, spacing = step - state.quiet_since, 1
    while spacing * 2 <= cfg.probe_spacing_max and quiet >= QUIET_INTERVALS * cfg.probe_every * spacing:
        spacing *= 2
    return cfg.probe_every * spacing


def over_budget(cfg: Health, state: HealthState) -> bool:
    """Would one more probe (as large as the last) take the run's probe bytes past `probe_budget`
    of the other bytes it sent so far (shadow windows' samples neither side)?"""
    return (cfg.probe_budget > 0
            and state.probe_bytes + state.last_probe_bytes > cfg.probe_budget * state.other_bytes())


def over_run_budget(cfg: Health, state: HealthState, horizon: int | None) -> bool:
    """Would one more dense probe take the run's probe bytes past DENSE_SHARE of the budget of the
    bytes the whole run of `horizon` steps will send (projected from the steps so far)? Never without
    a horizon (the run's length unknown, there is no future to borrow against, and budgeting them on
    the bytes so far starves the drift monitor in its first steps) or before any step was folded."""
    if cfg.probe_budget <= 0 or not horizon or state.steps_seen == 0:
        return False
    projected = state.other_bytes() / state.steps_seen * max(horizon, state.steps_seen)
    return state.probe_bytes + state.last_probe_bytes > DENSE_SHARE * cfg.probe_budget * projected


def probe_regions(step: int, cfg: Health, state: HealthState, lossy: tuple[str, ...], dense: bool,
                  watch_all: bool = False, horizon: int | None = None) -> frozenset[str]:
    """The regions `step` probes (empty: no probe). `lossy`: the regions the profile routes lossy
    at this step, sorted; `dense`: the drift monitor reads the optimizer's second moment, so the
    first `dense_probe_steps` (and a probation) probe every step; `watch_all`: error feedback runs
    in a lossy region, the combination that bent training within ~20 steps under Adam, so those
    dense probes sample every region (the drift monitor needs 2 probes of a region to act);
    `horizon`: the run's length in steps, when known (what dense probes may borrow against)."""
    if cfg.probe_every <= 0 or not lossy:
        return frozenset()
    if step < state.shadow_until:
        return frozenset(lossy)
    if dense and step < max(cfg.dense_probe_steps, state.probation_until):
        if watch_all:  # error feedback under the drift monitor: its safety is bought ahead of the budget
            return frozenset(lossy)
        if over_run_budget(cfg, state, horizon):
            return frozenset()
        turn = step
    elif over_budget(cfg, state):
        return frozenset()
    else:
        interval = probe_interval(step, cfg, state)
        if step % interval:
            return frozenset()
        turn = step // interval
    return frozenset((lossy[turn % len(lossy)],)) if cfg.probe_rotate else frozenset(lossy)
