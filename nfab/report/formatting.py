"""How each table column is shown to a person, shared by the terminal and the HTML page.

The frames keep raw numbers (accuracy as a fraction, traffic in MB) for summary.csv;
only display goes through here, so the terminal and the page never disagree.
"""

from __future__ import annotations

import math
from collections.abc import Callable

HEADERS = {
    "run": "run", "status": "status", "model": "model", "dataset": "dataset",
    "world_size": "W", "parallel": "parallel", "route": "route", "steps": "steps",
    "accuracy": "accuracy", "loss": "loss", "perplexity": "ppl",
    "wire_mb": "wire MB", "baseline_mb": "plain DDP/FSDP2 MB", "compression_ratio": "compression",
    "fallback_steps": "fallback steps", "cost_gated_steps": "cost-gated steps",
    "calibration_steps": "calibration steps", "wall_time_s": "wall s",
    "baseline": "vs FP32 run", "accuracy_delta_pts": "Δ accuracy (pts)",
    "loss_delta_pct": "Δ loss (%)", "traffic_ratio": "traffic ratio (FP32 run / this)",
    "calibration": "calibration", "phase": "phase", "region": "region",
    "error_feedback": "error feedback", "bits_per_element": "bits/element",
    "cosine": "cosine", "loss_delta": "loss delta",
    "variant": "variant", "time_to_target_s": "time to target s", "steps_to_target": "steps to target",
    "speedup_vs_fp32": "sooner than FP32", "speedup_vs_bf16": "sooner than bf16", "final_loss": "final loss",
    "wire_mb_to_target": "wire MB to target",
    "reached": "seeds that reached the target", "median_time_to_target_s": "median time to target s",
    "median_speedup_vs_fp32": "median sooner than FP32", "median_speedup_vs_bf16": "median sooner than bf16",
    "median_speedup_vs_powersgd": "median sooner than PowerSGD",
    "fewer_bytes_vs_fp32": "fewer bytes than FP32", "fewer_bytes_vs_bf16": "fewer bytes than bf16",
    "modelled_step_ms": "modelled ms/step", "time_to_accuracy_s": "time to accuracy s (modelled)",
}


def _number(spec: str, suffix: str = "") -> Callable[[object], str]:
    def render(value: object) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        if isinstance(value, float) and math.isinf(value):
            return "inf"
        return f"{value:{spec}}{suffix}"
    return render


def _time_to_target(value: object) -> str:
    return "never" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.1f}"


_FORMATS: dict[str, Callable[[object], str]] = {
    "world_size": _number(".0f"),
    "steps": _number(".0f"),
    "accuracy": lambda v: _number(".2f", "%")(None if v is None else float(v) * 100),
    "loss": _number(".4f"),
    "perplexity": _number(".2f"),
    "wire_mb": _number(".2f"),
    "baseline_mb": _number(".2f"),
    "compression_ratio": _number(".1f", "x"),
    "fallback_steps": _number(".0f"),
    "cost_gated_steps": _number(".0f"),
    "calibration_steps": _number(".0f"),
    "wall_time_s": _number(".1f"),
    "accuracy_delta_pts": _number("+.2f"),
    "loss_delta_pct": _number("+.2f"),
    "traffic_ratio": _number(".1f", "x"),
    "bits_per_element": _number(".2f"),
    "cosine": _number(".4f"),
    "loss_delta": _number("+.4f"),
    "error_feedback": lambda v: "yes" if v is True or v == 1 else "no",
    "time_to_target_s": _time_to_target,
    "median_time_to_target_s": _time_to_target,
    "steps_to_target": _number(".0f"),
    "final_loss": _number(".4f"),
    "wire_mb_to_target": _number(".1f"),
    "fewer_bytes_vs_fp32": _number(".1f", "x"),
    "fewer_bytes_vs_bf16": _number(".1f", "x"),
    "modelled_step_ms": _number(".0f"),
    "time_to_accuracy_s": _time_to_target,
    "speedup_vs_fp32": lambda v: v if isinstance(v, str) else _number(".2f", "x")(v),  # tta's: text already
    "speedup_vs_bf16": lambda v: v if isinstance(v, str) else _number(".2f", "x")(v),
}


def header(column: str) -> str:
    return HEADERS.get(column, column)


def cell(column: str, value: object) -> str:
    """The display text of one value of `column`."""
    render = _FORMATS.get(column)
    if render is not None:
        return render(value)
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)


def calibration_heading(name: str) -> str:
    """`Calibration NAME`, or just `Calibration` for a folder called calibration(s) (no repeated word)."""
    return "Calibration" if name.lower() in ("calibration", "calibrations") else f"Calibration {name}"
