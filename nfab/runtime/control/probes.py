"""Which regions a step's fidelity probe samples: a pure function of agreed state.

A probe all-reduces an FP32 sample of the lossy regions beside their low-bit payload. It is
control, and control must stay a small share of the bytes compression saves
(`StepStats.probe_wire_bytes`): on issue 31's GPT recipe, probing every lossy region on every
10th step (and every step of the first 20) made a 10%-of-FP32 route cost 31% FP32 on probe
steps. So a probe samples ONE lossy region, the next probe the next one (rotation), and the
interval doubles while the run stays quiet (no health event for 4 intervals), up to
`probe_spacing_max` times `probe_every`; a regular probe is skipped while the run's probes so
far exceed `probe_budget` (5%) of the other bytes it sent. The first `dense_probe_steps` and an
alarm's shadow window are safety and not budgeted; a shadow probes every lossy region, since it
must answer for all of them.

Everything here is a function of the step and the health state every rank holds bit for bit,
so every rank samples the same regions and launches the same probe collective.
"""

from __future__ import annotations

from nfab.profile.schema import Health
from nfab.runtime.control.health import HealthState

QUIET_INTERVALS = 4
"""Intervals without a health event before the probe interval doubles."""


def probe_interval(step: int, cfg: Health, state: HealthState) -> int:
    """Steps between regular probes at `step`: `probe_every`, doubled for each further
    QUIET_INTERVALS intervals without a health event, up to `probe_spacing_max` times."""
    quiet, spacing = step - state.quiet_since, 1
    while spacing * 2 <= cfg.probe_spacing_max and quiet >= QUIET_INTERVALS * cfg.probe_every * spacing:
        spacing *= 2
    return cfg.probe_every * spacing


def over_budget(cfg: Health, state: HealthState) -> bool:
    """The run's probes so far cost more than `probe_budget` of the other bytes it sent."""
    return cfg.probe_budget > 0 and state.probe_bytes > cfg.probe_budget * (state.sent_bytes - state.probe_bytes)


def probe_regions(step: int, cfg: Health, state: HealthState, lossy: tuple[str, ...], dense: bool,
                  watch_all: bool = False) -> frozenset[str]:
    """The regions `step` probes (empty: no probe). `lossy`: the regions the profile routes lossy
    at this step, sorted; `dense`: the drift monitor reads the optimizer's second moment, so the
    first `dense_probe_steps` (and a probation) probe every step; `watch_all`: error feedback runs
    in a lossy region, the combination that bent training within ~20 steps under Adam, so those
    dense probes sample every region (the drift monitor needs 2 probes of a region to act)."""
    if cfg.probe_every <= 0 or not lossy:
        return frozenset()
    if step < state.shadow_until:
        return frozenset(lossy)
    if dense and step < max(cfg.dense_probe_steps, state.probation_until):
        if watch_all:
            return frozenset(lossy)
        turn = step
    elif over_budget(cfg, state):
        return frozenset()
    else:
        interval = probe_interval(step, cfg, state)
        if step % interval:
            return frozenset()
        turn = step // interval
    return frozenset((lossy[turn % len(lossy)],)) if cfg.probe_rotate else frozenset(lossy)
