"""`nfab fit CALIBRATION.parquet [--tol-cosine X] [--tol-loss Y] [-o profile.json]`: refit without re-measuring."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from nfab.cli.output import console, fail
from nfab.errors import NfabError


def register(app: typer.Typer) -> None:
    @app.command("fit")
    def fit(
        table: Annotated[Path, typer.Argument(metavar="CALIBRATION.parquet", help="A calibration table.",
                                              show_default=False)],
        tol_cosine: Annotated[float | None, typer.Option(
            "--tol-cosine", help="Minimum cosine to the true mean gradient (default 0.3).", show_default=False)
        ] = None,
        tol_loss: Annotated[float | None, typer.Option(
            "--tol-loss", help="Maximum relative held-out loss increase of a trial (default 0.02).",
            show_default=False)] = None,
        output: Annotated[Path | None, typer.Option(
            "--output", "-o", help="Profile path (default profile.json beside the table).", show_default=False)
        ] = None,
    ) -> None:
        """Fit an operating profile from a calibration table at the given tolerances."""
        from nfab.calibrate import fit_file
        from nfab.cli.calibrate import profile_table

        target = output if output is not None else table.parent / "profile.json"
        try:
            profile = fit_file(table, target, tol_cosine=tol_cosine, tol_loss=tol_loss)
        except NfabError as exc:
            fail(str(exc))
        console.print(profile_table(profile))
        console.print(f"wrote {target}", highlight=False)
