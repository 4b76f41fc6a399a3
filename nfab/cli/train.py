"""`nfab train` (not built yet)."""

from __future__ import annotations

import typer

from nfab.cli.output import not_built


def register(app: typer.Typer) -> None:
    @app.command("train", context_settings={"allow_extra_args": True,
                                    "ignore_unknown_options": True})
    def train() -> None:
        """Not built yet."""
        not_built("train")
