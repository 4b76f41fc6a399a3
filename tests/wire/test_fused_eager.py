"""The compiled stages' pure functions, run eagerly, against the references they replace.

Fast (no compiling): the arithmetic that `torch.compile` turns into kernels -- scale codes by
exponent bits, lanes OR-ed column by column and unpacked by stacking, radix digits by Horner's
rule, votes by the vote table's arithmetic -- is checked here in the default suite;
tests/wire/test_compiled.py (NFAB_COMPILE_TESTS=1) checks the compiled kernels themselves.
"""

from __future__ import annotations

import pytest
import torch

from nfab.wire import fusion
from nfab.wire.blockq import fused as blockq_fused
from nfab.wire.blockq import radix, table
from nfab.wire.blockq.reducer import SCALES, block_reducers
from nfab.wire.qsum import fused as qsum_fused
from nfab.wire.qsum import words
from nfab.wire.qsum.lanes import LaneLayout, layout_for, pack, unpack
from nfab.wire.sign import codec as sign_codec
from nfab.wire.sign import fused as sign_fused
from nfab.wire.sign import scatter_fused
from nfab.wire.sign.scatter import pack_trits, unpack_trits


def _reference_codes(m: torch.Tensor) -> torch.Tensor:
    return torch.searchsorted(SCALES, torch.nan_to_num(m, nan=0.0)).clamp_(max=255).to(torch.uint8)


