"""Per-block work on the torch path as 2-D views, not per-element index tensors.

Why: the torch path (what CUDA takes, and CPU under `NFAB_HOST_KERNELS=0`) once expanded the
block scales to every element with a gather through an int64 block id per element: 8 bytes
read per element per use, three uses per step, 6 ms per 4M elements on one core where a
copy takes 0.6 ms. A bucket's blocks are rows: within a segment, its full blocks are the rows
of a (blocks, block) view and its tail one short row; where every segment but the last holds
whole blocks (the usual case: hidden sizes are multiples of 64), the whole bucket is one
(blocks, block) view and a tail. A per-block value then reaches its elements by broadcasting
(`[:, None]`), and a block's max is one row reduction: no index tensor, a few kernels per
bucket, the same values (broadcasting and gathering read the same scale).

Layouts that would need many views (many small unaligned segments) return None from
`pieces`: callers keep the gather there.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

MAX_PIECES = 16
"""Beyond this many views per bucket, one gather pass beats a kernel per view."""


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements [start, start + rows * width) as a (rows, width) view whose row r is block first_block + r."""

    start: int
    rows: int
    width: int
    first_block: int

    @property
    def stop(self) -> int:
        return self.start + self.rows * self.width


@lru_cache(maxsize=256)
def pieces(lengths: tuple[int, ...], block: int) -> tuple[Piece, ...] | None:
    """The views covering a bucket of segments `lengths` (blocks restart per segment), full blocks
    of consecutive segments merged into one view; None when more than MAX_PIECES."""
    out: list[Piece] = []
    at = first = 0
    for n in lengths:
        full, tail = divmod(n, block)
        if full:
            last = out[-1] if out else None
            if last is not None and last.width == block and last.stop == at:
                out[-1] = Piece(last.start, last.rows + full, block, last.first_block)
            else:
                out.append(Piece(at, full, block, first))
            at, first = at + full * block, first + full
        if tail:
            out.append(Piece(at, 1, tail, first))
            at, first = at + tail, first + 1
        if len(out) > MAX_PIECES:
            return None
    return tuple(out)


def rows(flat: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The (rows, width) view of `flat` (1-D, contiguous) that `piece` names."""
    return flat[piece.start : piece.stop].view(piece.rows, piece.width)


def column(per_block: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The per-block values of `piece`'s rows as a (rows, 1) column, to broadcast over a row."""
    return per_block[piece.first_block : piece.first_block + piece.rows].unsqueeze(1)


def block_amax(x: torch.Tensor, parts: tuple[Piece, ...], nblocks: int) -> torch.Tensor:
    """max |x| of every block (fp32), one row reduction per view (|x| then amax: the inf-norm over
    rows, `vector_norm(dim=1)`, ran 30x slower on CPU). Max is exact, so bf16/fp16 widen after it."""
    out = torch.zeros(nblocks, dtype=torch.float32, device=x.device)
    for p in parts:
        out[p.first_block : p.first_block + p.rows] = rows(x, p).abs().amax(1)
    return out


def mul_blocks_(flat: torch.Tensor, per_block: torch.Tensor, parts: tuple[Piece, ...]) -> torch.Tensor:
    """flat *= its block's value, in place (fl(x * s) per element, as a gathered scale gives)."""
    for p in parts:
        rows(flat, p).mul_(column(per_block, p))
    return flat


def div_blocks(x: torch.Tensor, per_block: torch.Tensor, parts: tuple[Piece, ...], out: torch.Tensor) -> torch.Tensor:
    """out = x / its block's value (fp32 `out`; a bf16/fp16 `x` widens exactly on the way)."""
    for p in parts:
        torch.div(rows(x, p), column(per_block, p), out=rows(out, p))
    return out


CACHED_INDEX = 1 << 20
"""Layouts of at most this many elements keep their per-element block index (8 MB of int64 at most);
larger ones, such as an FSDP2 module's W rows of segments (always past `MAX_PIECES`), keep only their
blocks' sizes and expand them on the device at each call: 256 kept indexes of whole modules came to
about twice the model's fp32 gradient in GPU memory."""


def block_index(lengths: tuple[int, ...], block: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Block id (int64) of every element of the concatenated segments (blocks restart per segment),
    on `device`, and the number of blocks: kept per layout up to `CACHED_INDEX` elements, else each
    block's id repeated by its size on the device (no host read: the total size is given)."""
    if sum(lengths) <= CACHED_INDEX:
        return _kept_block_index(lengths, block, device)
    sizes = block_sizes(lengths, block, device)
    ids = torch.arange(sizes.numel(), dtype=torch.int64, device=device)
    return torch.repeat_interleave(ids, sizes, output_size=sum(lengths)), sizes.numel()


@lru_cache(maxsize=256)
def block_sizes(lengths: tuple[int, ...], block: int, device: torch.device) -> torch.Tensor:
    """Every block's element count (int64, on `device`, made once per layout): `block`, and each
    segment's short last block."""
    per_segment = [torch.tensor([block] * (n // block) + ([n % block] if n % block else []), dtype=torch.int64)
                   for n in lengths]
    out = torch.cat(per_segment) if per_segment else torch.empty(0, dtype=torch.int64)
    return out.to(device, non_blocking=True)


@lru_cache(maxsize=256)
def _kept_block_index(lengths: tuple[int, ...], block: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """`block_index` of a small layout: made on the host once and copied without waiting for the device."""
    index, blocks = host_block_index(lengths, block)
    return index.to(device, non_blocking=True), blocks


def host_block_index(lengths: tuple[int, ...], block: int) -> tuple[torch.Tensor, int]:
    """`block_index` built on the host, element by element (int64), and the number of blocks."""
    ids, start = [], 0
    for n in lengths:
        ids.append(torch.arange(n, dtype=torch.int64, device="cpu") // block + start)
        start += -(-n // block)
    return (torch.cat(ids) if ids else torch.empty(0, dtype=torch.int64, device="cpu")), start
