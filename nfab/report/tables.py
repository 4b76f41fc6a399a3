"""The report's tables as pandas frames: pure functions of the loaded artifacts.

The same frames feed the terminal (rich), summary.csv and the HTML page, so a number
is computed once. Values come from summary.json where the run recorded them and from
metrics.parquet otherwise (a run still going has no summary yet).
"""

from __future__ import annotations

import json
import math

import pandas as pd

from nfab.report.artifacts import (
    NOMINAL_BITS,
    REGIONS,
    CalibrationArtifacts,
    RunArtifacts,
)

MB = 1e6  # report traffic in MB = 10^6 bytes

RUN_COLUMNS = (
    "run", "status", "model", "dataset", "world_size", "parallel", "route", "steps",
    "accuracy", "loss", "perplexity", "wire_mb", "baseline_mb", "compression_ratio",
    "fallback_steps", "cost_gated_steps", "calibration_steps", "wall_time_s", "fp32_reference",
)
COMPARISON_COLUMNS = ("run", "baseline", "accuracy_delta_pts", "loss_delta_pct", "traffic_ratio")
CALIBRATION_COLUMNS = ("calibration", "phase", "region", "route", "error_feedback",
                       "bits_per_element", "cosine", "loss_delta")


def _nan(value: float | int | None) -> float:
    return math.nan if value is None else float(value)


def describe_route(run: RunArtifacts) -> str:
    """A short label for what the run communicated with: route, dict route, or profile."""
    summary = run.summary
    if summary is None:
        return "?"
    if summary.route:
        try:
            parsed = json.loads(summary.route)
        except json.JSONDecodeError:
            return summary.route
        if isinstance(parsed, dict):
            return " ".join(f"{k}:{v}" for k, v in parsed.items())
        return summary.route
    if summary.profile_path:
        return f"profile {summary.profile_path.replace(chr(92), '/').rsplit('/', 1)[-1]}"
    return "-"


def _last_eval(metrics: pd.DataFrame | None, column: str) -> float:
    if metrics is None:
        return math.nan
    values = metrics[column].dropna()
    return float(values.iloc[-1]) if len(values) else math.nan


def run_row(run: RunArtifacts) -> dict[str, object]:
    """One row of the run table; a run without a summary is described from its metrics."""
    s, m = run.summary, run.metrics
    wire = s.wire_bytes_total if s and s.wire_bytes_total is not None else (
        int(m["wire_bytes"].sum()) if m is not None else None)
    fp32 = s.baseline_wire_bytes_total if s and s.baseline_wire_bytes_total is not None else (
        int(m["baseline_wire_bytes"].sum()) if m is not None else None)
    loss = s.final_loss if s and s.final_loss is not None else _last_eval(m, "eval_loss")
    accuracy = s.final_accuracy if s and s.final_accuracy is not None else \
        _last_eval(m, "eval_accuracy")
    perplexity = s.final_perplexity if s and s.final_perplexity is not None else math.nan
    if s and s.fallback_steps is not None:
        fallbacks: float = s.fallback_steps
    else:
        fallbacks = int(m["fallback"].fillna(False).astype(bool).sum()) if m is not None \
            else math.nan
    if s and s.wall_time_s is not None:
        wall = s.wall_time_s
    else:
        wall = float(m["step_time_s"].sum()) if m is not None and "step_time_s" in m else math.nan
    steps = len(m) if m is not None else _nan(s.steps if s else None)
    return {
        "run": run.name,
        "status": "complete" if run.complete else "incomplete",
        "model": s.model if s else "?",
        "dataset": s.dataset if s else "?",
        "world_size": s.world_size if s else math.nan,
        "parallel": s.parallel if s else "?",
        "route": describe_route(run),
        "steps": steps,
        "accuracy": _nan(accuracy),
        "loss": _nan(loss),
        "perplexity": _nan(perplexity),
        "wire_mb": _nan(wire) / MB,
        "baseline_mb": _nan(fp32) / MB,
        "compression_ratio": compression_ratio(fp32, wire),
        "fallback_steps": fallbacks,
        # steps on which the cost gate kept lossy routes on FP32 (the link makes compression not pay)
        "cost_gated_steps": int(m["cost_gated"].astype(bool).sum()) if m is not None and "cost_gated" in m
        else math.nan,
        # steps in an in-run calibration window (`--profile auto`): their samples' bytes are in wire_mb
        "calibration_steps": _calibration_steps(m),
        "wall_time_s": _nan(wall),
        "fp32_reference": bool(s and s.is_fp32),
    }


def _calibration_steps(metrics: pd.DataFrame | None) -> float:
    """Steps in an in-run calibration window; NaN for a run without any (the column is then not shown)."""
    if metrics is None or "calibrating" not in metrics:
        return math.nan
    n = int(metrics["calibrating"].astype(bool).sum())
    return n if n else math.nan


def compression_ratio(fp32_bytes: int | None, wire_bytes: int | None) -> float:
    """FP32-equivalent bytes over bytes actually sent (2.0 = half the traffic)."""
    if fp32_bytes is None or wire_bytes is None:
        return math.nan
    if wire_bytes == 0:
        return math.inf if fp32_bytes > 0 else math.nan
    return fp32_bytes / wire_bytes


