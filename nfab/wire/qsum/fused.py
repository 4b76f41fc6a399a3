"""qsum's stages, and the lane packing every codec shares, as traced functions for `torch.compile`.

Why: eager, qsum's encode is a division, the level arithmetic, a dozen passes of counter hash
and a packing pass per lane; compiled (`wire/fusion.py`), one segment of one-lane containers
(q8) is one kernel that reads x and writes the containers (the noise computed in registers,
the levels never stored), and its decode one kernel that reads the containers and writes the
bucket slice.

`packed` and `unpacked_into` are the lanes of `lanes.pack` / `lanes.unpack` in traced ops, for
use inside other compiled graphs (sign's votes, blockq's levels): integer sums of values shifted
into disjoint bits, so the same containers in any order. Several lanes per container are packed
from stored levels and unpacked to stored sums (two kernels: reading x, or writing the bucket,
once per lane from strided columns ran 2x slower). The level arithmetic is the eager order,
`((x / s + 1) * (M / 2) + u)`, floor, clamp, and the decode `(S * unit - 1) * s`, contraction off.

A bucket of several segments (a layer's norms and biases) runs as one levels kernel and one
decode kernel whatever their number: each element finds its segment's divisor, counter base and
scale in small tables through a per-element segment index (`segment_index`, 1-2 bytes per
element, made once per bucket layout), where a kernel per segment, or the eager path beyond a
few segments (about 60 ops per bucket), put a launch count on every small parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache, lru_cache
from itertools import accumulate

import torch

from nfab.wire import digits, fusion
from nfab.wire.qsum import chunks, words
from nfab.wire.qsum.lanes import LaneLayout


def _blocks(layout: LaneLayout) -> tuple[tuple[int, int], ...]:
    """`layout.blocks` without its cache (traced code calls no cached function)."""
    if layout.container == torch.uint8:
        return ((0, layout.lanes),)
    return tuple((l0, min(l0 + 8, layout.lanes)) for l0 in range(0, layout.lanes, 8))


def packed(values: torch.Tensor, layout: LaneLayout) -> torch.Tensor:
    """`lanes.pack` of the 1-D non-negative integer tensor `values` (traced ops).

    Each lane is one strided column of a (containers, lanes) view, shifted and OR-ed in: inductor
    vectorises that over the containers (0.5-0.7x a copy on one core), where a sum over a short
    inner dimension of lanes ran scalar (0.05x)."""
    n = values.shape[0]
    per, s = fusion.static(layout.lanes), fusion.static(layout.lane_bits)
    m = (n + per - 1) // per
    work = torch.int32 if layout.container == torch.uint8 else layout.container
    v = torch.nn.functional.pad(values.to(work), (0, m * per - n))
    terms = [t for l0, l1 in _blocks(layout) for t in column_terms(v[m * l0 : m * l1].view(m, l1 - l0), l0, s, work)]
    return or_all(terms).to(layout.container)


def column_terms(grid: torch.Tensor, l0: int, s: int, work: torch.dtype) -> list[torch.Tensor]:
    """Lanes l0, l0 + 1, ... of the containers as the columns of a (..., containers, lanes) `grid`, each
    in `work` and shifted to its lane's bits (`s` bits a lane). uint8 values widen through int32:
    straight to int64 inductor's C++ ran the conversion scalar."""
    cols = [grid[..., j].to(torch.int32) if grid.dtype == torch.uint8 else grid[..., j] for j in range(grid.shape[-1])]
    return [c.to(work) << ((l0 + j) * s) for j, c in enumerate(cols)]


def or_all(terms: list[torch.Tensor]) -> torch.Tensor:
    """The bitwise OR of integer tensors with disjoint bits (their sum)."""
    out = terms[0]
    for t in terms[1:]:
        out = out | t
    return out


lane_dtype = chunks.lane_dtype


