"""Compiled CPU kernels for signscatter's majority (numba): count lanes -> packed digits -> values.

The shard owner turns summed count lanes into one digit per element (a bit at odd W, a
base-3 trit at even W: 0 negative, 1 tie, 2 positive) and packs them; every rank then
decodes the gathered digits to fp32. Both steps are table lookups on whole groups, never
one element at a time: uint8 count containers are a plain bit stream of `lane_bits`-bit
counts (their lanes fill the byte: 1, 2, 4 or 8 bits), so 5 counts are 5 * lane_bits
consecutive bits and two small tables (2 counts, 3 counts) give their trit byte; 8 counts
are `lane_bits` whole bytes, one table row each. The decode moves a pair of trit bytes (10
values) as five uint64 words. Same bits as the torch reference in `signscatter.py`.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from nfab.wire import shared_kernels  # noqa: F401  (first: sets numba's cache directory)


def trit_tables(digit: np.ndarray, lane_bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) uint8 tables over the bits of 2 and of 3 consecutive counts: low = d0 + 3 d1,
    high = 9 d2 + 27 d3 + 81 d4, d = `digit[count]` (a count past `digit` is 0: never summed)."""
    mask = (1 << lane_bits) - 1
    d = np.zeros(mask + 1, dtype=np.int64)
    d[: digit.size] = digit[: mask + 1]
    k2 = np.arange(1 << (2 * lane_bits))
    k3 = np.arange(1 << (3 * lane_bits))
    low = d[k2 & mask] + 3 * d[k2 >> lane_bits]
    high = 9 * d[k3 & mask] + 27 * d[(k3 >> lane_bits) & mask] + 81 * d[k3 >> (2 * lane_bits)]
    return low.astype(np.uint8), high.astype(np.uint8)


def bit_table(digit: np.ndarray, lane_bits: int) -> np.ndarray:
    """uint8 table over a container byte: bit i = digit of its count lane i (8 // lane_bits lanes)."""
    lanes, mask = 8 // lane_bits, (1 << lane_bits) - 1
    d = np.zeros(mask + 1, dtype=np.int64)
    d[: digit.size] = digit[: mask + 1]
    b = np.arange(256)
    row = np.zeros(256, dtype=np.int64)
    for i in range(lanes):
        row |= d[(b >> (i * lane_bits)) & mask] << i
    return row.astype(np.uint8)


@njit(cache=True, nogil=True)
def byte_lanes_to_trits(containers, lane_bits, low, high, out):
    """out[o] = trit byte of counts 5o .. 5o+4, from uint8 containers whose lanes fill the byte
    (lane_bits 1, 2 or 4; `trit_tables`): 5 container bytes hold 40 / lane_bits counts, read
    as one word, 8 / lane_bits outputs of two lookups each. out.size * lane_bits is a multiple
    of 8 (a shard of whole 40-element groups)."""
    per = 8 // lane_bits
    step = np.uint64(5 * lane_bits)
    two = np.uint64(2 * lane_bits)
    amask = np.uint64((1 << (2 * lane_bits)) - 1)
    bmask = np.uint64((1 << (3 * lane_bits)) - 1)
    for t in range(out.size // per):
        src = containers[5 * t : 5 * t + 5]
        u = (np.uint64(src[0]) | (np.uint64(src[1]) << np.uint64(8)) | (np.uint64(src[2]) << np.uint64(16))
             | (np.uint64(src[3]) << np.uint64(24)) | (np.uint64(src[4]) << np.uint64(32)))
        o = out[t * per : t * per + per]
        for q in range(per):
            key = u >> (step * np.uint64(q))
            o[q] = low[key & amask] + high[(key >> two) & bmask]


@njit(cache=True, nogil=True)
def byte_lanes_to_bits(containers, lane_bits, row, out):
    """out[o] = the 8 majority bits of counts 8o .. 8o+7 (little-endian), from uint8 containers
    whose lanes fill the byte: `lane_bits` container bytes, one `bit_table` row each."""
    per = np.uint64(8 // lane_bits)
    for o in range(out.size):
        src = containers[o * lane_bits : o * lane_bits + lane_bits]
        v = np.uint64(0)
        for k in range(src.size):
            v |= np.uint64(row[src[k]]) << (per * np.uint64(k))
        out[o] = v


@njit(cache=True, nogil=True)
def decode_trits(packed, start, numel, rows, out):
    """out[i] (fp32 as uint32 bits) = the value of base-3 digit start + i (5 per byte). `rows`
    (256 x 5 uint32) holds a byte's 5 values; from the first element of an even byte on, a
    pair of bytes (10 values, 40 bytes) is written as 5 uint64 words, the middle one joining
    the two bytes' rows, whenever `out` there is 8-byte aligned (else value by value)."""
    i = 0
    while i < numel and (start + i) % 10:
        g = start + i
        out[i] = rows[packed[g // 5], g % 5]
        i += 1
    pairs = (numel - i) // 10
    if pairs and (out[i:].ctypes.data & 7) == 0:
        a = np.empty((256, 3), dtype=np.uint64)  # byte 2p: values 0-1, 2-3, 4 (low half)
        b = np.empty((256, 3), dtype=np.uint64)  # byte 2p+1: value 0 (high half), 1-2, 3-4
        for v in range(256):
            r = rows[v]
            a[v, 0] = np.uint64(r[0]) | (np.uint64(r[1]) << np.uint64(32))
            a[v, 1] = np.uint64(r[2]) | (np.uint64(r[3]) << np.uint64(32))
            a[v, 2] = np.uint64(r[4])
            b[v, 0] = np.uint64(r[0]) << np.uint64(32)
            b[v, 1] = np.uint64(r[1]) | (np.uint64(r[2]) << np.uint64(32))
            b[v, 2] = np.uint64(r[3]) | (np.uint64(r[4]) << np.uint64(32))
        k0 = (start + i) // 5
        src = packed[k0 : k0 + 2 * pairs]
        o64 = out[i : i + 10 * pairs].view(np.uint64)
        for p in range(pairs):
            x = np.int64(src[2 * p])
            y = np.int64(src[2 * p + 1])
            o = o64[5 * p : 5 * p + 5]
            o[0] = a[x, 0]
            o[1] = a[x, 1]
            o[2] = a[x, 2] | b[y, 0]
            o[3] = b[y, 1]
            o[4] = b[y, 2]
        i += 10 * pairs
    while i < numel:
        g = start + i
        out[i] = rows[packed[g // 5], g % 5]
        i += 1
