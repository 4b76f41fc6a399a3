"""Health monitor: a pure state machine over agreed per-step observations.

Inputs come only from collective results (identical on every rank), so every rank
reaches the same decisions: a rank never demotes a route alone.

Unhealthy signals: a non-finite gradient on any rank, a loss spike against the running
baseline, a gradient-norm jump, a fidelity probe below threshold. An unhealthy step
demotes the affected region classes to FP32 for at least `cooldown_steps`; a demoted
region is re-admitted after `readmit_after` consecutive healthy steps past the
cool-down (hysteresis, so a borderline region does not flap).

Alarms and shadows. Non-finite gradients demote every lossy region at once. A loss spike or a
gradient-norm jump is only an alarm: under clipping, accumulation and a decaying learning rate
the norm moves for healthy reasons. An alarm opens an FP32 shadow window (`Health.shadow_steps`
steps on which every lossy region is probed against its FP32 mean); the region the shadow finds
unfaithful is demoted, the others keep their route, and a window that finds every region
faithful is counted a false alarm. The spike and jump thresholds were fitted on the calibration's
reference run; for a longer run they are widened as the largest of more samples grows
(`horizon_threshold`). While a window is open the baselines keep learning, so a healthy level
shift does not raise the alarm again.

Slow divergence. Low-bit training rarely fails with a spike: it drifts (on the held-out
GPT under AdamW, sign + error feedback ended +56% with no spike, no norm jump and a plain
probe cosine far above any floor). So every probe also gives a per-region fidelity in
the optimizer's preconditioned space (`runtime/control/fidelity.py`), and the monitor keeps its
trend (an EMA over probes) per region. It acts only on preconditioned fidelity, i.e. when
`attach` was given an optimizer that keeps a second moment (Adam-style). A region whose trend falls below
`min_trend_cosine` loses what is most likely to blame first: a region running with error
feedback gets error feedback switched off for the rest of the run (its residuals dropped:
under Adam they are the stale mass that bends the update), keeping its route, and so does
every other region with error feedback (the suspect is error feedback under this optimizer,
not the region); a region
that drifts without error feedback is demoted to FP32 ("drift"), but only from step
`drift_demote_after` on (earlier only where its error feedback was already switched off
for drift: a confirmed suspect): Adam's first updates are close to sign(g) and its second moment is
an average of a few squared gradients, so early preconditioned cosines are low for healthy
routes too (switching error feedback off costs no bytes and may act at once). Each further drift
demotion of the same region doubles its cool-down (up to `max_backoff` times), so a
route that keeps failing spends ever less of the run on the wire, and a re-admitted (or
error-feedback-free) region starts a fresh trend.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from nfab.profile.schema import Health
from nfab.runtime.control.fidelity import RegionFidelity
from nfab.runtime.stats import StepStats

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Observation:
    """What every rank agreed on about one step."""

    step: int
    loss: float | None
    grad_norm: float
    nonfinite: bool
    probe_cosine: float | None = None
    probe_regions: frozenset[str] = frozenset()
    fidelity: Mapping[str, RegionFidelity] = field(default_factory=dict)
    """Per-region probe fidelity (preconditioned where the optimizer keeps a second moment)."""


@dataclass(frozen=True, slots=True)
class HealthEvent:
    """A fallback or a re-admission, with its reason."""

    step: int
    kind: str  # "fallback" | "readmit" | "ef_off"
    reason: str
    regions: tuple[str, ...]


@dataclass(slots=True)
class HealthState:
    """The monitor's memory; saved with checkpoints on every rank."""

    loss_baseline: float | None = None
    norm_baseline: float | None = None
    steps_seen: int = 0
    demoted_at: dict[str, int] = field(default_factory=dict)
    healthy_streak: dict[str, int] = field(default_factory=dict)
    trend: dict[str, float] = field(default_factory=dict)
    """Per region: EMA over probes of its (preconditioned) probe cosine."""
    probes: dict[str, int] = field(default_factory=dict)
    """Per region: probes folded into its current trend."""
    strikes: dict[str, int] = field(default_factory=dict)
    """Per region: drift demotions so far (each doubles the next cool-down)."""
    ef_off: set[str] = field(default_factory=set)
    """Regions whose error feedback the drift monitor switched off (for the rest of the run)."""
    probation_until: int = 0
    """Probe every step before this step: a route re-admitted after a drift demotion is watched
    closely (every `probe_every` steps it took ~20 steps to see it drift again, each time on the wire)."""
    shadow_until: int = 0
    """An alarm's FP32 shadow: steps before this one probe every lossy region; the window closes
    at the fold of this step (where the last shadow probe's fidelity arrives)."""
    shadow_needed: bool = False
    """The open window demoted a region (the alarm was not false)."""
    alarms: int = 0
    false_alarms: int = 0
    quiet_since: int = 0
    """The step of the last health event (probes space out the longer the run stays quiet)."""
    probe_bytes: int = 0
    sent_bytes: int = 0
    """Probe bytes (shadow windows' apart) and all bytes this rank sent so far (the same on every
    rank): `Health.probe_budget`."""
    shadow_bytes: int = 0
    """Bytes of the shadow windows' probes so far (an alarm's cost, not charged to the probe budget)."""
    last_probe_bytes: int = 0
    """Bytes of the latest budgeted probe: the estimate of the next one's (control/probes.py)."""

    def other_bytes(self) -> int:
        """Bytes sent so far that were neither probes nor shadow windows' samples: the budget's base."""
        return self.sent_bytes - self.probe_bytes - self.shadow_bytes

    def demoted(self) -> frozenset[str]:
        return frozenset(self.demoted_at)

    def cooldown(self, cfg: Health, region: str) -> int:
        """Steps `region` stays demoted: the base cool-down, doubled per earlier drift demotion."""
        strikes = self.strikes.get(region, 0)
        return cfg.cooldown_steps * min(1 << min(max(strikes - 1, 0), 30), max(cfg.max_backoff, 1))

    def to_dict(self) -> dict:
        return {
            "loss_baseline": self.loss_baseline,
            "norm_baseline": self.norm_baseline,
            "steps_seen": self.steps_seen,
            "demoted_at": dict(self.demoted_at),
            "healthy_streak": dict(self.healthy_streak),
            "trend": dict(self.trend),
            "probes": dict(self.probes),
            "strikes": dict(self.strikes),
            "ef_off": sorted(self.ef_off),
            "probation_until": self.probation_until,
            "shadow": [self.shadow_until, self.shadow_needed, self.alarms, self.false_alarms, self.quiet_since],
            "bytes": [self.probe_bytes, self.sent_bytes, self.shadow_bytes, self.last_probe_bytes],
        }

    @classmethod
    def from_dict(cls, d: dict) -> HealthState:
        until, needed, alarms, false_alarms, quiet = d.get("shadow", [0, False, 0, 0, 0])  # absent before shadows
        return cls(
            d["loss_baseline"], d["norm_baseline"], int(d["steps_seen"]),
            {str(k): int(v) for k, v in d["demoted_at"].items()},
            {str(k): int(v) for k, v in d["healthy_streak"].items()},
            {str(k): float(v) for k, v in d.get("trend", {}).items()},  # absent in states saved before drift
            {str(k): int(v) for k, v in d.get("probes", {}).items()},
            {str(k): int(v) for k, v in d.get("strikes", {}).items()},
            {str(r) for r in d.get("ef_off", [])},
            int(d.get("probation_until", 0)),
            int(until), bool(needed), int(alarms), int(false_alarms), int(quiet),
            *(int(b) for b in d.get("bytes", [0, 0])),
        )


