"""Compiled CPU kernels (numba) for the chunked lane order (`lanes.chunked_layout`).

In a chunk of g containers starting at container c0, lane l of container c0 + j holds element
lanes * c0 + l * g + j: each lane of a chunk is a contiguous row of elements, so the packing runs
lane by lane over contiguous rows, loops that vectorise. `nfab.wire.qsum.lanes` holds the torch
reference it matches bit for bit. blockq decodes these lanes by
`blockq.kernels.lanes_decode_chunked` (the value table's arithmetic and the block scales in one pass).
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def pack_chunked(values, numel, lane_bits, lanes, chunk, out):
    """out = `lanes.pack(values[:numel], layout)` of a chunked layout (`out`: its m containers;
    elements at or past `numel` packed as 0). Whole chunks lane by lane over contiguous rows; the
    elements of a chunk that reaches past `numel` one by one."""
    m = out.size
    for c0 in range(0, m, chunk):
        g = min(chunk, m - c0)
        e0 = c0 * lanes
        dest = out[c0 : c0 + g]
        if e0 + g * lanes <= numel:
            row = values[e0 : e0 + g]
            for j in range(g):
                dest[j] = row[j]
            for lane in range(1, lanes):
                row = values[e0 + lane * g : e0 + (lane + 1) * g]
                shift = lane * lane_bits
                for j in range(g):
                    dest[j] |= np.int64(row[j]) << shift
            continue
        for j in range(g):
            c = np.int64(0)
            for lane in range(lanes):
                e = e0 + lane * g + j
                if e < numel:
                    c |= np.int64(values[e]) << (lane * lane_bits)
            dest[j] = c

