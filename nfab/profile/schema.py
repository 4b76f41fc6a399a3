"""Profile schema (version 1): pydantic models, validated strictly on load, unknown keys are errors.

A profile is the written-down result of calibration: for each training phase, which
route (fp32, bf16, fp16, q8, q4, q2, sign) each region class takes; the health
thresholds that trigger an FP32 fallback; the world-size range its reducers are exact
for; and where it came from. JSON only — a profile is data, never code. The JSON
schema for editors and other tools is `nfab profile schema` (and `profile.schema.json`).
"""

from __future__ import annotations

import hashlib
import json
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from nfab.errors import ConfigError, ProfileError
from nfab.fsutil import atomic_write_text
from nfab.profile.routes import REGIONS, RouteSpec, check_route_name, parse_route, split_route
from nfab.validation import FrozenModel, validate

SCHEMA = "nfab.profile"
VERSION = 1

__all__ = ["REGIONS", "SCHEMA", "VERSION", "Fallback", "Health", "ModelRef", "Phase", "PhaseStart", "Profile",
           "WorldRange", "file_sha256", "json_schema"]


def _route(route: str, where: str) -> str:
    try:
        return check_route_name(route, where)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


class PhaseStart(FrozenModel):
    """Where a phase begins: an absolute optimizer step, or a fraction of the run."""

    step: int | None = Field(None, ge=0)
    """Absolute optimizer step."""
    fraction: float | None = Field(None, ge=0.0, le=1.0)
    """Fraction of the run's total steps (needs `total_steps` at attach)."""

    @model_validator(mode="after")
    def _one(self) -> PhaseStart:
        if (self.step is None) == (self.fraction is None):
            raise ValueError("phase start: give exactly one of 'step' or 'fraction'")
        return self

    def resolve(self, total_steps: int | None) -> int:
        """The absolute start step (a fraction needs the run's total steps)."""
        if self.step is not None:
            return self.step
        if total_steps is None:
            raise ProfileError("this profile places phases by fraction of the run: pass total_steps")
        return int(round(self.fraction * total_steps))  # type: ignore[operator]


class Phase(FrozenModel):
    """One training phase: from `start` on, each region class takes `routes[region]`."""

    name: str
    start: PhaseStart
    routes: dict[str, str]
    """Region class -> route name; a region not named stays fp32."""
    error_feedback: bool = True
    """Carry what lossy routes dropped into the next step in this phase."""

    @field_validator("routes")
    @classmethod
    def _routes(cls, routes: dict[str, str]) -> dict[str, str]:
        for region, route in routes.items():
            if region not in REGIONS:
                raise ValueError(f"unknown region {region!r} (regions: {', '.join(REGIONS)})")
            _route(route, f"region {region!r}")
        return routes

    def route_for(self, region: str) -> str:
        """The route for a region class; a region the phase does not name stays fp32."""
        return self.routes.get(region, "fp32")


class Health(FrozenModel):
    """Online health thresholds; the fit derives them from the reference run's statistics."""

    loss_spike_ratio: float = Field(3.0, gt=1)
    """Unhealthy when the step's mean loss exceeds this times the running baseline."""
    grad_norm_jump: float = Field(10.0, gt=1)
    """Unhealthy when the reduced gradient norm exceeds this times its running baseline."""
    min_fidelity_cosine: float = Field(0.1, ge=-1, le=1)
    """Unhealthy when a fidelity probe's cosine (low-bit vs FP32 result) falls below this."""
    probe_every: int = Field(10, ge=0)
    """Every this many steps each lossy bucket also reduces a strided sample (at most 512
    elements per parameter) in FP32 (0 = never): a few per mille of FP32's bytes at this rate."""
    cooldown_steps: int = Field(20, ge=0)
    """Steps a demoted region stays on FP32 at least."""
    readmit_after: int = Field(10, ge=0)
    """Consecutive healthy steps needed (after the cool-down) before re-admission."""
    baseline_beta: float = Field(0.9, ge=0, lt=1)
    """EMA factor of the loss and gradient-norm baselines."""
    warmup_steps: int = Field(10, ge=0)
    """Steps before spike and jump detection starts (the baseline needs history)."""
    min_trend_cosine: float = Field(0.5, ge=-1, le=1)
    """Slow divergence: demote a region when the trend of its probe cosine, measured in the
    optimizer's preconditioned space, falls below this (0 = off). See runtime/health.py."""
    trend_beta: float = Field(0.5, ge=0, lt=1)
    """EMA factor of the per-region fidelity trend, per probe."""
    trend_min_probes: int = Field(2, ge=0)
    """Probes a region's trend needs before it can demote (one probe is noise)."""
    max_backoff: int = Field(8, ge=0)
    """A region's n-th drift demotion lasts min(2^(n-1), this) cool-downs."""
    dense_probe_steps: int = Field(20, ge=0)
    """Probe every step during the first this many steps (when `attach` was given an optimizer
    with a second moment, the only case the drift monitor acts on): sign + error feedback under AdamW
    bent the held-out GPT for good within its first ~20 steps, before probes every
    `probe_every` steps could see a trend. Also for this many steps after a route that drifted is
    re-admitted (probation)."""
    shadow_steps: int = Field(3, ge=0)
    """A loss spike or gradient-norm jump is an alarm, not a verdict: it opens an FP32 shadow
    window, this many steps on which every lossy region is probed, and only a region the shadow
    finds below `min_fidelity_cosine` is demoted. A window that finds every region faithful was a
    false alarm (counted in `StepStats.false_alarms`). Under clipping and a decaying learning
    rate the norm moves for healthy reasons: on issue 31's GPT recipe one jump demoted every
    region for 30 steps. 0: an alarm demotes every lossy region at once (the old behaviour)."""
    probe_rotate: bool = True
    """A probe samples one lossy region, the next probe the next (sorted order), so each probe
    costs about 1/regions of a full one; shadow windows still probe every region."""
    probe_spacing_max: int = Field(4, ge=1)
    """Once no health event has happened for 4 probe intervals, the interval doubles, up to
    `probe_every` times this (probes are control, and control must stay a small share of the
    bytes compression saves)."""
    probe_budget: float = Field(0.05, ge=0)
    """The run's probe bytes stay within this share of the other bytes it sends (0: no cap). Regular
    probes pause while one more would exceed it so far; early dense and probation probes may borrow
    against the bytes the rest of the run will send (runtime/control/probes.py). An alarm's shadow
    window is not budgeted: its samples are counted apart (`StepStats.shadow_wire_bytes`)."""
    drift_demote_after: int = Field(20, ge=0)
    """Steps before the drift monitor may demote a route to FP32, except in a region whose error
    feedback it already switched off (a confirmed suspect); switching error feedback off (no
    bytes) acts from the first probe. Adam's first updates are close to sign(g) and its
    second moment averages only a few squared gradients, so early preconditioned cosines sit
    low even for healthy routes: on the held-out GPT, bq3 (+1.0% over the run) was demoted at
    steps 4-12 and sent ~30 steps of its largest regions in FP32 (4.0x instead of ~5.9x)."""