def _ema(old: float | None, new: float, beta: float) -> float:
    return new if old is None else beta * old + (1 - beta) * new


def horizon_threshold(ratio: float, fitted_steps: int | None, run_steps: int | None) -> float:
    """A spike/jump threshold fitted as the largest ratio over `fitted_steps`, for a run of
    `run_steps`: the largest of n roughly log-normal ratios grows like sqrt(2 ln n) standard
    deviations, so the log of the threshold grows by sqrt(ln run / ln fitted). Unchanged when
    either length is unknown or the run is not longer (a 100-step fit of 2.0 reads 2.16 at 300
    steps, 2.37 at 1,000)."""
    if not fitted_steps or not run_steps or run_steps <= fitted_steps or fitted_steps < 2:
        return ratio
    return math.exp(math.log(ratio) * math.sqrt(math.log(run_steps) / math.log(fitted_steps)))


def for_run(cfg: Health, fitted_steps: int | None, run_steps: int | None) -> Health:
    """`cfg` with its spike and jump thresholds widened for a run of `run_steps` (fitted over
    `fitted_steps`: `horizon_threshold`); `cfg` itself when nothing changes."""
    spike = horizon_threshold(cfg.loss_spike_ratio, fitted_steps, run_steps)
    jump = horizon_threshold(cfg.grad_norm_jump, fitted_steps, run_steps)
    if (spike, jump) == (cfg.loss_spike_ratio, cfg.grad_norm_jump):
        return cfg
    log.info("health thresholds fitted over %d steps, widened for a %d-step run: loss spike x%.3f, "
             "grad-norm jump x%.3f", fitted_steps, run_steps, spike, jump)
    return cfg.model_copy(update={"loss_spike_ratio": spike, "grad_norm_jump": jump})