def test_scale_codes_by_exponent_arithmetic_are_searchsorted_bit_for_bit():
    up = torch.nextafter(SCALES, torch.tensor(float("inf")))
    down = torch.nextafter(SCALES, torch.tensor(0.0))
    special = torch.tensor([0.0, -0.0, 1e-45, 1e-40, 1.17e-38, 2.0**-41, 2.0**-40, 2.0**23.75, 2.0**24, 3e38,
                            float("inf"), float("nan")], dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    spread = torch.exp2(torch.rand(100_000, generator=g) * 140 - 70)  # 2^-70 .. 2^70
    m = torch.cat([SCALES, up, down, special, spread]).abs()
    assert torch.equal(table.codes_of(m, SCALES), _reference_codes(m))


def test_every_scale_is_its_octave_entry_times_a_power_of_two():
    """What `table.codes_of` and `table.scales_of` rest on, for every code."""
    codes = torch.arange(1, 256)
    octave, step = torch.div(codes - table.CODE_OFFSET, 4, rounding_mode="floor"), (codes - table.CODE_OFFSET) % 4
    assert torch.equal(torch.ldexp(SCALES[table.CODE_OFFSET + step], octave), SCALES[1:])


def test_block_maxima_holding_a_non_finite_value_flag_block_zero_with_nan():
    maxima = torch.tensor([1.0, float("nan"), 3.0])
    assert torch.equal(blockq_fused.flagged(maxima[[0, 2]]), maxima[[0, 2]])
    flagged = blockq_fused.flagged(maxima)
    assert flagged[0].isnan() and flagged[2] == 3.0 and maxima[0] == 1.0  # a new tensor: the input kept


def test_scales_of_codes_are_the_table_bit_for_bit():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(table.scales_of(codes, SCALES).view(torch.int32), SCALES.view(torch.int32))
    divisors = table.scales_of(codes, SCALES, 1.0)
    assert divisors[0] == 1.0 and torch.equal(divisors[1:], SCALES[1:])


@pytest.mark.parametrize("lane_bits", [1, 2, 3, 4, 5, 6, 9, 13, 31])
@pytest.mark.parametrize("n", [1, 7, 64 * 9 + 5])
def test_lanes_packed_column_by_column_are_lanes_pack(lane_bits, n):
    layout = layout_for(lane_bits)
    g = torch.Generator().manual_seed(lane_bits * 100 + n)
    dtype = torch.uint8 if lane_bits <= 8 else torch.int32
    values = torch.randint(0, layout.max_value + 1, (n,), generator=g).to(dtype)
    got = qsum_fused.packed(values, layout)
    assert got.dtype == layout.container and torch.equal(got, pack(values, layout))
    m = got.numel()
    out = torch.empty(m * layout.lanes, dtype=qsum_fused.lane_dtype(layout))
    for l0, l1 in layout.blocks:
        qsum_fused.unpacked_into(out[m * l0 : m * l1].view(m, l1 - l0), got, layout, l0, l1)
    assert torch.equal(out[:n].to(torch.int64), unpack(got, layout, n).to(torch.int64))


def _route_radices() -> list[int]:
    """Every radix a block-scaled route packs its digits in at W = 1..16."""
    return sorted({red.layout(w).radix for red in block_reducers().values() for w in range(1, 17)
                   if red.capacity(w).ok and isinstance(red.layout(w), radix.RadixLayout)})


@pytest.mark.parametrize("base", _route_radices())
def test_radix_stages_are_radix_pack_and_unpack(base):
    """Every radix a route uses (groups of 1, 2, 4 and 8 containers; uint8 and int32 values and
    digits): one value (a zero-padded group), then whole groups and a ragged last one; the largest
    container (every digit R - 1), 0 and containers with a zero low half take the float64 split's
    corrections."""
    layout = radix.radix_layout(base)
    k, g = layout.digits, torch.Generator().manual_seed(base)
    for n in (1, 8 * k * 5 + 3):
        values = torch.randint(0, min(base, 256), (n,), generator=g).to(torch.uint8)
        values[: min(n, k)] = min(base - 1, 255)
        m = layout.containers_for(n)
        digits = torch.randint(0, base, (m * k,), generator=g)
        digits[:k] = base - 1
        digits[k : 2 * k] = 0
        digits.view(m, k)[2:40, : k // 2] = 0  # c = hi * R^h: a float64 quotient just below hi, corrected up
        sums = torch.randint(0, base, (n,), generator=g, dtype=torch.int32)  # the scatter owner's int32 sums
        with fusion.stages_compiled(False):
            packed = blockq_fused.radix_pack(values, layout), blockq_fused.radix_pack(sums, layout)
            unpacked = blockq_fused.radix_unpack(radix.pack(digits, layout), layout)
        assert torch.equal(packed[0], radix.pack(values, layout)) and torch.equal(packed[1], radix.pack(sums, layout))
        assert unpacked.numel() >= m * k and torch.equal(unpacked[: m * k].to(torch.int64), digits)


@pytest.mark.parametrize("vote", ["majority", "mean"])
@pytest.mark.parametrize("world_size", [2, 3, 4, 7])
def test_votes_by_arithmetic_are_the_vote_table(vote, world_size):
    counts = torch.arange(world_size + 1)
    w = torch.tensor(float(world_size))
    assert torch.equal(sign_fused._vote(counts, w, vote), sign_codec.vote_table(world_size, vote))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_vote_bytes_from_the_bits_are_the_reference_votes(dtype):
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1.0, -1.0, float("inf"), float("-inf"), float("nan"),
                            -float("nan"), 3e38, -3e38])
    x = torch.cat([special, torch.randn(4099, generator=torch.Generator().manual_seed(3))]).to(dtype)
    x[-5:] = 0.0
    for tie in (0, 1, 2, 5):  # x > 0, NaN negative, a zero by the tie
        got = sign_fused.vote_bytes(x, torch.tensor([tie & 1], dtype=torch.int32))
        assert torch.equal(got, sign_codec.sign_bits(x.float(), tie).to(torch.uint8))
    rows = x[:4080].view(102, 40)  # a 2-D view (signscatter's shards)
    assert torch.equal(sign_fused.vote_bytes(rows, torch.tensor([1], dtype=torch.int32)).reshape(-1),
                       sign_codec.sign_bits(x[:4080].float(), 1).to(torch.uint8))


@pytest.mark.parametrize("lane_bits", range(1, 8))
def test_eight_values_compressed_into_a_word_and_spread_back(lane_bits):
    """`words.compressed` / `spread`, the 8-lane blocks of int32/int64 containers: value k at bit
    k * lane_bits, for every width up to 7 (from 5 bits the halves are masked apart first)."""
    g = torch.Generator().manual_seed(lane_bits)
    values = torch.randint(0, 1 << lane_bits, (8 * 513,), generator=g).to(torch.uint8)
    values[:8] = (1 << lane_bits) - 1  # every bit of every lane set
    expected = sum(values.view(-1, 8)[:, k].to(torch.int64) << (k * lane_bits) for k in range(8))
    got = words.compressed(values.view(torch.int64), lane_bits)
    assert torch.equal(got, expected)
    assert torch.equal(words.spread(got, lane_bits), values.view(torch.int64))


@pytest.mark.parametrize("lane_bits", [3, 7])
@pytest.mark.parametrize("n", [1, 21 * 8 + 3, 64 * 21 + 5])
def test_wide_containers_packed_from_words_are_lanes_pack(lane_bits, n):
    """int64 containers of 21 (3-bit) or 9 (7-bit) lanes: their 8-lane blocks as words, the rest as
    columns (`qsum.fused.pack` / `unpack`, stages run eagerly)."""
    layout = layout_for(lane_bits)
    assert layout.container == torch.int64 and not words.fits(layout)
    values = torch.randint(0, layout.max_value + 1, (n,), generator=torch.Generator().manual_seed(n)).to(torch.uint8)
    with fusion.stages_compiled(False):
        packed = qsum_fused.pack(values, layout)
        assert torch.equal(packed, pack(values, layout))
        assert torch.equal(qsum_fused.unpack(packed, layout)[:n], values)


