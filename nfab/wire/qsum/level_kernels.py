"""Compiled CPU kernels of qsum's levels (numba): stochastic rounding with the noise computed in
the loop, and the summed or gathered levels decoded to fp32.

Pure functions over numpy arrays. `nfab.wire.qsum.host` adapts tensors to them; the torch
reference they match bit for bit is `QSum._levels_reference` and the table decode of
`nfab.wire.qsum.lanes`.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from nfab.wire.shared_kernels import (
    CHUNK,
    counter,
    first_draw_keys,
    next_counter,
    noise_u,
    read_ahead,
    segment_max_abs_bits,
    segments_sq,
    widen_chunk,
)


@njit(cache=True, nogil=True)
def decode_levels(levels, seg_starts, seg_ends, step, one, scales, out):
    """out[e] = fl(fl(fl(level_e * step) - one) * scale of e's segment), in float32 and in
    this order: the bits of qsum's table decode (levels * step - 1, times the scale),
    computed instead of looked up, so the loop vectorizes."""
    for s in range(seg_starts.size):
        a = seg_starts[s]
        e = seg_ends[s]
        lv = levels[a:e]
        oc = out[a:e]
        sc = scales[s]
        for i in range(lv.size):
            oc[i] = (np.float32(lv[i]) * step - one) * sc


@njit(cache=True, nogil=True)
def gathered_levels(rows, values, scales, seg_starts, seg_ends, inv_w, out, offsets):
    """The mean of W gathered one-lane level rows, each with its own rank's scales, in float32
    and in this order: d_r = fl(values[level] * scales[r, s]), acc = d_0, acc = fl(acc + d_r)
    for r = 1 .. W-1, out = fl(acc * inv_w) — the bits of the per-rank table decode, the
    rank-order sum and the final `mul_(1 / W)`. Segment s (elements seg_starts[s] ..
    seg_ends[s] of the rows) is written to out[offsets[s] ...]: slices where they lie."""
    w = rows.shape[0]
    for s in range(seg_starts.size):
        a = seg_starts[s]
        n = seg_ends[s] - a
        oc = out[offsets[s] : offsets[s] + n]
        for i in range(n):
            acc = values[rows[0, a + i]] * scales[0, s]
            for r in range(1, w):
                acc = acc + values[rows[r, a + i]] * scales[r, s]
            oc[i] = acc * inv_w


@njit(cache=True, nogil=True, inline="always")
def _level(xv, u, sc, one, half_m, top):
    """One level: floor((x/s + 1) * M/2 + u) clamped to [0, M], in the reference's float32 order."""
    t = np.floor((xv / sc + one) * half_m + u)
    return np.uint8(min(max(t, np.float32(0)), top))


@njit(cache=True, nogil=True)
def _round_run(xs, key, i0, sc, one, half_m, top, ls, ahead):
    """Levels of fp32 run `xs` (elements i0.. of its segment) into `ls`; the noise is computed
    here, never stored. 64 elements at a time, with `ahead` (when `xs` lies in memory, not in a
    scratch buffer) asking for the input `AHEAD` elements on (`read_ahead`: 8% faster out of
    cache)."""
    c, hi = counter(key, i0)
    zero = np.uint32(0)
    n = xs.size
    full = n >> 6
    for k in range(full):
        b = 64 * k
        if ahead:
            read_ahead(xs, b)
        xb = xs[b : b + 64]
        lb = ls[b : b + 64]
        for i in range(64):
            lb[i] = _level(xb[i], noise_u(c, hi, zero), sc, one, half_m, top)
            c = next_counter(c)
    for i in range(64 * full, n):
        ls[i] = _level(xs[i], noise_u(c, hi, zero), sc, one, half_m, top)
        c = next_counter(c)


@njit(cache=True, nogil=True)
def qsum_levels(x, keys, seg_starts, seg_ends, scales, one, half_m, max_level, levels):
    """Stochastically rounded levels floor((x/s + 1) * M/2 + u) clamped to [0, M], in one pass,
    into `levels` (one-lane containers are the levels themselves: no second copy).

    u is the counter-based noise of `nfab.wire.noise` (segment s's key, the element's index
    in its segment), computed here and never stored; the float32 operations and their order
    are those of the torch reference (`QSum._levels_reference`), so the levels are the same bits.
    """
    top = np.float32(max_level)
    for s in range(seg_starts.size):
        a = seg_starts[s]
        e = seg_ends[s]
        _round_run(x[a:e], keys[s], 0, scales[s], one, half_m, top, levels[a:e], True)


@njit(cache=True, nogil=True)
def qsum_levels_half(u, bf16, keys, seg_starts, seg_ends, scales, one, half_m, max_level, levels):
    """`qsum_levels` for bf16 (bf16=True) or fp16 inputs given as raw uint16 bits, widened
    exactly to fp32 chunk by chunk in an L1 scratch buffer (no fp32 copy of the input)."""
    top = np.float32(max_level)
    wide = np.empty(CHUNK, dtype=np.uint32)
    f32 = wide.view(np.float32)
    for s in range(seg_starts.size):
        a = seg_starts[s]
        e = seg_ends[s]
        for c0 in range(a, e, CHUNK):
            uc = u[c0 : min(c0 + CHUNK, e)]
            ln = uc.size
            widen_chunk(uc, bf16, wide, f32)
            _round_run(f32[:ln], keys[s], c0 - a, scales[s], one, half_m, top, levels[c0 : c0 + ln], False)


@njit(cache=True, nogil=True)
def qsum_own_scale(x, offsets, lengths, seeds, one, half_m, max_level, levels, amax_bits, amax, sqs):
    """qsum's levels of fp32 segments x[offsets[s] : + lengths[s]], read where they lie, each
    rounded in its OWN scale (a gathered bucket: ranks need not agree on one), in one call:
    amax[s] = max |x| of the segment (`segment_max_abs_bits`; written as bits into `amax_bits`,
    which `amax` views as float32), its key the first draw of seeds[s] (`first_draw_keys`), its
    levels (`qsum_levels` with scale amax[s], or 1 where that is not > 0: the reference's
    `where(s > 0, s, 1)`) packed back to back into `levels`. With a non-empty `sqs`, sqs[s] gets
    the segment's x^2 sum (`segments_sq`'s chunk sums: its |g|^2 share, on the same pass)."""
    top = np.float32(max_level)
    segment_max_abs_bits(x.view(np.uint32), np.uint32(0x7FFFFFFF), offsets, offsets + lengths, amax_bits)
    keys = np.empty(seeds.size, dtype=np.uint64)
    first_draw_keys(seeds, keys)
    pos = 0
    for s in range(offsets.size):
        a = offsets[s]
        n = lengths[s]
        sc = amax[s] if amax[s] > 0 else one
        _round_run(x[a : a + n], keys[s], 0, sc, one, half_m, top, levels[pos : pos + n], True)
        if sqs.size:
            sqs[s] = segments_sq(x, offsets[s : s + 1], lengths[s : s + 1])
        pos += n
