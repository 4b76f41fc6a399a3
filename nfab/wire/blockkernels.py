"""Compiled CPU kernels of block-scaled qsum (`blockq.py`): block maxima, levels, radix digits.

Why: the torch reference of block-scaled qsum runs a dozen full passes per encode — the
per-element block index, a scatter for the block maxima, the gathered scale vector, the
64-bit noise hash as seven int64 tensor ops, a radix multiply-and-sum — about 50 ns per
element on one core (1M elements: 50 ms encode, 17 ms decode at bq2, W=4). That is the
route the calibrated GPT profiles choose everywhere, so it decided both the hook's CPU per
step and the calibration's replay. These kernels do each of encode and decode in one pass.

Each kernel follows its torch reference's float32 operations in the same order (no fused
multiply-add: numba compiles without fastmath), so the levels, containers and decoded
values are the same bits; tests/wire/test_blockq_fast.py holds them to it. Inputs are
numpy views of contiguous CPU tensors (`blockq.py` dispatches); blocks restart in every
segment and are numbered consecutively across segments, as `blockq._block_index` numbers them
(`blockq._block_bounds` gives the kernels that need no segment their offsets).
"""

from __future__ import annotations

import numpy as np
from numba import njit

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # the constants of `nfab.wire.noise` (its docstring: the semantics)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_MASK24 = np.uint64((1 << 24) - 1)
_U24 = np.float32(2.0**-24)


@njit(cache=True, nogil=True)
def block_max_bits(u, block_starts, block_ends, out):
    """out[b] = max |x| of block b as float32 bits (`u`: x's uint32 bits): the integer order of
    |x|'s bits is the order of |x|, NaN above inf, so a NaN block gives a NaN (as the reference's
    scatter amax does)."""
    mask = np.uint32(0x7FFFFFFF)
    for b in range(block_starts.size):
        m = np.uint32(0)
        for i in range(block_starts[b], block_ends[b]):
            v = u[i] & mask
            m = v if v > m else m
        out[b] = m


@njit(cache=True, nogil=True)
def block_levels(x, keys, shift, seg_starts, seg_ends, block, scale_of_block, one, half_m, max_level, levels):
    """levels[i] = floor((x/s + 1) * M/2 + u) clamped to [0, M] with s = its block's scale (1
    where the scale is 0), u the stratified noise of `nfab.wire.noise` for (segment key, index in
    segment, `shift`): the reference's float32 operations in its order (`BlockQSum.encode`)."""
    top = np.float32(max_level)
    zero = np.float32(0)
    sh = np.uint64(shift)
    b = 0
    for s in range(seg_starts.size):
        a = seg_starts[s]
        e = seg_ends[s]
        key = np.uint64(keys[s])
        for b0 in range(a, e, block):
            b1 = min(b0 + block, e)
            sc = scale_of_block[b]
            sc = sc if sc > zero else one
            z = key + np.uint64(b0 - a) * _GOLDEN
            for i in range(b0, b1):
                z += _GOLDEN  # key + (index + 1) * golden, stepped
                y = (z ^ (z >> np.uint64(30))) * _MIX1
                y = (y ^ (y >> np.uint64(27))) * _MIX2
                # splitmix64's last step, y ^ (y >> 31), changes no bit above 32: u keeps bits 40-63
                u = np.float32(np.int64(((y >> np.uint64(40)) + sh) & _MASK24)) * _U24
                t = np.floor((x[i] / sc + one) * half_m + u)
                levels[i] = np.uint8(min(max(t, zero), top))
            b += 1


@njit(cache=True, nogil=True)
def radix_pack(levels, radix, digits, out):
    """out[j] = sum_d levels[j*k + d] * R^d (Horner from the top digit; exact in int64), the
    missing digits of the last container zero: `radix.pack`."""
    n = levels.size
    r = np.int64(radix)
    for j in range(out.size):
        c = np.int64(0)
        base = j * digits
        for d in range(digits - 1, -1, -1):
            i = base + d
            if i < n:
                c = c * r + np.int64(levels[i])
            else:
                c = c * r
        out[j] = c


@njit(cache=True, nogil=True, inline="always")
def _digits_into(v, radix, inv, count, out, at, numel):
    """The `count` low base-R digits of v (0 <= v < 2^51) into out[at:], least significant first.

    No integer division: q = floor((v + 0.5) / R) is exact in float64 for v < 2^51 (the true
    quotient sits at least 0.5/R from an integer; the rounding error is below v * 2^-52 / R)."""
    for d in range(count):
        q = np.int64((np.float64(v) + 0.5) * inv)
        if at + d < numel:
            out[at + d] = v - q * radix  # uint8 digits (uint16 above radix 256)
        v = q


