"""Where numba caches nfab's compiled kernels: a per-user cache directory, never the installed package.

Numba compiles each `@njit(cache=True)` kernel on its first call and keeps the machine code on
disk, by default beside the source file in the package's `__pycache__`: in a site-packages
install that is a directory the user may not be able to write (numba then falls back from one
place to the next) or, as root or in a shared image, one every user writes into. nfab points
numba at a cache of its own instead, before any codec module imports numba (each imports
`nfab.wire` first, whose `__init__` calls `configure`):

- `NUMBA_CACHE_DIR`, when the user set it: theirs wins;
- else `$XDG_CACHE_HOME/nfab/numba`, or `~/.cache/nfab/numba` without XDG_CACHE_HOME;
- else, when that cannot be written (no home, a read-only one), a private temp directory.

Numba reads the choice from the environment (`NUMBA_CACHE_DIR`), so it holds for the whole
process and the ranks it starts; a user's own cached numba kernels in that process go there too
(numba names each source file's cache by the file's directory, so nothing collides).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path


def cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """The directory numba should cache into: NUMBA_CACHE_DIR, $XDG_CACHE_HOME/nfab/numba or
    ~/.cache/nfab/numba (a relative XDG_CACHE_HOME is ignored, as the XDG spec says)."""
    if environ.get("NUMBA_CACHE_DIR"):
        return Path(environ["NUMBA_CACHE_DIR"])
    xdg = environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "nfab" / "numba"


def _writable(path: Path) -> bool:
    """Whether `path` exists and is writable, or could be made: its nearest existing ancestor is writable."""
    for p in (path, *path.parents):
        if p.exists():
            return p.is_dir() and os.access(p, os.W_OK)
    return False


def configure() -> str:
    """Point numba's cache at `cache_dir()` (left as it is when the user set NUMBA_CACHE_DIR); returns it.

    Sets NUMBA_CACHE_DIR, which numba reads when it is imported; where numba was imported before
    nfab, its config is set as well, so that nfab's kernels, decorated after this, cache there."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return os.environ["NUMBA_CACHE_DIR"]
    try:
        path = cache_dir()
    except RuntimeError:  # Path.home(): no home directory to be found
        path = None
    if path is None or not _writable(path):
        path = Path(tempfile.gettempdir()) / f"nfab-numba-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    os.environ["NUMBA_CACHE_DIR"] = str(path)
    config = sys.modules.get("numba.core.config")
    if config is not None:
        config.CACHE_DIR = str(path)
    return str(path)
