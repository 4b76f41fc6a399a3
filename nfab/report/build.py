"""Build a report: load the artifacts, compute the tables, write PNGs, CSV and HTML.

All files go to the output dir atomically. Everything a user can get wrong is raised as
`NfabError` before any file is written (loading and validating happen first).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from nfab.errors import NfabError
from nfab.fsutil import atomic_write_bytes, atomic_write_text
from nfab.report import plots
from nfab.report.discover import discover
from nfab.report.html import render_html
from nfab.report.model import CalibrationView, Report, TtaView
from nfab.report.tables import calibration_notes, calibration_table, comparison_table, run_table
from nfab.report.tta import seeds_table, tta_plot, tta_table


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "calibration"


def build_report(paths: Iterable[str], out: Path) -> Report:
    """Read every PATH (run or calibration dir, globs allowed) and write the report to `out`."""
    inputs = discover(paths)
    runs = run_table(inputs.runs)
    comparison = comparison_table(runs)
    if out.exists() and not out.is_dir():
        raise NfabError(f"--out {out} exists and is not a directory")
    written: list[Path] = []
    images: list[tuple[str, str]] = []
    if inputs.runs:
        for title, name, png in (
            ("Loss and eval metric vs step, fallback steps marked", "loss.png",
             plots.loss_plot(inputs.runs)),
            ("Cumulative wire traffic vs step", "wire_bytes.png", plots.wire_plot(inputs.runs)),
            ("Route mix over time, per run", "route_mix.png", plots.route_mix_plot(inputs.runs)),
        ):
            written.append(atomic_write_bytes(out / name, png))
            images.append((title, name))
    views = []
    for cal in inputs.calibrations:
        table = calibration_table(cal)
        heatmap = None
        if cal.profile is not None and len(table):
            heatmap = f"calibration_{_slug(cal.name)}.png"
            written.append(atomic_write_bytes(out / heatmap,
                                              plots.calibration_heatmap(cal.name, table)))
        views.append(CalibrationView(name=cal.name, table=table, fitted=cal.profile is not None,
                                     heatmap=heatmap, notes=calibration_notes(cal)))
    ttas = []
    for tta in inputs.ttas:
        if tta.over_seeds is not None:
            ttas.append(TtaView(name=f"{tta.series}, over seeds", target_loss=None, table=seeds_table(tta.over_seeds),
                                plot=None, note=f"{tta.model} on a {tta.link} link; each seed against its own "
                                "FP32 target; a seed that never reached it counts as slower than any that did"))
        plot = f"tta_{_slug(tta.name)}.png"
        written.append(atomic_write_bytes(out / plot, tta_plot(tta)))
        ttas.append(TtaView(name=tta.name, target_loss=tta.target_loss, table=tta_table(tta), plot=plot,
                            note=f"{tta.model} on a {tta.link} link; target: FP32's final validation loss "
                                 f"{tta.target_loss:.4f}; '×' (sooner than) = the base's time to target / this "
                                 "variant's; wall time counts training steps only, evaluation excluded"))
    if len(runs):  # the run table with the FP32 comparison joined on, for spreadsheets
        csv = runs.merge(comparison, on="run", how="left").astype(
            {c: "Int64" for c in ("world_size", "steps", "fallback_steps", "cost_gated_steps")})  # 4, not 4.0
        written.append(atomic_write_text(out / "summary.csv", csv.to_csv(index=False)))
    report = Report(out=out, runs=runs, comparison=comparison, calibrations=tuple(views), ttas=tuple(ttas),
                    images=tuple(images))
    written.append(atomic_write_text(out / "report.html", render_html(report)))
    return replace(report, files=tuple(written))
