"""Compiled CPU kernels for the codecs (numba): one pass over memory, no temporaries.

Pure functions over numpy arrays (no torch). `nfab.wire.fastpath` decides when they
apply and adapts tensors; `nfab.wire.qsum.lanes` holds the torch reference that runs on any
device and defines what these kernels must produce, bit for bit. The lane-container kernels
are in `lanekernels.py`, the majority vote's in `votekernels.py`.

Numba compiles each kernel on its first call and caches the machine code on disk
(`cache=True`), so a machine pays the compile once. The cache lives beside this file;
when the install is read-only, numba's own fallback is a per-user cache directory, and
when that is unusable too we point NUMBA_CACHE_DIR at a private temp directory before
numba is imported (set it yourself to choose the place).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _ensure_cache_dir() -> None:
    """Give numba a writable cache directory when neither the package dir nor $HOME is."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    here = Path(__file__).parent
    if os.access(here, os.W_OK):
        return
    home = Path(os.path.expanduser("~"))
    if home.is_dir() and os.access(home, os.W_OK):
        return  # numba's user-wide locator writes under ~/.cache
    os.environ["NUMBA_CACHE_DIR"] = str(Path(tempfile.gettempdir()) / f"nfab-numba-{os.getuid()}")


_ensure_cache_dir()

import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

# ---- sign votes ------------------------------------------------------------------------------
# A vote is x >= 0: +0.0 and -0.0 vote positive, NaN negative (torch's and numpy's >=).
# Loops index slices from 0 (never x[c + i]): numba then knows the index is non-negative,
# drops its negative-index handling, and LLVM vectorizes the loop.

_CHUNK = 4096  # elements per float32 partial |x| sum (counted from the segment start)
_I32 = ir.IntType(32)


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
def _votes8(typingctx, xc, i):
    """Bits j < 8 = xc[i + j] >= 0, for a C-contiguous float32 `xc`: one 8-lane vector load,
    an ordered compare (NaN false, -0.0 true) and its mask as an integer, which LLVM emits as a
    compare and a movemask. Numba's own loops cannot say "these 8 compares are one integer":
    written as shifts and ORs they compile to 64-bit lane shifts, 2.4x slower on AVX2."""
    if not (isinstance(xc, types.Array) and xc.dtype == types.float32 and xc.ndim == 1 and xc.layout == "C"):
        return None  # strided or other dtypes: no such load (the callers pass contiguous chunks)
    sig = types.uint64(xc, types.intp)

    def codegen(context, builder, signature, args):
        ty = signature.args[0]
        arr = context.make_array(ty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, ty, arr, [args[1]])
        lanes = ir.VectorType(ir.FloatType(), 8)
        v = builder.load(builder.bitcast(ptr, lanes.as_pointer()), align=4)
        ge = builder.fcmp_ordered(">=", v, ir.Constant(lanes, [0.0] * 8))
        return builder.zext(builder.bitcast(ge, ir.IntType(8)), ir.IntType(64))

    return sig, codegen


_AHEAD = 256  # fp32 elements (1 KiB) the sign pass and q8's rounding ask for ahead of the block they read


