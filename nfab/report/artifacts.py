"""Readers for the artifacts `nfab report` consumes: run dirs and calibration dirs.

The artifact contract (file names, Parquet columns, JSON keys) lives here and nowhere
else, so when a producer changes a column the report changes in one place. Every
problem a user can cause (missing file, truncated Parquet, malformed JSON, a missing
column) is raised as `NfabError` naming the file and what is wrong.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from nfab.errors import NfabError

SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.parquet"
CALIBRATION_FILE = "calibration.parquet"
PROFILE_FILE = "profile.json"

# Columns of metrics.parquet the report reads (the producer writes more: lr, grad_norm,
# fidelity_cosine, hook_time_s are not plotted yet). step_time_s is optional: it only
# stands in for wall time when summary.json is missing.
METRICS_REQUIRED = (
    "step", "phase", "loss", "wire_bytes", "baseline_wire_bytes", "route_mix",
    "fallback", "fallback_reason", "eval_loss", "eval_accuracy",
)
METRICS_NUMERIC = ("step", "loss", "wire_bytes", "baseline_wire_bytes", "eval_loss", "eval_accuracy")

CALIBRATION_REQUIRED = (
    "phase", "region", "route", "error_feedback", "bits_per_element",
    "cosine", "loss_delta",
)
CALIBRATION_NUMERIC = ("bits_per_element", "cosine", "loss_delta")

# Keys of summary.json the report reads; a run cut short ("complete": false) may lack
# everything but its identity, the rest is then taken from metrics.parquet.
SUMMARY_IDENTITY = ("model", "dataset", "world_size")
SUMMARY_TOTALS = ("wire_bytes_total", "baseline_wire_bytes_total", "final_eval")

# Region classes in the order the runtime defines them (DESIGN.md, layer 2).
REGIONS = ("conv", "linear", "embedding", "head", "norm", "bias", "small", "other")
# Nominal bits per element of each route, used only when no measurement is recorded.
NOMINAL_BITS = {"fp32": 32.0, "bf16": 16.0, "fp16": 16.0, "q8": 8.0, "q4": 4.0,
                "q2": 2.0, "sign": 1.0}


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSummary:
    """The typed view of summary.json; `None` means the run did not record the value."""

    model: str
    dataset: str
    world_size: int
    complete: bool
    steps: int | None = None
    final_loss: float | None = None
    final_accuracy: float | None = None
    """Fraction in [0, 1]; absent for language models."""
    final_perplexity: float | None = None
    wire_bytes_total: int | None = None
    baseline_wire_bytes_total: int | None = None
    fallback_steps: int | None = None
    skipped_steps: int | None = None
    wall_time_s: float | None = None
    route: str | None = None
    profile_path: str | None = None
    is_fp32: bool = False
    """True for the FP32 reference: "route": "fp32" or "fp32": true."""
    parallel: str = "ddp"
    """"ddp" or "fsdp" (runs before FSDP2 recorded none: DDP). An FSDP2 run's baseline is FSDP2's
    reduce-scatter, so it is compared with an FSDP2 FP32 run only."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunArtifacts:
    """One run dir: its summary (absent while it is still going) and per-step metrics."""

    path: Path
    name: str
    summary: RunSummary | None
    metrics: pd.DataFrame | None
    route_mix: pd.DataFrame | None
    """Fraction of gradient elements per route (columns), indexed by step."""

    @property
    def complete(self) -> bool:
        return self.summary is not None and self.summary.complete


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseChoice:
    """One profile phase: the route chosen per region and whether it uses error feedback."""

    name: str
    routes: dict[str, str]
    error_feedback: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Evidence:
    """The measurement that justified one (phase, region) choice in profile.json."""

    route: str
    bits_per_element: float | None
    cosine: float | None
    loss_delta: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class FittedProfile:
    """The parts of profile.json the report shows: phases and their evidence."""

    model: str
    phases: tuple[PhaseChoice, ...]
    evidence: dict[str, dict[str, Evidence]]
    validation: dict[str, Any] | None = None
    """`evidence.validation`: the fitted profile run against FP32 over the whole window (None: not recorded)."""
    timing: dict[str, Any] | None = None
    """`provenance.timing`: the calibration's seconds per stage and its ratio to the FP32 reference."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibrationArtifacts:
    """One calibration dir: the measurement table and, once fitted, the profile."""

    path: Path
    name: str
    table: pd.DataFrame | None
    profile: FittedProfile | None


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON object, turning unreadable or malformed files into one-line errors."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise NfabError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NfabError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise NfabError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


RENAMED = {"fp32_wire_bytes": "baseline_wire_bytes"}
"""Old column name -> current: metrics.parquet's plain-DDP bytes are counted in the bucket dtype."""