def global_reasons(state: HealthState, cfg: Health, obs: Observation) -> list[str]:
    """Reasons that make the whole step unhealthy (empty when healthy); `cfg` holds the thresholds
    for this run's length (`horizon_threshold`, applied once at attach)."""
    reasons = []
    if obs.nonfinite:
        reasons.append("nonfinite")
    armed = state.steps_seen >= cfg.warmup_steps
    if armed and obs.loss is not None and state.loss_baseline is not None:
        if not math.isfinite(obs.loss) or obs.loss > cfg.loss_spike_ratio * state.loss_baseline:
            reasons.append("loss_spike")
    if armed and not obs.nonfinite and state.norm_baseline is not None:
        if obs.grad_norm > cfg.grad_norm_jump * state.norm_baseline:
            reasons.append("grad_norm_jump")
    return reasons


def unfaithful(cfg: Health, obs: Observation, candidates: frozenset[str]) -> tuple[str, ...]:
    """Regions among `candidates` the step's probe found below `min_fidelity_cosine`: each probed
    region by its own cosine (so one bad region does not demote the others); the step's cosine
    stands for all of them only when the probe carried no per-region fidelity."""
    if obs.probe_cosine is None:
        return ()
    probed = candidates & obs.probe_regions
    if obs.fidelity:
        return tuple(sorted(r for r in probed if r in obs.fidelity
                            and obs.fidelity[r].cosine < cfg.min_fidelity_cosine))
    return tuple(sorted(probed)) if obs.probe_cosine < cfg.min_fidelity_cosine else ()


def observe(state: HealthState, cfg: Health, st: StepStats, fidelity: Mapping[str, RegionFidelity],
            probe_regions: frozenset[str], lossy: frozenset[str], with_ef: frozenset[str]) -> list[HealthEvent]:
    """Fold a finished step's agreed statistics into the monitor; the events it decided (logged)."""
    obs = Observation(st.step, st.loss, st.grad_norm, st.skipped, st.fidelity_cosine,
                      probe_regions if st.fidelity_cosine is not None else frozenset(), fidelity)
    st.shadow = st.step < state.shadow_until  # this step's probe was a shadow's (decided before this fold)
    if st.shadow:  # an alarm's cost, counted apart from the budgeted probes (control/probes.py)
        st.shadow_wire_bytes, st.probe_wire_bytes = st.shadow_wire_bytes + st.probe_wire_bytes, 0
    events = update(state, cfg, obs, lossy, with_ef)
    st.alarms, st.false_alarms = state.alarms, state.false_alarms
    state.probe_bytes += st.probe_wire_bytes
    state.shadow_bytes += st.shadow_wire_bytes
    state.sent_bytes += st.wire_bytes
    if st.probe_wire_bytes:
        state.last_probe_bytes = st.probe_wire_bytes
    for e in events:
        log.info("step %d %s (%s) regions=%s", e.step, e.kind, e.reason, ",".join(e.regions))
    return events