@njit(cache=True, nogil=True)
def radix_digits(containers, radix, digits, numel, out):
    """out[i] = digit i of the (summed) containers: `radix.unpack`, without a 64-bit division.

    A container (< 2^63) is split once into c = hi * R^h + lo with both parts below 2^51 (the
    float64 quotient corrected by integer steps), then each part's digits come from
    `_digits_into`."""
    r = np.int64(radix)
    inv = 1.0 / np.float64(radix)
    h = digits // 2
    p = np.int64(1)
    for _ in range(h):
        p *= r
    inv_p = 1.0 / np.float64(p)
    for j in range(containers.size):
        c = containers[j]
        hi = np.int64(np.float64(c) * inv_p)
        lo = c - hi * p
        while lo < 0:
            lo += p
            hi -= 1
        while lo >= p:
            lo -= p
            hi += 1
        at = j * digits
        _digits_into(lo, r, inv, h, out, at, numel)
        _digits_into(hi, r, inv, digits - h, out, at + h, numel)


@njit(cache=True, nogil=True)
def table_blocks(index, values, block_starts, block_ends, scale_of_block, out):
    """out[i] = values[index[i]] * (its block's scale): `BlockQSum.decode`'s value table and
    block scales in one pass."""
    for b in range(block_starts.size):
        sc = scale_of_block[b]
        for i in range(block_starts[b], block_ends[b]):
            out[i] = values[index[i]] * sc


@njit(cache=True, nogil=True)
def scale_blocks(out, block_starts, block_ends, scale_of_block):
    """out[i] *= its block's scale, in place (after a bit-lane table decode)."""
    for b in range(block_starts.size):
        sc = scale_of_block[b]
        for i in range(block_starts[b], block_ends[b]):
            out[i] = out[i] * sc


# ---- blockqscatter (`blockqscatter.py`): shards of bit lanes, the owner's exact sums --------------
@njit(cache=True, nogil=True)
def pack_lane_shards(values, numel, shard, lane_bits, lanes, out):
    """out[r] = `lanes.pack(values[r*shard : (r+1)*shard], layout)` for every row r of `out`
    (W x m containers, m * lanes == shard), elements at or past `numel` packed as 0: the lane
    order of `lanes.pack` (blocks of at most 8 lanes, container-major within a block)."""
    w, m = out.shape
    for r in range(w):
        first = r * shard
        if first + shard <= numel:  # a whole shard: no bound check per element
            _pack_row(values, first, m, lane_bits, lanes, out[r])
            continue
        for j in range(m):
            c = np.int64(0)
            for l0 in range(0, lanes, 8):
                g = min(l0 + 8, lanes) - l0
                for k in range(g):
                    i = first + m * l0 + j * g + k
                    if i < numel:
                        c |= np.int64(values[i]) << np.int64((l0 + k) * lane_bits)
            out[r, j] = c


@njit(cache=True, nogil=True, inline="always")
def _pack_row(values, first, m, lane_bits, lanes, out):
    """`pack_lane_shards` of one whole shard starting at `first`."""
    for l0 in range(0, lanes, 8):
        g = min(l0 + 8, lanes) - l0
        base = first + m * l0
        for j in range(m):
            c = np.int64(0) if l0 == 0 else np.int64(out[j])
            at = base + j * g
            for k in range(g):
                c |= np.int64(values[at + k]) << np.int64((l0 + k) * lane_bits)
            out[j] = c


@njit(cache=True, nogil=True)
def sum_lane_rows(rows, lane_bits, lanes, out):
    """out[e] = sum over rows r of lane value e of row r (`lanes.unpack` of each row's m
    containers, added exactly as integers); out.size == m * lanes (a whole shard)."""
    w, m = rows.shape
    mask = np.int64((1 << lane_bits) - 1)
    out[:] = 0
    for r in range(w):
        for l0 in range(0, lanes, 8):
            g = min(l0 + 8, lanes) - l0
            base = m * l0
            for j in range(m):
                c = np.int64(rows[r, j]) >> np.int64(l0 * lane_bits)
                at = base + j * g
                for k in range(g):
                    out[at + k] += c & mask
                    c >>= np.int64(lane_bits)
