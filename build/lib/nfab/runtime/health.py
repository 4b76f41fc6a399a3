"""Health monitor: a pure state machine over agreed per-step observations.

Inputs come only from collective results (identical on every rank), so every rank
reaches the same decisions: a rank never demotes a route alone.

Unhealthy signals: a non-finite gradient on any rank, a loss spike against the running
baseline, a gradient-norm jump, a fidelity probe below threshold. An unhealthy step
demotes the affected region classes to FP32 for at least `cooldown_steps`; a demoted
region is re-admitted after `readmit_after` consecutive healthy steps past the
cool-down (hysteresis, so a borderline region does not flap).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from nfab.profile.schema import Health


@dataclass(frozen=True, slots=True)
class Observation:
    """What every rank agreed on about one step."""

    step: int
    loss: float | None
    grad_norm: float
    nonfinite: bool
    probe_cosine: float | None = None
    probe_regions: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class HealthEvent:
    """A fallback or a re-admission, with its reason."""

    step: int
    kind: str  # "fallback" | "readmit"
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

    def demoted(self) -> frozenset[str]:
        return frozenset(self.demoted_at)

    def to_dict(self) -> dict:
        return {
            "loss_baseline": self.loss_baseline,
            "norm_baseline": self.norm_baseline,
            "steps_seen": self.steps_seen,
            "demoted_at": dict(self.demoted_at),
            "healthy_streak": dict(self.healthy_streak),
        }

    @classmethod
    def from_dict(cls, d: dict) -> HealthState:
        return cls(
            d["loss_baseline"], d["norm_baseline"], int(d["steps_seen"]),
            {str(k): int(v) for k, v in d["demoted_at"].items()},
            {str(k): int(v) for k, v in d["healthy_streak"].items()},
        )


def _ema(old: float | None, new: float, beta: float) -> float:
    return new if old is None else beta * old + (1 - beta) * new


def global_reasons(state: HealthState, cfg: Health, obs: Observation) -> list[str]:
    """Reasons that make the whole step unhealthy (empty when healthy)."""
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


def update(state: HealthState, cfg: Health, obs: Observation, lossy_regions: frozenset[str]) -> list[HealthEvent]:
    """Advance the monitor by one agreed observation; returns the events it decided."""
    events: list[HealthEvent] = []
    reasons = global_reasons(state, cfg, obs)
    healthy = not reasons
    # demote: whole-step reasons hit every lossy region; a bad probe hits its regions
    if reasons:
        hit = tuple(sorted(lossy_regions - state.demoted()))
        events.append(HealthEvent(obs.step, "fallback", "+".join(reasons), hit))
        for r in hit:
            state.demoted_at[r] = obs.step
            state.healthy_streak[r] = 0
        for r in state.demoted():
            state.healthy_streak[r] = 0
    if obs.probe_cosine is not None and obs.probe_cosine < cfg.min_fidelity_cosine:
        hit = tuple(sorted((obs.probe_regions & lossy_regions) - state.demoted()))
        if hit:
            events.append(HealthEvent(obs.step, "fallback", f"fidelity({obs.probe_cosine:.3f})", hit))
            for r in hit:
                state.demoted_at[r] = obs.step
                state.healthy_streak[r] = 0
    # re-admit after cool-down and a healthy streak
    if healthy:
        back = []
        for r, at in sorted(state.demoted_at.items()):
            if obs.step - at >= cfg.cooldown_steps:
                state.healthy_streak[r] = state.healthy_streak.get(r, 0) + 1
                if state.healthy_streak[r] >= cfg.readmit_after:
                    back.append(r)
        for r in back:
            del state.demoted_at[r]
            state.healthy_streak.pop(r, None)
        if back:
            events.append(HealthEvent(obs.step, "readmit", "healthy", tuple(back)))
    # baselines learn only from healthy, finite steps (a spike must not poison them)
    if healthy:
        if obs.loss is not None and math.isfinite(obs.loss):
            state.loss_baseline = _ema(state.loss_baseline, obs.loss, cfg.baseline_beta)
        if math.isfinite(obs.grad_norm):
            state.norm_baseline = _ema(state.norm_baseline, obs.grad_norm, cfg.baseline_beta)
    state.steps_seen += 1
    return events