class Fallback(FrozenModel):
    """What to do when a route cannot or should not run."""

    on_capacity: Literal["fp32", "error"] = "fp32"
    """'fp32': a reducer over capacity falls back with a warning; 'error': refuse to run."""
    cost_gate: bool = True
    """Fall back to FP32 where the cost model says compression is not cheaper."""
    pinned: tuple[str, ...] = ()
    """Region classes whose route is kept even when the cost model says it does not pay."""

    @field_validator("pinned")
    @classmethod
    def _pinned(cls, pinned: tuple[str, ...]) -> tuple[str, ...]:
        for region in pinned:
            if region not in REGIONS:
                raise ValueError(f"unknown region {region!r} (regions: {', '.join(REGIONS)})")
        return tuple(pinned)


class ModelRef(FrozenModel):
    """Which model a profile was made for: a name and a signature of its parameters."""

    name: str
    """Registry name or `module.path:factory`."""
    signature: str | None = None
    """sha256 of the sorted parameter names and shapes (`nfab.models.model_signature`)."""


class WorldRange(FrozenModel):
    """World sizes the profile's reducers are exact for."""

    min: int = Field(1, ge=1)
    max: int = Field(1 << 16, ge=1)

    @model_validator(mode="after")
    def _order(self) -> WorldRange:
        if self.min > self.max:
            raise ValueError(f"world_size range invalid: min={self.min}, max={self.max}")
        return self


