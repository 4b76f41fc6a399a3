"""Compiled CPU kernels of block-scaled qsum (`blockq.py`): block maxima, levels, radix digits.

Why: the torch reference of block-scaled qsum runs a dozen full passes per encode — the
per-element block index, a scatter for the block maxima, the gathered scale vector, the
64-bit noise hash as seven int64 tensor ops, a radix multiply-and-sum — about 50 ns per
element on one core (1M elements: 50 ms encode, 17 ms decode at bq2, W=4). That is the
route the calibrated GPT profiles choose everywhere, so it decided both the hook's CPU per
step and the calibration's replay. These kernels do each of encode and decode in one pass.

What keeps them near memory speed (issue #16: bq2 at W=4 went from ~3.5 + ~4.3 ms to ~1.9 + ~1.6
ms of encode + decode per 1M elements, one core): inner loops index slices from 0 (numba then
drops its negative-index handling and LLVM vectorizes), nothing carries a chain from element to
element (the hash counter comes from the index, radix packing is a dot product with the powers,
every digit its own float64 quotient), and no integer division runs per digit.

Each kernel follows its torch reference's float32 operations in the same order (no fused
multiply-add: numba compiles without fastmath), so the levels, containers and decoded
values are the same bits; tests/wire/test_blockq_fast.py holds them to it. Inputs are
numpy views of contiguous CPU tensors (`blockq.py` dispatches); blocks restart in every
segment and are numbered consecutively across segments, as `blockq.grid.block_index` numbers them
(`blockq._block_bounds` gives the kernels that need no segment their offsets).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from nfab.wire.blockq.table import CODE_OFFSET, CODES_PER_OCTAVE  # numba reads them as constants
from nfab.wire.shared_kernels import counter, next_counter, noise_u


@njit(cache=True, nogil=True)
def block_max_bits(u, block_starts, block_ends, out):
    """out[b] = max |x| of block b as float32 bits (`u`: x's uint32 bits): the integer order of
    |x|'s bits is the order of |x|, NaN above inf, so a NaN block gives a NaN (as the reference's
    scatter amax does). The inner loop runs over a slice from index 0 so that it vectorizes."""
    mask = np.uint32(0x7FFFFFFF)
    for b in range(block_starts.size):
        ub = u[block_starts[b]:block_ends[b]]
        m = np.uint32(0)
        for k in range(ub.size):
            v = ub[k] & mask
            m = v if v > m else m
        out[b] = m


@njit(cache=True, nogil=True)
def scale_codes(bits, octave_bits, out):
    """out[b] = smallest code whose scale covers block max b (`bits`: the maxima's fp32 bits as
    uint32) by exponent arithmetic (`table`), NaN and -0.0 as 0. `octave_bits`: the uint32
    bits of the octave [1, 2)'s four scales (`table.SCALES` from CODE_OFFSET), compared with the
    maximum's mantissa (as [1, 2)) as integers, whose order is the floats' there. Branch-free, so
    it vectorizes: per 64K blocks on one core, a binary search over the 256 scales took 0.65 ms."""
    for b in range(bits.size):
        u = np.int64(bits[b])
        mantissa = (u & 0x7FFFFF) | 0x3F800000
        code = CODE_OFFSET + CODES_PER_OCTAVE * (((u >> 23) & 0xFF) - 127)
        for j in range(CODES_PER_OCTAVE):
            code += 1 if octave_bits[j] < mantissa else 0
        code = min(max(code, 1), 255)
        out[b] = code if 0 < u <= 0x7F800000 else 0  # m > 0: not 0, -0.0 or NaN (bits above inf's)


@njit(cache=True, nogil=True)
def scales_of_codes(codes, scales, out):
    """out[b] = scales[codes[b]]: each block's agreed scale (fp32) from its uint8 code (a table of 256
    in L1; torch's index with the codes widened to int64 took 0.15 ms per 64K blocks on one core)."""
    for b in range(codes.size):
        out[b] = scales[codes[b]]


