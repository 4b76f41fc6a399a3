"""Atomic file writes: a reader never sees half a report.

The bytes go to a temp file in the destination dir (same filesystem, so the rename is
atomic) and `os.replace` puts it in place; on any error the temp file is removed.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_bytes(path: Path, data: bytes) -> Path:
    """Write `data` to `path` atomically; returns `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text(path: Path, text: str) -> Path:
    """Write UTF-8 text to `path` atomically; returns `path`."""
    return write_bytes(path, text.encode("utf-8"))
