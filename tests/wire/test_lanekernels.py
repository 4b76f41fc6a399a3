"""The vote spreads into count lanes (`lanekernels`) give `lanes.pack`'s containers bit for bit.

The layouts of W = 4..7 (21 three-bit lanes in int64) and W = 16..31 (6 five-bit lanes in int32)
fill whole containers a group at a time (8 and 4 containers) and leave the rest to the block
pass: sizes here sweep every remainder around those groups' edges, and shards whose neighbours'
votes sit right past their end.
"""

import pytest
import torch

from nfab.wire import dispatch
from nfab.wire.qsum import lanes
from nfab.wire.qsum.lanes import count_lane_bits, layout_for
from nfab.wire.sign import codec as sign_codec
from nfab.wire.sign import host as sign_host

pytestmark = pytest.mark.skipif(not dispatch.AVAILABLE, reason="numba not installed")


def _x(numel: int, seed: int) -> torch.Tensor:
    """Gaussian values with the inputs whose vote the sign bit alone would get wrong."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    special = torch.tensor([-0.0, float("nan"), -float("nan"), float("-inf"), float("inf"), 0.0, -1e-45])
    x[: min(numel, special.numel())] = special[: min(numel, special.numel())]
    if numel > 20:
        x[-3:] = special[:3]
    return x


@pytest.mark.parametrize("world_size", [4, 5, 7, 16, 17, 31])
def test_wide_spread_every_remainder(world_size):
    layout = layout_for(count_lane_bits(world_size))
    group = 8 * layout.lanes if layout.lanes == 21 else 4 * layout.lanes  # elements of one whole-container group
    sizes = list(range(1, 3 * group + 2)) + [k * group + d for k in (40, 41, 1000) for d in (-1, 0, 1, 17)]
    for numel in sizes:
        x = _x(numel, numel)
        bits, _ = sign_host.sign_votes(x, [numel])
        want = lanes.pack(sign_codec.sign_bits(x), layout)
        assert torch.equal(sign_host.votes_to_lanes(bits, numel, layout), want), numel


@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 8, 9, 15, 16, 17])
@pytest.mark.parametrize("numel", [1, 999, 4001, 70_003])
def test_shard_spread_is_per_shard_pack(world_size, numel):
    """Each shard is spread on its own: the next shard's votes right past its end never leak in."""
    layout = layout_for(count_lane_bits(world_size))
    shard = -(-numel // (40 * world_size)) * 40
    x = _x(numel, world_size)
    bits, _ = sign_host.sign_votes(x, [numel])
    votes = torch.zeros(world_size * shard, dtype=torch.bool)
    votes[:numel] = sign_codec.sign_bits(x)
    want = torch.cat([lanes.pack(v, layout) for v in votes.view(world_size, shard)])
    assert torch.equal(sign_host.votes_to_shard_lanes(bits, numel, shard, world_size, layout), want)
