"""`nfab ARGS` through the console-script entry, in this process (no interpreter or torch start-up).

`nfab.cli.app.main` is what the installed `nfab` script calls: the same parsing, checks and
`NfabError` -> one line + exit 2 path. Here it runs with sys.argv set, stdout/stderr
captured, and Python warnings and log records printed to that stderr as a plain interpreter
would print them (pytest would otherwise swallow them), so a stray warning still breaks a
one-line check. A test that must see the real process (environment, exit status, imports)
runs the script in a subprocess instead; each suite keeps a few such cases.
"""

from __future__ import annotations

import logging
import sys
import time
import traceback
import warnings
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from io import StringIO

import pytest

from nfab.cli.app import main


@dataclass
class Ran:
    code: int
    stdout: str
    stderr: str
    seconds: float


def _show(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001 - warnings' hook
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def nfab_main(*args: str) -> Ran:
    """Run `nfab ARGS` in-process; its exit code (an uncaught exception: 1 and the traceback on stderr)."""
    out, err = StringIO(), StringIO()
    t0 = time.perf_counter()
    with pytest.MonkeyPatch.context() as mp, redirect_stdout(out), redirect_stderr(err), warnings.catch_warnings():
        mp.setattr(sys, "argv", ["nfab", *args])
        mp.setattr(logging.getLogger(), "handlers", [])  # records reach logging.lastResort: stderr, as in a shell
        warnings.resetwarnings()  # the interpreter's defaults: DeprecationWarning only from __main__
        for quiet in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", quiet)
        warnings.showwarning = _show
        try:
            main()
            code = 0
        except SystemExit as exc:
            if isinstance(exc.code, str):
                print(exc.code, file=sys.stderr)
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except Exception:  # noqa: BLE001 - what the interpreter would print before exiting 1
            traceback.print_exc()
            code = 1
    return Ran(code, out.getvalue(), err.getvalue(), time.perf_counter() - t0)
