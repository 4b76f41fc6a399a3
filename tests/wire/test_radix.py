"""Radix lanes: densest digits per int64, exact round trips and carry-free sums at the bound."""

from __future__ import annotations

import math

import pytest
import torch

from nfab.wire.blockq.radix import pack, radix_layout, unpack


@pytest.mark.parametrize("radix", [2, 7, 13, 25, 29, 61, 4081])
def test_layout_is_the_most_digits_below_2_63(radix):
    k = radix_layout(radix).digits
    assert radix**k <= 1 << 63 < radix ** (k + 1)
    assert k == math.floor(63 / math.log2(radix) + 1e-12)


@pytest.mark.parametrize("radix,world_size", [(13, 4), (7, 2), (25, 8), (10, 3)])
def test_sums_of_packed_ranks_unpack_to_digit_sums(radix, world_size):
    """Every rank's digit <= (radix-1)/W: the int64 sum of containers holds every digit sum
    exactly, including the all-maximal case that touches the top of the range."""
    layout = radix_layout(radix)
    top = (radix - 1) // world_size
    g = torch.Generator().manual_seed(radix)
    n = 1001
    ranks = [torch.randint(0, top + 1, (n,), generator=g) for _ in range(world_size)]
    ranks[0][:layout.digits] = top  # a full container of maximal digits on every rank
    for r in ranks[1:]:
        r[:layout.digits] = top
    total = sum(pack(r, layout) for r in ranks)
    assert total.dtype == torch.int64 and bool((total >= 0).all())
    assert torch.equal(unpack(total, layout, n), sum(ranks))
    assert torch.equal(unpack(pack(ranks[1], layout), layout, n), ranks[1])
