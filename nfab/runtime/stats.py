"""Per-step statistics the runtime exposes (and `nfab train` writes to metrics.parquet)."""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class StepStats:
    """One optimizer step's communication, as every rank agreed on it."""

    step: int
    phase: str
    wire_bytes: int = 0
    """Bytes this rank sent (payloads, control words, scale agreements, probes)."""
    baseline_wire_bytes: int = 0
    """Bytes plain DDP would have sent for the same buckets, in each bucket's own dtype
    (2 bytes per element for a bf16/fp16 bucket): the base every compression ratio uses."""
    probe_wire_bytes: int = 0
    """Of `wire_bytes`: the fidelity probes' FP32 samples (reported apart: control must stay a
    small share of what compression saves; `Health.probe_budget`). A shadow window's are not here
    but in `shadow_wire_bytes`."""
    shadow_wire_bytes: int = 0
    """Of `wire_bytes`: the FP32 samples of an alarm's shadow window (every lossy region probed;
    not charged to the probe budget: an alarm's own cost)."""
    intra_node_bytes: int = 0
    """Of `wire_bytes`: the two-level path's node-local reduce-scatter + all-gather (the fast
    link; 0 without a hierarchy)."""
    inter_node_bytes: int = 0
    """Of `wire_bytes`: the two-level path's route across nodes at W = nodes (the slow link; 0
    without a hierarchy). The rest of `wire_bytes` went over all ranks (FP32 groups, control words)."""
    route_elements: dict[str, int] = field(default_factory=dict)
    """Gradient elements per route (sign split into signcount / signgather)."""
    fallback: bool = False
    """A safety fallback this step: health demotion, reducer capacity or a non-finite gradient."""
    fallback_reason: str = ""
    """Every reason a slice left its profile route, e.g. `health(conv); cost(norm)`."""
    cost_gated: bool = False
    """The cost gate kept at least one slice the profile routes lossy on FP32 this step (the
    measured link makes compression not pay there; `fallback_reason` names the regions as
    `cost(...)`). Not a safety fallback: `fallback` stays False for it."""
    shadow: bool = False
    """The step was in an FP32 shadow window: a loss spike or gradient-norm jump raised an alarm,
    and every lossy region is probed until the window says whether a demotion is needed."""
    alarms: int = 0
    """Loss-spike / gradient-norm-jump alarms so far in the run (each opens a shadow window)."""
    false_alarms: int = 0
    """Of `alarms`: those whose shadow window found every region faithful (no demotion)."""
    skipped: bool = False
    """A non-finite gradient on some rank: the step's reduced gradients are non-finite everywhere (a
    lossy bucket all NaN), so the step must not be taken: `nfab train` skips it, as a loss scaler
    (`GradScaler.step`) does."""
    fidelity_cosine: float | None = None
    """Cosine between a probed bucket's low-bit result and its FP32 all-reduce (on a strided
    sample): the probe taken in the PREVIOUS step, whose result the control words of this
    step's first bucket carry, averaged over ranks (so every rank decides on the same value)."""
    region_cosine: dict[str, float] = field(default_factory=dict)
    """Per region: the probe's cosine in the optimizer's preconditioned space (drift monitor)."""
    grad_norm: float = 0.0
    """sqrt(mean over ranks of each rank's local |g|^2 before communication), from the control
    words (identical on every rank); non-finite buckets count 0."""
    loss: float | None = None
    """Mean of the ranks' observed losses (`Runtime.observe_loss`), from the control word."""
    hook_time_s: float = 0.0
    """CPU seconds in nfab's hook bodies, callbacks and the step's fold (the sum of `hook_phases`)."""
    hook_phases: dict[str, float] = field(default_factory=dict)
    """`hook_time_s` by phase: plan, norm, encode, launch (hook body), decode (callbacks), fold."""
    calibrating: bool = False
    """The step was in an in-run calibration window (`attach(model, "auto")`: its samples were gathered)."""
    calibration_wire_bytes: int = 0
    """Of `wire_bytes`: the window's all-gather of every rank's gradient samples (in-run calibration's cost)."""
    saturated_slices: int = 0
    """qsum slices whose elements exceeded their delayed scale (clipped to +-scale)."""
    scale_rounds: int = 0
    """Blocking qsum scale agreements this step (a slice's first qsum step, or exact mode)."""
    buckets: int = 0
    collectives: int = 0
    """Collectives launched (payloads, control words, scale rounds, probes; a coalesced bucket is one)."""
    events: list[str] = field(default_factory=list)

    @property
    def route_mix(self) -> dict[str, float]:
        """Fraction of gradient elements per route."""
        total = sum(self.route_elements.values()) or 1
        return {k: v / total for k, v in sorted(self.route_elements.items())}

    def flag_fallbacks(self, whys: Collection[str]) -> None:
        """Set `fallback` and `cost_gated` from the step's fallback reasons, one rule for both front ends:
        `fallback` flags a safety event (health, capacity, a non-finite or skipped step); the cost gate's
        steady routing to FP32 where compression does not pay is `cost_gated`, and named in the reason only."""
        self.fallback = self.skipped or any(why != "cost" for why in whys)
        self.cost_gated = "cost" in whys

    def to_row(self) -> dict:
        """A flat row for metrics tables (route_mix as a JSON string)."""
        d = asdict(self)
        d.pop("route_elements")
        d.pop("hook_phases")
        d["route_mix"] = json.dumps(self.route_mix, sort_keys=True)
        d["events"] = "; ".join(self.events)
        d["region_cosine"] = json.dumps(self.region_cosine, sort_keys=True)
        return d
