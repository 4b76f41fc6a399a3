"""Integer lanes: several small non-negative integers packed into one machine integer.

Each lane holds one value in [0, 2**lane_bits). A container (uint8, int32 or int64)
holds `lanes` lanes side by side. When every rank's lane values are bounded so that the
*sum over W ranks* still fits in `lane_bits`, a plain integer all_reduce(SUM) of the
containers adds every lane exactly: no carry ever crosses from one lane into the next.
That turns a collective every backend has (ring, tree, gloo, NCCL) into W-way exact
counting, with no parameter server.

Signed containers keep their top bit clear (31 usable bits of int32, 63 of int64), so a
sum never wraps into the sign bit.

Element order. A container's lanes are split into *blocks* of at most 8 lanes (uint8
containers are one block). Block k holds lanes [l0, l1) and the element range
[m*l0, m*l1) of the m containers, container-major: element m*l0 + j*(l1-l0) + (l-l0)
sits in lane l of container j. For uint8 containers that is plain consecutive order.
The blocking lets a CPU kernel build a block from 8 consecutive votes with one table
lookup.

*Chunked* layouts (`chunk` > 0: blockq's all-reduce lanes, `chunked_layout`) order elements
by chunks of `chunk` containers instead: in the chunk of g containers starting at container c0
(g = chunk, less for the last), lane l of container c0 + j holds element lanes * c0 + l * g + j.
A chunk holds a contiguous run of elements, lane-major, so packing reads `lanes` contiguous
rows and unpacking writes them: every load and store of a kernel contiguous (a CPU's vectors, a
GPU's coalesced accesses), no transposing copy, and with 64-element chunks a row is one
64-element scale block, so the decode's unpacking and scaling are one pass.

This module is the reference: torch ops on any device. The compiled CPU paths (`qsum/host.py`,
`sign/host.py`, `qsum/chunk_kernels.py`) produce identical containers and values, and tests hold
them to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cache, lru_cache

import torch

# (dtype, usable bits) in order of preference when two pack equally densely.
_CONTAINERS: tuple[tuple[torch.dtype, int, int], ...] = (
    (torch.uint8, 8, 8),  # dtype, usable bits, storage bits
    (torch.int32, 31, 32),
    (torch.int64, 63, 64),
)


@dataclass(frozen=True, slots=True)
class LaneLayout:
    """How lanes of `lane_bits` bits sit in a container dtype."""

    lane_bits: int
    container: torch.dtype
    lanes: int
    storage_bits: int
    chunk: int = 0
    """Containers per chunk of the chunked element order (module docstring); 0: blocks of 8 lanes."""

    @property
    def max_value(self) -> int:
        """Largest value one lane can hold (and so the largest W-rank sum)."""
        return (1 << self.lane_bits) - 1

    @property
    def bits_per_element(self) -> float:
        """Wire bits per packed element, container padding included."""
        return self.storage_bits / self.lanes

    def containers_for(self, numel: int) -> int:
        """Number of containers needed for `numel` lane values."""
        return -(-numel // self.lanes)

    @property
    def blocks(self) -> tuple[tuple[int, int], ...]:
        """Lane ranges [l0, l1) of the element blocks (see the module docstring)."""
        return _blocks(self)


def count_lane_bits(world_size: int) -> int:
    """Lane width that holds a count in [0, W]: ceil(log2(W + 1))."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    return max(1, math.ceil(math.log2(world_size + 1)))


@cache
def layout_for(lane_bits: int) -> LaneLayout:
    """The densest container layout for lanes of `lane_bits` bits (1..63)."""
    if not 1 <= lane_bits <= 63:
        raise ValueError(f"lane width must be in 1..63 bits, got {lane_bits}")
    best: LaneLayout | None = None
    for dtype, usable, storage in _CONTAINERS:
        lanes = usable // lane_bits
        if lanes == 0:
            continue
        cand = LaneLayout(lane_bits, dtype, lanes, storage)
        if best is None or cand.bits_per_element < best.bits_per_element - 1e-9:
            best = cand
    assert best is not None
    return best


CHUNK = 64
"""Containers per chunk of `chunked_layout`s: one 64-element blockq scale block per lane row."""


@cache
def chunked_layout(lane_bits: int) -> LaneLayout:
    """`layout_for(lane_bits)` in the chunked element order (`CHUNK` containers a chunk) where a
    container holds several lanes (blockq's lanes sized for W: 4-bit lanes 2 to a byte, 5-bit 6 to
    an int32, 3-bit 21 to an int64, ...); one-lane layouts as they are. The same containers and
    bytes, another element order. qsum's and sign's lanes keep the plain order: their CPU kernels
    store two adjacent lanes' values in one word (qsum's q4 decode ran 1.33x slower chunked) or
    build a block of 8 lanes from a byte of votes by one table lookup."""
    base = layout_for(lane_bits)
    if base.lanes == 1:
        return base
    return replace(base, chunk=CHUNK)