def _prefetcher(write: bool):
    """An intrinsic prefetch(xc, i): the cache line of xc[i], for reading or for writing
    (`llvm.prefetch`, kept in all cache levels). i may lie past the end: a prefetch never
    faults. Loops that read or write memory with compute between the accesses leave fewer
    lines in flight than a plain copy or sum does; asking for a line ~1 KiB ahead restores it
    (the sign pass, out of cache: 0.78x of `torch.sum`'s read speed without, 0.92x with)."""

    @intrinsic
    def prefetch(typingctx, xc, i):
        if not (isinstance(xc, types.Array) and xc.ndim == 1):
            return None
        sig = types.void(xc, types.intp)

        def codegen(context, builder, signature, args):
            ty = signature.args[0]
            arr = context.make_array(ty)(context, builder, args[0])
            i8p = ir.IntType(8).as_pointer()
            # declare_intrinsic spells the pointer suffix as this llvmlite's LLVM wants it
            fn = builder.module.declare_intrinsic(
                "llvm.prefetch", [i8p], ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]))
            ptr = builder.bitcast(cgutils.get_item_pointer(context, builder, ty, arr, [args[1]]), i8p)
            builder.call(fn, [ptr, ir.Constant(_I32, int(write)), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
            return context.get_dummy_value()

        return sig, codegen

    return prefetch


prefetch_read = _prefetcher(False)
prefetch_write = _prefetcher(True)


@njit(cache=True, nogil=True, inline="always")
def _read_ahead(x, b):
    """Ask for the 4 lines of fp32 `x` that hold elements b + `_AHEAD` .. + 64 (the block a
    64-element loop reads `_AHEAD` elements on)."""
    for line in range(4):
        prefetch_read(x, b + _AHEAD + 16 * line)


@njit(cache=True, nogil=True, fastmath={"reassoc"})
def _sign_chunk(xc, words, g, with_sq, ahead):
    """Votes of fp32 chunk `xc` ORed into the bit words at element g; returns the chunk's |x|
    sum and (with `with_sq`, else 0) its x^2 sum, in float32 lanes (the compiler picks the lane
    order; reassociation is the only licence: NaN and inf propagate as usual).

    One pass, 64 elements at a time: their sums (vectorized; `with_sq` is the same for the
    whole loop, which the compiler unswitches), their votes, 8 per vector compare (`_votes8`),
    64 to a word stored straight into `words` (shifted across two words when g is not a
    multiple of 64), and, with `ahead` (when `xc` lies in memory, not in a scratch buffer), a
    prefetch of the lines `_AHEAD` elements on."""
    ln = xc.size
    full = ln >> 6
    s = np.float32(0)
    q = np.float32(0)
    for k in range(full):
        b = 64 * k
        if ahead:
            _read_ahead(xc, b)
        xs = xc[b : b + 64]
        for i in range(64):
            v = xs[i]
            s += abs(v)
            if with_sq:
                q += v * v
        w = np.uint64(0)
        for j in range(8):
            w |= _votes8(xc, b + 8 * j) << np.uint64(8 * j)
        _put_word(words, g + b, w)
    if ln & 63:
        xs = xc[64 * full : ln]
        w = np.uint64(0)
        for j in range(xs.size):
            v = xs[j]
            s += abs(v)
            if with_sq:
                q += v * v
            w |= np.uint64(v >= 0) << np.uint64(j)
        _put_word(words, g + 64 * full, w)
    return s, q


@njit(cache=True, nogil=True)
def sign_bits_f32(x, seg_starts, seg_ends, bases, words, sums, sqs):
    """Votes of fp32 `x` packed 1 bit per element (little-endian) into ZEROED uint64 `words`
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
        for c0 in range(a, e, _CHUNK):
            ca, cq = _sign_chunk(x[c0 : min(c0 + _CHUNK, e)], words, bases[s] + c0, sqs.size > 0, True)
            tot += ca
            sq += cq
        sums[s] = tot
        if sqs.size:
            sqs[s] = sq


@njit(cache=True, nogil=True)
def _f16_to_f32(u):
    """An IEEE fp16 given as raw bits, widened exactly to float32."""
    sign = np.float32(-1.0) if u & 0x8000 else np.float32(1.0)
    e = (u >> 10) & 0x1F
    m = u & 0x3FF
    if e == 0:
        return sign * np.float32(m * 5.9604644775390625e-08)  # 2**-24, exact
    if e == 31:
        return sign * np.float32(np.inf) if m == 0 else np.float32(np.nan)
    return sign * np.float32((1024 + m) * 2.0 ** (np.int64(e) - 25))


@njit(cache=True, nogil=True)
def _widen_chunk(uc, bf16, wide, f32):
    """Write a chunk of raw bf16/fp16 bits into the fp32 scratch (`f32` is a view of `wide`)."""
    if bf16:
        for i in range(uc.size):
            wide[i] = np.uint32(uc[i]) << 16
    else:
        for i in range(uc.size):
            f32[i] = _f16_to_f32(uc[i])


@njit(cache=True, nogil=True)
def sign_bits_half(u, bf16, seg_starts, seg_ends, bases, words, sums, sqs):
    """`sign_bits_f32` for bf16 (bf16=True) or fp16 inputs given as raw uint16 bits.

    Each chunk is widened exactly to fp32 in an L1 scratch buffer (widening keeps every
    sign, zero and NaN), so votes and sums are those of `sign_bits_f32` on the fp32 values.
    """
    wide = np.empty(_CHUNK, dtype=np.uint32)
    f32 = wide.view(np.float32)
    for s in range(seg_starts.size):
        a = seg_starts[s]
        e = seg_ends[s]
        tot = 0.0
        sq = 0.0
        for c0 in range(a, e, _CHUNK):
            uc = u[c0 : min(c0 + _CHUNK, e)]
            ln = uc.size
            _widen_chunk(uc, bf16, wide, f32)
            ca, cq = _sign_chunk(f32[:ln], words, bases[s] + c0, sqs.size > 0, False)
            tot += ca
            sq += cq
        sums[s] = tot
        if sqs.size:
            sqs[s] = sq


# ---- counting gathered 1-bit rows ---------------------------------------------------------------


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
    cnt = np.zeros(_CHUNK, dtype=np.uint8)
    cnt64 = cnt.view(np.uint64)
    while i < numel:
        ln = min(_CHUNK, numel - i)
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


# ---- gathering slices ------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def gather_segments(x, offsets, lengths, out):
    """out = x[offsets[0] : + lengths[0]] ++ x[offsets[1] : ...] ++ ... (raw element bits: any
    dtype viewed as unsigned integers of its width)."""
    pos = 0
    for s in range(offsets.size):
        a = offsets[s]
        n = lengths[s]
        src = x[a : a + n]
        dst = out[pos : pos + n]
        for i in range(n):
            dst[i] = src[i]
        pos += n


@njit(cache=True, nogil=True, fastmath={"reassoc"})
def segments_sq(x, offsets, lengths):
    """The x^2 sum of fp32 segments x[offsets[s] : + lengths[s]], read where they lie: float32
    chunk sums (lanes in the compiler's order) added in float64; NaN and inf propagate."""
    tot = 0.0
    for s in range(offsets.size):
        a = offsets[s]
        e = a + lengths[s]
        for c0 in range(a, e, _CHUNK):
            xc = x[c0 : min(c0 + _CHUNK, e)]
            q = np.float32(0)
            for i in range(xc.size):
                q += xc[i] * xc[i]
            tot += q
    return tot


# ---- noise keys ------------------------------------------------------------------------------------


@njit(cache=True, nogil=True, inline="always")
def _temper(y):
    y ^= y >> np.uint64(11)
    y ^= (y << np.uint64(7)) & np.uint64(0x9D2C5680)
    y ^= (y << np.uint64(15)) & np.uint64(0xEFC60000)
    y ^= y >> np.uint64(18)
    return y & np.uint64(0xFFFFFFFF)


@njit(cache=True, nogil=True)
def first_draw_keys(seeds, out):
    """out[k] = the int64 that `torch.randint(-2**63, 2**63 - 1, (1,), generator=g)` draws first
    from a CPU generator after `g.manual_seed(seeds[k])`, without a generator. `out` is uint64
    (the int64's bits).

    torch's CPU generator is MT19937 seeded with the seed's low 32 bits (init_genrand); a
    64-bit draw is its first two outputs (a << 32 | b), taken mod the range (2**64 - 1) and
    offset by -2**63, i.e. the top bit flipped. Only the state words that the first two
    outputs read (0, 1, 2, 397, 398) are kept; init_genrand's chain of 398 steps runs for all
    seeds side by side (independent chains: the compiler vectorizes across seeds)."""
    mask = np.uint64(0xFFFFFFFF)
    cur = seeds.astype(np.uint64) & mask
    kept = np.empty((5, seeds.size), dtype=np.uint64)  # state words 0, 1, 2, 397, 398
    kept[0] = cur
    for i in range(1, 399):
        c = np.uint64(i)
        for k in range(cur.size):
            p = cur[k]
            cur[k] = (np.uint64(1812433253) * (p ^ (p >> np.uint64(30))) + c) & mask
        if i <= 2:
            kept[i] = cur
        elif i >= 397:
            kept[i - 394] = cur
    for k in range(cur.size):
        r = np.uint64(0)
        for j in range(2):
            y = (kept[j, k] & np.uint64(0x80000000)) | (kept[j + 1, k] & np.uint64(0x7FFFFFFF))
            m = kept[j + 3, k] ^ (y >> np.uint64(1))
            if y & np.uint64(1):
                m ^= np.uint64(0x9908B0DF)
            r = (r << np.uint64(32)) | _temper(m)
        if r == np.uint64(0xFFFFFFFFFFFFFFFF):  # mod (2**64 - 1)
            r = np.uint64(0)
        out[k] = r ^ np.uint64(0x8000000000000000)


# ---- qsum levels ---------------------------------------------------------------------------------


_GOLDEN = 0x9E3779B9  # the counter's step (`nfab.wire.noise`: the semantics)


@intrinsic
def noise_u(typingctx, c, key_hi, shift):
    """`nfab.wire.noise`'s u in [0, 1) (float32) from the counter word c (key_lo + (i + 1) *
    golden, stepped per element by `next_counter`), the key's high half and the stratum's 24-bit
    shift, all uint32. The hash is emitted as i32 IR because numba widens every integer
    expression to 64 bits, where AVX2 has no multiply: in 32-bit lanes the loop hashes 8
    elements per instruction, two `vpmulld` per 8."""
    if not all(t == types.uint32 for t in (c, key_hi, shift)):
        return None
    sig = types.float32(types.uint32, types.uint32, types.uint32)

    def codegen(context, builder, signature, args):
        def shr_xor(y, k):
            return builder.xor(y, builder.lshr(y, ir.Constant(_I32, k)))

        y = builder.xor(args[0], args[1])
        y = builder.mul(shr_xor(y, 16), ir.Constant(_I32, 0x7FEB352D))
        y = builder.mul(shr_xor(y, 15), ir.Constant(_I32, 0x846CA68B))
        u24 = builder.lshr(shr_xor(y, 16), ir.Constant(_I32, 8))
        u24 = builder.and_(builder.add(u24, args[2]), ir.Constant(_I32, 0xFFFFFF))
        return builder.fmul(builder.sitofp(u24, ir.FloatType()), ir.Constant(ir.FloatType(), 2.0**-24))

    return sig, codegen


@intrinsic
def next_counter(typingctx, c):
    """c + golden as a uint32 (mod 2**32). Numba's own `c + golden` is 64-bit: a 64-bit counter
    vectorizes as two 4-lane halves and a shuffle per 8 elements, 22% slower in the q8 loop."""
    if c != types.uint32:
        return None
    sig = types.uint32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.add(args[0], ir.Constant(_I32, _GOLDEN))

    return sig, codegen


@njit(cache=True, nogil=True, inline="always")
def counter(key, i0):
    """(the counter word of element i0 of a segment, the key's high half), uint32, for `noise_u`."""
    k = np.uint64(key)
    c = k + (np.uint64(i0) + np.uint64(1)) * np.uint64(_GOLDEN)
    return np.uint32(c & np.uint64(0xFFFFFFFF)), np.uint32(k >> np.uint64(32))


@njit(cache=True, nogil=True, inline="always")
def _level(xv, u, sc, one, half_m, top):
    """One level: floor((x/s + 1) * M/2 + u) clamped to [0, M], in the reference's float32 order."""
    t = np.floor((xv / sc + one) * half_m + u)
    return np.uint8(min(max(t, np.float32(0)), top))


@njit(cache=True, nogil=True)
def _round_run(xs, key, i0, sc, one, half_m, top, ls, ahead):
    """Levels of fp32 run `xs` (elements i0.. of its segment) into `ls`; the noise is computed
    here, never stored. 64 elements at a time, with `ahead` (when `xs` lies in memory, not in a
    scratch buffer) asking for the input `_AHEAD` elements on (`_read_ahead`: 8% faster out of
    cache)."""
    c, hi = counter(key, i0)
    zero = np.uint32(0)
    n = xs.size
    full = n >> 6
    for k in range(full):
        b = 64 * k
        if ahead:
            _read_ahead(xs, b)
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
    wide = np.empty(_CHUNK, dtype=np.uint32)
    f32 = wide.view(np.float32)
    for s in range(seg_starts.size):
        a = seg_starts[s]
        e = seg_ends[s]
        for c0 in range(a, e, _CHUNK):
            uc = u[c0 : min(c0 + _CHUNK, e)]
            ln = uc.size
            _widen_chunk(uc, bf16, wide, f32)
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


@njit(cache=True, nogil=True)
def segment_max_abs_bits(u, sign_mask, seg_starts, seg_ends, out):
    """max over each segment of (raw float bits & ~sign): for IEEE floats of one width the
    integer order of |x|'s bits is the order of |x| (NaN above inf), so this is max |x| as
    bits, in one vectorized integer pass; 0 for an empty segment."""
    for s in range(seg_starts.size):
        us = u[seg_starts[s] : seg_ends[s]]
        m = us.dtype.type(0)
        for i in range(us.size):
            v = us.dtype.type(us[i] & sign_mask)  # kept at the input's width: twice the lanes of int64
            m = v if v > m else m
        out[s] = m
