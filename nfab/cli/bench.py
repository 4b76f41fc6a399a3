"""`nfab bench`: wire, hook, step and study benchmarks (a sub-app, one command each)."""

from __future__ import annotations

import typer

from nfab.cli.output import not_built

bench_app = typer.Typer(help="Benchmarks: compare side by side in one run, report ratios.",
                        no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")


@bench_app.command("step")
def step() -> None:
    """Not built yet."""
    not_built("bench step")