def chunk_rows(flat: torch.Tensor, k: int, g: int, m: int) -> list[tuple[int, torch.Tensor]]:
    """(first container, (chunks, k, g') view) of the m * k elements `flat` of m containers of k lanes
    (or digits) in chunks of g containers: the whole chunks as one view, the last, shorter chunk as
    another (row [c, l] of a view: lane l of that chunk's containers, in element order)."""
    whole = m // g
    views = [(0, flat[: whole * g * k].view(whole, k, g))] if whole else []
    if m > whole * g:
        views.append((whole * g, flat[whole * g * k : m * k].view(1, k, m - whole * g)))
    return views


@cache
def _blocks(layout: LaneLayout) -> tuple[tuple[int, int], ...]:
    if layout.container == torch.uint8:
        return ((0, layout.lanes),)
    return tuple((l0, min(l0 + 8, layout.lanes)) for l0 in range(0, layout.lanes, 8))


def _lane_views(flat: torch.Tensor, layout: LaneLayout, m: int):
    """(lane, column view) for every lane of a flat tensor of m * lanes elements."""
    for l0, l1 in layout.blocks:
        grid = flat[m * l0 : m * l1].view(m, l1 - l0)
        for lane in range(l0, l1):
            yield lane, grid[:, lane - l0]


@lru_cache(maxsize=64)
def _lane_shifts(layout: LaneLayout, device: torch.device) -> torch.Tensor:
    """(1, lanes, 1) each lane's bit offset in the container dtype, on `device`: made once, so a
    chunked view packs or unpacks in a fixed few ops whatever its lane count."""
    offsets = torch.arange(layout.lanes, dtype=layout.container, device="cpu") * layout.lane_bits
    return offsets.view(1, -1, 1).to(device, non_blocking=True)


def pack(values: torch.Tensor, layout: LaneLayout) -> torch.Tensor:
    """Pack non-negative integers (each <= layout.max_value) into containers.

    `values` is any integer or bool tensor; it is flattened and zero-padded to a whole
    number of containers. Returns a 1-D tensor of `layout.container` dtype.
    """
    flat = values.reshape(-1)
    n = flat.numel()
    m = layout.containers_for(n)
    work = {torch.uint8: torch.uint8, torch.int32: torch.int32, torch.int64: torch.int64}[layout.container]
    padded = torch.zeros(m * layout.lanes, dtype=work, device=flat.device)
    padded[:n] = flat
    out = torch.zeros(m, dtype=work, device=flat.device)
    if layout.chunk:  # per view of chunks: every lane shifted by a broadcast offset, summed (disjoint bits)
        shifts = _lane_shifts(layout, flat.device)
        for c0, rows in chunk_rows(padded, layout.lanes, layout.chunk, m):
            dest = out[c0 : c0 + rows.shape[0] * rows.shape[2]].view(rows.shape[0], rows.shape[2])
            torch.sum(rows.to(shifts.dtype) << shifts, 1, dtype=shifts.dtype, out=dest)
        return out
    for lane, col in _lane_views(padded, layout, m):
        out |= col << (lane * layout.lane_bits)
    return out


def unpack(containers: torch.Tensor, layout: LaneLayout, numel: int) -> torch.Tensor:
    """Inverse of `pack` (also after an integer SUM): the first `numel` lane values.

    Returns int64 when the container is int64, else int32 (uint8 lanes come back as uint8).
    """
    mask = layout.max_value
    m = containers.numel()
    out = torch.empty(m * layout.lanes, dtype=containers.dtype, device=containers.device)
    if layout.chunk:  # per view of chunks: one broadcast shift, one mask
        shifts = _lane_shifts(layout, containers.device)
        for c0, rows in chunk_rows(out, layout.lanes, layout.chunk, m):
            src = containers[c0 : c0 + rows.shape[0] * rows.shape[2]].view(rows.shape[0], 1, rows.shape[2])
            torch.bitwise_and(src.to(shifts.dtype) >> shifts, mask, out=rows)
        return out[:numel]
    for lane, col in _lane_views(out, layout, m):
        torch.bitwise_and(containers >> (lane * layout.lane_bits), mask, out=col)
    return out[:numel]


def decode_table(
    containers: torch.Tensor, layout: LaneLayout, numel: int, values: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`values[lane value]` for the first `numel` lanes: unpack and look up in one go (fp32).

    `values` is a float32 table of length max_value + 1 (e.g. count -> vote). With `out`
    (fp32, `numel` elements) the result is written there and `out` is returned.
    """
    m = containers.numel()
    if m == 0 or numel == 0:
        if out is not None:
            return out.zero_()
        return torch.zeros(numel, dtype=torch.float32, device=containers.device)
    lanes = unpack(containers, layout, numel)
    res = values.to(torch.float32)[lanes.to(torch.int64)]
    if out is not None:
        return out.copy_(res.view(out.shape))
    return res


