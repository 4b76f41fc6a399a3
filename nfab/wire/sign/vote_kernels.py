"""Compiled CPU kernels for the majority vote: bit-sliced counting and word-wide selects.

The majority decode only needs, per element, whether the count c of positive votes is above
W/2, equal to it (a tie, even W only) or below. Counting W packed bit rows bit-sliced (one
uint64 word of 64 elements per operation, vectorized) and comparing the count's bit planes
with W // 2 gives two bit masks; a vectorized select per element over each 64-bit mask word
then writes the fp32 values (hi = fl(1*s), lo = fl(-1*s), the tie value mid = fl(0*s)). For
W <= 16 the count is a fixed carry-save tree over 16 rows (rows past W zero) whose planes
never leave registers; wider W ripple-add row by row into planes in L1. Same bits as the
count-and-look-up reference (`kernels.decode_bit_rows` with the majority table). Pure
numpy in, numpy out."""

from __future__ import annotations

import numpy as np
from numba import njit

from nfab.wire.shared_kernels import prefetch_read, prefetch_write

_CHUNK = 16384  # elements per pass: 16 rows of it (32 KiB), planes and masks stay in L1
_AHEAD = 256  # output elements (1 KiB) asked for writing ahead of the select that writes them
_CW = _CHUNK // 64 + 1  # uint64 words of one chunk's masks, plus the window's spill byte


@njit(cache=True, nogil=True)
def _count_planes(rows, k0, nb, planes, carry):
    """planes[j] = bit j of the count, per element, of the W rows over bytes k0 .. k0+nb (bytes
    past a row's end count as 0). Planes and carry are uint64 words (8 bytes of elements each):
    row r's bytes are copied into `carry` (uint8 view) and added in words."""
    w, size = rows.shape
    nw = (nb + 7) >> 3
    c8 = carry.view(np.uint8)
    planes[:, :nw] = 0
    have = max(0, min(nb, size - k0))
    for r in range(w):
        rk = rows[r, k0 : k0 + have]
        for k in range(have):
            c8[k] = rk[k]
        for k in range(have, nw * 8):
            c8[k] = 0
        top = 1
        while (1 << top) <= r + 1:  # after r + 1 rows the count needs bitlen(r + 1) planes
            top += 1
        for j in range(top):
            for k in range(nw):
                c = carry[k]
                t = planes[j, k] & c
                planes[j, k] ^= c
                carry[k] = t


@njit(cache=True, nogil=True)
def _compare(planes, nb, half, gt, eq):
    """gt: count > half; eq: count == half; bit by bit from the top plane down (uint64 words)."""
    nw = (nb + 7) >> 3
    for k in range(nw):
        gt[k] = 0
        eq[k] = ~np.uint64(0)
    for j in range(planes.shape[0] - 1, -1, -1):
        if (half >> j) & 1:
            for k in range(nw):
                eq[k] &= planes[j, k]
        else:
            for k in range(nw):
                gt[k] |= eq[k] & planes[j, k]
                eq[k] &= ~planes[j, k]


@njit(cache=True, nogil=True, inline="always")
def _full_add(a, b, c):
    """(sum, carry) bit planes of three bit planes."""
    t = a ^ b
    return t ^ c, (a & b) | (c & t)


@njit(cache=True, nogil=True, inline="always")
def _count8(x0, x1, x2, x3, x4, x5, x6, x7):
    """The 4 bit planes (1, 2, 4, 8) of how many of 8 bit planes are set: a carry-save tree."""
    s1, c1 = _full_add(x0, x1, x2)
    s2, c2 = _full_add(x3, x4, x5)
    s3, c3 = x6 ^ x7, x6 & x7
    b0, c4 = _full_add(s1, s2, s3)
    t, c5 = _full_add(c1, c2, c3)
    return b0, t ^ c4, c5 ^ (t & c4), c5 & t & c4


_ROWS16 = 16  # the register counter's rows: W <= 16 counts in one pass, rows past W are zero