def run_table(runs: tuple[RunArtifacts, ...]) -> pd.DataFrame:
    """The run table, one row per run in the order given."""
    return pd.DataFrame([run_row(r) for r in runs], columns=list(RUN_COLUMNS))


def _baseline_for(row: pd.Series, references: pd.DataFrame) -> pd.Series | None:
    """The FP32 run to compare against: same model, dataset and parallelism (an FSDP2 run sends
    reduce-scatter shards, DDP all-reduced buckets: their bytes do not compare), then the one that
    also has the same W and the same length (a 30-step run was compared with a 6-step FP32 run
    beside a 30-step one), W first; among equals, the first given."""
    same = references[(references["model"] == row["model"])
                      & (references["dataset"] == row["dataset"])
                      & (references["parallel"] == row["parallel"])
                      & (references["run"] != row["run"])]
    if same.empty:
        return None
    score = (2 * (same["world_size"] == row["world_size"]).astype(int) + (same["steps"] == row["steps"]).astype(int))
    return same.loc[score.idxmax()]


def comparison_table(table: pd.DataFrame) -> pd.DataFrame:
    """Each non-FP32 run against an FP32 run of the same model and dataset.

    accuracy_delta_pts: (accuracy - FP32 accuracy) in percentage points;
    loss_delta_pct: (loss - FP32 loss) / FP32 loss in %;
    traffic_ratio: FP32 run's wire bytes / this run's wire bytes (higher = less traffic).
    """
    references = table[table["fp32_reference"]]
    rows = []
    for _, row in table[~table["fp32_reference"]].iterrows():
        base = _baseline_for(row, references)
        if base is None:
            continue
        loss_delta = (row["loss"] - base["loss"]) / base["loss"] * 100 if base["loss"] else math.nan
        traffic = base["wire_mb"] / row["wire_mb"] if row["wire_mb"] else math.nan
        rows.append({
            "run": row["run"],
            "baseline": base["run"],
            "accuracy_delta_pts": (row["accuracy"] - base["accuracy"]) * 100,
            "loss_delta_pct": loss_delta,
            "traffic_ratio": traffic,
        })
    return pd.DataFrame(rows, columns=list(COMPARISON_COLUMNS))


def _measured(cal: CalibrationArtifacts, phase: str, region: str, route: str,
              error_feedback: bool) -> pd.Series | None:
    """The calibration.parquet row behind a choice, when the table is there."""
    t = cal.table
    if t is None:
        return None
    hit = t[(t["phase"] == phase) & (t["region"] == region) & (t["route"] == route)
            & (t["error_feedback"].astype(bool) == error_feedback)]
    return None if hit.empty else hit.iloc[0]


def calibration_table(cal: CalibrationArtifacts) -> pd.DataFrame:
    """Per phase and region: the fitted route and the evidence that justified it.

    Evidence comes from profile.json; where the profile lacks it, from the matching
    calibration.parquet row. Without a profile (not fitted yet) every measured row is
    listed instead, so the table still shows what was measured.
    """
    if cal.profile is None:
        t = cal.table if cal.table is not None else pd.DataFrame(columns=CALIBRATION_COLUMNS)
        listed = t.assign(calibration=cal.name)
        return listed.reindex(columns=list(CALIBRATION_COLUMNS)).sort_values(
            ["phase", "region", "bits_per_element"]).reset_index(drop=True)
    rows = []
    for phase in cal.profile.phases:
        evidence = cal.profile.evidence.get(phase.name, {})
        ordered = sorted(phase.routes, key=lambda r: REGIONS.index(r) if r in REGIONS else 99)
        for region in ordered:
            route = phase.routes[region]
            ev = evidence.get(region)
            row = _measured(cal, phase.name, region, route, phase.error_feedback)
            bits = ev.bits_per_element if ev and ev.bits_per_element is not None else (
                float(row["bits_per_element"]) if row is not None
                else NOMINAL_BITS.get(route, math.nan))
            cosine = ev.cosine if ev and ev.cosine is not None else (
                float(row["cosine"]) if row is not None else math.nan)
            loss_delta = ev.loss_delta if ev and ev.loss_delta is not None else (
                float(row["loss_delta"]) if row is not None else math.nan)
            rows.append({"calibration": cal.name, "phase": phase.name, "region": region,
                         "route": route, "error_feedback": phase.error_feedback,
                         "bits_per_element": bits, "cosine": cosine, "loss_delta": loss_delta})
    return pd.DataFrame(rows, columns=list(CALIBRATION_COLUMNS))


def calibration_notes(cal: CalibrationArtifacts) -> tuple[str, ...]:
    """The profile's validation line and the calibration's time split, as the calibrate command printed them."""
    from nfab.profile.evidence import describe_timing, describe_validation

    if cal.profile is None:
        return ()
    notes = []
    if cal.profile.validation is not None:
        notes.append(describe_validation(cal.profile.validation))
    else:
        notes.append("validation: not recorded (profile made before calibrate validated its profiles)")
    if cal.profile.timing is not None:
        notes.append(f"calibration time: {describe_timing(cal.profile.timing)}")
    return tuple(notes)
