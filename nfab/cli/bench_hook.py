"""`nfab bench hook` (not built yet)."""

from __future__ import annotations

import typer

from nfab.cli.output import not_built


def register(app: typer.Typer) -> None:
    @app.command("hook", context_settings={"allow_extra_args": True,
                                    "ignore_unknown_options": True})
    def bench_hook() -> None:
        """Not built yet."""
        not_built("bench hook")
