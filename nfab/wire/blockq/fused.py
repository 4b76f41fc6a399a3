"""blockq's stages as whole `torch.compile`d functions (opt-in: `NFAB_COMPILE=1`; see `wire/fusion.py`).

Why: eager, blockq's encode is about twenty full passes over the bucket (the counter hash a
dozen of them) and its decode four; memory-bound, so a few hundredths of a copy. Compiled:

- `local_scale`: one row reduction per block view (max |x|) and the non-finite flag from the
  maxima, one graph;
- agreement: the scale codes (`table.codes_of`: exponent arithmetic) in one kernel over the blocks;
- encode: each block's divisor, counter base and key word in one small kernel over the blocks
  (`row_terms`); then, where the chunk rows are the bucket's first blocks (`packed_levels`), the
  keyed counter hash, the division by the block's agreed scale, the level arithmetic and the
  packing of the chunked lanes or radix digits in one kernel (`chunks.packed_levels_fn`: each lane
  or digit of a chunk a contiguous row of x; the noise and the levels never stored); elsewhere
  the levels in one kernel per block view, then packed (`blockq/chunks.py`, `qsum/chunks.py`);
- decode: where the chunk rows are the bucket's first blocks (a bucket that starts with a view of
  whole 64-element blocks), the containers unpacked and `(S * 2 / (M * W) - 1) * scale` stored
  into the bucket in one kernel (`decode_chunks`; radix digits after a small kernel splitting each
  container); elsewhere the lanes or digits unpacked, then scaled in one kernel per view.
  blockqscatter's own and summed shards keep the plain order (`qsum.fused`, `radix_unpack`:
  digits in groups of whole words after a transposing copy, `wire/digits.py`).

Fewer kernels ran slower on one CPU core: a container that reads its lanes' levels as a sum over
a short inner dimension, or a level kernel that finds its block's scale by an index expression,
vectorised badly (0.02-0.08x a copy, against 0.3-0.9x for each of the kernels above; measured
side by side, scratch script, 2026-12-03).

The functions are pure over (blocks, width) views (`grid.Piece`): a block's per-row values (its
scale code, its counter base, its key's high word) broadcast over its row, so there is no
data-dependent control flow and no host read, and `dynamic=True` serves every bucket size with
one graph per lane layout. They compute the eager path's bits, op for op:

- the hash: the Weyl counter of element i of segment s is `key_lo[s] + (i - start_s + 1) * G`
  (mod 2^32); for the element at column j of a block whose first element is i0 that is the
  row's base `key_lo[s] + (i0 - start_s + 1) * G` plus `j * G`: the same word;
- the level arithmetic in the eager order, `((x / s + 1) * (M / 2) + u)`, floor, clamp, and the
  decode's `(S * unit - 1) * scale`, with contraction switched off (`fusion.OPTIONS`);
- the lanes: the same containers as `lanes.pack` / `radix.pack` (integer sums of disjoint bits
  or of digits times powers: exact in any order).

`tests/wire/test_compiled.py` (NFAB_COMPILE_TESTS=1) checks every stage against the eager path bit
for bit. Any compile error falls back to eager (logged once) for the rest of the process.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache, lru_cache

import torch

from nfab.wire import digits, fusion, noise
from nfab.wire.blockq import chunks, grid, radix, table
from nfab.wire.blockq.radix import RadixLayout
from nfab.wire.qsum import fused as qsum_fused
from nfab.wire.qsum.lanes import LaneLayout

Layout = LaneLayout | RadixLayout


# ---- the compiled functions (pure) -----------------------------------------------------------
def block_max_rows(x: torch.Tensor) -> torch.Tensor:
    """max |x| of each row of a (blocks, width) view, fp32 (max is exact: bf16/fp16 widen after)."""
    return x.abs().amax(1).to(torch.float32)


def flagged(block_max: torch.Tensor) -> torch.Tensor:
    """`block_max` with block 0 set to NaN when any block max is non-finite (a row's amax keeps its
    NaN or inf): `local_scale`'s flag for the whole group, on the device."""
    bad = ~torch.isfinite(block_max).all()
    return torch.cat([torch.where(bad, torch.full_like(block_max[:1], float("nan")), block_max[:1]), block_max[1:]])


