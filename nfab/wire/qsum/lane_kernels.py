"""Compiled CPU kernels for lane containers (numba): votes into count lanes, lanes into values.

Pure functions over numpy arrays, split from `kernels.py` by topic. uint8 containers and the
wider int32 / int64 ones have separate entry points, so each is compiled only for the
container types it serves (a cold compile pays for what a run uses). `nfab.wire.qsum.lanes` holds
the torch reference these kernels must match bit for bit.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from nfab.wire.shared_kernels import prefetch_write

_AHEAD64 = 128  # uint64 words of output (1 KiB) asked for writing ahead of the lookups that write them

# ---- votes -> count lanes -----------------------------------------------------------------------


@njit(cache=True, nogil=True)
def spread_table(lane_bits):
    """256 entries: 8 votes -> the votes placed at lanes 0..7 of width `lane_bits` (uint64)."""
    t = np.zeros(256, dtype=np.uint64)
    for v in range(256):
        w = np.uint64(0)
        for j in range(8):
            if (v >> j) & 1:
                w |= np.uint64(1) << np.uint64(j * lane_bits)
        t[v] = w
    return t


@njit(cache=True, nogil=True)
def _spread_block(bits, first, n, g, m, spread, shift, out, assign):
    """Containers j < m get the votes of elements first + j*g .. (g each) spread into lanes:
    written (`assign`, the first block: `out` need not be zeroed) or ORed in (later blocks).
    Returns how many containers, from 0, it reached (those holding at least one element).

    `bits` carries two zero bytes past its end, so a 16-bit window never reads out of bounds.
    Indices are unsigned (numba then skips its negative-index handling); a block of 8 lanes
    that starts on a whole byte reads its votes as bytes.
    """
    if first >= n:
        return 0
    whole = min(m, (n - first) // g)  # containers whose g votes all lie below n
    if g == 8 and first & 7 == 0:
        src = bits[first >> 3 : (first >> 3) + whole]
        if assign:
            for j in range(whole):
                out[j] = spread[src[j]] << shift
        else:
            for j in range(whole):
                out[j] |= spread[src[j]] << shift
    else:
        gmask = np.uint64((1 << g) - 1)
        if assign:
            for j in range(whole):
                a = np.uint64(first + j * g)
                k = a >> np.uint64(3)
                w = np.uint64(bits[k]) | (np.uint64(bits[k + np.uint64(1)]) << np.uint64(8))
                out[j] = spread[(w >> (a & np.uint64(7))) & gmask] << shift
        else:
            for j in range(whole):
                a = np.uint64(first + j * g)
                k = a >> np.uint64(3)
                w = np.uint64(bits[k]) | (np.uint64(bits[k + np.uint64(1)]) << np.uint64(8))
                out[j] |= spread[(w >> (a & np.uint64(7))) & gmask] << shift
    a = first + whole * g
    if whole < m and a < n:
        v = (np.int64(bits[a >> 3]) | (np.int64(bits[(a >> 3) + 1]) << 8)) >> (a & 7)
        t = spread[v & ((1 << (n - a)) - 1)] << shift
        if assign:
            out[whole] = t
        else:
            out[whole] |= t
        return whole + 1
    return whole


@njit(cache=True, nogil=True)
def _spread_bytes(bits, n, lanes, spread, out):
    """uint8 containers of `lanes` (1, 2, 4 or 8) lanes: each vote byte fills 8 // lanes containers,
    written as one word from a 256-row table (`spread` of the byte's lane groups), the tail
    one by one; every container is written."""
    per = 8 // lanes
    lmask = (1 << lanes) - 1
    whole = n // 8  # vote bytes whose 8 votes all lie below n
    rows = np.empty((256, per), dtype=np.uint8)
    for b in range(256):
        for q in range(per):
            rows[b, q] = spread[(b >> (q * lanes)) & lmask]
    src = bits[:whole]
    if per == 2:
        r16 = rows.reshape(-1).view(np.uint16)
        o16 = out[: whole * 2].view(np.uint16)
        for k in range(whole):
            o16[k] = r16[src[k]]
    elif per == 4:
        r32 = rows.reshape(-1).view(np.uint32)
        o32 = out[: whole * 4].view(np.uint32)
        for k in range(whole):
            o32[k] = r32[src[k]]
    elif per == 1:
        for k in range(whole):
            out[k] = rows[src[k], 0]
    else:
        r64 = rows.reshape(-1).view(np.uint64)
        o64 = out[: whole * 8].view(np.uint64)
        for k in range(whole):
            o64[k] = r64[src[k]]
    for j in range(whole * per, out.size):
        a = j * lanes
        if a >= n:  # containers past the last element: written 0 (`out` need not be zeroed)
            out[j] = 0
            continue
        v = (np.int64(bits[a >> 3]) >> (a & 7)) & lmask
        if n - a < lanes:
            v &= (1 << (n - a)) - 1
        out[j] = spread[v]


@njit(cache=True, nogil=True)
def bits_to_byte_lanes(bits, n, lanes, out, spread):
    """Votes (1 bit per element) -> uint8 count lane containers in `out` (consecutive
    elements, the layout of `lanes.pack`), every container written: `out` may come from
    np.empty (a zeroed buffer costs a pass of its own). `spread` is `spread_table(lane_bits)`."""
    if 8 % lanes == 0:
        _spread_bytes(bits, n, lanes, spread, out)
    else:
        done = _spread_block(bits, 0, n, lanes, out.size, spread, np.uint64(0), out, True)
        out[done:] = 0


@njit(cache=True, nogil=True)
def spread_21x3(bits, m, whole, spread, out):
    """int64 containers of 21 three-bit lanes (W = 4..7), all three blocks in one pass over
    containers j < `whole` (a multiple of 8, every lane's element below n): lanes 0-7 from vote
    byte j, lanes 8-15 from byte m + j, lanes 16-20 from 5 bits of the 5 bytes that 8 containers
    share. Each container is written once, by three scalar lookups in the 256-row byte table:
    2.4x faster than a pass per block (two of them read-modify-write)."""
    b0 = bits[:m]
    b1 = bits[m : 2 * m]
    tail = bits[2 * m :]  # lanes 16-20: element 16m + 5j on, byte-aligned
    for p in range(whole >> 3):
        src = tail[5 * p : 5 * p + 5]
        t = (np.uint64(src[0]) | (np.uint64(src[1]) << np.uint64(8)) | (np.uint64(src[2]) << np.uint64(16))
             | (np.uint64(src[3]) << np.uint64(24)) | (np.uint64(src[4]) << np.uint64(32)))
        for i in range(8):
            j = 8 * p + i
            out[j] = np.int64(spread[b0[j]] | (spread[b1[j]] << np.uint64(24))
                              | (spread[(t >> np.uint64(5 * i)) & np.uint64(31)] << np.uint64(48)))


@njit(cache=True, nogil=True)
def spread_6x5(bits, whole, spread, out):
    """int32 containers of 6 five-bit lanes (W = 16..31), containers j < `whole` (a multiple of
    4): 4 containers from the 24 votes of 3 bytes, one scalar lookup each (1.6x faster than a
    16-bit window read per container)."""
    for q in range(whole >> 2):
        src = bits[3 * q : 3 * q + 3]
        t = np.int64(src[0]) | (np.int64(src[1]) << 8) | (np.int64(src[2]) << 16)
        o = out[4 * q : 4 * q + 4]
        o[0] = np.int32(spread[t & 63])
        o[1] = np.int32(spread[(t >> 6) & 63])
        o[2] = np.int32(spread[(t >> 12) & 63])
        o[3] = np.int32(spread[t >> 18])


@njit(cache=True, nogil=True)
def bits_to_wide_lanes(bits, n, lane_bits, lanes, out, spread, done=0):
    """Votes -> int32 / int64 count lane containers in `out` (any contents: the first block
    writes, the others OR in): blocks of at most 8 lanes, element m*l0 + j*g + (l - l0) in
    lane l of container j (see lanes.py). Containers below `done` are already written whole
    by a layout's own pass (`spread_21x3`, `spread_6x5`, entry points of their own so that
    each container type compiles only the pass it uses); the rest go block by block."""
    m = out.size
    rest = out[done:]
    for l0 in range(0, lanes, 8):
        g = min(l0 + 8, lanes) - l0
        reached = _spread_block(bits, m * l0 + done * g, n, g, m - done, spread, np.uint64(l0 * lane_bits), rest,
                                l0 == 0)
        if l0 == 0:
            rest[reached:] = 0  # containers the first block did not reach hold no element


# ---- lane containers -> values --------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _pairs_u64(containers, shift, pairs, step, mask2, t2, out64):
    """out64[j * pairs + p] = t2[lanes 2p, 2p+1 of container j >> shift] (the 2 values as one word)."""
    if pairs == 4:
        for j in range(containers.size):
            prefetch_write(out64, 4 * j + _AHEAD64)
            c = np.uint64(containers[j]) >> shift
            out64[4 * j] = t2[c & mask2]
            out64[4 * j + 1] = t2[(c >> step) & mask2]
            out64[4 * j + 2] = t2[(c >> (step + step)) & mask2]
            out64[4 * j + 3] = t2[(c >> (step + step + step)) & mask2]
    elif pairs == 3:
        for j in range(containers.size):
            prefetch_write(out64, 3 * j + _AHEAD64)
            c = np.uint64(containers[j]) >> shift
            out64[3 * j] = t2[c & mask2]
            out64[3 * j + 1] = t2[(c >> step) & mask2]
            out64[3 * j + 2] = t2[(c >> (step + step)) & mask2]
    else:
        for j in range(containers.size):
            c = np.uint64(containers[j]) >> shift
            for p in range(pairs):
                out64[np.uint64(j * pairs + p)] = t2[(c >> (step * np.uint64(p))) & mask2]


@njit(cache=True, nogil=True)
def _five_lanes_u64(containers, shift, lane_bits, mask, mask2, t2, out64):
    """`_pairs_u64` for blocks of 5 lanes (W=4's 21 three-bit lanes end in one; so do W=32..63's
    5 six-bit lanes): containers 2i and 2i+1 give 10 values at an even offset, 5 uint64 pairs,
    the middle one from the first's lane 4 and the second's lane 0 (3x faster than 5 uint32
    stores per container)."""
    two = lane_bits + lane_bits
    for i in range(containers.size // 2):
        a = np.uint64(containers[2 * i]) >> shift
        b = np.uint64(containers[2 * i + 1]) >> shift
        prefetch_write(out64, 5 * i + _AHEAD64)
        o = out64[5 * i : 5 * i + 5]
        o[0] = t2[a & mask2]
        o[1] = t2[(a >> two) & mask2]
        o[2] = t2[((a >> (two + two)) & mask) | ((b & mask) << lane_bits)]
        o[3] = t2[(b >> lane_bits) & mask2]
        o[4] = t2[(b >> (two + lane_bits)) & mask2]


@njit(cache=True, nogil=True)
def _pairs_u32(containers, shift, g, lane_bits, mask2, mask, t2, table, ob):
    """ob[j * g + l] = value of lane l of container j >> shift, two lanes per lookup (odd g: the
    last one alone). Indices are unsigned: numba then skips its negative-index handling."""
    for j in range(containers.size):
        c = np.uint64(containers[j]) >> shift
        o = j * g
        for p in range(0, g - 1, 2):
            key = (c >> np.uint64(p * lane_bits)) & np.uint64(mask2)
            ob[np.uint64(o + p)] = t2[key, np.uint64(0)]
            ob[np.uint64(o + p + 1)] = t2[key, np.uint64(1)]
        if g & 1:
            ob[np.uint64(o + g - 1)] = table[(c >> np.uint64((g - 1) * lane_bits)) & np.uint64(mask)]


@njit(cache=True, nogil=True)
def decode_byte_lanes(containers, lane_bits, lanes, numel, table, out):
    """out[e] = table[lane value of element e] for e < numel, uint8 containers (layout of
    `lanes.pack`): each container byte's lanes move as lanes/2 uint64 words of a 256-row table."""
    m = containers.size
    mask = (1 << lane_bits) - 1
    if lanes == 1:
        for j in range(numel):
            out[j] = table[containers[j]]
        return
    whole = min(m, numel // lanes)
    # container byte -> its lanes' fp32 values, moved as lanes/2 uint64 words per container
    rows = np.empty((256, lanes), dtype=np.float32)
    for c in range(256):
        for lane in range(lanes):
            rows[c, lane] = table[(c >> (lane * lane_bits)) & mask]
    half = lanes // 2
    rows64 = rows.reshape(-1).view(np.uint64)
    out64 = out[: whole * lanes].view(np.uint64)
    src = containers[:whole]
    if half == 1:
        for j in range(whole):
            prefetch_write(out64, j + _AHEAD64)
            out64[j] = rows64[src[j]]
    elif half == 2:  # flat indices with a constant stride: no 2-D index arithmetic per word
        for j in range(whole):
            prefetch_write(out64, 2 * j + _AHEAD64)
            c = np.int64(src[j]) * 2
            out64[2 * j] = rows64[c]
            out64[2 * j + 1] = rows64[c + 1]
    else:
        for j in range(whole):
            c = np.int64(src[j]) * half
            for q in range(half):
                out64[j * half + q] = rows64[c + q]
    for e in range(whole * lanes, numel):
        out[e] = table[(np.int64(containers[e // lanes]) >> ((e % lanes) * lane_bits)) & mask]


@njit(cache=True, nogil=True)
def decode_wide_lanes(containers, lane_bits, lanes, numel, table, out):
    """out[e] = table[lane value of element e] for e < numel, int32 / int64 containers (layout
    of `lanes.pack`): blocks of at most 8 lanes, two lanes per table lookup where they fit."""
    m = containers.size
    mask = (1 << lane_bits) - 1
    pairs = 2 * lane_bits <= 12
    if pairs:  # two lanes -> their two values in one lookup (at most 4096 rows of 8 bytes)
        t2 = np.empty((1 << (2 * lane_bits), 2), dtype=table.dtype)
        for v in range(1 << (2 * lane_bits)):
            t2[v, 0] = table[v & mask]
            t2[v, 1] = table[v >> lane_bits]
    else:
        t2 = np.empty((0, 2), dtype=table.dtype)
    mask2 = (1 << (2 * lane_bits)) - 1
    for l0 in range(0, lanes, 8):
        g = min(l0 + 8, lanes) - l0
        base = m * l0
        if base >= numel:
            break
        whole = min(m, (numel - base) // g)  # containers whose g elements all lie below numel
        ob = out[base : base + whole * g]
        if pairs:
            if g % 2 == 0 and base % 2 == 0:  # whole pairs at even offsets: one uint64 per pair
                _pairs_u64(containers[:whole], np.uint64(l0 * lane_bits), g // 2, np.uint64(2 * lane_bits),
                           np.uint64(mask2), t2.reshape(-1).view(np.uint64), ob.view(np.uint64))
            elif g == 5 and base % 2 == 0:  # two containers: 10 values, 5 uint64 pairs (one across the two)
                two = whole & ~1
                _five_lanes_u64(containers[:two], np.uint64(l0 * lane_bits), np.uint64(lane_bits), np.uint64(mask),
                                np.uint64(mask2), t2.reshape(-1).view(np.uint64), ob[: two * 5].view(np.uint64))
                _pairs_u32(containers[two:whole], np.uint64(l0 * lane_bits), g, lane_bits, mask2, mask, t2, table,
                           ob[two * 5 :])
            else:
                _pairs_u32(containers[:whole], np.uint64(l0 * lane_bits), g, lane_bits, mask2, mask, t2, table, ob)
        else:
            for j in range(whole):
                c = np.int64(containers[j])
                for lane in range(g):
                    ob[j * g + lane] = table[(c >> ((l0 + lane) * lane_bits)) & mask]
        a = base + whole * g
        if whole < m and a < numel:
            c = np.int64(containers[whole])
            for lane in range(numel - a):
                out[a + lane] = table[(c >> ((l0 + lane) * lane_bits)) & mask]


@njit(cache=True, nogil=True, inline="always")
def _fold_word(t, lane_bits):
    """The 8 values (each < 2**lane_bits, lane_bits 1, 2 or 4) of the uint64 `t` packed into its low
    8 // (8 // lane_bits) bytes, value i at bits lane_bits * i: each fold ORs a field's upper half
    down onto its lower half and masks (no field carries into another: the values' high bits are 0)."""
    if lane_bits == 4:  # 2 values a byte: fold pairs, then gather the 4 low bytes of the 16-bit fields
        t = (t | (t >> np.uint64(4))) & np.uint64(0x00FF00FF00FF00FF)
        t = (t | (t >> np.uint64(8))) & np.uint64(0x0000FFFF0000FFFF)
        return (t | (t >> np.uint64(16))) & np.uint64(0xFFFFFFFF)
    if lane_bits == 2:  # 4 a byte: pairs, quads, then the 2 low bytes of the 32-bit fields
        t = (t | (t >> np.uint64(6))) & np.uint64(0x000F000F000F000F)
        t = (t | (t >> np.uint64(12))) & np.uint64(0x000000FF000000FF)
        return (t | (t >> np.uint64(24))) & np.uint64(0xFFFF)
    t = (t | (t >> np.uint64(7))) & np.uint64(0x0003000300030003)  # 8 a byte: pairs, quads, octets
    t = (t | (t >> np.uint64(14))) & np.uint64(0x0000000F0000000F)
    return (t | (t >> np.uint64(28))) & np.uint64(0xFF)


@njit(cache=True, nogil=True)
def pack_bytes(values, lane_bits, out):
    """Lane-pack uint8 values (each < 2**lane_bits; lane_bits 1, 2 or 4) into uint8 containers of
    8 // lane_bits lanes. Whole words of 8 values are folded in a register (`_fold_word`) and
    stored as their 8 // lanes container bytes; the last, partial word value by value. Per 4M
    values on one core: 0.2-0.4 ms, against 2.2-5.2 ms for the value-by-value loop over a
    (containers, lanes) grid it replaces (the level kernel beside it takes about 2)."""
    lanes = 8 // lane_bits
    per = 8 // lanes  # container bytes per word of 8 values
    n = values.size
    words = n // 8
    v64 = values[: words * 8].view(np.uint64)
    if per == 4:  # one loop per width, each its stores written out (a slice per word ran 5x slower)
        for w in range(words):
            t = _fold_word(v64[w], lane_bits)
            out[4 * w] = np.uint8(t & np.uint64(0xFF))
            out[4 * w + 1] = np.uint8((t >> np.uint64(8)) & np.uint64(0xFF))
            out[4 * w + 2] = np.uint8((t >> np.uint64(16)) & np.uint64(0xFF))
            out[4 * w + 3] = np.uint8(t >> np.uint64(24))
    elif per == 2:
        for w in range(words):
            t = _fold_word(v64[w], lane_bits)
            out[2 * w] = np.uint8(t & np.uint64(0xFF))
            out[2 * w + 1] = np.uint8(t >> np.uint64(8))
    else:
        for w in range(words):
            out[w] = np.uint8(_fold_word(v64[w], lane_bits))
    for j in range(words * per, out.size):
        c = 0
        for lane in range(lanes):
            e = j * lanes + lane
            if e < n:
                c |= np.int64(values[e]) << (lane * lane_bits)
        out[j] = c


# ---- count lanes -> small digits (signscatter's owner step) ---------------------------------------


@njit(cache=True, nogil=True)
def byte_lane_digits(containers, lane_bits, lanes, numel, digit, out):
    """out[e] = digit[lane value of element e] (uint8) for e < numel, uint8 containers (consecutive
    lanes): `decode_byte_lanes` with a uint8 table, for a shard's counts -> majority digits."""
    mask = (1 << lane_bits) - 1
    whole = min(containers.size, numel // lanes)
    for j in range(whole):
        c = np.int64(containers[j])
        for lane in range(lanes):
            out[j * lanes + lane] = digit[(c >> (lane * lane_bits)) & mask]
    for e in range(whole * lanes, numel):
        out[e] = digit[(np.int64(containers[e // lanes]) >> ((e % lanes) * lane_bits)) & mask]


@njit(cache=True, nogil=True)
def pack_trits(digits, out):
    """Digits in {0, 1, 2} (a multiple of 40) -> trit bytes: byte e of each group of 8 is the sum
    over k of digit 8k + e of the group's 40 times 3**k (`sign.scatter.pack_trits`'s order)."""
    for g in range(out.size // 8):
        d = digits[40 * g : 40 * g + 40]
        o = out[8 * g : 8 * g + 8]
        for e in range(8):
            o[e] = d[e] + 3 * d[8 + e] + 9 * d[16 + e] + 27 * d[24 + e] + 81 * d[32 + e]
