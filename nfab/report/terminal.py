"""Rich tables of a built report, for the CLI to print (the library does not print)."""

from __future__ import annotations

import pandas as pd
from rich import box
from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from nfab.report.formatting import calibration_heading, cell, header
from nfab.report.model import Report, visible_columns

_LEFT = {"run", "status", "model", "dataset", "parallel", "route", "baseline", "calibration", "phase",
         "region", "error_feedback", "variant"}


# Shorter headers than the page's: an 80-column terminal must hold the run table.
_SHORT = {"accuracy": "acc", "wire_mb": "wire\nMB", "baseline_mb": "plain\nMB",
          "compression_ratio": "compr-\nession", "fallback_steps": "fall-\nbacks",
          "cost_gated_steps": "cost-\ngated", "calibration_steps": "calib-\nration",
          "wall_time_s": "wall\ns", "accuracy_delta_pts": "Δ acc\n(pts)",
          "loss_delta_pct": "Δ loss\n(%)", "traffic_ratio": "traffic ratio\n(FP32 run/this)",
          "bits_per_element": "bits/\nelement", "error_feedback": "error\nfeedback",
          "time_to_target_s": "to\ntarget s", "steps_to_target": "steps to\ntarget",
          "speedup_vs_fp32": "×\nFP32", "speedup_vs_bf16": "×\nbf16",
          "final_loss": "final\nloss", "wire_mb_to_target": "MB to\ntarget",
          "reached": "reached", "median_time_to_target_s": "median to\ntarget s",
          "median_speedup_vs_fp32": "median ×\nFP32", "median_speedup_vs_bf16": "median ×\nbf16",
          "median_speedup_vs_powersgd": "median ×\nPowerSGD",
          "fewer_bytes_vs_fp32": "fewer B\nvs FP32", "fewer_bytes_vs_bf16": "fewer B\nvs bf16",
          "modelled_step_ms": "ms/\nstep", "time_to_accuracy_s": "to acc.\ns"}
# Text that may wrap when space runs out; numbers and names never do.
_WRAPPABLE = {"route", "model", "dataset", "baseline"}


def _table(title: str, frame: pd.DataFrame, columns: list[str]) -> Table:
    table = Table(title=title, title_justify="left", header_style="bold",
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for column in columns:
        table.add_column(_SHORT.get(column, header(column)),
                         justify="left" if column in _LEFT else "right",
                         overflow="fold", no_wrap=column not in _WRAPPABLE)
    for _, row in frame.iterrows():
        cells = [cell(c, row[c]) for c in columns]
        style = "yellow" if row.get("status") == "incomplete" else None
        table.add_row(*cells, style=style)
    return table


_FOLDABLE = ("model", "dataset", "world_size", "parallel")


def _fold_constants(frame: pd.DataFrame, columns: list[str]) -> tuple[list[str], str]:
    """Move columns with one value across all rows into the title: saves terminal width."""
    if len(frame) < 2:
        return columns, ""
    folded = [c for c in _FOLDABLE if c in columns and frame[c].nunique(dropna=False) == 1]
    note = ", ".join(f"{header(c)}={cell(c, frame[c].iloc[0])}" for c in folded)
    return [c for c in columns if c not in folded], note


def renderables(report: Report) -> list[RenderableType]:
    """The run table, the FP32 comparison, one table per calibration, and where files went."""
    out: list[RenderableType] = []
    if len(report.runs):
        columns, note = _fold_constants(report.runs, visible_columns(report.runs))
        # Two tables, each with the run name, so an 80-column terminal holds both.
        split = columns.index("steps") + 1
        out.append(_table(f"Runs ({note})" if note else "Runs", report.runs, columns[:split]))
        out.append(_table("Results", report.runs, ["run", *columns[split:]]))
        if len(report.comparison):
            out.append(_table("Against the FP32 run", report.comparison,
                              list(report.comparison.columns)))
        elif not report.runs["fp32_reference"].any():
            out.append(Text("no FP32 run among these runs: no comparison table", style="dim"))
    for tta in report.ttas:
        out.append(_table(f"Time to accuracy: {tta.name}", tta.table, list(tta.table.columns)))
        out.append(Text(tta.note))
    for view in report.calibrations:
        columns = [c for c in view.table.columns if c != "calibration"]
        title = f"{calibration_heading(view.name)}: " + (
            "fitted route per phase and region, with its evidence" if view.fitted
            else "measurements (no profile.json yet: not fitted)")
        out.append(_table(title, view.table, columns))
        out.extend(Text(note) for note in view.notes)
    csv = f", {report.out / 'summary.csv'}" if any(p.name == "summary.csv" for p in report.files) else ""
    out.append(Text(f"wrote {report.out / 'report.html'}{csv} "
                    f"and {sum(p.suffix == '.png' for p in report.files)} PNG plots"))
    if report.removed:
        out.append(Text(f"removed what an earlier report there wrote and this one does not: "
                        f"{', '.join(p.name for p in report.removed)}"))
    return out
