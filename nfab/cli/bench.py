"""`nfab bench`: a sub-app with one module per benchmark (wire, launches, hook, step, tta)."""

from __future__ import annotations

import typer

from nfab.cli import bench_hook, bench_launches, bench_step, bench_tta, bench_wire

bench_app = typer.Typer(
    help="Benchmarks: compare side by side in one run, report ratios.", no_args_is_help=True
)

for module in (bench_wire, bench_launches, bench_hook, bench_step, bench_tta):
    module.register(bench_app)


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
