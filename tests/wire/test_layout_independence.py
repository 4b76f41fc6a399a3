"""A parameter's encoding must not depend on which bucket neighbours it travels with.

DDP's first iteration after a resume uses its initial bucket layout and later iterations
the rebuilt one; if a slice's scale or votes depended on its offset in a group, a resumed
run would drift from an uninterrupted one.
"""

import pytest
import torch

from nfab.wire.registry import REDUCERS


@pytest.mark.parametrize("key", ["signcount", "signgather"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_scales_do_not_depend_on_offset_or_neighbours(key, world_size):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(300_001, generator=g)
    b = torch.randn(70_003, generator=g)
    c = torch.randn(5, generator=g)
    red = REDUCERS[key]
    first = red.encode(torch.cat([a, b]), [a.numel(), b.numel()], world_size)
    later = red.encode(torch.cat([c, b, a]), [c.numel(), b.numel(), a.numel()], world_size)
    alone = red.encode(a.clone(), [a.numel()], world_size)
    assert torch.equal(first.scales[0], later.scales[2]) and torch.equal(first.scales[0], alone.scales[0])
    assert torch.equal(first.scales[1], later.scales[1])
    assert torch.equal(first.local[: a.numel()], later.local[-a.numel():])
