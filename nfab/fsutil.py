"""Atomic file writes: a temp file in the same folder, fsync, then rename.

A crash mid-write leaves the previous file intact, never a half-written one. Every
artifact nfab writes (profiles, tables, summaries, reports, benchmark JSON) goes
through here. A process killed mid-write (SIGKILL: no cleanup runs) leaves its temp
file behind; the temp name carries the host and pid, and the next write to the same
path removes temp files of writers on this host that are no longer alive.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp_path)`, fsync it, then rename the temp file onto `path`.

    A symlink is written through (its target is replaced, the link stays); a path that exists but
    is no regular file (a folder, a device, a pipe) is refused with an `OSError` naming it: the
    rename would replace it (as root, `-o /dev/full` once replaced the device node)."""
    path = Path(os.path.realpath(path))
    if path.exists() and not path.is_file():
        code = errno.EISDIR if path.is_dir() else errno.EINVAL
        raise OSError(code, "is a folder" if path.is_dir() else "is not a regular file", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(path)
    fd, tmp = tempfile.mkstemp(prefix=f"{_temp_prefix(path)}{_HOST}-{os.getpid()}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        write(tmp_path)
        with open(tmp_path, "rb") as handle:
            os.fsync(handle.fileno())
        os.chmod(tmp_path, 0o666 & ~_umask())  # mkstemp makes 0600; artifacts are for everyone
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    return path


_HOST = socket.gethostname().replace(".", "_").replace("-", "_") or "host"


def _temp_prefix(path: Path) -> str:
    return f".{path.name}."


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def sweep_stale(path: str | Path) -> list[Path]:
    """Remove temp files of `path` left by dead writers on this host (a killed process); return them."""
    path = Path(path)
    prefix = _temp_prefix(path) + _HOST + "-"
    removed = []
    for tmp in path.parent.glob(f"{glob_escape(prefix)}*.tmp"):
        pid = tmp.name[len(prefix):].split(".", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def glob_escape(text: str) -> str:
    """`text` with glob metacharacters escaped (for Path.glob)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write bytes atomically."""
    return atomic_write(path, lambda p: p.write_bytes(data))


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write UTF-8 text atomically."""
    return atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))


def atomic_write_json(path: str | Path, payload: Any) -> Path:
    """Write JSON (indented, keys sorted) atomically."""
    return atomic_write_text(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")
