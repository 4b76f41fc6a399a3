"""Exact qsum scale agreement, launched early and waited for late.

A summed qsum group (q8/q4/q2 in exact mode, and every block-scaled `bq` group) needs one
scale every rank encodes with: the MAX over ranks of each rank's local scale. Agreeing it
with a blocking all-reduce inside the group's encode made the hook body wait a full round
trip per group (on a shared 2-core host: 1-7 ms, mostly the other rank arriving later).

Here a bucket's agreements are launched as ONE asynchronous MAX all-reduce per dtype
(uint8 block codes; fp32 max |x|), from the hook body, before any of the bucket's groups
is encoded; the values are read when a group's encode needs them (`Agreement.wait`). MAX
is elementwise, so batching the groups gives exactly the codes each group's own MAX gives:
the encoded bits are those of the blocking agreement (calibration's replay). Every rank
launches the same collectives in the same order: which groups agree is a function of the
bucket's routes and the agreed scale history, never of a rank's values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nfab.wire.registry import REDUCERS, allreduce_factor


@dataclass(frozen=True, slots=True)
class Batch:
    """One dtype's agreement: its MAX all-reduce (in flight until waited for) and its groups."""

    values: torch.Tensor
    """Every group's local scales of this dtype, concatenated: the MAX lands here in place."""
    work: dist.Work
    members: tuple[tuple[int, int, int], ...]
    """(group position in the bucket, start, length) of each group's part of `values`."""


@dataclass(frozen=True, slots=True)
class Agreement:
    """A bucket's scale agreements in flight: one `Batch` per dtype."""

    batches: tuple[Batch, ...]
    rounds: int
    """Collectives launched (one per dtype)."""
    wire_bytes: float

    def wait(self, groups: int) -> list[torch.Tensor | None]:
        """The agreed scales by group position (None for a group that agreed nothing); waits
        for the collectives (on an accelerator, the current stream waits, not the host)."""
        out: list[torch.Tensor | None] = [None] * groups
        for b in self.batches:
            b.work.wait()
            for pos, start, length in b.members:
                out[pos] = b.values[start : start + length]
        return out


def launch(inputs: Sequence[tuple[str, torch.Tensor] | None], world_size: int,
           group: dist.ProcessGroup | None) -> Agreement | None:
    """Launch the MAX of every group's local scale (`inputs` by group position: the group's
    reducer key and its `local_scale`, or None); None when no group needs one."""
    by_dtype: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
    for pos, item in enumerate(inputs):
        if item is not None:
            key, local = item
            codes = REDUCERS[key].agree_input(local)
            by_dtype.setdefault(codes.dtype, []).append((pos, codes.reshape(-1)))
    if not by_dtype:
        return None
    batches, nbytes = [], 0.0
    for parts in by_dtype.values():
        values = torch.cat([t for _, t in parts])  # a new tensor: the locals stay as they are
        members, start = [], 0
        for pos, t in parts:
            members.append((pos, start, t.numel()))
            start += t.numel()
        work = dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group, async_op=True)
        batches.append(Batch(values, work, tuple(members)))
        nbytes += allreduce_factor(world_size) * values.numel() * values.element_size()
    return Agreement(tuple(batches), len(batches), nbytes)