@njit(cache=True, nogil=True)
def _load_rows(rows, k0, nb, buf):
    """buf[r] (uint64 words) = row r's bytes k0 .. k0 + nb (0 past the row's end), r < W; the
    rows past W stay zero."""
    w, size = rows.shape
    have = max(0, min(nb, size - k0))
    nw = (nb + 7) >> 3
    b8 = buf.view(np.uint8)
    for r in range(w):
        src = rows[r, k0 : k0 + have]
        dst = b8[r]
        for k in range(have):
            dst[k] = src[k]
        for k in range(have, nw * 8):
            dst[k] = 0


@njit(cache=True, nogil=True)
def _count_compare16(buf, nw, half, masks):
    """masks[0] = count > half, masks[1] = count == half, over words k < nw, the count taken
    over the 16 rows of `buf`: two 8-row carry-save trees and a 4-bit add give its 5 planes
    in registers (no plane is stored), compared with `half` from the top plane down. Fixed
    work per word (no loop over rows), so the compiler vectorizes the loop over words."""
    z, f = np.uint64(0), ~np.uint64(0)
    h0, h1, h2, h3, h4 = (f if half & 1 else z, f if half & 2 else z, f if half & 4 else z,
                          f if half & 8 else z, f if half & 16 else z)
    for k in range(nw):
        p0, p1, p2, p3 = _count8(buf[0, k], buf[1, k], buf[2, k], buf[3, k],
                                 buf[4, k], buf[5, k], buf[6, k], buf[7, k])
        q0, q1, q2, q3 = _count8(buf[8, k], buf[9, k], buf[10, k], buf[11, k],
                                 buf[12, k], buf[13, k], buf[14, k], buf[15, k])
        s0, c = p0 ^ q0, p0 & q0
        s1, c = _full_add(p1, q1, c)
        s2, c = _full_add(p2, q2, c)
        s3, s4 = _full_add(p3, q3, c)
        gt, eq = z, f
        gt |= eq & s4 & ~h4
        eq &= ~(s4 ^ h4)
        gt |= eq & s3 & ~h3
        eq &= ~(s3 ^ h3)
        gt |= eq & s2 & ~h2
        eq &= ~(s2 ^ h2)
        gt |= eq & s1 & ~h1
        eq &= ~(s1 ^ h1)
        gt |= eq & s0 & ~h0
        eq &= ~(s0 ^ h0)
        masks[0, k] = gt
        masks[1, k] = eq