def flagged_block_max(x: torch.Tensor) -> torch.Tensor:
    """`block_max_rows` of one (blocks, width) view, `flagged`: one graph (six eager ops on the
    maxima took 0.15 ms per 64K blocks on one CPU core)."""
    return flagged(block_max_rows(x))


def _safe_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The divisor of each row: its agreed scale, 1 for an all-zero block ((rows, 1) fp32)."""
    return table.scales_of(codes, scales, 1.0).unsqueeze(1)


def _keyed(keys: torch.Tensor, seg: torch.Tensor, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row (int32 (rows, 1)): the keyed counter at its first element, its key's high word
    (`seg`, `first`: the row's segment, and its first element's index in it plus 1)."""
    key = keys[seg]
    base = ((key & 0xFFFFFFFF) + first * fusion.GOLDEN_I32) & 0xFFFFFFFF  # exact in int64: |first * G| < 2^63
    hi = (key >> 32) & 0xFFFFFFFF
    return fusion.as_i32(base).unsqueeze(1), fusion.as_i32(hi).unsqueeze(1)


def row_terms(codes: torch.Tensor, scales: torch.Tensor, keys: torch.Tensor, seg: torch.Tensor,
              first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block row ((rows, 1) each): its divisor (`_safe_rows`: `codes`, uint8, index `scales`)
    and its counters' base and high word (`_keyed`: `keys` int64 per segment; `seg`, `first` int64
    per row). One small kernel over the blocks, so the level kernel reads three values per row
    instead of redoing the gathers and the key arithmetic for every 16 elements (0.7 ms of 2.5 on
    4M elements)."""
    base, hi = _keyed(keys, seg, first)
    return _safe_rows(codes, scales), base, hi


def levels_into(out: torch.Tensor, x: torch.Tensor, safe: torch.Tensor, base: torch.Tensor, hi: torch.Tensor,
                shift: torch.Tensor, half_m: torch.Tensor, m: torch.Tensor, weyl: torch.Tensor) -> None:
    """Stochastically rounded levels (uint8, into `out`) of a (blocks, width) view `x` whose rows'
    `row_terms` are `safe`, `base`, `hi`; `shift` (1-element int32): the stratum's offset on the
    24-bit grid; `half_m`, `m`: 0-d fp32 M / 2 and M (tensors: one graph serves every route);
    `weyl`: `fusion.weyl(width)`, the counters' steps along a row."""
    out.copy_(fusion.levels_of(x, safe, (base + weyl) ^ hi, shift, half_m, m))


def _digit_width(layout: RadixLayout) -> int:
    """Bytes per unpacked digit (`chunks.digit_width`: uint8 up to radix 256, else int32)."""
    return chunks.digit_width(layout).itemsize


