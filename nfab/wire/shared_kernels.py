"""Numba pieces shared by every codec's compiled kernels: prefetch, the
counter-based noise hash, fp16/bf16 widening, slices read where they lie, max |x| as bits and
the generator's first draw.

The codecs' own kernels live beside their torch references (`sign/bit_kernels.py`,
`sign/vote_kernels.py`, `sign/trit_kernels.py`, `qsum/level_kernels.py`,
`qsum/lane_kernels.py`, `blockq/kernels.py`). `nfab.wire.dispatch` chooses
whether a tensor takes these kernels (CPU) or the torch reference (every other device).

Numba compiles each kernel on its first call and caches the machine code on disk
(`cache=True`, one cache per source file), so a machine pays the compile once. The cache lives
in a per-user directory (`nfab.wire.numba_cache`: NUMBA_CACHE_DIR if set, else
`$XDG_CACHE_HOME/nfab/numba` or `~/.cache/nfab/numba`), never in the installed package.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

CHUNK = 4096  # elements per float32 partial sum and per widened scratch chunk (counted from the segment start)
_I32 = ir.IntType(32)


AHEAD = 256  # fp32 elements (1 KiB) the sign pass and q8's rounding ask for ahead of the block they read


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
def read_ahead(x, b):
    """Ask for the 4 lines of fp32 `x` that hold elements b + `AHEAD` .. + 64 (the block a
    64-element loop reads `AHEAD` elements on)."""
    for line in range(4):
        prefetch_read(x, b + AHEAD + 16 * line)


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
def widen_chunk(uc, bf16, wide, f32):
    """Write a chunk of raw bf16/fp16 bits into the fp32 scratch (`f32` is a view of `wide`)."""
    if bf16:
        for i in range(uc.size):
            wide[i] = np.uint32(uc[i]) << 16
    else:
        for i in range(uc.size):
            f32[i] = _f16_to_f32(uc[i])


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
        for c0 in range(a, e, CHUNK):
            xc = x[c0 : min(c0 + CHUNK, e)]
            q = np.float32(0)
            for i in range(xc.size):
                q += xc[i] * xc[i]
            tot += q
    return tot


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
