"""`nfab report PATH... [--out DIR]`: tables, summary.csv and an HTML page with plots."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nfab.cli.output import console, fail
from nfab.errors import NfabError


def register(app: typer.Typer) -> None:
    @app.command("report")
    def report(
        paths: Annotated[list[str], typer.Argument(
            metavar="PATH", help="Run dirs, calibration dirs and nfab bench tta JSON files (globs allowed).",
            show_default=False)],
        out: Annotated[Path, typer.Option(
            "--out", help="Directory for report.html, summary.csv and the PNG plots.")
        ] = Path("report"),
    ) -> None:
        """Compare runs side by side, show calibration choices, write report.html."""
        # Imported here so `nfab --help` does not pay for pandas and matplotlib.
        from nfab.report import build_report
        from nfab.report.terminal import renderables

        try:
            built = build_report(paths, out)
        except NfabError as exc:
            fail(str(exc))
        for renderable in renderables(built):
            console.print(renderable)
