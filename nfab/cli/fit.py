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
            "--tol-cosine", help="Minimum cosine to the true mean gradient, in [-1, 1] (default 0.3; under an "
            "adaptive optimizer at least 0.75).", show_default=False)] = None,
        tol_loss: Annotated[float | None, typer.Option(
            "--tol-loss", help="Maximum relative held-out loss increase of a trial, >= 0 (default 0.02).",
            show_default=False)] = None,
        output: Annotated[Path | None, typer.Option(
            "--output", "-o", help="Profile path (default profile.json beside the table).", show_default=False)
        ] = None,
        overwrite: Annotated[bool, typer.Option(
            "--overwrite", help="Replace an existing profile (e.g. the calibration's validated one).")] = False,
    ) -> None:
        """Fit an operating profile from a calibration table at the given tolerances (not validated)."""
        from nfab.calibrate import fit_file
        from nfab.calibrate.fit import adaptive_cosine_note
        from nfab.cli.calibrate import check_tolerances, profile_table

        check_tolerances(tol_cosine, tol_loss)
        target = output if output is not None else table.parent / "profile.json"
        if target.exists() and table.exists() and target.resolve() == table.resolve():
            fail(f"{target} is the calibration table itself: write the profile elsewhere (-o profile.json)")
        if target.is_file() and not overwrite:
            fail(f"{target} exists (a refit is not validated; calibrate's profile is): pass --overwrite to "
                 "replace it, or -o OTHER.json")
        try:
            profile = fit_file(table, target, tol_cosine=tol_cosine, tol_loss=tol_loss)
        except NfabError as exc:
            fail(str(exc))
        if (note := adaptive_cosine_note(profile, tol_cosine)) is not None:
            console.print(note, highlight=False)
        console.print(profile_table(profile))
        console.print(f"wrote {target}", highlight=False)
