"""Checkpoints: model, optimizer, scheduler, data position, RNG, metrics and hook state.

Layout in the run dir::

    checkpoints/step-000040/state.pt     model, optimizer, scheduler, data position, rows (rank 0)
    checkpoints/step-000040/rank{r}.pt   hook Runtime state + RNG states of rank r
    checkpoints/latest                   name of the newest complete checkpoint

Rank 0 gathers every rank's state and writes the whole checkpoint into a temp folder,
renames it into place, then points `latest` at it: a crash mid-save leaves the previous
checkpoint intact. On load rank 0 reads and broadcasts, so nodes need no shared disk.
Files hold only tensors and plain containers, read with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import pickle
import random
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from nfab.errors import NfabError
from nfab.fsutil import atomic_write_text

CHECKPOINT_DIR = "checkpoints"
KEEP = 2


def rng_state() -> dict[str, Any]:
    """This process's torch, numpy and python RNG states as tensors and lists."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "python": {"version": int(version), "internal": list(internal), "gauss": gauss},
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss"]))


def latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder in `run_dir`, or None."""
    root = Path(run_dir) / CHECKPOINT_DIR
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / "state.pt").is_file() else None


def read(path: str | Path, mmap: bool = False) -> Any:
    """`torch.load(weights_only=True)` of one checkpoint file; an unreadable one is one NfabError line."""
    try:
        return torch.load(path, weights_only=True, mmap=mmap, map_location="cpu")
    except pickle.UnpicklingError as exc:  # weights-only refused a global: never retried as a full unpickle
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = f" ({found.group(1)})" if found else ""
        raise NfabError(f"checkpoint file {path} holds objects other than tensors and plain containers{what}; "
                        "nfab loads checkpoints weights-only and refuses it") from exc
    except Exception as exc:  # noqa: BLE001 - zip and OS errors all mean "not a checkpoint we can read"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise NfabError(f"checkpoint file {path} cannot be read ({first})") from exc


def check_model_state(state: Mapping[str, Any], module: torch.nn.Module, where: str | Path) -> None:
    """Refuse a checkpoint whose model state does not fit `module` (names and shapes), in one line."""
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    reshaped = sorted(k for k in set(own) & set(state) if tuple(own[k].shape) != tuple(state[k].shape))
    if missing or unexpected or reshaped:
        example = (missing or unexpected or reshaped)[0]
        raise NfabError(
            f"checkpoint {where} was written for another model ({len(missing)} tensors missing, "
            f"{len(unexpected)} unexpected, {len(reshaped)} of another shape, e.g. {example!r}); "
            "resume with the run's own model, or start a new run dir")


def save(run_dir: str | Path, step: int, state: dict[str, Any] | None, rank_state: dict[str, Any]) -> Path | None:
    """Collective: gather every rank's `rank_state`; rank 0 writes `state` and all of them."""
    world = dist.get_world_size()
    gathered: list[Any] = [None] * world if dist.get_rank() == 0 else []
    dist.gather_object(rank_state, gathered if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return None
    assert state is not None, "rank 0 holds the shared checkpoint state"
    root = Path(run_dir) / CHECKPOINT_DIR
    name = f"step-{step:06d}"
    final, tmp = root / name, root / f".{name}.tmp"
    for stale in root.glob(".step-*.tmp"):  # left by a save that was killed (only rank 0 writes here)
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save(state, tmp / "state.pt")
    for r, rs in enumerate(gathered):
        torch.save(rs, tmp / f"rank{r}.pt")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    atomic_write_text(root / "latest", name + "\n")
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load(run_dir: str | Path) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Collective: rank 0 reads the latest checkpoint and sends each rank (shared state, its own state)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    box: list[Any] = [None]
    per_rank: list[Any] | None = None
    if rank == 0:
        path = latest(run_dir)
        error = None
        if path is not None:
            files = sorted(path.glob("rank*.pt"))
            if len(files) != world:
                error = f"checkpoint {path} was written by {len(files)} ranks; this run has {world}"
            else:
                try:
                    box = [read(path / "state.pt")]
                    per_rank = [read(path / f"rank{r}.pt") for r in range(world)]
                except NfabError as exc:  # said on every rank, never a peer left waiting
                    error = str(exc)
        box = [{"error": error}] if error else box
    dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        return None
    if "error" in box[0]:
        raise NfabError(box[0]["error"])
    mine: list[Any] = [None]
    dist.scatter_object_list(mine, per_rank, src=0)
    return box[0], mine[0]
