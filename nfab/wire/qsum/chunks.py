"""The chunked lane order (`lanes.chunked_layout`) as traced functions for `torch.compile`.

Lane l of a chunk's containers is a contiguous row of elements, so a (chunks, lanes, g) view of
the values and a (chunks, g) view of the containers line up: packing ORs `lanes` shifted rows
into a row of containers, unpacking writes each lane's row, every load and store contiguous
along g (inductor's C++ vectorises it; a GPU coalesces it). The whole chunks are one view, the
last, shorter chunk another (`lanes.chunk_rows`), the same graph for both (`dynamic=True`).
`tests/wire/test_chunked.py` holds them to `lanes.pack` / `lanes.unpack`.
"""

from __future__ import annotations

from functools import cache

import torch

from nfab.wire import fusion
from nfab.wire.qsum.lanes import LaneLayout, chunk_rows


def lane_dtype(layout: LaneLayout) -> torch.dtype:
    """The narrowest integer dtype that holds a lane value: uint8 up to 8-bit lanes."""
    if layout.lane_bits <= 8:
        return torch.uint8
    return torch.int32 if layout.lane_bits <= 31 else torch.int64


def lane_values(c: torch.Tensor, layout: LaneLayout) -> torch.Tensor:
    """The (chunks, lanes, g) lane values of (chunks, g) containers `c` (traced; int32, or int64 for
    lanes past 31 bits): one broadcast shift by a lane's offset, computed from the index (a stack
    of per-lane rows ran 2x slower on one CPU core)."""
    s, top = fusion.static(layout.lane_bits), fusion.static(layout.max_value)
    wide = c.to(torch.int32) if c.dtype == torch.uint8 else c  # uint8 shifts ran scalar (4x slower)
    offsets = torch.arange(fusion.static(layout.lanes), dtype=wide.dtype, device=c.device).view(1, -1, 1) * s
    values = (wide.unsqueeze(1) >> offsets) & top
    return values.to(torch.int32) if layout.lane_bits <= 31 else values


def widened(values: torch.Tensor, container: torch.dtype) -> torch.Tensor:
    """`values` as `container`; uint8 through int32 (straight to int64 inductor's C++ ran it scalar)."""
    return values.to(torch.int32).to(container) if values.dtype == torch.uint8 else values.to(container)


@cache
def pack_rows_fn(layout: LaneLayout):
    """(chunks, g) containers from the (chunks, lanes, g) values of whole chunks (one graph per layout)."""

    def pack_rows(out: torch.Tensor, values: torch.Tensor) -> None:
        s = fusion.static(layout.lane_bits)
        acc = widened(values[:, 0], layout.container)
        for lane in range(1, fusion.static(layout.lanes)):
            acc = acc | (widened(values[:, lane], layout.container) << (lane * s))
        out.copy_(acc)

    return pack_rows


@cache
def unpack_rows_fn(layout: LaneLayout):
    """The (chunks, lanes, g) lane values of (chunks, g) containers (one graph per layout)."""

    def unpack_rows(out: torch.Tensor, c: torch.Tensor) -> None:
        out.copy_(lane_values(c, layout).to(out.dtype))

    return unpack_rows


def pack(values: torch.Tensor, layout: LaneLayout) -> torch.Tensor | None:
    """`lanes.pack` of the 1-D non-negative integers `values` in a chunked layout (compiled), or None
    when compiling failed (`pack_chunks`)."""
    return pack_chunks(values, layout.lanes, layout.chunk, layout.container, pack_rows_fn(layout))


def pack_chunks(values: torch.Tensor, k: int, g: int, container: torch.dtype, rows_fn,
                out: torch.Tensor | None = None) -> torch.Tensor | None:
    """The containers of `values` (1-D) in chunks of g containers of k lanes or digits (into `out`
    when given: ceil(n / k) of `container`), each view of whole chunks packed by the traced
    `rows_fn(out (chunks, g'), values (chunks, k, g'))`; None when compiling failed. The chunks
    whose elements all lie in `values` are read in place, the rest (at most two chunks) from a
    zero-padded copy of their few values."""
    v = values.reshape(-1)
    n = v.numel()
    m = -(-n // k)
    out = torch.empty(m, dtype=container, device=v.device) if out is None else out
    whole = n // (g * k)
    parts = [(0, v[: whole * g * k].view(whole, k, g))] if whole else []
    if m > whole * g:  # one op: a zero-padded copy of the last few values
        rest = torch.nn.functional.pad(v[whole * g * k :], (0, m * k - n))
        parts += [(whole * g + c0, rows) for c0, rows in chunk_rows(rest, k, g, m - whole * g)]
    for c0, rows in parts:
        dest = out[c0 : c0 + rows.shape[0] * rows.shape[2]].view(rows.shape[0], rows.shape[2])
        if fusion.run(rows_fn, dest, rows) is None and fusion.failed():
            return None
    return out


def unpack(c: torch.Tensor, layout: LaneLayout) -> torch.Tensor | None:
    """The m * lanes lane values (`lane_dtype`, element order) of the m containers `c` of a chunked
    layout (compiled), or None when compiling failed."""
    return unpack_chunks(c, layout.lanes, layout.chunk, lane_dtype(layout), unpack_rows_fn(layout))


def unpack_chunks(c: torch.Tensor, k: int, g: int, dtype: torch.dtype, rows_fn) -> torch.Tensor | None:
    """The m * k values (`dtype`, element order) of the m containers `c` in chunks of g, each view
    of whole chunks unpacked by the traced `rows_fn(out (chunks, k, g'), c (chunks, g'))`; None when
    compiling failed."""
    c = c.reshape(-1)
    m = c.numel()
    out = torch.empty(m * k, dtype=dtype, device=c.device)
    for c0, rows in chunk_rows(out, k, g, m):
        src = c[c0 : c0 + rows.shape[0] * rows.shape[2]].view(rows.shape[0], rows.shape[2])
        if fusion.run(rows_fn, rows, src) is None and fusion.failed():
            return None
    return out

