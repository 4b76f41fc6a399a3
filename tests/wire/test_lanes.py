"""Lane packing: pack, integer-sum across W ranks, unpack equals the elementwise sum."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nfab.wire.qsum.lanes import count_lane_bits, layout_for, pack, unpack


@pytest.mark.parametrize("w,bits", [(1, 1), (2, 2), (3, 2), (4, 3), (7, 3), (8, 4), (15, 4), (16, 5), (64, 7)])
def test_count_lane_bits(w, bits):
    assert count_lane_bits(w) == bits
    assert (1 << bits) - 1 >= w > (1 << (bits - 1)) - 1


@settings(max_examples=60, deadline=None)
@given(
    world_size=st.integers(1, 64),
    numel=st.integers(0, 300),
    seed=st.integers(0, 2**31 - 1),
)
def test_sum_of_packed_counts_is_exact(world_size, numel, seed):
    layout = layout_for(count_lane_bits(world_size))
    g = torch.Generator().manual_seed(seed)
    votes = [torch.randint(0, 2, (numel,), generator=g) for _ in range(world_size)]
    total = pack(votes[0], layout).clone()
    for v in votes[1:]:
        total += pack(v, layout)  # the integer SUM an all-reduce computes
    assert torch.equal(unpack(total, layout, numel).long(), torch.stack(votes).sum(0))


@settings(max_examples=60, deadline=None)
@given(lane_bits=st.integers(1, 20), numel=st.integers(0, 200), seed=st.integers(0, 1000))
def test_every_lane_width_round_trips_at_full_headroom(lane_bits, numel, seed):
    """Sums that reach the lane's maximum value still never carry into the next lane."""
    layout = layout_for(lane_bits)
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, layout.max_value + 1, (numel,), generator=g)
    b = layout.max_value - a  # a + b == max_value in every lane
    total = pack(a, layout) + pack(b, layout)
    assert torch.equal(unpack(total, layout, numel).long(), a + b)


def test_layout_density():
    assert layout_for(2).bits_per_element == 2.0  # 4 lanes in a uint8
    assert layout_for(3).bits_per_element <= 3.2  # W=4..7 sign counts: <= 1/10 of fp32
    with pytest.raises(ValueError):
        layout_for(0)
