"""`nfab report` (not built yet)."""

from __future__ import annotations

import typer

from nfab.cli.output import not_built


def register(app: typer.Typer) -> None:
    @app.command("report", context_settings={"allow_extra_args": True,
                                    "ignore_unknown_options": True})
    def report() -> None:
        """Not built yet."""
        not_built("report")