@njit(cache=True, nogil=True, error_model="numpy")
def block_levels(x, keys, shift, seg_starts, seg_ends, block, scale_of_block, one, half_m, max_level, levels):
    """levels[i] = floor((x/s + 1) * M/2 + u) clamped to [0, M] with s = its block's scale (1
    where the scale is 0), u the stratified noise of `nfab.wire.noise` for (segment key, index in
    segment, `shift`): the reference's float32 operations in its order (`BlockQSum.encode`).

    Each block is one loop over slices from index 0, the noise counter stepped by an add
    (`kernels.noise_u`, `next_counter`: 32-bit lanes), so LLVM vectorizes hash, division and
    rounding together; error_model "numpy" drops the per-element zero-division check (the
    divisor is never 0), not a rounding."""
    top = np.float32(max_level)
    zero = np.float32(0)
    sh = np.uint32(shift)
    b = 0
    for s in range(seg_starts.size):
        a = seg_starts[s]
        e = seg_ends[s]
        for b0 in range(a, e, block):
            b1 = min(b0 + block, e)
            sc = scale_of_block[b]
            sc = sc if sc > zero else one
            c, hi = counter(keys[s], b0 - a)  # the counter at the block's start
            xb = x[b0:b1]
            lb = levels[b0:b1]
            for k in range(xb.size):
                t = np.floor((xb[k] / sc + one) * half_m + noise_u(c, hi, sh))
                t = t if t > zero else zero
                t = t if t < top else top
                lb[k] = np.uint8(np.int32(t))
                c = next_counter(c)
            b += 1