def read_parquet(path: Path, required: tuple[str, ...], numeric: tuple[str, ...]) -> pd.DataFrame:
    """Read a Parquet table and check it has the required columns with numeric types."""
    try:
        frame = pd.read_parquet(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ValueError, ...
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise NfabError(f"cannot read {path} (truncated or not Parquet?): {reason}") from exc
    frame = frame.rename(columns=RENAMED)  # tables written before a column was renamed
    missing = [c for c in required if c not in frame.columns]
    if missing:
        raise NfabError(f"{path} lacks required column(s): {', '.join(missing)}")
    for column in numeric:
        if not pd.api.types.is_numeric_dtype(frame[column]):
            raise NfabError(f"{path}: column '{column}' must be numeric, "
                            f"found {frame[column].dtype}")
    return frame


def _typed(data: dict[str, Any], key: str, kind: type | tuple[type, ...], path: Path) -> Any:
    """Fetch an optional key, checking its type (bool is not accepted as a number)."""
    value = data.get(key)
    if value is None:
        return None
    is_bool = isinstance(value, bool)
    if not isinstance(value, kind) or (is_bool and bool not in _as_tuple(kind)):
        raise NfabError(f"{path}: '{key}' must be {_kind_name(kind)}, found {value!r}")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in _as_tuple(kind))


def _number(data: dict[str, Any], key: str, path: Path) -> float | None:
    value = _typed(data, key, (int, float), path)
    return None if value is None else float(value)


def parse_summary(data: dict[str, Any], path: Path) -> RunSummary:
    """Turn summary.json into a `RunSummary`, naming missing or mistyped keys."""
    complete = _typed(data, "complete", bool, path)
    required = SUMMARY_IDENTITY + (SUMMARY_TOTALS if complete else ())
    missing = [k for k in required if data.get(k) is None]
    if missing:
        raise NfabError(f"{path} lacks required key(s): {', '.join(missing)}")
    final_eval = _typed(data, "final_eval", dict, path) or {}
    accuracy = _number(final_eval, "accuracy", path)
    if accuracy is not None and not 0.0 <= accuracy <= 1.0:
        raise NfabError(f"{path}: final_eval.accuracy must be a fraction in [0, 1], "
                        f"found {accuracy}")
    profile = _typed(data, "profile", dict, path)
    route = _typed(data, "route", str, path)
    return RunSummary(
        model=str(data["model"]),
        dataset=str(data["dataset"]),
        world_size=_typed(data, "world_size", int, path),
        complete=bool(complete),
        steps=_typed(data, "steps", int, path),
        final_loss=_number(final_eval, "loss", path),
        final_accuracy=accuracy,
        final_perplexity=_number(final_eval, "perplexity", path),
        wire_bytes_total=_typed(data, "wire_bytes_total", int, path),
        # runs written before the rename name the same total fp32_wire_bytes_total
        baseline_wire_bytes_total=_typed(data, "baseline_wire_bytes_total" if "baseline_wire_bytes_total" in data
                                         else "fp32_wire_bytes_total", int, path),
        fallback_steps=_typed(data, "fallback_steps", int, path),
        skipped_steps=_typed(data, "skipped_steps", int, path),
        wall_time_s=_number(data, "wall_time_s", path),
        route=route,
        profile_path=None if profile is None else str(profile.get("path", "")) or None,
        is_fp32=route == "fp32" or data.get("fp32") is True,
        parallel=_typed(data, "parallel", str, path) or "ddp",
    )


def load_run(path: Path, name: str) -> RunArtifacts:
    """Load a run dir; either file may be missing (not both), as for a run still going."""
    summary_path, metrics_path = path / SUMMARY_FILE, path / METRICS_FILE
    summary = parse_summary(read_json(summary_path), summary_path) if summary_path.exists() else None
    metrics = route_mix = None
    if metrics_path.exists():
        metrics = read_parquet(metrics_path, METRICS_REQUIRED, METRICS_NUMERIC)
        metrics = metrics.sort_values("step", kind="stable").reset_index(drop=True)
        route_mix = route_mix_frame(metrics, metrics_path)  # parsed now: fail before writing
    return RunArtifacts(path=path, name=name, summary=summary, metrics=metrics,
                        route_mix=route_mix)


