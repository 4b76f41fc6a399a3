"""Coalescing: a bucket's control word and every group's payload as the bytes of ONE all-gather.

Beside a signgather group (whose payload is an all-gather anyway) the other payloads can
ride the same collective: each rank then combines the W copies of each payload as its
own collective would have (`Reducer.combine`: the integer lane SUM for qsum, rank-order
sums for fp32/bf16, the rows for signgather), so results match the per-group path on
every rank. Pure functions: the decision, packing a row, and reading parts back out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nfab.runtime import reads
from nfab.runtime.control.controller import Group
from nfab.wire.cost import CostModel
from nfab.wire.registry import REDUCERS, allgather_factor

SIGNGATHER = "signgather"
ALIGN = 8
"""Every part starts at a multiple of 8 bytes, so any payload dtype can be viewed in place."""


@dataclass(frozen=True, slots=True)
class Part:
    """Where one tensor's bytes sit in each rank's row of the coalesced all-gather."""

    offset: int
    nbytes: int
    dtype: torch.dtype

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        """This part of every rank's row, as a (W, numel) view of its dtype (no copy: rows are
        whole multiples of 8 bytes and parts start at one, so any dtype's view lines up)."""
        return reads.of(rows.device).part_rows(rows, self.offset, self.nbytes, self.dtype)


def should_coalesce(groups: Sequence[Group], world_size: int, enabled: bool, cost_model: CostModel | None) -> bool:
    """Send the bucket as one all-gather? Only beside a signgather group, and only when
    gathering the other payloads (W-1 copies instead of a ring all-reduce's 2(W-1)/W) adds
    no bytes (W=2, or nothing else to send) or, under a cost model, costs less wire time
    than the collectives it saves."""
    if not enabled or not any(g.key == SIGNGATHER for g in groups):
        return False
    w = world_size
    others = [g for g in groups if g.key != SIGNGATHER]
    extra = sum((allgather_factor(w) - REDUCERS[g.key].collective_factor(w)) * REDUCERS[g.key].payload_bytes(
        g.numel, w) for g in others)
    if extra <= 0:
        return True
    if cost_model is None:  # no link model: never send more bytes (as sign then picks by bytes)
        return False
    saved = cost_model.allgather.latency_s + cost_model.allreduce.latency_s * len(others)
    return extra / cost_model.allgather.bandwidth_bps < saved


def pack(tensors: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, list[Part]]:
    """One uint8 row holding every tensor's bytes at 8-byte aligned offsets, and where each sits
    (zero bytes between them and to the row's end, a whole multiple of 8)."""
    parts, end = _layout(tensors)
    row = reads.of(device).pack_row(tensors, [p.offset for p in parts], _gap_ends(parts, end), device)
    return row, parts


def _layout(tensors: Sequence[torch.Tensor]) -> tuple[list[Part], int]:
    """Each tensor's place in the row (8-byte aligned) and the row's length, a whole multiple
    of 8 bytes (`Part.rows` views need no copy)."""
    parts: list[Part] = []
    at = 0
    for t in tensors:
        parts.append(Part(at, t.numel() * t.element_size(), t.dtype))
        at = -(-(at + parts[-1].nbytes) // ALIGN) * ALIGN
    return parts, at


def _gap_ends(parts: list[Part], end: int) -> list[int]:
    """Where the zero bytes after each part end: the next part's offset, or the row's end."""
    return [p.offset for p in parts[1:]] + [end]

