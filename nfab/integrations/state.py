"""nfab's hook state inside a framework's checkpoint: every rank's, restored on its own rank.

A `Runtime`'s state (`Runtime.state_dict`: step, health, qsum amax history, and the
error-feedback residuals) differs from rank to rank: the residuals are what each rank's
own compression dropped. Frameworks write their checkpoint on rank 0 only, so a checkpoint
that held rank 0's state alone would resume every other rank with the wrong residuals.

- `RankStates`: an object with `state_dict()` / `load_state_dict()` for checkpoints one rank
  writes (Lightning, Accelerate): `state_dict()` all-gathers every rank's state (a
  collective: every rank calls it, as these frameworks do while saving), and
  `load_state_dict()` takes this rank's entry.
- `save_rank_file` / `load_rank_file`: one file per rank in a checkpoint folder (the
  Transformers Trainer, which saves RNG states the same way), written temp + rename.

Residuals travel on the CPU and are restored onto their parameter's device.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nfab.errors import NfabError
from nfab.fsutil import atomic_write_bytes
from nfab.runtime.frontends.ddp import Runtime

KEY = "nfab"
"""The key nfab's state goes under in a checkpoint dictionary."""
VERSION = 1


def restore(runtime: Runtime, blob: dict[str, Any]) -> None:
    """Load this rank's entry of `blob` (from `RankStates.state_dict`) into `runtime`."""
    if not isinstance(blob, dict) or blob.get("version") != VERSION or "ranks" not in blob:
        raise NfabError(f"not an nfab checkpoint state (version {VERSION} expected)")
    saved = int(blob["world_size"])
    if saved != runtime.world_size:
        raise NfabError(f"nfab state was saved at world size {saved}, resumed at {runtime.world_size}: "
                        f"error-feedback residuals are per rank and cannot be redistributed")
    runtime.load_state_dict(dict(blob["ranks"][runtime.rank]))


class RankStates:
    """Every rank's `Runtime` state as one checkpointable object (see the module doc)."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def state_dict(self) -> dict[str, Any]:
        """Every rank's state, by rank. A collective: call it on every rank."""
        rt = self.runtime
        every: list[Any] = [None] * rt.world_size
        dist.all_gather_object(every, rt.state_dict(), group=rt.group)
        return {"version": VERSION, "world_size": rt.world_size, "ranks": every}

    def load_state_dict(self, blob: dict[str, Any]) -> None:
        restore(self.runtime, blob)


def rank_file(folder: str | Path, rank: int) -> Path:
    return Path(folder) / f"nfab_state_rank{rank}.pt"


def save_rank_file(runtime: Runtime, folder: str | Path) -> Path:
    """Write this rank's state into `folder` (temp file + rename); every rank writes its own."""
    buf = io.BytesIO()
    blob = {"version": VERSION, "world_size": runtime.world_size, "rank": runtime.rank,
            "state": runtime.state_dict()}
    torch.save(blob, buf)
    Path(folder).mkdir(parents=True, exist_ok=True)
    return atomic_write_bytes(rank_file(folder, runtime.rank), buf.getvalue())


def load_rank_file(runtime: Runtime, folder: str | Path) -> bool:
    """Restore this rank's state from `folder`; False when the folder holds none."""
    path = rank_file(folder, runtime.rank)
    if not path.is_file():
        return False
    blob = torch.load(path, map_location="cpu", weights_only=True)
    ranks: list[Any] = [None] * int(blob["world_size"])
    ranks[int(blob["rank"])] = blob["state"]
    restore(runtime, {"version": blob["version"], "world_size": blob["world_size"], "ranks": ranks})
    return True