def lane_cases(layout, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, containers) of n lane values in `layout`: random, the first container every lane at
    its largest value, the second all zero; the containers `lanes.pack`'s."""
    dtype = torch.uint8 if layout.lane_bits <= 8 else torch.int32
    values = torch.randint(0, layout.max_value + 1, (n,), generator=torch.Generator().manual_seed(seed)).to(dtype)
    values[: layout.lanes] = layout.max_value
    values[layout.lanes : 2 * layout.lanes] = 0
    return values, pack(values, layout)


@pytest.mark.parametrize("layout", [layout_for(5), layout_for(6), LaneLayout(7, torch.int32, 4, 32),
                                    LaneLayout(8, torch.int64, 7, 64)], ids=str)
@pytest.mark.parametrize("n", [1, 6, 24 * 7, 40 * 7 + 3, 40 * 64 + 17])
def test_one_block_wide_lanes_unpacked_as_digits_are_lanes_unpack(layout, n):
    """int32 / int64 containers of one block of uint8 lanes (5-bit lanes 6 to an int32, 6-bit 5: the
    routes'; 7-bit 4 to an int32, 8-bit 7 to an int64): `qsum.fused.unpack` as digits in groups of
    whole words (`digits.unpack_lanes`, stages run eagerly) is `lanes.unpack`, for whole groups, a
    ragged last group and an odd number of int32 containers; also from containers that do not
    start on a whole word. `qsum.fused.pack` is `lanes.pack`."""
    assert qsum_fused.digit_lanes(layout)
    lane_bits = layout.lane_bits
    values, containers = lane_cases(layout, n, lane_bits * 1000 + n)
    m = containers.numel()
    shifted = torch.cat([containers[:1], containers])[1:]  # 4 bytes past a word boundary
    with fusion.stages_compiled(False):
        packed = qsum_fused.pack(values, layout)
        unpacked, from_shifted = qsum_fused.unpack(containers, layout), qsum_fused.unpack(shifted, layout)
    assert torch.equal(packed, containers)
    want = unpack(containers, layout, m * layout.lanes).to(torch.int64)
    for got in (unpacked, from_shifted):
        assert got.dtype == qsum_fused.lane_dtype(layout) and got.numel() >= m * layout.lanes
        assert torch.equal(got[: m * layout.lanes].to(torch.int64), want)
    assert torch.equal(unpacked[:n].to(values.dtype), values)


@pytest.mark.parametrize("lane_bits", words.LANE_BITS)
@pytest.mark.parametrize("n", [1, 7, 8, 64 * 9 + 5])
def test_lanes_as_words_are_lanes_pack_and_unpack(lane_bits, n):
    layout = layout_for(lane_bits)
    assert words.fits(layout)
    g = torch.Generator().manual_seed(lane_bits * 10 + n)
    values = torch.randint(0, layout.max_value + 1, (n,), generator=g).to(torch.uint8)
    whole = words.as_words(values)
    assert torch.equal(words.lanes_of_bytes(whole, lane_bits).view(torch.uint8)[: layout.containers_for(n)],
                       pack(values, layout))
    if lane_bits == 2:
        assert torch.equal(words.quad_lanes(whole.view(torch.int32))[: layout.containers_for(n)], pack(values, layout))
    votes = values & 1  # 0/1 bytes, as sign packs its votes: through `words.pack`, stages run eagerly
    with fusion.stages_compiled(False):
        assert torch.equal(words.pack(votes, layout), pack(votes, layout))
    with fusion.stages_compiled(False):
        got = words.unpack(pack(values, layout), layout)
    assert torch.equal(got[:n], values)


@pytest.mark.parametrize("rows", [1, 2, 5, 255])
def test_gathered_vote_rows_counted_in_words_are_the_sum_of_votes(rows):
    n = 8 * 41 + 3
    votes = torch.randint(0, 2, (rows, n), generator=torch.Generator().manual_seed(rows)).to(torch.uint8)
    packed_rows = torch.stack([pack(v, layout_for(1)) for v in votes])
    assert torch.equal(words.row_counts(packed_rows).view(torch.uint8)[:n], votes.sum(0).to(torch.uint8))


