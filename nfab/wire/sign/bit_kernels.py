"""Compiled CPU kernels of the sign votes (numba): votes packed 1 bit per element with each
segment's |x| sum on the same read, and W gathered bit rows counted and looked up.

Pure functions over numpy arrays. `nfab.wire.sign.host` adapts tensors to them;
`nfab.wire.sign.codec` (`sign_bits`, `sign_values`) is the torch reference they match bit for
bit. A vote is x > 0, NaN negative; an exact zero (+0.0 or -0.0), which one bit cannot abstain
with, votes positive when `tie` is even, negative when odd (`codec.sign_bits`).
Loops index slices from 0 (never x[c + i]): numba then knows the index is non-negative,
drops its negative-index handling, and LLVM vectorizes the loop.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from nfab.wire.shared_kernels import CHUNK, read_ahead, widen_chunk


@njit(cache=True, nogil=True, inline="always")
def _put_word(words, g, w):
    """OR 64 votes (bit j = element g + j) into the little-endian bit words at element g."""
    k = g >> 6
    sh = g & 63
    if sh == 0:
        words[k] |= w
    else:
        words[k] |= w << np.uint64(sh)
        words[k + 1] |= w >> np.uint64(64 - sh)


@intrinsic
def _votes8(typingctx, xc, i, ties):
    """Bits j < 8 = the votes of xc[i + j], for a C-contiguous float32 `xc`: x > 0, or x == 0 where
    bit j of `ties` is set (all 8 or none). One 8-lane vector load, two ordered compares (NaN false
    for both) and their masks as integers, which LLVM emits as compares and movemasks. Numba's own loops cannot
    say "these 8 compares are one integer": written as shifts and ORs they compile to 64-bit lane
    shifts, 2.4x slower on AVX2."""
    if not (isinstance(xc, types.Array) and xc.dtype == types.float32 and xc.ndim == 1 and xc.layout == "C"):
        return None  # strided or other dtypes: no such load (the callers pass contiguous chunks)
    sig = types.uint64(xc, types.intp, types.uint64)

    def codegen(context, builder, signature, args):
        ty = signature.args[0]
        arr = context.make_array(ty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, ty, arr, [args[1]])
        lanes = ir.VectorType(ir.FloatType(), 8)
        v = builder.load(builder.bitcast(ptr, lanes.as_pointer()), align=4)
        zero = ir.Constant(lanes, [0.0] * 8)
        gt = builder.zext(builder.bitcast(builder.fcmp_ordered(">", v, zero), ir.IntType(8)), ir.IntType(64))
        eq = builder.zext(builder.bitcast(builder.fcmp_ordered("==", v, zero), ir.IntType(8)), ir.IntType(64))
        return builder.or_(gt, builder.and_(eq, args[2]))

    return sig, codegen


@njit(cache=True, nogil=True, fastmath={"reassoc"})
def _sign_chunk(xc, words, g, with_sq, ahead, tie):
    """Votes of fp32 chunk `xc` ORed into the bit words at element g (a zero votes positive when
    `tie` is even); returns the chunk's |x|
    sum and (with `with_sq`, else 0) its x^2 sum, in float32 lanes (the compiler picks the lane
    order; reassociation is the only licence: NaN and inf propagate as usual).

    One pass, 64 elements at a time: their sums (vectorized; `with_sq` is the same for the
    whole loop, which the compiler unswitches), their votes, 8 per vector compare (`_votes8`),
    64 to a word stored straight into `words` (shifted across two words when g is not a
    multiple of 64), and, with `ahead` (when `xc` lies in memory, not in a scratch buffer), a
    prefetch of the lines `AHEAD` elements on."""
    ln = xc.size
    full = ln >> 6
    zero_votes = tie & 1 == 0
    ties = np.uint64(0xFF) if zero_votes else np.uint64(0)  # a zero's vote, in every lane
    s = np.float32(0)
    q = np.float32(0)
    for k in range(full):
        b = 64 * k
        if ahead:
            read_ahead(xc, b)
        xs = xc[b : b + 64]
        for i in range(64):
            v = xs[i]
            s += abs(v)
            if with_sq:
                q += v * v
        w = np.uint64(0)
        for j in range(8):
            w |= _votes8(xc, b + 8 * j, ties) << np.uint64(8 * j)
        _put_word(words, g + b, w)
    if ln & 63:
        xs = xc[64 * full : ln]
        w = np.uint64(0)
        for j in range(xs.size):
            v = xs[j]
            s += abs(v)
            if with_sq:
                q += v * v
            w |= np.uint64(v > 0 or (v == 0 and zero_votes)) << np.uint64(j)
        _put_word(words, g + 64 * full, w)
    return s, q


@njit(cache=True, nogil=True)
def sign_bits_f32(x, seg_starts, seg_ends, bases, words, sums, sqs, tie):
    """Votes of fp32 `x` packed 1 bit per element (little-endian) into ZEROED uint64 `words`
    (a zero votes positive when `tie` is even)
    (one word of room past the last vote's), and the |x| sum of each segment
    [seg_starts[s], seg_ends[s]) of `x` into sums[s]. Element j of `x`, in segment s, goes to
    bit bases[s] + j: segments read where they lie in a bucket land packed back to back.

    A segment's sum adds float32 chunk sums (chunks of 4096 counted from the segment's own
    start) in float64: it depends only on the segment's own elements, never on its
    neighbours or its offset in a bucket. With a non-empty `sqs`, sqs[s] gets the segment's x^2
    sum the same way (its |g|^2 share, on the same read).
    """
    for s in range(seg_starts.size):
        a = seg_starts[s]
        e = seg_ends[s]
        tot = 0.0
        sq = 0.0
        for c0 in range(a, e, CHUNK):
            ca, cq = _sign_chunk(x[c0 : min(c0 + CHUNK, e)], words, bases[s] + c0, sqs.size > 0, True, tie)
            tot += ca
            sq += cq
        sums[s] = tot
        if sqs.size:
            sqs[s] = sq


@njit(cache=True, nogil=True)
def sign_bits_half(u, bf16, seg_starts, seg_ends, bases, words, sums, sqs, tie):
    """`sign_bits_f32` for bf16 (bf16=True) or fp16 inputs given as raw uint16 bits.

    Each chunk is widened exactly to fp32 in an L1 scratch buffer (widening keeps every
    sign, zero and NaN), so votes and sums are those of `sign_bits_f32` on the fp32 values.
    """
    wide = np.empty(CHUNK, dtype=np.uint32)
    f32 = wide.view(np.float32)
    for s in range(seg_starts.size):
        a = seg_starts[s]
        e = seg_ends[s]
        tot = 0.0
        sq = 0.0
        for c0 in range(a, e, CHUNK):
            uc = u[c0 : min(c0 + CHUNK, e)]
            ln = uc.size
            widen_chunk(uc, bf16, wide, f32)
            ca, cq = _sign_chunk(f32[:ln], words, bases[s] + c0, sqs.size > 0, False, tie)
            tot += ca
            sq += cq
        sums[s] = tot
        if sqs.size:
            sqs[s] = sq


@njit(cache=True, nogil=True)
def count_expand_table():
    """256 entries: 8 bits -> 8 byte-lanes of a uint64 holding each bit (for counting)."""
    t = np.zeros(256, dtype=np.uint64)
    for v in range(256):
        w = np.uint64(0)
        for j in range(8):
            if (v >> j) & 1:
                w |= np.uint64(1) << np.uint64(8 * j)
        t[v] = w
    return t


@njit(cache=True, nogil=True)
def decode_bit_rows(rows, start, numel, table, out, expand):
    """out[i] = table[count of rows with bit start+i set], i < numel; rows (W <= 255, nbytes).

    Counts are kept one byte per element: each row's byte expands (`expand`, a table) to
    eight byte-lanes of a uint64 that is added to the chunk's counts (no lane reaches 256,
    so none carries); then one table lookup per element.
    """
    w = rows.shape[0]
    i = 0
    while i < numel and (start + i) & 7:  # elements before the first whole byte
        g = start + i
        c = 0
        for r in range(w):
            c += (rows[r, g >> 3] >> (g & 7)) & 1
        out[i] = table[c]
        i += 1
    cnt = np.zeros(CHUNK, dtype=np.uint8)
    cnt64 = cnt.view(np.uint64)
    while i < numel:
        ln = min(CHUNK, numel - i)
        k0 = (start + i) >> 3
        nb = (ln + 7) >> 3
        for k in range(nb):
            cnt64[k] = 0
        for r in range(w):
            rk = rows[r, k0 : k0 + nb]
            for k in range(nb):
                cnt64[k] += expand[rk[k]]
        oc = out[i : i + ln]
        for t in range(ln):
            oc[t] = table[cnt[t]]
        i += ln