def _optional_float(value: Any) -> float | None:
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return None if math.isnan(float(value)) else float(value)


def parse_profile(data: dict[str, Any], path: Path) -> FittedProfile:
    """Read the phases and evidence of profile.json (schema nfab.profile, version 1)."""
    if data.get("schema") != "nfab.profile" or data.get("version") != 1:
        raise NfabError(f"{path} is not an nfab profile (schema 'nfab.profile', version 1); "
                        f"found schema={data.get('schema')!r} version={data.get('version')!r}")
    phases_raw = data.get("phases")
    if not isinstance(phases_raw, list) or not phases_raw:
        raise NfabError(f"{path}: 'phases' must be a non-empty list")
    phases = []
    for i, phase in enumerate(phases_raw):
        if not isinstance(phase, dict) or not isinstance(phase.get("name"), str) \
                or not isinstance(phase.get("routes"), dict):
            raise NfabError(f"{path}: phases[{i}] needs a 'name' string and a 'routes' object")
        phases.append(PhaseChoice(name=phase["name"],
                                  routes={str(k): str(v) for k, v in phase["routes"].items()},
                                  error_feedback=bool(phase.get("error_feedback", False))))
    evidence: dict[str, dict[str, Evidence]] = {}
    evidence_raw = data.get("evidence") or {}
    if not isinstance(evidence_raw, dict):
        raise NfabError(f"{path}: 'evidence' must be an object")
    validation = evidence_raw.get("validation")
    for phase_name, regions in evidence_raw.items():
        if phase_name == "validation":
            continue
        if not isinstance(regions, dict):
            raise NfabError(f"{path}: evidence['{phase_name}'] must be an object")
        evidence[phase_name] = {
            region: Evidence(route=str(e.get("route", "")),
                             bits_per_element=_optional_float(e.get("bits_per_element")),
                             cosine=_optional_float(e.get("cosine")),
                             loss_delta=_optional_float(e.get("loss_delta")))
            for region, e in regions.items() if isinstance(e, dict)
        }
    model = data.get("model")
    model_name = str(model.get("name", "")) if isinstance(model, dict) else ""
    provenance = data.get("provenance")
    timing = provenance.get("timing") if isinstance(provenance, dict) else None
    return FittedProfile(model=model_name, phases=tuple(phases), evidence=evidence,
                         validation=validation if isinstance(validation, dict) else None,
                         timing=timing if isinstance(timing, dict) else None)


def load_calibration(path: Path, name: str) -> CalibrationArtifacts:
    """Load a calibration dir; the profile is absent until `nfab fit` has run."""
    table_path, profile_path = path / CALIBRATION_FILE, path / PROFILE_FILE
    table = None
    if table_path.exists():
        table = read_parquet(table_path, CALIBRATION_REQUIRED, CALIBRATION_NUMERIC)
    profile = None
    if profile_path.exists():
        profile = parse_profile(read_json(profile_path), profile_path)
    return CalibrationArtifacts(path=path, name=name, table=table, profile=profile)


def route_mix_frame(metrics: pd.DataFrame, path: Path) -> pd.DataFrame:
    """Expand the per-step `route_mix` JSON strings into one column per route.

    Rows are indexed by step; a step with an empty string gets zeros everywhere (the
    producer had nothing to report), a malformed string is an error naming the step.
    """
    rows: list[dict[str, float]] = []
    for step, text in zip(metrics["step"], metrics["route_mix"], strict=True):
        if text is None or (isinstance(text, float) and math.isnan(text)) or text == "":
            rows.append({})
            continue
        try:
            mix = json.loads(text)
        except (TypeError, json.JSONDecodeError) as exc:
            raise NfabError(f"{path}: route_mix at step {step} is not JSON: {text!r}") from exc
        if not isinstance(mix, dict) or not all(
                isinstance(v, int | float) and not isinstance(v, bool) for v in mix.values()):
            raise NfabError(f"{path}: route_mix at step {step} must map route -> fraction, "
                            f"found {text!r}")
        rows.append({str(k): float(v) for k, v in mix.items()})
    frame = pd.DataFrame(rows, index=pd.Index(metrics["step"].to_numpy(), name="step"))
    return frame.fillna(0.0)
