"""Build a report: load the artifacts, compute the tables, write PNGs, CSV and HTML.

All files go to the output dir atomically. Everything a user can get wrong is raised as
`NfabError` before any file is written (loading and validating happen first). A report over
other inputs in the same dir removes the plots and CSV the last one wrote and this one does not
(their names are kept in `MANIFEST`): a stale loss.png beside a new report.html reads as current.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from nfab.errors import NfabError
from nfab.fsutil import atomic_write_bytes, atomic_write_text
from nfab.report import plots
from nfab.report.discover import discover
from nfab.report.html import render_html
from nfab.report.linktime import ACCURACY_POINTS, TARGET_EVALS, link_view
from nfab.report.model import CalibrationView, Report, TtaView
from nfab.report.tables import calibration_notes, calibration_table, comparison_table, run_table
from nfab.report.tta import seeds_table, tta_plot, tta_table

MANIFEST = ".nfab-report.json"
"""The names of the files the last report in a dir wrote: what the next one may remove."""
_OWNED = re.compile(r"(loss|wire_bytes|route_mix)\.png|(calibration|tta)_[A-Za-z0-9_.-]+\.png|summary\.csv")
"""Names report writes: a manifest entry outside these (edited, or another tool's) is never removed."""


def _remove_stale(out: Path, written: list[Path]) -> tuple[Path, ...]:
    """Remove the files the last report in `out` wrote (its `MANIFEST`) that this one did not write,
    then record this one's. Only names report gives its files, only regular files (a symlink stays)."""
    try:
        before = json.loads((out / MANIFEST).read_text(encoding="utf-8")).get("files", [])
    except (OSError, ValueError, AttributeError):  # none yet (a first report), or unreadable: remove nothing
        before = []
    now = {p.name for p in written}
    removed = []
    for name in before:
        if not isinstance(name, str) or name in now or not _OWNED.fullmatch(name):
            continue
        path = out / name
        if path.is_file() and not path.is_symlink():
            path.unlink()
            removed.append(path)
    atomic_write_text(out / MANIFEST, json.dumps({"files": sorted(now)}, indent=2) + "\n")
    return tuple(removed)


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
                            note=f"{tta.model} ({tta.recipe}) on a {tta.link} link; target {tta.target_loss:.4f} "
                                 f"({tta.target_rule}); '×' (sooner than) = the base's time to target / this "
                                 "variant's; wall time counts training steps only, evaluation excluded"))
    if (priced := link_view(inputs.runs)) is not None:  # runs trained for a declared link: priced at it
        link, table, target = priced
        ttas.append(TtaView(name=f"at the declared {link} (modelled)", target_loss=None, table=table, plot=None,
                            note=f"each step: this machine's compute (the fastest half of its steps) + its "
                                 f"gradient bytes at {link} (nfab.report.linktime); target: {target:.2%} held-out "
                                 f"accuracy, FP32's mean over its last {TARGET_EVALS} evaluations less "
                                 f"{ACCURACY_POINTS:g} point; 'sooner than' = the base's time to accuracy / this "
                                 "run's; fewer bytes = the base's / this run's"))
    if len(runs):  # the run table with the FP32 comparison joined on, for spreadsheets
        csv = runs.merge(comparison, on="run", how="left").astype(
            {c: "Int64" for c in ("world_size", "steps", "fallback_steps", "cost_gated_steps",
                                  "calibration_steps")})  # 4, not 4.0
        written.append(atomic_write_text(out / "summary.csv", csv.to_csv(index=False)))
    report = Report(out=out, runs=runs, comparison=comparison, calibrations=tuple(views), ttas=tuple(ttas),
                    images=tuple(images))
    written.append(atomic_write_text(out / "report.html", render_html(report)))
    removed = _remove_stale(out, written)
    return replace(report, files=tuple(written), removed=removed)
