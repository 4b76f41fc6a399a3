"""Compiled CPU kernels for signscatter's majority (numba): count lanes -> packed digits -> values.

The shard owner turns summed count lanes into one digit per element (a bit at odd W, a
base-3 trit at even W: 0 negative, 1 tie, 2 positive) and packs them; every rank then
decodes the gathered digits to fp32. Both steps are table lookups on whole groups, never
one element at a time. Trits go by groups of 40 elements in 8 bytes (`scatter.pack_trits`):
element 8k + e is digit k of byte e, so plane k is 8 consecutive counts, and uint8 count
containers (a plain bit stream of `lane_bits`-bit counts: 1, 2 or 4 bits) hold a plane in
`lane_bits` whole bytes, each looked up as the digit bytes of its counts (`plane_table`); the 5
planes weigh into the group's 8 trit bytes as one uint64 (no byte sum exceeds 242). For bits,
8 counts are `lane_bits` whole bytes, one table row each. Same bits as the torch reference in
`scatter.py`.
"""

from __future__ import annotations

import numpy as np
from numba import njit


def plane_table(digit: np.ndarray, lane_bits: int) -> np.ndarray:
    """uint64 table over a container byte: its 8 // lane_bits counts' digits (`digit[count]`, a count
    past `digit` is 0: never summed), one per byte of the word, count i in byte i."""
    lanes, mask = 8 // lane_bits, (1 << lane_bits) - 1
    d = np.zeros(mask + 1, dtype=np.uint64)
    d[: digit.size] = digit[: mask + 1]
    b = np.arange(256)
    row = np.zeros(256, dtype=np.uint64)
    for i in range(lanes):
        row |= d[(b >> (i * lane_bits)) & mask] << np.uint64(8 * i)
    return row


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
def byte_lanes_to_trits(containers, lane_bits, planes, out):
    """out = the trit bytes of the counts in uint8 `containers` whose lanes fill the byte (lane_bits
    1, 2 or 4; `planes`: `plane_table` of the trit digits): a group's plane k (its 8 counts 8k..8k+7)
    is `lane_bits` container bytes, their looked-up digit bytes side by side; the group's 8 trit
    bytes are the planes times 3^k, summed as one uint64 (every byte's sum is at most 242: no
    carries). out.size is a multiple of 8 (whole groups), `out` 8-byte aligned."""
    per = np.uint64(64 // lane_bits)  # bits of the digit word one container byte fills
    words = out.view(np.uint64)
    step = 5 * lane_bits
    three = np.uint64(3)
    for g in range(words.size):
        src = containers[g * step : g * step + step]
        acc = np.uint64(0)
        for k in range(4, -1, -1):
            plane = np.uint64(0)
            for b in range(lane_bits):
                plane |= planes[src[k * lane_bits + b]] << (per * np.uint64(b))
            acc = acc * three + plane
        words[g] = acc


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
def decode_trits(packed, start, numel, columns, out):
    """out[i] (fp32 as uint32 bits) = the value of trit start + i: element 8k + e of a group of 40 is
    digit k of the group's byte e. `columns` (5 x 256 uint32) holds each digit position's value per
    byte; a whole group is 8 bytes read once and 5 runs of 8 consecutive values written."""
    i = 0
    while i < numel and (start + i) % 40:
        g = start + i
        out[i] = columns[(g % 40) >> 3, packed[(g // 40) * 8 + (g & 7)]]
        i += 1
    groups = (numel - i) // 40
    first = (start + i) // 40
    for t in range(groups):
        src = packed[(first + t) * 8 : (first + t) * 8 + 8]
        o = out[i + 40 * t : i + 40 * t + 40]
        for k in range(5):
            col = columns[k]
            for e in range(8):
                o[8 * k + e] = col[src[e]]
    i += 40 * groups
    while i < numel:
        g = start + i
        out[i] = columns[(g % 40) >> 3, packed[(g // 40) * 8 + (g & 7)]]
        i += 1
