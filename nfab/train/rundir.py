"""One run per run dir: the lock `nfab train` holds while it writes there, and what `--resume` may change.

Two `nfab train` into one folder both exited 0 and printed the same figures: the second
overwrote the first's config, metrics and checkpoints, and the first's run was gone. The
lock is an advisory `flock` on a file inside the run dir, held by node 0's `nfab train`
for the whole launch and released by the kernel when that process ends, however it ends
(so a killed run never leaves a stale lock behind).

A resumed run continues the saved one: its optimizer, schedule and communication state
come from the checkpoint, so a changed learning rate was silently ignored while
`config.json` recorded it. `--resume` may lengthen the run and change how it is watched
and launched; anything that shapes the training itself is refused in one line.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from nfab.errors import NfabError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no lock, as before
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = ".nfab-lock"
"""Held by the `nfab train` writing the run dir (empty; its presence alone means nothing)."""

RESUME_MAY_CHANGE = ("steps", "eval_every", "checkpoint_every", "metrics_every", "run_dir",
                     "launch.max_restarts", "launch.timeout_s", "launch.rdzv_endpoint", "launch.rdzv_backend",
                     "launch.nnodes", "launch.node_rank")
"""Keys a resumed run may differ in from the saved config: its length, what it records, and how
it is launched (W itself, `launch.nproc` x nodes, is checked against the checkpoint)."""


@contextmanager
def held(run_dir: Path) -> Iterator[None]:
    """Hold the run dir's lock for the block (creating the folder), or refuse in one line."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise NfabError(f"run dir {run_dir} is in use by another nfab train (it holds {LOCK_FILE}): "
                            "wait for it to end, or pass another --run-dir") from None
        yield
    finally:
        os.close(fd)  # releases the lock


def clear(run_dir: Path) -> None:
    """`--overwrite`: empty the run dir but keep the lock file this process holds."""
    for child in run_dir.iterdir():
        if child.name == LOCK_FILE:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def check_resume(saved: dict[str, Any], resumed: dict[str, Any], *, finished_steps: int | None) -> None:
    """Refuse a `--resume` whose config trains differently from the saved run, or a finished run that
    would not train on (`finished_steps`: the steps of a complete run, else None)."""
    old, new = _flat(saved), _flat(resumed)
    changed = [k for k in sorted(old)  # a key the saved config lacks (an older nfab's) has nothing to differ from
               if old.get(k) != new.get(k) and not any(k == m or k.startswith(m + ".") for m in RESUME_MAY_CHANGE)]
    if changed:
        shown = ", ".join(f"{k} ({json.dumps(old.get(k))} -> {json.dumps(new.get(k))})" for k in changed[:3])
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        raise NfabError(f"--resume continues the saved run, which trained with other settings: {shown}{more}. "
                        "Drop the changes, or start a new run (another --run-dir, or --overwrite)")
    if finished_steps is not None and new.get("steps", 0) <= finished_steps:
        raise NfabError(f"the run finished its {finished_steps} steps: nothing to resume (--steps N with N > "
                        f"{finished_steps} trains on from its last checkpoint)")