@njit(cache=True, nogil=True)
def radix_pack(levels, radix, digits, out):
    """out[j] = sum_d levels[j*k + d] * R^d (exact in int64: the sum stays below R^k <= 2^63), the
    missing digits of the last container zero: `radix.pack`. An integer dot product with the
    powers instead of Horner's chain: no carried dependency, and it vectorizes."""
    n = levels.size
    powers = np.empty(digits, dtype=np.int64)
    p = np.int64(1)
    for d in range(digits):
        powers[d] = p
        p *= np.int64(radix)
    whole = min(n // digits, out.size)
    for j in range(whole):
        lv = levels[j * digits:(j + 1) * digits]
        c = np.int64(0)
        for d in range(digits):
            c += np.int64(lv[d]) * powers[d]
        out[j] = c
    for j in range(whole, out.size):  # the last, partly filled container and any padding
        c = np.int64(0)
        for d in range(digits):
            i = j * digits + d
            if i < n:
                c += np.int64(levels[i]) * powers[d]
        out[j] = c


_DIGIT_CHUNK = 256  # containers per pass of the digit kernels: their scratch stays in L1


@njit(cache=True, nogil=True)
def _inverse_powers(r, digits):
    """(1 / R^d for d = 0 .. k - k//2, R^(k//2)): what `_chunk_digits` needs."""
    h = digits // 2
    inv_powers = np.empty(digits - h + 1, dtype=np.float64)
    p = np.int64(1)
    p_lo = np.int64(1)
    for d in range(digits - h + 1):
        inv_powers[d] = 1.0 / np.float64(p)
        if d == h:
            p_lo = p
        p *= r
    return inv_powers, p_lo


@njit(cache=True, nogil=True, inline="always")
def _chunk_digits(cc, r, digits, inv_powers, p_lo, halves, quotients, out):
    """out[d, j] = digit d of container cc[j] (< 2^63), for a chunk of containers: no integer
    division and no chain from digit to digit, every loop over the chunk's containers (SIMD lanes).

    1. Split c = hi * R^h + lo (h = k // 2): the float64 quotient is off by at most one, since
       R^h >= 2^13 for every layout here (c * 2^-52 / R^h < 1), and one correction each way fixes it;
       both parts are then below 2^51.
    2. q_d = floor((v + 0.5) / R^d) for each part v: exact in float64 for v < 2^51 (the true
       quotient sits at least 0.5/R^d from an integer; the rounding error is below v * 2^-52 / R^d).
    3. digit d = q_d - R * q_(d+1), exact in float64."""
    h = digits // 2
    m = cc.size
    inv_p = 1.0 / np.float64(p_lo)
    lo_f = halves[0]
    hi_f = halves[1]
    for j in range(m):
        c = cc[j]
        hi = np.int64(np.float64(c) * inv_p)
        lo = c - hi * p_lo
        neg = lo < 0
        lo = lo + p_lo if neg else lo
        hi = hi - 1 if neg else hi
        big = lo >= p_lo
        lo = lo - p_lo if big else lo
        hi = hi + 1 if big else hi
        lo_f[j] = np.float64(lo) + 0.5
        hi_f[j] = np.float64(hi) + 0.5
    for d in range(h + 1):  # quotients of lo in rows 0..h, of hi in rows h+1..k+1
        q = quotients[d]
        iv = inv_powers[d]
        for j in range(m):
            q[j] = np.floor(lo_f[j] * iv)
    for d in range(digits - h + 1):
        q = quotients[h + 1 + d]
        iv = inv_powers[d]
        for j in range(m):
            q[j] = np.floor(hi_f[j] * iv)
    rf = np.float64(r)
    for d in range(digits):
        row = d if d < h else d + 1
        q0 = quotients[row]
        q1 = quotients[row + 1]
        o = out[d]
        for j in range(m):
            o[j] = np.int32(q0[j] - rf * q1[j])


@njit(cache=True, nogil=True, inline="always")
def _digit_scratch(r, digits):
    """What `_chunk_digits` needs for one chunk of containers: the inverse powers of the radix and
    the scratch rows it fills (allocated once per call, reused by every chunk)."""
    inv_powers, p_lo = _inverse_powers(r, digits)
    halves = np.empty((2, _DIGIT_CHUNK), dtype=np.float64)
    quotients = np.empty((digits + 2, _DIGIT_CHUNK), dtype=np.float64)
    dig = np.empty((digits, _DIGIT_CHUNK), dtype=np.int32)
    return inv_powers, p_lo, halves, quotients, dig


@njit(cache=True, nogil=True, inline="always")
def _scale_span(out, a, e, b, block_starts, block_ends, scale_of_block):
    """out[a:e] times each block's scale, for the blocks from `b` on that meet [a, e) (a chunk's
    elements, in order); returns the block the next chunk starts in (one reaching past e goes on there)."""
    while b < block_starts.size and block_starts[b] < e:
        sb = scale_of_block[b]
        part = out[max(block_starts[b], a):min(block_ends[b], e)]
        for k in range(part.size):
            part[k] = part[k] * sb
        if block_ends[b] > e:
            break
        b += 1
    return b


@njit(cache=True, nogil=True, error_model="numpy")
def radix_decode_blocks(containers, radix, digits, numel, table, block_starts, block_ends, scale_of_block, out):
    """out[i] = table[digit i of the (summed) containers] * (its block's scale): `radix.unpack`, the
    value table and the block scales of `BlockQSum.decode` in one pass, same float32 products.

    Per chunk of containers (L1): their digits (`_chunk_digits`), then the table values in element
    order straight into `out`, then the chunk's blocks scaled in place."""
    r = np.int64(radix)
    inv_powers, p_lo, halves, quotients, dig = _digit_scratch(r, digits)
    nc = min(containers.size, -(-numel // digits))
    b = 0
    for j0 in range(0, nc, _DIGIT_CHUNK):
        cc = containers[j0:min(j0 + _DIGIT_CHUNK, nc)]
        _chunk_digits(cc, r, digits, inv_powers, p_lo, halves, quotients, dig)
        a = j0 * digits
        e = min((j0 + cc.size) * digits, numel)
        ob = out[a:e]
        for j in range(cc.size):
            row = ob[j * digits:(j + 1) * digits]  # the last container may hold fewer elements
            for d in range(row.size):
                row[d] = table[dig[d, j]]
        b = _scale_span(out, a, e, b, block_starts, block_ends, scale_of_block)


@njit(cache=True, nogil=True)
def radix_pack_chunked(levels, radix, digits, chunk, out):
    """`radix.pack` of a chunked layout (`out`: its containers; elements past the levels 0): per chunk
    of g containers, out[c0 + i] = sum_d levels[k * c0 + d * g + i] * R^d, digit by digit over
    contiguous rows (it vectorizes; exact in int64 in any order)."""
    n, m = levels.size, out.size
    powers = np.empty(digits, dtype=np.int64)
    p = np.int64(1)
    for d in range(digits):
        powers[d] = p
        p *= np.int64(radix)
    for c0 in range(0, m, chunk):
        g = min(chunk, m - c0)
        e0 = c0 * digits
        dest = out[c0:c0 + g]
        if e0 + g * digits <= n:
            row = levels[e0:e0 + g]
            for i in range(g):
                dest[i] = np.int64(row[i])
            for d in range(1, digits):
                row = levels[e0 + d * g:e0 + (d + 1) * g]
                pd = powers[d]
                for i in range(g):
                    dest[i] += np.int64(row[i]) * pd
            continue
        for i in range(g):
            c = np.int64(0)
            for d in range(digits):
                e = e0 + d * g + i
                if e < n:
                    c += np.int64(levels[e]) * powers[d]
            dest[i] = c


@njit(cache=True, nogil=True, error_model="numpy")
def radix_decode_chunked(containers, radix, digits, chunk, numel, table, block_starts, block_ends, scale_of_block,
                         out):
    """`radix_decode_blocks` of a chunked layout: per chunk of containers, their digits
    (`_chunk_digits`), each digit's row of table values into its contiguous run of `out`, then the
    chunk's blocks scaled in place. Same float32 products."""
    r = np.int64(radix)
    inv_powers, p_lo, halves, quotients, dig = _digit_scratch(r, digits)
    m = containers.size
    b = 0
    for c0 in range(0, m, chunk):
        g = min(chunk, m - c0)
        e0 = c0 * digits
        if e0 >= numel:
            break
        _chunk_digits(containers[c0:c0 + g], r, digits, inv_powers, p_lo, halves, quotients, dig)
        e = min(e0 + g * digits, numel)
        for d in range(digits):
            a = e0 + d * g
            count = min(g, numel - a)
            if count <= 0:
                break
            row = out[a:a + count]
            dd = dig[d]
            for i in range(count):
                row[i] = table[dd[i]]
        b = _scale_span(out, e0, e, b, block_starts, block_ends, scale_of_block)


@njit(cache=True, nogil=True)
def lanes_decode_chunked(containers, lane_bits, lanes, chunk, numel, unit, block_starts, block_ends, scale_of_block,
                         out):
    """`BlockQSum.decode` of chunked bit lanes in one pass: out[e] = (S * unit - 1) * its block's scale,
    S the lane value of element e, in float32 in that order (the bits of the value table
    `arange * unit - 1` times the block scale). Each lane of a chunk is a contiguous row, so the
    arithmetic runs over rows (it vectorizes), where a table lookup per element ran scalar (1.8 ms
    per 4M 4-bit lanes on one core)."""
    m = containers.size
    mask = (1 << lane_bits) - 1
    one = np.float32(1.0)
    b = 0
    for c0 in range(0, m, chunk):
        g = min(chunk, m - c0)
        e0 = c0 * lanes
        if e0 >= numel:
            break
        src = containers[c0:c0 + g]
        for lane in range(lanes):
            first = e0 + lane * g
            count = min(g, numel - first)
            if count <= 0:
                break
            shift = lane * lane_bits
            row = out[first:first + count]
            for j in range(count):
                row[j] = np.float32((src[j] >> shift) & mask) * unit - one
        e = min(e0 + g * lanes, numel)
        b = _scale_span(out, e0, e, b, block_starts, block_ends, scale_of_block)


@njit(cache=True, nogil=True, error_model="numpy")
def radix_digits(containers, radix, digits, numel, out):
    """out[i] = digit i of the (summed) containers: `radix.unpack` (the owner's sum of own digits
    in `blockqscatter`), the digits as `_chunk_digits` finds them."""
    r = np.int64(radix)
    inv_powers, p_lo, halves, quotients, dig = _digit_scratch(r, digits)
    nc = min(containers.size, -(-numel // digits))
    for j0 in range(0, nc, _DIGIT_CHUNK):
        cc = containers[j0:min(j0 + _DIGIT_CHUNK, nc)]
        _chunk_digits(cc, r, digits, inv_powers, p_lo, halves, quotients, dig)
        a = j0 * digits
        ob = out[a:min((j0 + cc.size) * digits, numel)]
        for j in range(cc.size):
            row = ob[j * digits:(j + 1) * digits]
            for d in range(row.size):
                row[d] = dig[d, j]


@njit(cache=True, nogil=True)
def scale_blocks(out, block_starts, block_ends, scale_of_block):
    """out[i] *= its block's scale, in place (after a bit-lane table decode); slices from index 0
    so that the loop vectorizes."""
    for b in range(block_starts.size):
        sc = scale_of_block[b]
        ob = out[block_starts[b]:block_ends[b]]
        for k in range(ob.size):
            ob[k] = ob[k] * sc


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
            if lanes <= 8:
                _pack_block_row(values, first, m, lane_bits, lanes, out[r])
            else:
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
def _pack_block_row(values, first, m, lane_bits, lanes, out):
    """`pack_lane_shards` of one whole shard of a one-block layout (at most 8 lanes: element j * lanes
    + k is lane k of container j): container by container, over a fixed 8 lanes with the unused ones
    skipped, so the loop unrolls. Per 4M values of 5 or 6 bits on one core: 0.75-0.8 ms, against
    2.6 for a pass per lane (`_pack_row`) and 1.8-2.0 for a loop over `lanes`."""
    vr = values[first:first + m * lanes]
    for j in range(m):
        b = lanes * j
        c = np.int64(0)
        for k in range(8):
            if k < lanes:
                c |= np.int64(vr[b + k]) << np.int64(k * lane_bits)
        out[j] = c


@njit(cache=True, nogil=True, inline="always")
def _pack_row(values, first, m, lane_bits, lanes, out):
    """`pack_lane_shards` of one whole shard starting at `first`: one pass per lane, each a loop
    over the m containers on slices from index 0 (strided loads, no negative-index handling:
    it vectorizes)."""
    vr = values[first:first + m * lanes]
    for l0 in range(0, lanes, 8):
        g = min(l0 + 8, lanes) - l0
        vb = vr[m * l0:m * (l0 + g)]
        for k in range(g):
            shift = np.int64((l0 + k) * lane_bits)
            vk = vb[k:]
            if l0 == 0 and k == 0:
                for j in range(m):
                    out[j] = np.int64(vk[j * g]) << shift
            else:
                for j in range(m):
                    out[j] = np.int64(out[j]) | (np.int64(vk[j * g]) << shift)


@njit(cache=True, nogil=True)
def sum_lane_rows(rows, lane_bits, lanes, out):
    """out[e] = sum over rows r of lane value e of row r (`lanes.unpack` of each row's m
    containers, added exactly as integers); out.size == m * lanes (a whole shard). One pass per
    row and lane over the m containers, on slices from index 0 (it vectorizes)."""
    w, m = rows.shape
    mask = np.int64((1 << lane_bits) - 1)
    out[:] = 0
    for r in range(w):
        row = rows[r]
        for l0 in range(0, lanes, 8):
            g = min(l0 + 8, lanes) - l0
            ob = out[m * l0:m * (l0 + g)]
            for k in range(g):
                shift = np.int64((l0 + k) * lane_bits)
                ok = ob[k:]
                for j in range(m):
                    ok[j * g] += (np.int64(row[j]) >> shift) & mask