def unpacked_into(out: torch.Tensor, c: torch.Tensor, layout: LaneLayout, l0: int, l1: int) -> None:
    """Lanes [l0, l1) -- one block of `lanes.unpack` -- of the 1-D containers `c` into the (m, l1 - l0)
    `out` (`lane_dtype`), stacked as columns: one vectorised kernel (a 2-D shift over a short inner
    dimension of lanes ran scalar; the lanes narrowed to int32 before the stack, as int64 -> uint8
    per lane ran 7x slower)."""
    w = c.to(torch.int64 if c.dtype == torch.int64 else torch.int32)
    s, top = fusion.static(layout.lane_bits), fusion.static(layout.max_value)
    narrow = torch.int32 if s <= 31 else torch.int64
    lanes = [((w >> (lane * s)) & top).to(narrow) for lane in range(fusion.static(l0), fusion.static(l1))]
    out.copy_(torch.stack(lanes, 1).to(out.dtype))


@cache
def unpack_fn(layout: LaneLayout, l0: int, l1: int):
    """`unpacked_into` for one block of one layout (one graph each)."""

    def unpack_block(out: torch.Tensor, c: torch.Tensor) -> None:
        unpacked_into(out, c, layout, l0, l1)

    return unpack_block


def unpack(c: torch.Tensor, layout: LaneLayout) -> torch.Tensor | None:
    """The lane values of the 1-D containers `c` (compiled; `lane_dtype`, m * lanes of them or a few more: the
    caller reads the first numel), or None when compiling failed. 1-, 2- and 4-bit lanes of uint8
    containers as whole words (`words`), a one-block wide container as digits (`digit_lanes`),
    others block by block; a chunked layout by its contiguous rows (`chunks`)."""
    if layout.chunk:
        return chunks.unpack(c, layout)
    if words.fits(layout):
        return words.unpack(c, layout)
    if digit_lanes(layout):
        return digits.unpack_lanes(c, layout.lane_bits, layout.lanes, lane_dtype(layout).itemsize)
    m = c.numel()
    # whole int64 words of lane bytes: a compiled stage writes a block through an int64 view of them
    out = torch.empty(-(-m * layout.lanes // 8) * 8, dtype=lane_dtype(layout), device=c.device)
    for l0, l1 in _blocks(layout):  # a call per block: one graph writing every block's slice ran 8x slower
        if _word_block(layout, l0, l1):  # 8 lanes: one int64 word of bytes per container
            fusion.run(spread_fn(layout, l0), out[m * l0 : m * l1].view(torch.int64), c.reshape(-1))
        else:
            fusion.run(unpack_fn(layout, l0, l1), out[m * l0 : m * l1].view(m, l1 - l0), c.reshape(-1))
        if fusion.failed():
            return None
    return out


def digit_lanes(layout: LaneLayout) -> bool:
    """Whether `layout`'s containers are unpacked as base-2^b digits in groups of whole words
    (`digits.unpack_lanes`): int32 / int64 containers of one block of 2..8 lanes of at most 8 bits
    (uint8 lane values), not an 8-lane word block, in the plain order: of `layout_for`'s, 5-bit lanes
    6 to an int32 and 6-bit 5 (blockqscatter-bq4's sums at W = 2, 4, blockqscatter-bq3's at W = 4 to
    8, signcount at W = 16 to 63; blockq's all-reduce lanes are chunked, `chunks`). Lane l of
    container j is element j * lanes + l: digit l of a radix-2^b container.

    Why: the lanes as stacked columns of a (containers, lanes) view ran scalar, 1.7-2.5 ms per 4M
    elements on one core (a 16 MB copy: 1.05 ms); as digits, 0.55-0.8 ms for the transposing copy of
    the containers' words plus 0.52-0.6 ms for the kernel (`cost.codec_work` stage by stage,
    blockq-bq4 W=2, 4, blockq-bq3 W=4, 2026-12-04). Wider lanes (int32 values, 4 to a word) gained less or lost: 9-bit
    lanes 7 to an int64 2.0 ms against 2.1-2.8, 10-bit 3 to an int32 2.5 against 2.6, 16-bit 3 to an
    int64 3.6 against 2.5. Packing stays `packed`'s strided columns (1.31-1.44 ms): as digits (the
    int32 containers two to a word) the values' transposing copy, 0.61-0.8 ms, ate the kernel's
    gain (0.47-0.64 ms), and read in place (no copy) the kernel ran scalar, 0.96-1.0 ms plus a
    second call or a copy for the last group."""
    return (layout.container != torch.uint8 and layout.lane_bits <= 8 and 1 < layout.lanes <= 8
            and not _word_block(layout, 0, layout.lanes))


def _word_block(layout: LaneLayout, l0: int, l1: int) -> bool:
    """Whether block [l0, l1) of a wide container is 8 lanes of at most 7 bits: its 8 values per
    container are one int64 word of bytes (`words.compressed` / `words.spread`)."""
    return layout.container != torch.uint8 and l1 - l0 == 8 and layout.lane_bits <= 7


@cache
def spread_fn(layout: LaneLayout, l0: int):
    """Block [l0, l0 + 8) of the containers `c` into `out` as int64 words of 8 bytes (one graph each)."""

    def spread_block(out: torch.Tensor, c: torch.Tensor) -> None:
        s, shift = fusion.static(layout.lane_bits), fusion.static(l0 * layout.lane_bits)
        out.copy_(words.spread((c.to(torch.int64) >> shift) & ((1 << 8 * s) - 1), s))

    return spread_block


@cache
def word_pack_fn(layout: LaneLayout):
    """`packed` from the blocks of padded uint8 values: an 8-lane block as int64 words of 8 bytes
    (`words.compressed`: contiguous loads, where a lane's strided column ran scalar), others as a
    (containers, lanes) grid, one column per lane (one graph per layout)."""

    def pack_blocks(*parts: torch.Tensor) -> torch.Tensor:
        s = fusion.static(layout.lane_bits)
        terms = []
        for (l0, l1), part in zip(_blocks(layout), parts, strict=True):
            if _word_block(layout, l0, l1):
                terms.append(words.compressed(part, s) << (l0 * s))
            else:
                terms += column_terms(part, l0, s, torch.int64)
        return or_all(terms).to(layout.container)

    return pack_blocks


@cache
def pack_fn(layout: LaneLayout):
    """`packed` for one layout as a function of its values alone (one graph per layout)."""

    def pack_lanes(values: torch.Tensor) -> torch.Tensor:
        return packed(values, layout)

    return pack_lanes


def pack(values: torch.Tensor, layout: LaneLayout) -> torch.Tensor | None:
    """`lanes.pack` of the 1-D uint8 `values` (compiled), or None when compiling failed: 1-, 2- and
    4-bit lanes of uint8 containers as whole words (`words`), 8-lane blocks as words, others lane by
    lane (`packed`; `digit_lanes` says why a one-block wide container is not packed as digits)."""
    if layout.chunk:
        return chunks.pack(values, layout)
    if words.fits(layout) and values.dtype == torch.uint8:
        return words.pack(values, layout)
    blocks = _blocks(layout)
    if values.dtype == torch.uint8 and any(_word_block(layout, l0, l1) for l0, l1 in blocks):
        m = layout.containers_for(values.numel())
        padded = values.reshape(-1)
        if padded.numel() != m * layout.lanes or padded.storage_offset() % 8:  # whole, aligned words
            padded = torch.nn.functional.pad(padded, (0, m * layout.lanes - padded.numel()))
        parts = [padded[m * l0 : m * l1].view(torch.int64) if _word_block(layout, l0, l1)
                 else padded[m * l0 : m * l1].view(m, l1 - l0) for l0, l1 in blocks]
        return fusion.run(word_pack_fn(layout), *parts)
    return fusion.run(pack_fn(layout), values)


def padded_length(n: int, layout: LaneLayout) -> int:
    """How many uint8 values `pack_prefix` reads for n values in `layout`: whole containers' lanes,
    in whole int64 words. A stage that writes its values into a buffer this long, the values past
    n zeroed (zero lanes, as `lanes.pack` pads), is packed without a padding copy: the copy took
    0.5 ms per 4M votes on one CPU core, a fifth of signcount's encode and decode at W=4."""
    return -(-layout.containers_for(n) * layout.lanes // 8) * 8


def lane_buffer(total: int, n: int, device: torch.device) -> torch.Tensor:
    """`total` uint8 values to be written up to n, zero past n (zero lanes, as `lanes.pack` pads):
    what a stage writes its levels or votes into so that `pack_prefix` packs them in place."""
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    buffer[n:].zero_()
    return buffer


def pack_prefix(values: torch.Tensor, n: int, layout: LaneLayout) -> torch.Tensor | None:
    """`pack` of the first n of the uint8 `values` (`padded_length(n)` of them, zero past n)."""
    m = layout.containers_for(n)
    got = pack(values if words.fits(layout) and not layout.chunk else values[: m * layout.lanes], layout)
    return None if got is None else got[:m]


def shard_rows(world_size: int, per: int, device: torch.device, n: int, shard: int) -> torch.Tensor:
    """W uint8 rows of at least `per` values, each starting on a whole int64 word, for n values in
    shards of `shard` (`shard_parts` writes them): zero wherever those values do not land -- a shard's
    padding, the tail shard's rest -- so each row packs with no padding copy (`pack_rows`). Only the
    padding is zeroed: a fill of every row took 0.11 ms per 4M values on one CPU core."""
    rows = torch.empty(world_size, -(-per // 8) * 8, dtype=torch.uint8, device=device)
    full = min(n // shard, world_size)
    rows[:full, shard:].zero_()
    if full < world_size:
        rows[full, n - full * shard :].zero_()
        rows[full + 1 :].zero_()
    return rows


def pack_rows(rows: torch.Tensor, count: int, layout: LaneLayout) -> torch.Tensor | None:
    """Each of `rows`' first `count` values packed in `layout`, the rows' containers one after the
    other (`shard_rows`: zero past the values); None when compiling failed. Layouts with 8-lane word
    blocks pack every row in one graph (a graph per row and their concatenation cost 0.3 ms per 4M
    sign votes at W=4, one CPU core); others row by row."""
    m = layout.containers_for(count)
    blocks = _blocks(layout)
    if rows.shape[1] >= m * layout.lanes and any(_word_block(layout, l0, l1) for l0, l1 in blocks):
        parts = [rows[:, m * l0 : m * l1].view(torch.int64) if _word_block(layout, l0, l1)
                 else rows[:, m * l0 : m * l1].unflatten(1, (m, l1 - l0)) for l0, l1 in blocks]
        got = fusion.run(word_pack_fn(layout), *parts)
        return None if got is None else got.reshape(-1)
    packed_rows = [pack(row[:count], layout) for row in rows]
    return None if any(p is None for p in packed_rows) else torch.cat(packed_rows)  # type: ignore[arg-type]


def shard_parts(rows: torch.Tensor, flat: torch.Tensor, shard: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(row views, `flat`'s views) pairs that put `flat` into `shard_rows`, `shard` values a row:
    its whole shards, then the tail shard (an empty pair when there is none)."""
    n = flat.shape[0]
    full = n // shard
    return [(rows[:full, :shard], flat[: full * shard].view(full, shard)),
            (rows[full : full + 1, : n - full * shard], flat[full * shard :].view(1, -1))]


def segment_starts(lengths: Sequence[int]) -> torch.Tensor:
    """Where each segment starts in its bucket (int64, CPU)."""
    return torch.tensor([0, *accumulate(lengths[:-1])], dtype=torch.int64, device="cpu")


def index_dtype(entries: int) -> torch.dtype:
    """The narrowest integer dtype of a per-element index into `entries` table entries: the index
    is read once per element, so its bytes are the indexed kernels' extra traffic."""
    if entries <= 1 << 8:
        return torch.uint8
    return torch.int16 if entries <= 1 << 15 else torch.int32


@lru_cache(maxsize=64)
def segment_index(lengths: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the segment of every element (`index_dtype`), each segment's counter offset 1 - its start
    (int64)) on `device`: made on the host once per bucket layout, sent without waiting. The index
    costs 1-2 bytes per element of the bucket while its layout is in use (64 layouts kept)."""
    starts = segment_starts(lengths)
    counts = torch.tensor(lengths, dtype=torch.int64, device="cpu")
    ids = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int64), counts, output_size=sum(lengths))
    index = ids.to(index_dtype(len(lengths)))
    return index.to(device, non_blocking=True), (1 - starts).to(device, non_blocking=True)


def segment_counters(x: torch.Tensor, key: torch.Tensor, first: torch.Tensor, weyl: torch.Tensor) -> torch.Tensor:
    """The keyed counters (int32) of rows `x` of one segment ((rows, width) views) whose element (r, k)
    hashes counter `first` + r * ROW + k (int32 `first`: 1 at the segment's start), keyed by the
    int64 `key` (1 element); `weyl`: `fusion.weyl(ROW)`. A segment is its whole rows of ROW and its
    last (fewer than ROW) elements as a (1, n) row of their own (`fusion.row_parts`)."""
    lo = fusion.as_i32(key & 0xFFFFFFFF)
    hi = fusion.as_i32((key >> 32) & 0xFFFFFFFF)
    return fusion.row_steps(x, first, weyl, lo) ^ hi


def levels_into(out: torch.Tensor, x: torch.Tensor, safe: torch.Tensor, key: torch.Tensor, first: torch.Tensor,
                half_m: torch.Tensor, m: torch.Tensor, weyl: torch.Tensor) -> None:
    """out = the levels (`fusion.levels_of`) of rows `x` of one segment (`segment_counters`; out of any
    integer dtype: one-lane containers are the levels)."""
    out.copy_(fusion.levels_of(x, safe, segment_counters(x, key, first, weyl), None, half_m, m))


def indexed_terms(x: torch.Tensor, index: torch.Tensor, safe: torch.Tensor, base: torch.Tensor, hi: torch.Tensor,
                  weyl: torch.Tensor, at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(divisor, keyed counter) of every element of rows `x` of a bucket ((rows, width) views,
    `fusion.row_parts`; the first element at bucket index `at`, int32) whose element i belongs to
    entry index[i] of the small tables `safe` (its divisor), `base` and `hi` (int32: its counter is
    base + i * G, keyed by hi; `counter_terms`): every segment or block in one kernel, whatever their
    number. The gathers read tables of a few KB (in cache); the per-element index is what a bucket
    of many small segments costs instead of a launch per segment."""
    k = index.to(torch.int64)
    return safe[k], (base[k] + fusion.row_steps(x, at, weyl)) ^ hi[k]


def indexed_levels_into(out: torch.Tensor, x: torch.Tensor, index: torch.Tensor, safe: torch.Tensor,
                        base: torch.Tensor, hi: torch.Tensor, shift: torch.Tensor | None, half_m: torch.Tensor,
                        m: torch.Tensor, weyl: torch.Tensor, at: torch.Tensor) -> None:
    """out = the levels of rows `x` of a bucket through the per-element index (`indexed_terms`)."""
    out.copy_(fusion.levels_of(x, *indexed_terms(x, index, safe, base, hi, weyl, at), shift, half_m, m))


def packed_levels(x: torch.Tensor, safe: torch.Tensor, counters: torch.Tensor, shift: torch.Tensor | None,
                  half_m: torch.Tensor, m: torch.Tensor, layout: LaneLayout) -> torch.Tensor:
    """The containers (rows, ROW / lanes) of the levels of whole rows `x` (rows, ROW) and their terms
    (`counters`, and `safe` where it is per element: (rows, ROW) each), in the consecutive order:
    container j of a row holds its levels j * lanes .. + lanes - 1, lowest lane first. Each lane's
    levels come from strided views of x and of those terms, in registers. The views' sizes are
    constants of the trace: split by a dynamic size (`view(rows, -1, lanes)`, or views made outside
    the trace), inductor's C++ gathered each strided load element by element, 2.5x slower than the
    level kernel and the packing apart."""
    k, bits = fusion.static(layout.lanes), fusion.static(layout.lane_bits)

    def lanes(t: torch.Tensor) -> torch.Tensor:
        return t.view(t.shape[0], fusion.static(fusion.ROW // k), k) if t.dim() == 2 else t

    x, counters = lanes(x), lanes(counters)
    safe = lanes(safe) if safe.dim() == 2 else safe

    def level(j: int) -> torch.Tensor:
        return fusion.levels_of(x[..., j], safe[..., j] if safe.dim() == 3 else safe, counters[..., j], shift,
                                half_m, m)

    acc = level(0)
    for j in range(1, k):
        acc = acc | (level(j) << (j * bits))
    return acc


@cache
def packed_levels_fn(layout: LaneLayout, indexed: bool):
    """`levels_into` (`indexed`: `indexed_levels_into`) writing the rows' containers (`packed_levels`)
    instead of their levels: one kernel from x to the payload, the levels never stored (1.8 ms per
    4M q4 elements on one CPU core against 1.8 + 0.3 for the level kernel and the packing)."""
    if indexed:
        def packed_indexed_into(out: torch.Tensor, x: torch.Tensor, index: torch.Tensor, safe: torch.Tensor,
                                base: torch.Tensor, hi: torch.Tensor, shift: torch.Tensor | None,
                                half_m: torch.Tensor, m: torch.Tensor, weyl: torch.Tensor, at: torch.Tensor) -> None:
            out.copy_(packed_levels(x, *indexed_terms(x, index, safe, base, hi, weyl, at), shift, half_m, m, layout))

        return packed_indexed_into

    def packed_segment_into(out: torch.Tensor, x: torch.Tensor, safe: torch.Tensor, key: torch.Tensor,
                            first: torch.Tensor, half_m: torch.Tensor, m: torch.Tensor, weyl: torch.Tensor) -> None:
        out.copy_(packed_levels(x, safe, segment_counters(x, key, first, weyl), None, half_m, m, layout))

    return packed_segment_into


def counter_terms(keys: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per entry (int32): the counter base `key_lo + offset * G` (mod 2^32) and the key's high word,
    from int64 `keys` and `offset`. With offset = 1 - (the entry's segment start in the bucket),
    element i of the bucket hashes base + i * G = key_lo + (i - start + 1) * G: `noise.uniform`'s word."""
    base = ((keys & 0xFFFFFFFF) + offset * fusion.GOLDEN_I32) & 0xFFFFFFFF  # exact in int64: |offset * G| < 2^63
    return fusion.as_i32(base), fusion.as_i32((keys >> 32) & 0xFFFFFFFF)


def indexed_scaled_into(out: torch.Tensor, sums: torch.Tensor, index: torch.Tensor, scales: torch.Tensor,
                        unit: torch.Tensor) -> None:
    """out = (S * unit - 1) * scales[index[i]] of the first out.numel() lane sums: a whole bucket's
    decode in one kernel, whatever its number of segments or blocks."""
    n = out.shape[0]
    out.copy_((sums[:n].to(torch.float32) * unit - 1.0) * scales[index.to(torch.int64)])


@cache
def decode_one_fn(layout: LaneLayout):
    """One segment's decode of one-lane containers in one graph: out = (S * unit - 1) * scale."""

    def decode_one(out: torch.Tensor, c: torch.Tensor, unit: torch.Tensor, scale: torch.Tensor) -> None:
        out.copy_((c[: out.shape[0]].to(torch.float32) * unit - 1.0) * scale)

    return decode_one


def scaled_into(out: torch.Tensor, sums: torch.Tensor, unit: torch.Tensor, scale: torch.Tensor) -> None:
    """out = (S * unit - 1) * scale of the first out.numel() unpacked lane sums."""
    out.copy_((sums[: out.shape[0]].to(torch.float32) * unit - 1.0) * scale)


def encode(x: torch.Tensor, safe: torch.Tensor, keys: torch.Tensor, lengths: Sequence[int], m: int,
           layout: LaneLayout) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(payload, the levels where they were stored, else None) of qsum's encode by compiled stages:
    the same containers as `QSum._levels_reference`. One segment: a level kernel per
    `fusion.row_parts` part; several: one for all of them through the per-element segment index.
    One-lane containers are the levels; q4's are packed inside the level kernel
    (`packed_levels_fn`; its last short row apart); q2's levels are stored, then packed. None when
    compiling failed."""
    lengths = list(lengths)
    if not lengths or not x.is_contiguous():
        return None
    dev = x.device
    flat = x.reshape(-1)
    half_m, top = fusion.constant(0.5 * m, dev), fusion.constant(float(m), dev)
    safe = safe.reshape(-1).to(torch.float32)
    n, k = flat.numel(), layout.lanes
    weyl = fusion.weyl(fusion.ROW, dev)
    if len(lengths) == 1:
        stage, parts = levels_into, fusion.row_parts(flat)

        def extra(at: int) -> tuple[torch.Tensor | None, ...]:
            return safe[:1], keys[:1], fusion.int_constant(1 + at, dev), half_m, top, weyl
    else:
        index, offsets = segment_index(tuple(lengths), dev)
        terms = fusion.run(counter_terms, keys.reshape(-1), offsets)
        if terms is None:
            return None
        stage, parts = indexed_levels_into, fusion.row_parts(flat, index)

        def extra(at: int) -> tuple[torch.Tensor | None, ...]:
            return safe, *terms, None, half_m, top, weyl, fusion.int_constant(at, dev)
    # one lane: the levels are the payload; two (q4): whole rows packed in the level kernel; four (q2):
    # levels, then packed (its stride-4 loads, inductor's C++ gathered element by element: 6x slower)
    packed = packed_levels_fn(layout, stage is indexed_levels_into) if k == 2 else None
    direct = k == 1 or packed is not None
    if direct:
        payload = torch.empty(layout.containers_for(n), dtype=layout.container, device=dev)
    else:  # zero past n: packed in place (`pack_prefix`)
        levels = lane_buffer(padded_length(n, layout), n, dev)
    tail: tuple[int, torch.Tensor, int] | None = None
    for at, (x_part, *index_part) in parts:
        rows, width = x_part.shape
        args = (x_part, *index_part, *extra(at))
        if k == 1:
            fusion.run(stage, payload[at : at + rows * width].view(rows, width), *args)
        elif packed is not None and width == fusion.ROW:
            fusion.run(packed, payload[at // k : (at + rows * width) // k].view(rows, width // k), *args)
        elif packed is not None:  # the last, short row: its levels zero-padded to whole containers
            short = lane_buffer(padded_length(width, layout), width, dev)
            fusion.run(stage, short[:width].view(1, width), *args)
            tail = (at, short, width)
        else:
            fusion.run(stage, levels[at : at + rows * width].view(rows, width), *args)
        if fusion.failed():
            return None
    if not direct:
        payload = pack_prefix(levels, n, layout)
    elif tail is not None and (last := pack_prefix(tail[1], tail[2], layout)) is not None:
        payload[tail[0] // k :].copy_(last)
    return None if payload is None or fusion.failed() else (payload, None if direct else levels[:n])


def decode(reduced: torch.Tensor, layout: LaneLayout, numel: int, unit: float, scale: torch.Tensor,
           out: torch.Tensor | None, lengths: Sequence[int] | None = None) -> torch.Tensor | None:
    """The decoded mean (fp32, into `out` when given): the same bits as `decode_scaled`'s table of
    `levels * unit - 1` times each segment's scale. One segment (`lengths` None): one-lane containers
    in one kernel; several lanes by `_lanes_scaled_into` (whole words of uint8 lanes in one kernel).
    Several segments: the same, each element scaled by its segment's scale through the per-element
    index. None when compiling failed."""
    dev = reduced.device
    res = out.view(-1) if out is not None else torch.empty(numel, dtype=torch.float32, device=dev)
    unit_ = fusion.constant(unit, dev)
    if lengths is not None and len(lengths) > 1:
        index, _ = segment_index(tuple(lengths), dev)
        scales = scale.reshape(-1).to(torch.float32)
        if layout.lanes == 1:
            fusion.run(indexed_scaled_into, res, reduced.reshape(-1), index, scales, unit_)
        else:
            _lanes_scaled_into(res, reduced.reshape(-1), layout, unit_, scales, index)
        return None if fusion.failed() else res
    scale = scale.reshape(-1)[:1].to(torch.float32)
    if layout.lanes == 1:
        fusion.run(decode_one_fn(layout), res, reduced.reshape(-1), unit_, scale)
    else:
        _lanes_scaled_into(res, reduced.reshape(-1), layout, unit_, scale, None)
    return None if fusion.failed() else res


def _lanes_scaled_into(res: torch.Tensor, c: torch.Tensor, layout: LaneLayout, unit: torch.Tensor,
                       scale: torch.Tensor, index: torch.Tensor | None) -> None:
    """res = the decoded lane sums of containers `c` (several lanes each), scaled by `scale` (one
    value) or, with a per-element `index`, by each element's entry of `scale`: uint8 lanes of 1, 2 or
    4 bits in one graph (`words.scaled_into`); others (and containers that do not start on a word)
    unpacked (`unpack`), then scaled."""
    if words.fits(layout) and words.scaled_into(res, c, layout.lane_bits, unit, scale, index):
        return
    if (sums := unpack(c, layout)) is None:
        return
    if index is None:
        fusion.run(scaled_into, res, sums, unit, scale)
    else:
        fusion.run(indexed_scaled_into, res, sums, index, scale, unit)
