"""The `nfab` entry point: mounts one module per subcommand.

Every `NfabError` (a problem the user can fix) becomes one line on stderr and exit 2,
never a traceback.
"""

from __future__ import annotations

import typer

from nfab import __version__
from nfab.cli import bench, calibrate, demo, fit, inspect, profile, report, train
from nfab.cli.output import fail
from nfab.errors import NfabError

app = typer.Typer(
    name="nfab",
    help="NEURON-Fabric: controlled low-bit gradient communication for PyTorch DDP.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"nfab {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """NEURON-Fabric: calibrate, fit, train, report."""


for module in (calibrate, fit, train, report, inspect, profile, bench, demo):
    module.register(app)


def main() -> None:
    """Console-script entry: run the app, mapping user errors to one line and exit 2."""
    try:
        app()
    except NfabError as exc:
        fail(str(exc))
