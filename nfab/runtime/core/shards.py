"""Shard layouts: where each parameter's gradient lies in an FSDP2 reduce-scatter input.

FSDP2 (`fully_shard`) reduces one param group's gradients with ONE reduce-scatter. Its input is
the group's flat gradient viewed (W, C): row r (the chunk rank r receives) is the padded dim-0
shards of the group's parameters, concatenated in the group's order. A parameter with d0 rows of
`row_numel` elements is padded to ceil(d0 / W) rows per rank: rank r's share holds its real rows
(possibly none) and then zeros. The comm that FSDP2 calls sees only the flat tensors, so the
layout is derived once at attach from the group's parameters (`FSDPParam.padded_sharded_param_size`
and the unsharded size) and checked against the input's size on every call.

A `ShardLayout` gives the controller a `BucketPlan` over ONE row (every row has the same slice
table: offsets within the chunk), and each lossy codec the segments of every row: a parameter's
real elements and its padding are separate segments, so a block never mixes them and the
padding (zero on every rank) encodes to an all-zero block that decodes to exactly 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from nfab.runtime.core.plan import BucketPlan, Slice


@dataclass(frozen=True, slots=True)
class ShardParam:
    """One parameter inside a row of the reduce-scatter input."""

    name: str
    region: str
    offset: int
    """Element offset of this parameter's share inside a row (the same in every row)."""
    shard_numel: int
    """Elements of one rank's padded dim-0 shard."""
    numel: int
    """Elements of the whole (unsharded) parameter."""

    def real(self, rank: int) -> int:
        """Real (non-padding) elements of rank `rank`'s share: shards are whole dim-0 rows, in rank order."""
        return max(0, min(self.shard_numel, self.numel - rank * self.shard_numel))


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """The reduce-scatter input of one FSDP2 param group: W rows of `chunk` elements."""

    params: tuple[ShardParam, ...]
    world_size: int
    chunk: int

    @property
    def numel(self) -> int:
        """Elements of the whole input (W * chunk)."""
        return self.world_size * self.chunk

    def plan(self) -> BucketPlan:
        """One row's slice table, for the controller (a slice per parameter, its padded share)."""
        slices = tuple(Slice(p.offset, p.shard_numel, p.name, p.region) for p in self.params)
        key = tuple(hash(p.name) for p in self.params)
        return BucketPlan(key, slices, self.chunk)

    def by_name(self) -> dict[str, ShardParam]:
        return {p.name: p for p in self.params}

    def real_elements(self) -> int:
        """Real gradient elements of the group (the baseline's element count, padding aside)."""
        return sum(p.numel for p in self.params)


def build_layout(entries: list[tuple[str, str, int, int]], world_size: int) -> ShardLayout:
    """A layout from (name, region, padded shard numel, unsharded numel) in the group's order."""
    params, offset = [], 0
    for name, region, shard_numel, numel in entries:
        params.append(ShardParam(name, region, offset, shard_numel, numel))
        offset += shard_numel
    return ShardLayout(tuple(params), world_size, offset)


def row_segments(layout: ShardLayout, names: tuple[str, ...], rank: int, padded: int) -> list[int]:
    """The segment lengths of row `rank` of a group of parameters (`names`, in row order) copied
    into `padded` elements: each parameter's real part, its padding, then the row's tail (zero-length
    segments left out). Every rank computes the same lengths for a row."""
    by_name = layout.by_name()
    out: list[int] = []
    total = 0
    for name in names:
        p = by_name[name]
        real = p.real(rank)
        out.extend(n for n in (real, p.shard_numel - real) if n)
        total += p.shard_numel
    if padded > total:
        out.append(padded - total)
    return out


def row_sources(layout: ShardLayout, names: tuple[str, ...], padded: int) -> list[tuple[int, int]]:
    """Where every segment of `row_segments` (rows 0..W-1, in order) lies in the flat (W, chunk)
    input: (start, length), start -1 for the row's tail (nothing to read). A codec that reads the
    segments there needs no copy of the group's columns padded to `padded`."""
    by_name = layout.by_name()
    out: list[tuple[int, int]] = []
    for r in range(layout.world_size):
        total = 0
        for name in names:
            p = by_name[name]
            real, at = p.real(r), r * layout.chunk + p.offset
            out.extend((start, n) for start, n in ((at, real), (at + real, p.shard_numel - real)) if n)
            total += p.shard_numel
        if padded > total:
            out.append((-1, padded - total))
    return out
