"""The self-contained report page: inline CSS, tables, and PNGs referenced relatively.

No scripts and no external assets, so the page opens offline, from an archive, or
attached to an issue together with its PNGs. Every string from an artifact is escaped.
"""

from __future__ import annotations

from datetime import datetime, timezone
from html import escape

import pandas as pd

from nfab import __version__
from nfab.report.formatting import calibration_heading, cell, header
from nfab.report.model import Report, visible_columns

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1200px;
       color: #222; padding: 0 1rem; }
table { border-collapse: collapse; margin: 0.5rem 0 1.5rem; font-size: 0.9rem; }
th, td { border: 1px solid #ccc; padding: 0.25rem 0.6rem; }
th { background: #f2f2f2; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.incomplete td { background: #fff6d5; }
figure { margin: 1rem 0 2rem; }
img { max-width: 100%; border: 1px solid #eee; }
.note { color: #666; font-size: 0.85rem; }
"""

_TEXT_COLUMNS = {"run", "status", "model", "dataset", "route", "baseline", "calibration",
                 "phase", "region", "error_feedback", "variant"}


_NUM = ' class="num"'


def table_html(frame: pd.DataFrame, columns: list[str]) -> str:
    """An HTML table; rows of incomplete runs get the `incomplete` class."""
    head = "".join(f"<th>{escape(header(c))}</th>" for c in columns)
    rows = []
    for _, row in frame.iterrows():
        klass = ' class="incomplete"' if row.get("status") == "incomplete" else ""
        cells = "".join(
            f"<td{_NUM if c not in _TEXT_COLUMNS else ''}>{escape(cell(c, row[c]))}</td>"
            for c in columns)
        rows.append(f"<tr{klass}>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _figure(title: str, file_name: str) -> str:
    return (f'<figure><img src="{escape(file_name)}" alt="{escape(title)}">'
            f"<figcaption>{escape(title)}</figcaption></figure>")


def render_html(report: Report) -> str:
    """The whole page as a string."""
    parts = [f"<h1>nfab report</h1><p class='note'>nfab {escape(__version__)}, generated "
             f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}. Traffic in MB = 10^6 bytes; "
             "compression = FP32-equivalent bytes / bytes sent.</p>"]
    if len(report.runs):
        parts.append("<h2>Runs</h2>")
        parts.append(table_html(report.runs, visible_columns(report.runs)))
        if (report.runs["status"] == "incomplete").any():
            parts.append("<p class='note'>Highlighted runs are incomplete (still going or cut "
                         "short): their numbers cover the steps recorded so far.</p>")
        if len(report.comparison):
            parts.append("<h2>Against the FP32 run</h2>")
            parts.append(table_html(report.comparison, list(report.comparison.columns)))
        parts.extend(_figure(title, name) for title, name in report.images)
    for tta in report.ttas:
        parts.append(f"<h2>Time to accuracy: {escape(tta.name)}</h2>")
        parts.append(table_html(tta.table, list(tta.table.columns)))
        parts.append(f"<p class='note'>{escape(tta.note)}</p>")
        if tta.plot is not None:
            parts.append(_figure(f"{tta.name}: validation loss against training wall time", tta.plot))
    for view in report.calibrations:
        parts.append(f"<h2>{escape(calibration_heading(view.name))}</h2>")
        if not view.fitted:
            parts.append("<p class='note'>No profile.json yet (not fitted): all measured "
                         "rows are listed.</p>")
        columns = [c for c in view.table.columns if c != "calibration"]
        parts.append(table_html(view.table, columns))
        parts.extend(f"<p class='note'>{escape(note)}</p>" for note in view.notes)
        if view.heatmap:
            parts.append(_figure(f"{calibration_heading(view.name)}: chosen route per phase x region",
                                 view.heatmap))
    body = "\n".join(parts)
    return (f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<title>nfab report</title><style>{_CSS}</style></head>\n<body>\n{body}\n"
            f"</body></html>\n")
