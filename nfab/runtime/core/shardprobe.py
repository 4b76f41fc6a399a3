"""Fidelity probes of FSDP2's reduce-scatter: each rank compares its own shard, the ranks add their sums.

On DDP every rank decodes the whole bucket, so a probe all-reduces an FP32 sample and every rank
compares the same values. Under FSDP2 a rank decodes only its row of the group's input (its
shard), so a probe of a lossy group

1. samples the same columns of every row (every k-th element of each probed parameter's share of
   a row: about PARAM_SAMPLES / W from each of its W rows, as many elements of the parameter as
   DDP's probe samples), a (W, S) FP32 matrix taken before the group is encoded;
2. reduce-scatters it (SUM, launched before the group's low-bit collectives): this rank's row of
   the exact FP32 sum at those columns, divided by W for the mean;
3. compares it with the same columns of the row this rank decoded (its mean, before FSDP2's op
   factor): per parameter, the sums of `fidelity.STAT_FIELDS` over this rank's shard, left on the
   device until the step's fold reads them with the control words;
4. at the fold, adds them per region (`fidelity.region_sums`): this rank's share of the probe.

A cosine of shards is not the cosine of the whole; sums are. So the ranks' per-region sums ride
the next step's first control word (all-gathered with it, no collective of their own), and every
rank adds the W ranks' sums in rank order (`agree`): the whole sample's sums and cosine, the same
bits on every rank. A probe's verdict thus arrives one step after the probe, as on DDP (where the
probe's fidelity also rides the next step's first word), and health acts on it at that step's fold:
a shadow window demotes only a region the ranks' added sums find unfaithful, on every rank alike.

The FSDP2 front end quantizes block routes in plain space (it holds no preconditioner), so its
probes compare in plain space too; the drift monitor, which reads only preconditioned fidelity,
does not act on FSDP2.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.distributed as dist

from nfab.runtime.control import fidelity
from nfab.runtime.control.controller import Group
from nfab.runtime.control.fidelity import RegionSums
from nfab.runtime.core import rowscatter
from nfab.wire.contract import allgather_factor, reduce_scatter_flat


def row_samples(world_size: int) -> int:
    """Samples of each parameter's share of one row: PARAM_SAMPLES over the W rows."""
    return max(1, -(-fidelity.PARAM_SAMPLES // world_size))


@dataclass(frozen=True, slots=True)
class ShardProbe:
    """One lossy group's probe in flight: where its sample lies and this rank's FP32 reference."""

    layout: fidelity.SampleLayout
    """Sampled columns of the group's (concatenated) slices, the same in every row."""
    slices: tuple[tuple[str, str], ...]
    """(name, region) of the group's slices, in order."""
    ref: torch.Tensor
    """This rank's row of the FP32 sum of the sample (filled when `work` completes)."""
    work: Any
    wire_bytes: float
    """Bytes this rank sends for the reference (a ring reduce-scatter of the (W, S) sample)."""


@lru_cache(maxsize=1024)
def chunk_columns(lengths: tuple[int, ...], offsets: tuple[int, ...], mask: tuple[bool, ...], per_slice: int,
                  device: torch.device) -> torch.Tensor:
    """The columns of the module's chunk a group's probe samples: `fidelity.sample_layout`'s elements
    (every k-th of each masked slice, in slice order), where each slice lies (`offsets`) rather than
    where it sits in the concatenated group. Made on the device from host numbers (no device read)."""
    parts = [torch.arange(off, off + n, fidelity.param_stride(n, per_slice), dtype=torch.int64, device=device)
             for n, off, m in zip(lengths, offsets, mask, strict=True) if m]
    return torch.cat(parts)


def launch(rows: torch.Tensor, group: Group, probing: frozenset[str], world_size: int,
           pg: dist.ProcessGroup | None) -> ShardProbe | None:
    """Sample a lossy group's slices in the module's rows `rows` (W, C) where `probing` asks, and launch
    the reduce-scatter of the FP32 sample; None when no slice is probed."""
    mask = fidelity.probe_mask([s.region for s in group.slices], probing)
    if mask is None:
        return None
    layout = fidelity.sample_layout(group.lengths, rows.device, mask, row_samples(world_size))
    cols = layout.src if group.whole else chunk_columns(group.lengths, tuple(int(o) for o in group.offsets), mask,
                                                        row_samples(world_size), rows.device)
    sample = rows.index_select(1, cols).to(torch.float32).contiguous()  # (W, S), before the codec reads the rows
    ref = torch.empty(layout.numel, dtype=torch.float32, device=rows.device)
    work = reduce_scatter_flat(ref, sample.view(-1), op=dist.ReduceOp.SUM, group=pg, async_op=True)
    return ShardProbe(layout, tuple((s.name, s.region) for s in group.slices), ref, work,
                      rowscatter.plain_bytes(layout.numel, world_size, 4))


def compare(probe: ShardProbe, row: torch.Tensor, world_size: int) -> tuple[tuple, torch.Tensor]:
    """The probe's per-parameter sums (`fidelity.bucket_probe`): `row`, this rank's decoded mean of the
    group's slices (before FSDP2's op factor), against the FP32 mean, at the sampled columns."""
    probe.work.wait()
    est = row.index_select(0, probe.layout.src)
    return fidelity.bucket_probe(est, probe.ref.div_(world_size), probe.slices, probe.layout, None)


def word_values(sums: dict[str, RegionSums], device: torch.device) -> tuple[tuple[str, ...], torch.Tensor]:
    """This rank's per-region sums as control-word values (regions sorted, `fidelity.SUM_FIELDS` each),
    on `device` (host values made at the fold: copied without waiting for the device)."""
    names = tuple(sorted(sums))
    vals = [v for r in names for v in sums[r].as_row()]
    return names, torch.tensor(vals, dtype=torch.float32, device="cpu").to(device, non_blocking=True)


def word_bytes(regions: int, world_size: int) -> float:
    """Bytes one rank sends for `regions` regions' sums riding an all-gathered control word."""
    return allgather_factor(world_size) * regions * len(fidelity.SUM_FIELDS) * 4


def agree(rows: Sequence[Sequence[float]], names: Sequence[str], start: int) -> dict[str, RegionSums]:
    """Every rank's per-region sums read from the gathered word (`rows`: one per rank, the sums of
    `names` from column `start`), added in rank order: the whole probe's sums, identical on every rank."""
    k = len(fidelity.SUM_FIELDS)
    parts = [{region: RegionSums.from_row(row[start + i * k : start + (i + 1) * k]) for i, region in enumerate(names)}
             for row in rows]
    return fidelity.add_sums(parts)


def carried_state(sums: dict[str, RegionSums]) -> dict[str, list[float]]:
    """The sums the next step's first word will carry, for a checkpoint."""
    return {r: s.as_row() for r, s in sorted(sums.items())}


def load_carried(state: dict[str, Sequence[float]] | None) -> dict[str, RegionSums]:
    """`carried_state`'s inverse (absent in states saved before FSDP2 probes: nothing carried)."""
    return {r: RegionSums.from_row(v) for r, v in (state or {}).items()}