def update(state: HealthState, cfg: Health, obs: Observation, lossy_regions: frozenset[str],
           ef_regions: frozenset[str] = frozenset()) -> list[HealthEvent]:
    """Advance the monitor by one agreed observation; returns the events it decided.

    `ef_regions`: lossy regions that ran with error feedback this step (a drifting one
    loses its error feedback before its route)."""
    events: list[HealthEvent] = []
    reasons = global_reasons(state, cfg, obs)
    healthy = not reasons
    # demote every lossy region on any alarm without shadows; with them, a non-finite gradient, a spike
    # or a jump opens a shadow window instead: its probes decide which region, if any. A non-finite
    # gradient is this step's input (every rank's |g|^2 before it was sent), not what was sent: under a
    # loss scaler it is an fp16 overflow the scaler skips, at the start and at every scale growth, and
    # demoting every region for it cost the cooldown in FP32 each time
    if reasons and cfg.shadow_steps == 0:
        hit = tuple(sorted(lossy_regions - state.demoted()))
        events.append(HealthEvent(obs.step, "fallback", "+".join(reasons), hit))
        for r in hit:
            state.demoted_at[r] = obs.step
            state.healthy_streak[r] = 0
    if reasons:  # a demoted region waits for healthy steps, whatever the alarm turns out to be
        for r in state.demoted():
            state.healthy_streak[r] = 0
    # the floor waits out the warm-up: Adam's first second moments rest on a few squared
    # gradients, and a probe read through them is noise (healthy bq2 read 0.25 at step 2)
    if state.steps_seen >= cfg.warmup_steps:
        hit = unfaithful(cfg, obs, lossy_regions - state.demoted())
        if hit:
            cos = min((obs.fidelity[r].cosine for r in hit if r in obs.fidelity), default=obs.probe_cosine)
            events.append(HealthEvent(obs.step, "fallback", f"fidelity({cos:.3f})", hit))
            for r in hit:
                state.demoted_at[r] = obs.step
                state.healthy_streak[r] = 0
    events.extend(_drift(state, cfg, obs, lossy_regions, ef_regions - state.ef_off))
    events.extend(_shadow(state, cfg, obs, reasons, lossy_regions, any(e.kind == "fallback" for e in events)))
    # re-admit after cool-down and a healthy streak
    if healthy:
        back = []
        for r, at in sorted(state.demoted_at.items()):
            if obs.step - at >= state.cooldown(cfg, r):
                state.healthy_streak[r] = state.healthy_streak.get(r, 0) + 1
                if state.healthy_streak[r] >= cfg.readmit_after:
                    back.append(r)
        if any(state.strikes.get(r, 0) for r in back):  # its route drifted before: probe it densely
            state.probation_until = obs.step + 1 + cfg.dense_probe_steps
        for r in back:
            del state.demoted_at[r]
            state.healthy_streak.pop(r, None)
            state.trend.pop(r, None)  # a re-admitted region earns a fresh trend
            state.probes.pop(r, None)
        if back:
            events.append(HealthEvent(obs.step, "readmit", "healthy", tuple(back)))
    # baselines learn only from healthy, finite steps (a spike must not poison them), and while
    # an alarm is under review (a healthy level shift must not alarm again when the window closes)
    reviewing = state.shadow_until > obs.step and "nonfinite" not in reasons
    if any(e.kind != "readmit" for e in events):
        state.quiet_since = obs.step
    if healthy or reviewing:
        if obs.loss is not None and math.isfinite(obs.loss):
            state.loss_baseline = _ema(state.loss_baseline, obs.loss, cfg.baseline_beta)
        if math.isfinite(obs.grad_norm):
            state.norm_baseline = _ema(state.norm_baseline, obs.grad_norm, cfg.baseline_beta)
    state.steps_seen += 1
    return events


