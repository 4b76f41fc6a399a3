"""metrics.parquet (one row per optimizer step) and summary.json, written by rank 0.

The column contract is `COLUMNS`; `nfab report` reads these files (nfab/report/artifacts.py).
Both files are written atomically, so a crashed run leaves the last complete version.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from nfab.fsutil import atomic_write, atomic_write_text

METRICS_FILE = "metrics.parquet"
SUMMARY_FILE = "summary.json"

COLUMNS: tuple[tuple[str, pa.DataType], ...] = (
    ("step", pa.int64()),
    ("phase", pa.string()),
    ("loss", pa.float64()),
    ("lr", pa.float64()),
    ("grad_norm", pa.float64()),
    ("wire_bytes", pa.int64()),
    ("baseline_wire_bytes", pa.int64()),
    ("intra_node_bytes", pa.int64()),
    ("inter_node_bytes", pa.int64()),
    ("probe_wire_bytes", pa.int64()),
    ("shadow_wire_bytes", pa.int64()),
    ("calibration_wire_bytes", pa.int64()),
    ("route_mix", pa.string()),
    ("fallback", pa.bool_()),
    ("fallback_reason", pa.string()),
    ("skipped", pa.bool_()),
    ("cost_gated", pa.bool_()),
    ("calibrating", pa.bool_()),
    ("shadow", pa.bool_()),
    ("alarms", pa.int64()),
    ("false_alarms", pa.int64()),
    ("fidelity_cosine", pa.float64()),
    ("region_cosine", pa.string()),
    ("hook_time_s", pa.float64()),
    ("collectives", pa.int64()),
    ("scale_rounds", pa.int64()),
    ("saturated_slices", pa.int64()),
    ("step_time_s", pa.float64()),
    ("eval_loss", pa.float64()),
    ("eval_accuracy", pa.float64()),
    ("events", pa.string()),
)
SCHEMA = pa.schema([pa.field(name, kind, nullable=False) for name, kind in COLUMNS])
NAN = float("nan")


_COUNTERS_ABSENT = {"collectives": 0, "scale_rounds": 0, "saturated_slices": 0, "region_cosine": "{}",
                    "intra_node_bytes": 0, "inter_node_bytes": 0, "probe_wire_bytes": 0, "shadow_wire_bytes": 0,
                    "cost_gated": False, "calibrating": False, "calibration_wire_bytes": 0,
                    "shadow": False, "alarms": 0, "false_alarms": 0}


def _nan(value: float | None) -> float:
    return NAN if value is None else float(value)


def make_row(
    *,
    step: int,
    phase: str,
    loss: float,
    lr: float,
    grad_norm: float,
    wire_bytes: int,
    baseline_wire_bytes: int,
    route_mix: dict[str, float],
    fallback: bool = False,
    fallback_reason: str = "",
    skipped: bool = False,
    fidelity_cosine: float | None = None,
    region_cosine: dict[str, float] | None = None,
    hook_time_s: float = 0.0,
    collectives: int = 0,
    scale_rounds: int = 0,
    saturated_slices: int = 0,
    intra_node_bytes: int = 0,
    inter_node_bytes: int = 0,
    step_time_s: float = 0.0,
    events: str = "",
    probe_wire_bytes: int = 0,
    shadow_wire_bytes: int = 0,
    cost_gated: bool = False,
    shadow: bool = False,
    alarms: int = 0,
    false_alarms: int = 0,
    calibrating: bool = False,
    calibration_wire_bytes: int = 0,
) -> dict[str, Any]:
    """One metrics row with every column typed; eval columns start as NaN."""
    return {
        "step": int(step), "phase": str(phase), "loss": float(loss), "lr": float(lr),
        "grad_norm": float(grad_norm), "wire_bytes": int(wire_bytes), "baseline_wire_bytes": int(baseline_wire_bytes),
        "intra_node_bytes": int(intra_node_bytes), "inter_node_bytes": int(inter_node_bytes),
        "route_mix": json.dumps(route_mix, sort_keys=True), "fallback": bool(fallback),
        "fallback_reason": fallback_reason or "", "skipped": bool(skipped),
        "probe_wire_bytes": int(probe_wire_bytes), "shadow_wire_bytes": int(shadow_wire_bytes),
        "cost_gated": bool(cost_gated), "shadow": bool(shadow),
        "calibrating": bool(calibrating), "calibration_wire_bytes": int(calibration_wire_bytes),  # attach "auto"
        "alarms": int(alarms), "false_alarms": int(false_alarms),  # run totals so far
        "fidelity_cosine": _nan(fidelity_cosine),
        "region_cosine": json.dumps(region_cosine or {}, sort_keys=True),  # drift monitor's per-region probe
        "hook_time_s": float(hook_time_s),
        "collectives": int(collectives), "scale_rounds": int(scale_rounds), "saturated_slices": int(saturated_slices),
        "step_time_s": float(step_time_s), "eval_loss": NAN, "eval_accuracy": NAN, "events": events or "",
    }


def write_metrics(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    """Write all rows as metrics.parquet with the exact column types, atomically."""
    rows = [{**_COUNTERS_ABSENT, **r} for r in rows]  # rows from a checkpoint written before the counters
    table = pa.Table.from_pylist(rows, schema=SCHEMA) if rows else SCHEMA.empty_table()
    return atomic_write(path, lambda tmp: pq.write_table(table, tmp))


@dataclass(slots=True)
class Totals:
    """Run totals folded from the metrics rows (what summary.json reports)."""

    wire_bytes: int = 0
    baseline_wire_bytes: int = 0
    intra_node_bytes: int = 0
    inter_node_bytes: int = 0
    probe_wire_bytes: int = 0
    shadow_wire_bytes: int = 0
    fallback_steps: int = 0
    skipped_steps: int = 0
    cost_gated_steps: int = 0
    alarms: int = 0
    false_alarms: int = 0
    final_eval: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, rows: list[dict[str, Any]], lm: bool) -> Totals:
        t = cls()
        for r in rows:
            t.wire_bytes += r["wire_bytes"]
            t.baseline_wire_bytes += r["baseline_wire_bytes"]
            t.intra_node_bytes += r.get("intra_node_bytes", 0)
            t.inter_node_bytes += r.get("inter_node_bytes", 0)
            t.probe_wire_bytes += r.get("probe_wire_bytes", 0)
            t.shadow_wire_bytes += r.get("shadow_wire_bytes", 0)
            t.cost_gated_steps += bool(r.get("cost_gated", False))
            t.alarms, t.false_alarms = r.get("alarms", 0), r.get("false_alarms", 0)  # running totals
            t.fallback_steps += bool(r["fallback"])
            t.skipped_steps += bool(r["skipped"])
        evals = [r for r in rows if not math.isnan(r["eval_loss"])]
        if evals:
            last = evals[-1]
            t.final_eval = {"loss": last["eval_loss"]}
            if lm:
                t.final_eval["perplexity"] = math.exp(min(last["eval_loss"], 700.0))
            elif not math.isnan(last["eval_accuracy"]):  # a user's loss has no accuracy to report
                t.final_eval["accuracy"] = last["eval_accuracy"]
        return t


def write_summary(path: str | Path, identity: dict[str, Any], rows: list[dict[str, Any]], *, lm: bool,
                  complete: bool, wall_time_s: float, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write summary.json from the run's identity and its metrics rows, atomically.

    `extra` holds end-of-run checks (`replicas_identical`: all ranks' parameters bit-identical).
    """
    t = Totals.of(rows, lm)
    summary = {
        **{k: identity[k] for k in ("model", "dataset", "world_size")},
        "steps": len(rows),
        "complete": complete,
        "final_eval": t.final_eval,
        "wire_bytes_total": t.wire_bytes,
        "baseline_wire_bytes_total": t.baseline_wire_bytes,
        "compression_ratio": t.baseline_wire_bytes / t.wire_bytes if t.wire_bytes else 1.0,
        "intra_node_bytes_total": t.intra_node_bytes,
        "inter_node_bytes_total": t.inter_node_bytes,
        "probe_wire_bytes_total": t.probe_wire_bytes,
        "shadow_wire_bytes_total": t.shadow_wire_bytes,
        "fallback_steps": t.fallback_steps,
        "skipped_steps": t.skipped_steps,
        "cost_gated_steps": t.cost_gated_steps,
        "alarms": t.alarms,
        "false_alarms": t.false_alarms,
        "wall_time_s": wall_time_s,
        **(extra or {}),
        **{k: v for k, v in identity.items() if k not in ("model", "dataset", "world_size")},
    }
    atomic_write_text(path, json.dumps(summary, indent=2) + "\n")
    return summary
