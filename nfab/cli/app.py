"""The `nfab` entry point: mounts one module per subcommand.

Every `NfabError` (a problem the user can fix) becomes one line on stderr and exit 2,
never a traceback.
"""

from __future__ import annotations

import signal
import sys

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


try:  # typer 0.2x carries its own copy of click; before it, typer used click itself
    from typer._click import exceptions as click
except ImportError:  # pragma: no cover  (typer < 0.20)
    from click import exceptions as click  # type: ignore[no-redef]

_NO_ARGS_IS_HELP = getattr(click, "NoArgsIsHelpError", ())
"""What click 8.2 and later raise for a bare group (before it, the help is printed as an exit)."""


def main() -> None:
    """Console-script entry: run the app, mapping user errors to one line and exit 2.

    Besides `NfabError`: click's usage errors (a mistyped option or value; click boxes them in
    several lines), a file system refusal on a path the user gave (`OSError`: a folder that
    cannot be made, a file where a folder should be) and an interrupt (one line, exit 130; under
    `nfab train` torchrun's launcher raises its own `SignalException` for it)."""
    try:
        code = app(standalone_mode=False)
    except NfabError as exc:
        fail(str(exc))
    except _NO_ARGS_IS_HELP as exc:  # a bare `nfab` or group: the help, as click shows it
        exc.show()
        sys.exit(exc.exit_code)
    except click.UsageError as exc:
        where = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
        fail(exc.format_message() + where)
    except click.ClickException as exc:
        fail(exc.format_message(), exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        fail("interrupted", 130)
    except OSError as exc:
        fail(_os_line(exc))
    except Exception as exc:
        if (signum := _interrupted(exc)) is not None:
            fail("interrupted" if signum == signal.SIGINT else f"terminated ({signal.Signals(signum).name})",
                 128 + signum)  # the shell's code for the signal: 130 for Ctrl-C, 143 for SIGTERM
        raise
    if code == 130:  # typer turns a KeyboardInterrupt inside a command into Exit(130)
        fail("interrupted", 130)
    sys.exit(code if isinstance(code, int) else 0)


def _os_line(exc: OSError) -> str:
    """'cannot use PATH: REASON' for a file system error on a user's path (the reason as the OS says it)."""
    reason = exc.strerror or str(exc)
    return f"cannot use {exc.filename}: {reason}" if exc.filename else reason


def _interrupted(exc: Exception) -> int | None:
    """The signal when `exc` is torchrun's launcher reporting SIGINT or SIGTERM (`nfab train`'s Ctrl-C), else None."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    return int(exc.sigval) if isinstance(exc, SignalException) else None
