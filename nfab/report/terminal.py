"""Rich tables of a built report, for the CLI to print (the library does not print)."""

from __future__ import annotations

import pandas as pd
from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from nfab.report.formatting import cell, header
from nfab.report.model import Report, visible_columns

_LEFT = {"run", "status", "model", "dataset", "route", "baseline", "calibration", "phase",
         "region", "error_feedback"}


def _table(title: str, frame: pd.DataFrame, columns: list[str]) -> Table:
    table = Table(title=title, title_justify="left", header_style="bold")
    for column in columns:
        table.add_column(header(column), justify="left" if column in _LEFT else "right",
                         overflow="fold")
    for _, row in frame.iterrows():
        cells = [cell(c, row[c]) for c in columns]
        style = "yellow" if row.get("status") == "incomplete" else None
        table.add_row(*cells, style=style)
    return table


def renderables(report: Report) -> list[RenderableType]:
    """The run table, the FP32 comparison, one table per calibration, and where files went."""
    out: list[RenderableType] = []
    if len(report.runs):
        out.append(_table("Runs", report.runs, visible_columns(report.runs)))
        if len(report.comparison):
            out.append(_table("Against the FP32 run", report.comparison,
                              list(report.comparison.columns)))
        elif not report.runs["fp32_reference"].any():
            out.append(Text("no FP32 run among these runs: no comparison table", style="dim"))
    for view in report.calibrations:
        columns = [c for c in view.table.columns if c != "calibration"]
        title = f"Calibration {view.name}: " + (
            "fitted route per phase and region, with its evidence" if view.fitted
            else "measurements (no profile.json yet: not fitted)")
        out.append(_table(title, view.table, columns))
    out.append(Text(f"wrote {report.out / 'report.html'}, {report.out / 'summary.csv'} "
                    f"and {sum(p.suffix == '.png' for p in report.files)} PNG plots"))
    return out