class Profile(FrozenModel):
    """An operating profile (schema `nfab.profile`, version 1)."""

    model: ModelRef
    phases: tuple[Phase, ...]
    """Phases in any order, one from step 0 (or fraction 0), no two at one start or of one name; the one
    in force at a step is the last whose start is <= step."""
    world_size: WorldRange = Field(default_factory=WorldRange)
    overrides: dict[str, str] = Field(default_factory=dict)
    """Parameter-name glob -> route; a glob beats a region class."""
    health: Health = Field(default_factory=Health)
    fallback: Fallback = Field(default_factory=Fallback)
    vote: Literal["majority", "mean"] = "majority"
    """How sign votes combine: majority (ties -> 0) or the mean vote."""
    noise_moment: bool = False
    """Calibrated with the block-scaled routes' rounding noise taken out of Adam's second moment
    (runtime/moment.py), so `attach(optimizer=adam, noise_moment="auto")` runs it the same way."""
    evidence: dict[str, Any] = Field(default_factory=dict)
    """Per phase and region: the measurements that justified each route (written by the fit)."""
    provenance: dict[str, Any] = Field(default_factory=dict)
    """Where the profile came from; `provenance.calibrated` is the setting it was calibrated under."""

    @field_validator("phases")
    @classmethod
    def _some_phases(cls, phases: tuple[Phase, ...]) -> tuple[Phase, ...]:
        """At least one phase, one of them from the start of the run, no two at one start or of one name:
        otherwise which phase is in force is a guess (the earliest ran before its own start)."""
        if not phases:
            raise ValueError("a profile needs at least one phase")
        if not any(p.start.step == 0 or p.start.fraction == 0 for p in phases):
            raise ValueError("no phase starts at step 0 or fraction 0: say which routes run from the start")
        names: set[str] = set()
        starts: dict[tuple[int | None, float | None], str] = {}
        for p in phases:
            if p.name in names:
                raise ValueError(f"two phases are named {p.name!r}")
            names.add(p.name)
            key = (p.start.step, p.start.fraction)
            if key in starts:
                raise ValueError(f"phases {starts[key]!r} and {p.name!r} start at the same point")
            starts[key] = p.name
        return phases

    @field_validator("overrides")
    @classmethod
    def _overrides(cls, overrides: dict[str, str]) -> dict[str, str]:
        for glob, route in overrides.items():
            _route(route, f"override {glob!r}")
        return overrides

    # ---- queries ------------------------------------------------------------------
    def phase_at(self, step: int, total_steps: int | None = None) -> Phase:
        """The phase in force at `step`: the last phase whose start is <= step."""
        starts = [(p.start.resolve(total_steps), i) for i, p in enumerate(self.phases)]
        current = self.phases[min(starts)[1]]
        for start, i in sorted(starts):
            if start <= step:
                current = self.phases[i]
        return current

    def route_for(self, phase: Phase, name: str, region: str) -> str:
        """The route `phase` asks for the parameter `name` of class `region`: a name glob beats the class."""
        for glob, route in self.overrides.items():
            if fnmatchcase(name, glob):
                return route
        return phase.route_for(region)

    def routes_used(self) -> set[str]:
        return {r for p in self.phases for r in p.routes.values()} | set(self.overrides.values())

    # ---- construction -------------------------------------------------------------
    @classmethod
    def static(cls, route: RouteSpec | str, model_name: str = "any") -> Profile:
        """A one-phase profile for an explicit route in the one route grammar (`nfab.profile.routes`):
        a name for every region, `conv:sign,*.bias:fp32`, or a mapping (unnamed regions stay fp32)."""
        routes, overrides = split_route(parse_route(route))
        phase = Phase(name="static", start=PhaseStart(step=0), routes=routes)
        return cls(model=ModelRef(name=model_name), phases=(phase,), overrides=overrides)

    @classmethod
    def from_dict(cls, d: Any) -> Profile:
        """Validate a profile document strictly (wrong types and unknown keys are one-line errors)."""
        if not isinstance(d, dict):
            raise ProfileError("a profile must be a JSON object")
        if d.get("schema") != SCHEMA:
            raise ProfileError(f"not an nfab profile (schema is {d.get('schema')!r}, expected {SCHEMA!r})")
        if d.get("version") != VERSION:
            raise ProfileError(
                f"profile schema version {d.get('version')!r} is not supported (this nfab reads {VERSION})"
            )
        body = {k: v for k, v in d.items() if k not in ("schema", "version")}
        return validate(cls, body, where="profile", error=ProfileError)

    def to_dict(self) -> dict[str, Any]:
        d = self.model_dump(mode="json")
        d["phases"] = [{**p, "start": {k: v for k, v in p["start"].items() if v is not None}} for p in d["phases"]]
        return {"schema": SCHEMA, "version": VERSION, **d}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    def save(self, path: str | Path) -> Path:
        """Write the profile as JSON, atomically."""
        return atomic_write_text(path, self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read and validate a profile; every problem is one clear `ProfileError` line."""
        p = Path(path)
        try:
            raw = p.read_bytes()
        except OSError as exc:
            raise ProfileError(f"cannot read profile {p}: {exc.strerror or exc}") from exc
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:  # never unpickled or loaded as anything but JSON
            kind = "a pickle" if raw[:1] == b"\x80" else "binary data"
            raise ProfileError(f"profile {p} is {kind}, not JSON: profiles are JSON only, never pickles") from exc
        if text.lstrip()[:1] not in ("{", "["):
            raise ProfileError(f"profile {p} is not a JSON object (profiles are JSON only, never pickles)")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"profile {p} is not valid JSON: {exc.msg} at line {exc.lineno}") from exc
        try:
            return cls.from_dict(data)
        except ProfileError as exc:
            raise ProfileError(f"profile {p}: {exc}") from exc

    def check_model(self, name: str, signature: str) -> None:
        """Refuse a profile made for another model (by its parameter signature)."""
        if self.model.signature and self.model.signature != signature:
            raise ProfileError(
                f"profile was made for model {self.model.name!r} with another parameter layout "
                f"(signature {self.model.signature[:12]}…, this model {signature[:12]}…)"
            )

    def check_world_size(self, world_size: int) -> bool:
        return self.world_size.min <= world_size <= self.world_size.max


def file_sha256(path: str | Path) -> str:
    """Content hash of a file (profile and calibration provenance)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def json_schema() -> dict[str, Any]:
    """The profile file's JSON schema (draft 2020-12), `schema` and `version` included."""
    doc = Profile.model_json_schema()
    doc["properties"] = {"schema": {"const": SCHEMA, "type": "string"},
                         "version": {"const": VERSION, "type": "integer"}, **doc["properties"]}
    doc["required"] = ["schema", "version", *doc.get("required", [])]
    doc["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    doc["title"] = "nfab operating profile"
    return doc
