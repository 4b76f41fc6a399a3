"""The chunked lane order (`lanes.chunked_layout`, blockq's wide one-block lanes) on every path.

The order is stated here once more, independently, in plain Python (`_place`): the torch reference
(`lanes.pack` / `lanes.unpack`) is held to it, and the numba kernels (`chunk_kernels`) to the
reference, over sizes that end inside, at and past a chunk boundary.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nfab.wire.blockq import radix
from nfab.wire.blockq.radix import chunked_radix_layout
from nfab.wire.qsum import host, lanes
from nfab.wire.qsum.lanes import CHUNK, chunked_layout, layout_for
from nfab.wire.registry import REDUCERS

BITS = [1, 2, 3, 4, 5, 6, 7, 9, 10, 12]  # uint8 8, 4, 2 lanes; int64 21; int32 6, 5; int64 9, 7; int32 3, 2
SIZES = [1, 5, 6, 7, 64 * 6 - 1, 64 * 6, 64 * 6 + 1, 64 * 13 + 3, 64 * 6 * 5 + 64 * 2 + 11, 64 * 6 * 9]


def _place(e: int, n: int, lanes: int, chunk: int = CHUNK) -> tuple[int, int]:
    """(container, lane) of element e of n: chunks of `chunk` containers (the last one shorter),
    lane-major inside a chunk."""
    m = -(-n // lanes)
    c0 = e // (chunk * lanes) * chunk
    g = min(chunk, m - c0)
    lane, j = divmod(e - c0 * lanes, g)
    return c0 + j, lane


@pytest.mark.parametrize("bits", BITS)
def test_the_chunked_layouts_are_the_dense_ones_in_another_order(bits):
    plain, chunked = layout_for(bits), chunked_layout(bits)
    assert chunked.chunk == CHUNK and chunked.lanes > 1
    assert (chunked.lane_bits, chunked.container, chunked.lanes, chunked.storage_bits) == (
        plain.lane_bits, plain.container, plain.lanes, plain.storage_bits)


def test_one_lane_layouts_stay_unchunked():
    for bits in (8, 31, 32, 63):
        assert chunked_layout(bits).chunk == 0


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n", SIZES)
def test_reference_places_every_element_where_the_order_says(bits, n):
    layout = chunked_layout(bits)
    values = torch.randint(0, layout.max_value + 1, (n,), generator=torch.Generator().manual_seed(n))
    packed = lanes.pack(values, layout)
    assert packed.numel() == layout.containers_for(n)
    for e in range(n):
        c, lane = _place(e, n, layout.lanes)
        assert (int(packed[c]) >> lane * bits) & layout.max_value == int(values[e]), (e, c, lane)
    assert torch.equal(lanes.unpack(packed, layout, n).to(torch.int64), values)
    m = packed.numel()  # the lanes past n hold 0
    tail = lanes.unpack(packed, layout, m * layout.lanes)[n:]
    assert not tail.any()


def _lane_case(bits: int, n: int) -> tuple[lanes.LaneLayout, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chunked layout, n random lane values (int64), the same in the narrowest dtype the paths take,
    their reference packing)."""
    layout = chunked_layout(bits)
    values = torch.randint(0, layout.max_value + 1, (n,), generator=torch.Generator().manual_seed(n))
    narrow = values.to(torch.uint8 if bits <= 8 else torch.int32)
    return layout, values, narrow, lanes.pack(narrow, layout)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n", SIZES)
def test_numba_kernels_are_the_reference(bits, n):
    from nfab.wire.blockq.reducer import pack_any

    layout, _, narrow, ref = _lane_case(bits, n)
    assert torch.equal(pack_any(narrow, layout, True), ref)
    table = torch.randn(layout.max_value + 1, generator=torch.Generator().manual_seed(1))
    for count in (n, max(n - 3, 0)):
        assert torch.equal(host.decode_table(ref, layout, count, table), lanes.decode_table(ref, layout, count, table))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n", SIZES)
def test_numba_block_decode_is_the_reference_arithmetic(bits, n):
    """`lanes_decode_chunked` (blockq's CPU decode of chunked lanes): (S * unit - 1) * the block's
    scale in float32, as the reference unpacking followed by the eager arithmetic gives it."""
    from nfab.wire.blockq import kernels as blockkernels

    layout = chunked_layout(bits)
    values = torch.randint(0, layout.max_value + 1, (n,), generator=torch.Generator().manual_seed(n))
    packed = lanes.pack(values, layout)
    unit = np.float32(2.0 / layout.max_value)
    for count in (n, max(n - 3, 0)):
        starts = np.arange(0, count, 64, dtype=np.int64)
        ends = np.minimum(starts + 64, count)
        scales = torch.rand(starts.size, generator=torch.Generator().manual_seed(2)) + 0.5
        got = np.empty(count, dtype=np.float32)
        blockkernels.lanes_decode_chunked(packed.numpy(), bits, layout.lanes, layout.chunk, count, unit, starts, ends,
                                          scales.numpy(), got)
        per_element = torch.repeat_interleave(scales, torch.from_numpy(ends - starts))
        want = (lanes.unpack(packed, layout, count).to(torch.float32) * float(unit) - 1.0) * per_element
        assert torch.equal(torch.from_numpy(got), want)


@pytest.mark.parametrize("world_size", [2, 4])
def test_blockq_packs_chunked_and_its_scatter_plain(world_size):
    """blockq's all-reduce lanes sized for W are chunked where wide; blockqscatter's owners pack
    one shard each, which concatenate to the whole packing only in the plain order."""
    for route in ("bq4", "bq2", "bl5"):  # bit lanes at W=2 and 4, radix digits
        assert REDUCERS[f"blockq-{route}"].layout(world_size).chunk == CHUNK
        assert REDUCERS[f"blockqscatter-{route}"].layout(world_size).chunk == 0


RADICES = [7, 13, 5, 300]  # bq2 at W=2 and 4 (22 and 17 digits), bl5-like, int32 digits


@pytest.mark.parametrize("base", RADICES)
@pytest.mark.parametrize("n", SIZES)
def test_radix_reference_places_every_digit_where_the_order_says(base, n):
    layout = chunked_radix_layout(base)
    k = layout.digits
    values = torch.randint(0, base, (n,), generator=torch.Generator().manual_seed(n))
    packed = radix.pack(values, layout)
    assert packed.numel() == layout.containers_for(n)
    for e in range(n):
        c, place = _place(e, n, k)
        assert int(packed[c]) // base**place % base == int(values[e]), (e, c, place)
    assert torch.equal(radix.unpack(packed, layout, n), values)
    assert not radix.unpack(packed, layout, packed.numel() * k)[n:].any()


@pytest.mark.parametrize("base", RADICES)
@pytest.mark.parametrize("n", SIZES)
def test_radix_numba_path_is_the_reference(base, n):
    from nfab.wire.blockq.reducer import pack_any

    layout = chunked_radix_layout(base)
    values = torch.randint(0, base, (n,), generator=torch.Generator().manual_seed(n))
    narrow = values.to(torch.uint8 if base <= 256 else torch.int32)
    ref = radix.pack(narrow, layout)
    assert torch.equal(pack_any(narrow, layout, True), ref)