@njit(cache=True, nogil=True)
def _emit(gt, eq, sh, ln, ties, lo, mid, hi, oc, rows, next_k0, next_nb):
    """oc[i] (fp32 bits) for element i of the chunk, whose vote is bit sh + i of the mask words:
    hi where gt, else mid where eq and `ties`, else lo. The mask words are first shifted by
    `sh` in place (a word's bit j is then element 64 k + j); then 32 elements per 32-bit half
    word, a test against a constant bit per lane (`bits[j]` = 1 << j), which the compiler turns
    into vector and-compare-blend (1.7x faster than shifting the word by j in 64-bit lanes).

    Each step also asks for the output ~1 KiB ahead (for writing) and for one line of the next
    chunk's row bytes (next_nb bytes from byte next_k0 of every row), spread over the loop:
    out of cache, 4M elements, the decode went from 1.91 to 1.64 ms at W = 2 and from 2.66 to
    2.10 ms at W = 16 (16 row streams)."""
    full = ln >> 6
    if sh:
        s = np.uint64(sh)
        r = np.uint64(64 - sh)
        for k in range(full):
            gt[k] = (gt[k] >> s) | (gt[k + 1] << r)
            eq[k] = (eq[k] >> s) | (eq[k + 1] << r)
    if not ties:
        eq[:full] = 0
    g32 = gt.view(np.uint32)
    e32 = eq.view(np.uint32)
    bits = np.empty(32, dtype=np.uint32)
    for j in range(32):
        bits[j] = np.uint32(1) << np.uint32(j)
    w = rows.shape[0]
    row_lines = w * ((next_nb + 63) >> 6)
    for k in range(2 * full):
        prefetch_write(oc, 32 * k + _AHEAD)
        prefetch_write(oc, 32 * k + _AHEAD + 16)
        if k < row_lines:
            prefetch_read(rows[k % w], next_k0 + 64 * (k // w))
        g = g32[k]
        e = e32[k]
        o = oc[32 * k : 32 * k + 32]
        for j in range(32):
            b = bits[j]
            o[j] = hi if (g & b) != 0 else (mid if (e & b) != 0 else lo)
    g8 = gt.view(np.uint8)
    e8 = eq.view(np.uint8)
    for i in range(full * 64, ln):
        b = sh + i  # the tail's words were not shifted: its votes are at their original bits
        if (g8[b >> 3] >> (b & 7)) & 1:
            oc[i] = hi
        elif ties and (e8[b >> 3] >> (b & 7)) & 1:
            oc[i] = mid
        else:
            oc[i] = lo


_SMALL = 1024  # below this many elements a segment is counted element by element (no tables to build)


@njit(cache=True, nogil=True)
def _majority_small(rows, start, numel, half, ties, lo, mid, hi, out):
    """The same values one element at a time: for a bucket's many small segments (biases,
    norms) the per-segment set-up of the table path would cost more than the work."""
    w = rows.shape[0]
    for i in range(numel):
        g = start + i
        k = g >> 3
        sh = g & 7
        c = 0
        for r in range(w):
            c += (rows[r, k] >> sh) & 1
        if c > half:
            out[i] = hi
        elif ties and c == half:
            out[i] = mid
        else:
            out[i] = lo


@njit(cache=True, nogil=True)
def majority_rows(rows, start, numel, half, ties, units, scale, out):
    """out[i] (fp32 as uint32 bits) = fl(v * scale) for the majority v: +1 if count > half,
    0 if count == half and `ties`, else -1; count = rows (W <= 255 packed little-endian bit
    rows) with bit start + i set. `units` is the float32 array [-1, 0, 1], passed in rather
    than written here: a constant -1 would let the compiler turn fl(-1 * s) into -s, which
    differs from the table decode's product in a NaN's sign bit."""
    sv = np.empty(3, dtype=np.float32)
    for j in range(3):
        sv[j] = units[j] * scale  # the values of the table decode: vote_table * scale in float32
    bits = sv.view(np.uint32)
    lo, mid, hi = bits[0], bits[1], bits[2]
    if numel < _SMALL:
        _majority_small(rows, start, numel, half, ties, lo, mid, hi, out)
        return
    w = rows.shape[0]
    p = 1
    while (1 << p) <= w:
        p += 1
    planes = np.empty((p, _CW), dtype=np.uint64)
    carry = np.empty(_CW, dtype=np.uint64)
    masks = np.empty((2, _CW), dtype=np.uint64)
    gt, eq = masks[0], masks[1]
    buf = np.zeros((_ROWS16, _CW), dtype=np.uint64) if w <= _ROWS16 else np.empty((0, _CW), dtype=np.uint64)
    i = 0
    while i < numel:
        ln = min(_CHUNK, numel - i)
        g = start + i
        sh = g & 7
        nb = ((sh + ln + 7) >> 3) + 1  # one more byte: the 16-bit window of the last group
        if w <= _ROWS16:
            _load_rows(rows, g >> 3, nb, buf)
            _count_compare16(buf, (nb + 7) >> 3, half, masks)
        else:
            _count_planes(rows, g >> 3, nb, planes, carry)
            _compare(planes, nb, half, gt, eq)
        nxt = g + ln  # the next chunk's first vote: its row bytes are prefetched during this emit
        _emit(gt, eq, sh, ln, ties, lo, mid, hi, out[i : i + ln], rows, nxt >> 3,
              min(nb, max(0, (start + numel - nxt + 7) >> 3)))
        i += ln


@njit(cache=True, nogil=True)
def majority_segments(rows, starts, numels, half, ties, units, scales, out, offsets):
    """`majority_rows` for many segments in one call: segment s (bits starts[s] .. starts[s] +
    numels[s] of the rows, scale scales[s]) into out[offsets[s] : offsets[s] + numels[s]]. A
    bucket's slices decode where they lie, without a Python call per slice."""
    for s in range(starts.size):
        o = offsets[s]
        majority_rows(rows, starts[s], numels[s], half, ties, units, scales[s], out[o : o + numels[s]])