@cache
def radix_unpack_fn(layout: RadixLayout):
    """The digits of int64 containers as a traced function: (containers of each group, groups) --
    `digits.columns_fn` -- to (groups, words) int64 words holding the digits in element order
    (`digits.digit_words`, `width` bytes each: a uint8 or int32 view of them is the digits).
    `table`: float64 [R, R^-1, R^-2, ...].

    Per container, the numba kernel's arithmetic (`kernels._chunk_digits`), so the same integers:
    1. split c = hi * R^h + lo (h = k // 2): the quotient int(fl(c) * R^-h) is within one of
       floor(c / R^h) (R^h >= 2^12: three roundings err by less than 3 * 2^-53 * 2^63 / R^h < 1), and one
       correction each way makes it exact; both parts are then below 2^51 (`test_every_radix_
       splits_into_exact_float64_halves`);
    2. q_j = floor((v + 0.5) * R^-j) for a part v: (v + 0.5) / R^j lies at least 0.5 / R^j from an
       integer (odd over even), and the two roundings err by less than (v + 0.5) * 2^-52 / R^j,
       below that for v < 2^51, so the floor is floor(v / R^j);
    3. digit j = q_j - R * q_(j+1), exact in float64; shifted into its byte(s) of its word.
    Every load is a contiguous row and every operation a vector one; only the words are stored
    with a stride: 0.70-1.05 ms per 4M elements on one core plus 0.25-0.39 ms for `columns_fn`,
    against 3.0-4.3 ms for the digits as stacked uint8 columns of float64 divisions (the kernel
    before, which inductor ran scalar)."""
    k, r, h = layout.digits, layout.radix, layout.digits // 2
    split, width = fusion.static(r**h), _digit_width(layout)  # registered outside the trace (`fusion.static`)
    g, _ = digits.groups(k, width)

    def radix_digits(columns: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        base, cut = fusion.static(split), fusion.static(h)
        found = []
        for t in range(fusion.static(g)):
            c = columns[t]
            hi = (c.to(torch.float64) * table[cut]).to(torch.int64)
            lo = c - hi * base
            under = lo < 0
            lo, hi = torch.where(under, lo + base, lo), torch.where(under, hi - 1, hi)
            over = lo >= base
            lo, hi = torch.where(over, lo - base, lo), torch.where(over, hi + 1, hi)
            for part, count in ((lo, cut), (hi, fusion.static(k - h))):
                q, shifted = part.to(torch.float64), part.to(torch.float64) + 0.5
                for j in range(1, count + 1):
                    next_q = torch.floor(shifted * table[j])
                    found.append((q - next_q * table[0]).to(torch.int64))
                    q = next_q
        return digits.digit_words(found, width)

    return radix_digits


@lru_cache(maxsize=64)
def _radix_tensor(base: int, k: int, device: torch.device) -> torch.Tensor:
    """float64 [R, R^-1, .., R^-(k - k // 2)] on `device`, made once (`radix_unpack_fn`'s table)."""
    values = [float(base)] + [1.0 / base**j for j in range(1, k - k // 2 + 1)]
    return torch.tensor(values, dtype=torch.float64, device="cpu").to(device, non_blocking=True)


def radix_pack(values: torch.Tensor, layout: RadixLayout) -> torch.Tensor | None:
    """Non-negative integer `values` (uint8 levels, int32 owner sums; each below R) as `layout`'s
    containers (compiled; `radix.pack`'s integers), or None when compiling failed: `digits.pack`,
    groups of whole containers whose digits fill whole int64 words. 0.42-0.76 ms per 4M uint8
    values on one core, plus 0.35-0.98 ms for the transposing copy (partial 16 x 16 tiles), against
    1.1-1.5 ms for Horner's rule over strided byte columns (the kernel before, which inductor ran
    scalar: it stops vectorising at 35 strided loads and stores); docs/gpu.md has the runs."""
    if layout.chunk:
        return chunks.pack_radix(values, layout)
    return digits.pack(values, layout.radix, layout.digits)


def radix_unpack(c: torch.Tensor, layout: RadixLayout) -> torch.Tensor | None:
    """The digits of the summed containers `c` (compiled; uint8 up to radix 256, else int32; at least
    m * digits of them, the caller reads the first numel), or None when compiling failed."""
    if layout.radix >= radix.EXACT_RADIX:  # never chosen by a layout in use: the eager integer path
        return radix.unpack(c, layout, c.numel() * layout.digits, torch.int64)
    if layout.chunk:
        return chunks.unpack_radix(c, layout)
    width = _digit_width(layout)
    columns = fusion.run(digits.columns_fn(digits.groups(layout.digits, width)[0]), *digits.word_parts(c))
    words = None if columns is None else fusion.run(radix_unpack_fn(layout), columns,
                                                     _radix_tensor(layout.radix, layout.digits, c.device))
    return None if words is None else words.view(torch.uint8 if width == 1 else torch.int32).view(-1)


def unit_scaled_into(out: torch.Tensor, sums: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                     unit: torch.Tensor) -> None:
    """out = (S * unit - 1) * scale (fp32) of a (blocks, width) view of W-rank sums `sums` (whole
    numbers, integer or fp32), `unit` the 0-d fp32 2 / (M * W): `unit_values` then `scale_blocks_`.
    The scale is one table read per row here (`table.scales_of`'s arithmetic, redone for every
    16 elements, ran 2x slower on a CPU core)."""
    out.copy_(chunks.unit_scaled(sums, codes, scales, unit))


# ---- the stages (called by the reducer; None: run eager) --------------------------------------
def block_max(x: torch.Tensor, parts: tuple[grid.Piece, ...], nblocks: int) -> torch.Tensor | None:
    """`grid.block_amax` compiled per view (one-row views eager), `flagged`; None when compiling failed."""
    if len(parts) == 1 and parts[0].rows > 1:
        return fusion.run(flagged_block_max, grid.rows(x, parts[0]))
    out = torch.zeros(nblocks, dtype=torch.float32, device=x.device)
    for p in parts:
        view = grid.rows(x, p)
        got = view.abs().amax(1).to(torch.float32) if p.rows == 1 else fusion.run(block_max_rows, view)
        if got is None:
            return None
        out[p.first_block : p.first_block + p.rows] = got
    return fusion.run(flagged, out)


def codes(shared: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
    """The agreed uint8 codes: `shared` itself, or the codes of its fp32 block maxima (compiled)."""
    if shared.dtype == torch.uint8:
        return shared
    return fusion.run(table.codes_of, shared.contiguous(), scales)


@lru_cache(maxsize=256)
def _row_counters(lengths: tuple[int, ...], block: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block (int64, on `device`, made once per layout): its segment, and its first element's
    index within that segment plus 1."""
    seg, first = [], []
    for s, n in enumerate(lengths):
        starts = torch.arange(0, n, block, dtype=torch.int64, device="cpu")
        seg.append(torch.full_like(starts, s))
        first.append(starts + 1)
    if not seg:
        none = torch.empty(0, dtype=torch.int64, device="cpu")
        seg, first = [none], [none]
    return torch.cat(seg).to(device, non_blocking=True), torch.cat(first).to(device, non_blocking=True)


def _block_index(lengths: tuple[int, ...], block: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the block of every element (`qsum.fused.index_dtype`), each block's segment and that
    segment's counter offset 1 - its start (int64)) on `device`: what the indexed kernels read for
    a bucket of more block views than `grid.MAX_PIECES`. The per-block parts are kept per layout, the
    per-element index only up to `grid.CACHED_INDEX` elements (`grid.block_index`)."""
    seg, offset = _block_segments(lengths, block, device)
    dtype = qsum_fused.index_dtype(seg.numel())
    if sum(lengths) <= grid.CACHED_INDEX:
        return _kept_index(lengths, block, device, dtype), seg, offset
    return grid.block_index(lengths, block, device)[0].to(dtype), seg, offset


@lru_cache(maxsize=64)
def _block_segments(lengths: tuple[int, ...], block: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block (int64, on `device`, made once per layout): its segment, and 1 - that segment's start."""
    seg, _ = _row_counters(lengths, block, torch.device("cpu"))
    starts = qsum_fused.segment_starts(lengths)
    offset = 1 - starts[seg] if seg.numel() else seg
    return seg.to(device, non_blocking=True), offset.to(device, non_blocking=True)


@lru_cache(maxsize=64)
def _kept_index(lengths: tuple[int, ...], block: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The per-element block index of a small layout in `dtype`, made on the host once."""
    return grid.host_block_index(lengths, block, dtype)[0].to(device, non_blocking=True)


def block_terms(codes_: torch.Tensor, scales: torch.Tensor, keys: torch.Tensor, seg: torch.Tensor,
                offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block (1-D): its divisor and its segment's counter base and high word
    (`qsum.fused.counter_terms`), for the indexed level kernel."""
    return table.scales_of(codes_, scales, 1.0), *qsum_fused.counter_terms(keys[seg], offset)


def block_scales(codes_: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Each block's agreed scale (fp32): the indexed decode's table."""
    return table.scales_of(codes_, scales)


def levels(x: torch.Tensor, codes_: torch.Tensor, scales: torch.Tensor, lengths: Sequence[int], block: int,
           parts: tuple[grid.Piece, ...] | None, stratum: noise.Stratum, m: int) -> torch.Tensor | None:
    """blockq's levels of the bucket `x` (uint8, one per element), the same bits as `BlockQSum._levels`:
    a kernel per block view, or (`parts` None: many small segments) one for the whole bucket through
    the per-element block index. None when compiling failed (the caller runs eager)."""
    dev = x.device
    rest = _level_constants(stratum, m, dev)
    flat = x.reshape(-1)
    out = torch.empty(flat.numel(), dtype=torch.uint8, device=dev)
    keys = stratum.keys(len(lengths), dev)
    if parts is None:
        index, seg, offset = _block_index(tuple(lengths), block, dev)
        terms = fusion.run(block_terms, codes_, scales, keys, seg, offset)
        if terms is None:
            return None
        weyl = fusion.weyl(fusion.ROW, dev)
        for at, (x_part, out_part, index_part) in fusion.row_parts(flat, out, index):
            if fusion.run(qsum_fused.indexed_levels_into, out_part, x_part, index_part, *terms, *rest, weyl,
                          fusion.int_constant(at, dev)) is None and fusion.failed():
                return None
        return out
    terms = fusion.run(row_terms, codes_, scales, keys, *_row_counters(tuple(lengths), block, dev))
    return None if terms is None else _levels_by_rows(out, flat, terms, rest, fusion.weyl(block, dev), parts)


def _level_constants(stratum: noise.Stratum, m: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """A level kernel's constants: the stratum's shift (int32), M / 2 and M (fp32), as tensors."""
    return (fusion.int_constant(stratum.shift, device), fusion.constant(0.5 * m, device),
            fusion.constant(float(m), device))


def _levels_by_rows(out: torch.Tensor, flat: torch.Tensor, terms: tuple[torch.Tensor, ...],
                    rest: tuple[torch.Tensor, ...], steps: torch.Tensor, parts: Sequence[grid.Piece]
                    ) -> torch.Tensor | None:
    """`levels_into` for every view `parts` of `flat` (into `out`), its rows' `row_terms` read from
    `terms` by their block numbers; `rest`: the stratum's shift, M / 2 and M. `out`, or None when
    compiling failed."""
    for p in parts:
        b = slice(p.first_block, p.first_block + p.rows)
        args = (grid.rows(out, p), grid.rows(flat, p), *(t[b] for t in terms), *rest, steps[: p.width])
        if fusion.run(levels_into, *args) is None and fusion.failed():
            return None
    return out


def packs_levels(layout: Layout, block: int, parts: tuple[grid.Piece, ...] | None) -> bool:
    """Whether `packed_levels` runs for this bucket: a layout chunked by blocks, and a bucket that
    starts with a view of at least one chunk of whole blocks."""
    k = layout.lanes if isinstance(layout, LaneLayout) else layout.digits
    return bool(layout.chunk == block and parts and parts[0].start == 0 and parts[0].width == block
                and parts[0].rows >= k)


def packed_levels(x: torch.Tensor, codes_: torch.Tensor, scales: torch.Tensor, lengths: Sequence[int], block: int,
                  parts: tuple[grid.Piece, ...] | None, stratum: noise.Stratum, m: int, layout: Layout
                  ) -> torch.Tensor | None:
    """blockq's payload of the bucket `x` (`levels`, then `pack`: the same containers) where the layout
    is chunked by blocks and the bucket starts with a view of at least one chunk of whole blocks
    (`decode_chunks`' case, the usual bucket): the whole chunks of that view go from x to containers
    in one kernel (`chunks.packed_levels_fn`, the levels never stored), the rest (from a chunk
    boundary: the same chunking) by `levels` and `pack`. None outside that case (the caller takes
    `levels`, then `pack`) or when compiling failed."""
    if not packs_levels(layout, block, parts):
        return None
    k = layout.lanes if isinstance(layout, LaneLayout) else layout.digits
    dev, flat, q = x.device, x.reshape(-1), parts[0].rows // k
    rest = _level_constants(stratum, m, dev)
    terms = fusion.run(row_terms, codes_, scales, stratum.keys(len(lengths), dev),
                       *_row_counters(tuple(lengths), block, dev))
    if terms is None:
        return None
    steps = fusion.weyl(block, dev)
    container = layout.container if isinstance(layout, LaneLayout) else torch.int64
    out = torch.empty(layout.containers_for(flat.numel()), dtype=container, device=dev)
    whole = (out[: q * block].view(q, block), flat[: q * k * block].view(q, k, block),
             *(t[: q * k].view(q, k, 1) for t in terms))
    if fusion.run(chunks.packed_levels_fn(layout), *whole, *rest, steps) is None and fusion.failed():
        return None
    done = q * k * block
    if done == flat.numel():
        return out
    if _rest_in_one(layout, lengths):
        rows = slice(q * k, q * k - (-(flat.numel() - done) // block))
        got = fusion.run(chunks.packed_rest_fn(layout, block), out[q * block :], flat[done:],
                         *(t[rows] for t in terms), *rest, steps)
        return None if got is None and fusion.failed() else out
    levels_ = torch.empty(flat.numel() - done, dtype=torch.uint8, device=dev)
    got = _levels_by_rows(levels_, flat[done:], terms, rest, steps, _after_chunks(parts, q * k))
    return None if got is None or chunks.pack_into(got, layout, out[q * block :]) is None else out


def pack(values: torch.Tensor, layout: Layout) -> torch.Tensor | None:
    """uint8 values in `layout`'s lanes or digits (compiled); None when compiling failed."""
    if isinstance(layout, LaneLayout):
        return qsum_fused.pack(values.reshape(-1), layout)
    return radix_pack(values, layout)


def decode(reduced: torch.Tensor, codes_: torch.Tensor, scales: torch.Tensor, parts: tuple[grid.Piece, ...] | None,
           numel: int, total: int, layout: Layout, out: torch.Tensor | None, lengths: Sequence[int] = (),
           block: int = 0) -> torch.Tensor | None:
    """The decoded mean (fp32, into `out` when given: a contiguous fp32 tensor of `numel`) of the
    summed payload, the same bits as the eager unpack, `unit_values` and `scale_blocks_`: a kernel
    per block view, or (`parts` None) one through the block index of the bucket's `lengths`; None
    when compiling failed. Chunked lanes whose chunk rows are the bucket's first blocks are
    unpacked and scaled in one kernel there (`decode_chunks`)."""
    if layout.chunk == block and parts and parts[0].start == 0 and parts[0].width == block:
        return decode_chunks(reduced, codes_, scales, parts, numel, total, layout, out, lengths, block)
    sums = unpack(reduced, layout)
    return None if sums is None else scaled(sums, codes_, scales, parts, numel, total, out, lengths, block)


def decode_chunks(reduced: torch.Tensor, codes_: torch.Tensor, scales: torch.Tensor, parts: tuple[grid.Piece, ...],
                  numel: int, total: int, layout: Layout, out: torch.Tensor | None, lengths: Sequence[int],
                  block: int) -> torch.Tensor | None:
    """`decode` of chunked lanes or digits (`layout.chunk == block`) whose first view starts the
    bucket: there, row l of chunk q is block q * k + l, so the whole chunks inside that view are
    unpacked and scaled in one kernel (`chunks.scaled_lanes_fn`; radix digits: after one small
    kernel splitting each container, `chunks.scaled_digits_fn`); the rest (from a chunk boundary:
    the same chunking) unpacked, then scaled view by view. None when compiling failed."""
    k = layout.lanes if isinstance(layout, LaneLayout) else layout.digits
    c = reduced.reshape(-1)
    res = out.view(-1) if out is not None else torch.empty(numel, dtype=torch.float32, device=c.device)
    q = min(parts[0].rows, c.numel() // block * k) // k
    if q:
        dest, src, unit = res[: q * k * block].view(q, k, block), c[: q * block].view(q, block), fusion.constant(
            2.0 / total, c.device)
        if isinstance(layout, LaneLayout):
            got = fusion.run(chunks.scaled_lanes_fn(layout), dest, src, codes_[: q * k].view(q, k), scales, unit)
        else:
            parts_ = chunks.parts_of(src, layout)
            got = None if parts_ is None else fusion.run(
                chunks.scaled_digits_fn(layout), dest, codes_[: q * k].view(q, k), scales, unit,
                chunks.digit_powers(layout.radix, layout.digits, c.device), *parts_)
        if got is None and fusion.failed():
            return None
    done = q * k * block
    if done == numel:
        return res
    if _rest_in_one(layout, lengths):
        rows = slice(q * k, q * k - (-(numel - done) // block))
        got = fusion.run(chunks.scaled_rest_fn(layout, block), res[done:], c[q * block : q * block - (
            -(numel - done) // k)], codes_[rows], scales, fusion.constant(2.0 / total, c.device))
        return None if got is None and fusion.failed() else res
    rest = _after_chunks(parts, q * k)
    sums = unpack(c[q * block :], layout)
    if sums is None:
        return None
    rest_mean = scaled(sums, codes_, scales, rest, numel - done, total, res[done:], lengths, block)
    return None if rest_mean is None else res


def _rest_in_one(layout: Layout, lengths: Sequence[int]) -> bool:
    """Whether what follows a bucket's whole chunks is one graph each way (`chunks.packed_rest_fn`,
    `scaled_rest_fn`): bit lanes, and a bucket of one segment, so that the rest is consecutive blocks
    within one partial chunk. Several segments, and radix digits, keep the stages per view."""
    return isinstance(layout, LaneLayout) and len(lengths) == 1


def _after_chunks(parts: tuple[grid.Piece, ...], rows: int) -> tuple[grid.Piece, ...]:
    """The views of what follows the first `rows` rows of the first view (whole chunks), numbered
    from there (their block numbers unchanged)."""
    first, done = parts[0], rows * parts[0].width
    head = (grid.Piece(0, first.rows - rows, first.width, first.first_block + rows),) if first.rows > rows else ()
    return head + tuple(grid.Piece(p.start - done, p.rows, p.width, p.first_block) for p in parts[1:])


def unpack(reduced: torch.Tensor, layout: Layout) -> torch.Tensor | None:
    """The lane values or digits of the containers `reduced` (compiled; the caller reads the first
    numel), or None when compiling failed."""
    return radix_unpack(reduced, layout) if isinstance(layout, RadixLayout) else qsum_fused.unpack(reduced, layout)


def scaled(sums: torch.Tensor, codes_: torch.Tensor, scales: torch.Tensor, parts: tuple[grid.Piece, ...] | None,
           numel: int, total: int, out: torch.Tensor | None, lengths: Sequence[int] = (),
           block: int = 0) -> torch.Tensor | None:
    """`decode` after the unpacking: the W-rank level sums `sums` (one per element) as the mean."""
    dev = sums.device
    unit = fusion.constant(2.0 / total, dev)
    res = out.view(-1) if out is not None else torch.empty(numel, dtype=torch.float32, device=dev)
    if parts is None:
        index = _block_index(tuple(lengths), block, dev)[0]
        table = fusion.run(block_scales, codes_, scales)
        if table is None or fusion.run(qsum_fused.indexed_scaled_into, res, sums, index, table,
                                       unit) is None and fusion.failed():
            return None
        return res
    for p in parts:
        args = (grid.rows(res, p), grid.rows(sums, p), codes_[p.first_block : p.first_block + p.rows], scales, unit)
        if p.rows == 1:
            unit_scaled_into(*args)
        elif fusion.run(unit_scaled_into, *args) is None and fusion.failed():
            return None
    return res
