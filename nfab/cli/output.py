"""All CLI printing goes through here: one rich console, and the one-line error path."""

from __future__ import annotations

import sys
from typing import NoReturn

from rich.console import Console
from rich.markup import escape

console = Console()
err_console = Console(stderr=True)


def fail(message: str, code: int = 2) -> NoReturn:
    """Print one clear line to stderr and exit (code 2 for user errors); the message is not markup."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    sys.exit(code)