def test_trit_digits_by_swar_division_are_unpack_trits_for_every_byte_in_every_position():
    """`digit_words` splits a word of 8 trit bytes into its 5 planes by 16-bit-field arithmetic: every
    byte value 0..242 at every byte position of the word, against the integer division of `unpack_trits`."""
    grid = (torch.arange(243).view(-1, 1) + 31 * torch.arange(8).view(1, -1)) % 243  # (words, position)
    packed = grid.to(torch.uint8).reshape(-1)
    digits = scatter_fused.digit_words(packed.view(torch.int64)).view(torch.uint8).reshape(-1)
    want = unpack_trits(packed, 243 * 40)
    assert torch.equal(digits.to(torch.int32), want)
    out = torch.empty(243 * 40 - 3)
    scatter_fused.digit_values_into(out, digits, torch.tensor([0.75]))
    assert torch.equal(out, (want[: out.numel()].to(torch.float32) - 1.0) * 0.75)


@pytest.mark.parametrize("world_size", [2, 4, 7])
def test_majority_bits_and_trits_by_arithmetic_are_the_eager_owner_step(world_size):
    counts = torch.randint(0, world_size + 1, (400,), generator=torch.Generator().manual_seed(world_size))
    half = torch.tensor([world_size // 2], dtype=torch.int32)
    assert torch.equal(scatter_fused.majority_bits(counts.to(torch.uint8), half), (counts > world_size // 2)
                       .to(torch.uint8))
    trits = (counts >= world_size // 2).to(torch.uint8) + (counts > world_size // 2).to(torch.uint8)
    got = torch.empty(400, dtype=torch.uint8)
    scatter_fused.trits_into(got, counts.to(torch.uint8), half)
    assert torch.equal(got, trits)
    packed = scatter_fused.trit_words(got.view(torch.int64).view(-1, 5)).view(torch.uint8)
    assert torch.equal(packed, pack_trits(trits))


def test_levels_are_floor_then_clamp_for_every_t_and_zero_for_nan():
    """`fusion.levels_of` caps at M, truncates and raises to 0 as an integer (5 vector instructions
    where two NaN-aware clamps are 8): the reference's floor-then-clamp for every non-NaN t, including
    the edges, the fp32 rounding of M + u up to M + 1, and +-inf; a NaN gives 0, as the reference's
    uint8 cast does."""
    m = 15.0
    x = torch.tensor([-3.0, -1.0, -0.999, -1e-7, 0.0, 0.5, 0.9999, 1.0, 1.0001, 7.0, float("inf"),
                      -float("inf"), 3e38, -3e38, float("nan")])
    safe = torch.tensor(1.0)
    counters = torch.arange(x.numel(), dtype=torch.int32) * 7919
    got = fusion.levels_of(x, safe, counters, None, torch.tensor(m / 2), torch.tensor(m))
    t = (x / safe + 1.0) * (m / 2) + fusion.uniform_of(counters, None)
    want = t.floor().clamp(0, m).nan_to_num(nan=0.0).to(torch.int32)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    top = fusion.levels_of(torch.ones(4), safe, counters[:4], None, torch.tensor(127.5), torch.tensor(255.0))
    assert int(top.max()) <= 255


def test_a_large_layouts_block_index_is_built_on_the_device_as_the_kept_one_is():
    """Past `grid.CACHED_INDEX` elements (an FSDP2 module's rows of segments) the per-element block ids
    are expanded from the kept block sizes at each call: the same ids and count as the index built
    element by element, in the torch path's int64 and in the compiled path's narrow dtype."""
    from nfab.wire.blockq import grid

    cpu = torch.device("cpu")
    lengths = (grid.CACHED_INDEX // 2 + 3, 64 * 5, 1, grid.CACHED_INDEX // 2 + 100)
    ids, at = [], 0
    for n in lengths:  # the numbering `kernels.py` documents: blocks restart per segment, counted on
        ids.append(torch.arange(n) // 64 + at)
        at += -(-n // 64)
    want = torch.cat(ids)
    got, blocks = grid.block_index(lengths, 64, cpu)
    assert sum(lengths) > grid.CACHED_INDEX and blocks == at and torch.equal(got, want)
    index, seg, offset = blockq_fused._block_index(lengths, 64, cpu)
    assert index.dtype == qsum_fused.index_dtype(at) and torch.equal(index.long(), want)
    small = lengths[1:3]
    assert torch.equal(blockq_fused._block_index(small, 64, cpu)[0].long(), grid.block_index(small, 64, cpu)[0])
    assert seg.numel() == offset.numel() == at