def _shadow(state: HealthState, cfg: Health, obs: Observation, reasons: list[str], lossy_regions: frozenset[str],
            demoted_now: bool) -> list[HealthEvent]:
    """Close a shadow window whose last probe has been read (false alarm when it demoted no
    region), then open one on a new alarm: a non-finite gradient, a spike or a jump (while none is open)."""
    events = []
    if state.shadow_until:
        state.shadow_needed |= demoted_now
        if obs.step >= state.shadow_until:
            false = not state.shadow_needed
            state.false_alarms += false
            events.append(HealthEvent(obs.step, "shadow", "false alarm" if false else "demotion needed", ()))
            state.shadow_until, state.shadow_needed = 0, False
    if reasons and cfg.shadow_steps > 0 and not state.shadow_until:
        watched = tuple(sorted(lossy_regions - state.demoted()))
        if watched:
            state.shadow_until, state.shadow_needed = obs.step + 1 + cfg.shadow_steps, False
            state.alarms += 1
            events.append(HealthEvent(obs.step, "alarm", "+".join(reasons), watched))
    return events


def fold_trend(state: HealthState, cfg: Health, fidelity: Mapping[str, RegionFidelity]) -> None:
    """Fold one probe's preconditioned per-region cosines into the regions' trends (EMA over probes).

    Plain cosines (no optimizer given, SGD, or before Adam's first step) are not folded: in
    plain space a majority-vote sign sits near 0.4-0.6 while training well under SGD, so
    a floor there would demote healthy runs and cost bytes.
    """
    for region, fid in sorted(fidelity.items()):
        if not fid.preconditioned:
            continue
        state.trend[region] = _ema(state.trend.get(region), fid.cosine, cfg.trend_beta)
        state.probes[region] = state.probes.get(region, 0) + 1


def _drift(state: HealthState, cfg: Health, obs: Observation, lossy_regions: frozenset[str],
           ef_regions: frozenset[str]) -> list[HealthEvent]:
    """Switch off error feedback in, or else demote, lossy regions whose trend fell below `min_trend_cosine`."""
    if not obs.fidelity:
        return []
    fold_trend(state, cfg, obs.fidelity)
    if cfg.min_trend_cosine <= 0:
        return []
    hit = tuple(sorted(
        r for r in (lossy_regions - state.demoted()) & set(obs.fidelity)
        # switching error feedback off costs no bytes: one probe is evidence enough for it
        if state.probes.get(r, 0) >= (1 if r in ef_regions else cfg.trend_min_probes)
        and state.trend[r] < cfg.min_trend_cosine and obs.fidelity[r].preconditioned
    ))
    if not hit:
        return []
    detail = ",".join(f"{r}={state.trend[r]:.3f}" for r in hit)
    why = f"drift(preconditioned cosine trend {detail} < {cfg.min_trend_cosine})"
    events = []
    if any(r in ef_regions for r in hit):
        # first suspect: error feedback (stale residuals under a per-coordinate RMS). The drift
        # measure acts only under an adaptive optimizer, and there the suspect is the combination,
        # not the region: it goes off in every region at the first one's drift (on the third
        # held-out model, region by region took until step 10 for the largest, and the run ended
        # +6.4% above FP32 even with every region demoted after that)
        no_ef = tuple(sorted(ef_regions))
        state.ef_off.update(no_ef)
        for r in no_ef:
            state.trend.pop(r, None)
            state.probes.pop(r, None)
        events.append(HealthEvent(obs.step, "ef_off", why, no_ef))
    hit = tuple(r for r in hit if r not in ef_regions)
    # before the preconditioner matures only confirmed suspects are demoted: regions whose error
    # feedback was already switched off for drift and still drift without it
    hit = hit if obs.step >= cfg.drift_demote_after else tuple(r for r in hit if r in state.ef_off)
    if not hit:
        return events
    for r in hit:
        state.demoted_at[r] = obs.step
        state.healthy_streak[r] = 0
        state.strikes[r] = state.strikes.get(r, 0) + 1
    return [*events, HealthEvent(obs.step, "fallback", why, hit)]
