"""Profile schema (version 1): typed dataclasses, validated on load, unknown keys are errors.

A profile is the written-down result of calibration: for each training phase, which
route (fp32, bf16, fp16, q8, q4, q2, sign) each region class takes; the health
thresholds that trigger an FP32 fallback; the world-size range its reducers are exact
for; and where it came from. JSON only — a profile is data, never code.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from nfab.errors import ProfileError
from nfab.fsutil import atomic_write_text
from nfab.wire.codecs import ROUTES

SCHEMA = "nfab.profile"
VERSION = 1
REGIONS: tuple[str, ...] = ("conv", "linear", "embedding", "head", "norm", "bias", "small", "other")


def _check_keys(d: dict[str, Any], cls: type, where: str) -> None:
    if not isinstance(d, dict):
        raise ProfileError(f"{where}: expected an object, got {type(d).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ProfileError(f"{where}: unknown key(s) {', '.join(unknown)}")


def _check_route(route: Any, where: str) -> str:
    if route not in ROUTES:
        raise ProfileError(f"{where}: unknown route {route!r} (routes: {', '.join(ROUTES)})")
    return str(route)


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseStart:
    """Where a phase begins: an absolute optimizer step, or a fraction of the run."""

    step: int | None = None
    fraction: float | None = None

    def __post_init__(self) -> None:
        if (self.step is None) == (self.fraction is None):
            raise ProfileError("phase start: give exactly one of 'step' or 'fraction'")
        if self.step is not None and self.step < 0:
            raise ProfileError(f"phase start step must be >= 0, got {self.step}")
        if self.fraction is not None and not 0.0 <= self.fraction <= 1.0:
            raise ProfileError(f"phase start fraction must be in [0, 1], got {self.fraction}")

    def resolve(self, total_steps: int | None) -> int:
        """The absolute start step (a fraction needs the run's total steps)."""
        if self.step is not None:
            return self.step
        if total_steps is None:
            raise ProfileError("this profile places phases by fraction of the run: pass total_steps")
        return int(round(self.fraction * total_steps))  # type: ignore[operator]


@dataclass(frozen=True, slots=True, kw_only=True)
class Phase:
    """One training phase: from `start` on, each region class takes `routes[region]`."""

    name: str
    start: PhaseStart
    routes: dict[str, str]
    error_feedback: bool = True

    def __post_init__(self) -> None:
        for region, route in self.routes.items():
            if region not in REGIONS:
                raise ProfileError(f"phase {self.name!r}: unknown region {region!r} (regions: {', '.join(REGIONS)})")
            _check_route(route, f"phase {self.name!r} region {region!r}")

    def route_for(self, region: str) -> str:
        """The route for a region class; a region the phase does not name stays fp32."""
        return self.routes.get(region, "fp32")


@dataclass(frozen=True, slots=True, kw_only=True)
class Health:
    """Online health thresholds; the fit derives them from the reference run's statistics."""

    loss_spike_ratio: float = 3.0
    """Unhealthy when the step's mean loss exceeds this times the running baseline."""
    grad_norm_jump: float = 10.0
    """Unhealthy when the reduced gradient norm exceeds this times its running baseline."""
    min_fidelity_cosine: float = 0.1
    """Unhealthy when a fidelity probe's cosine (low-bit vs FP32 result) falls below this."""
    probe_every: int = 25
    """Every this many steps one bucket is also reduced in FP32 (0 = never)."""
    cooldown_steps: int = 20
    """Steps a demoted region stays on FP32 at least."""
    readmit_after: int = 10
    """Consecutive healthy steps needed (after the cool-down) before re-admission."""
    baseline_beta: float = 0.9
    """EMA factor of the loss and gradient-norm baselines."""
    warmup_steps: int = 10
    """Steps before spike and jump detection starts (the baseline needs history)."""

    def __post_init__(self) -> None:
        if self.loss_spike_ratio <= 1 or self.grad_norm_jump <= 1:
            raise ProfileError("health: loss_spike_ratio and grad_norm_jump must be > 1")
        if not 0 <= self.baseline_beta < 1:
            raise ProfileError("health: baseline_beta must be in [0, 1)")
        if min(self.probe_every, self.cooldown_steps, self.readmit_after, self.warmup_steps) < 0:
            raise ProfileError("health: step counts must be >= 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class Fallback:
    """What to do when a route cannot or should not run."""

    on_capacity: str = "fp32"
    """'fp32': a reducer over capacity falls back with a warning; 'error': refuse to run."""
    cost_gate: bool = True
    """Fall back to FP32 where the cost model says compression is not cheaper."""
    pinned: tuple[str, ...] = ()
    """Region classes whose route is kept even when the cost model says it does not pay."""

    def __post_init__(self) -> None:
        if self.on_capacity not in ("fp32", "error"):
            raise ProfileError(f"fallback.on_capacity must be 'fp32' or 'error', got {self.on_capacity!r}")
        for region in self.pinned:
            if region not in REGIONS:
                raise ProfileError(f"fallback.pinned: unknown region {region!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelRef:
    """Which model a profile was made for: a name and a signature of its parameters."""

    name: str
    signature: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class WorldRange:
    """World sizes the profile's reducers are exact for."""

    min: int = 1
    max: int = 1 << 16

    def __post_init__(self) -> None:
        if not 1 <= self.min <= self.max:
            raise ProfileError(f"world_size range invalid: min={self.min}, max={self.max}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """An operating profile (schema `nfab.profile`, version 1)."""

    model: ModelRef
    phases: tuple[Phase, ...]
    world_size: WorldRange = field(default_factory=WorldRange)
    overrides: dict[str, str] = field(default_factory=dict)
    """Parameter-name glob -> route; a glob beats a region class."""
    health: Health = field(default_factory=Health)
    fallback: Fallback = field(default_factory=Fallback)
    vote: str = "majority"
    evidence: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.phases:
            raise ProfileError("a profile needs at least one phase")
        if self.vote not in ("majority", "mean"):
            raise ProfileError(f"vote must be 'majority' or 'mean', got {self.vote!r}")
        for glob, route in self.overrides.items():
            _check_route(route, f"override {glob!r}")

    # ---- queries ------------------------------------------------------------------
    def phase_at(self, step: int, total_steps: int | None = None) -> Phase:
        """The phase in force at `step`: the last phase whose start is <= step."""
        starts = [(p.start.resolve(total_steps), i) for i, p in enumerate(self.phases)]
        current = self.phases[min(starts)[1]]
        for start, i in sorted(starts):
            if start <= step:
                current = self.phases[i]
        return current

    def routes_used(self) -> set[str]:
        return {r for p in self.phases for r in p.routes.values()} | set(self.overrides.values())

    # ---- construction -------------------------------------------------------------
    @classmethod
    def static(cls, route: str | dict[str, str], model_name: str = "any") -> Profile:
        """A one-phase profile for an explicit route: a name for every region, or a dict
        from region class or parameter-name glob to route (unnamed regions stay fp32)."""
        if isinstance(route, str):
            _check_route(route, "route")
            routes = {r: route for r in REGIONS}
            overrides: dict[str, str] = {}
        else:
            routes = {k: v for k, v in route.items() if k in REGIONS}
            overrides = {k: v for k, v in route.items() if k not in REGIONS}
        phase = Phase(name="static", start=PhaseStart(step=0), routes=routes)
        return cls(model=ModelRef(name=model_name), phases=(phase,), overrides=overrides)

    @classmethod
    def from_dict(cls, d: Any) -> Profile:
        if not isinstance(d, dict):
            raise ProfileError("a profile must be a JSON object")
        if d.get("schema") != SCHEMA:
            raise ProfileError(f"not an nfab profile (schema is {d.get('schema')!r}, expected {SCHEMA!r})")
        if d.get("version") != VERSION:
            raise ProfileError(
                f"profile schema version {d.get('version')!r} is not supported (this nfab reads {VERSION})"
            )
        body = {k: v for k, v in d.items() if k not in ("schema", "version")}
        _check_keys(body, cls, "profile")
        try:
            model = body.get("model")
            _check_keys(model, ModelRef, "profile.model")
            phases = []
            for i, p in enumerate(body.get("phases") or []):
                _check_keys(p, Phase, f"profile.phases[{i}]")
                _check_keys(p.get("start"), PhaseStart, f"profile.phases[{i}].start")
                phases.append(Phase(
                    name=str(p["name"]), start=PhaseStart(**p["start"]),
                    routes=dict(p.get("routes", {})), error_feedback=bool(p.get("error_feedback", True)),
                ))
            kwargs: dict[str, Any] = {"model": ModelRef(**model), "phases": tuple(phases)}
            for key, sub in (("world_size", WorldRange), ("health", Health), ("fallback", Fallback)):
                if key in body:
                    _check_keys(body[key], sub, f"profile.{key}")
                    val = dict(body[key])
                    if key == "fallback" and "pinned" in val:
                        val["pinned"] = tuple(val["pinned"])
                    kwargs[key] = sub(**val)
            for key in ("overrides", "evidence", "provenance"):
                if key in body:
                    kwargs[key] = dict(body[key])
            if "vote" in body:
                kwargs["vote"] = body["vote"]
            return cls(**kwargs)
        except (TypeError, KeyError, ValueError) as exc:
            raise ProfileError(f"malformed profile: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["phases"] = [
            {**p, "start": {k: v for k, v in p["start"].items() if v is not None}} for p in d["phases"]
        ]
        d["fallback"]["pinned"] = list(d["fallback"]["pinned"])
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
