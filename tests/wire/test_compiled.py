"""blockq's compiled chains (`wire/blockq/fused.py`) against the eager torch path, bit for bit.

Skipped unless NFAB_COMPILE_TESTS=1: torch.compile builds C++ on the first call (about a
minute on the shared 2-core box), which the default suite should not pay. Run:
`NFAB_COMPILE_TESTS=1 pytest tests/wire/test_compiled.py`.
"""

from __future__ import annotations

import os

import pytest
import torch

from nfab.wire import dispatch, noise
from nfab.wire.blockq import fused
from nfab.wire.registry import REDUCERS

pytestmark = pytest.mark.skipif(os.environ.get("NFAB_COMPILE_TESTS") != "1",
                                reason="compiles C++ for a minute: set NFAB_COMPILE_TESTS=1")

LAYOUTS = [
    [64 * 300],  # one view of whole blocks
    [64 * 40 + 5, 64 * 7, 3, 130],  # tails, short segments: several views
    [1000, 0, 4096 + 77],  # an empty segment
]
ROUTES = ["blockq-bq3", "blockq-bq2", "blockq-bq8", "blockq-bl5", "blockq-bq4-128"]


def _round_trip(name: str, lengths: list[int], world_size: int, compiled: bool) -> tuple[list, torch.Tensor]:
    """Every rank's payload and own decoded levels, and the decoded mean of the summed payloads."""
    red = REDUCERS[name]
    xs = [torch.randn(sum(lengths), generator=torch.Generator().manual_seed(r), device="cpu") * (r + 1)
          for r in range(world_size)]
    xs[0][::9] = 0.0
    with dispatch.host_paths(False), dispatch.compile_paths(compiled):
        shared = torch.stack([red.local_scale(x, lengths) for x in xs]).amax(0)
        keys = noise.draw_keys(torch.Generator().manual_seed(7), len(lengths), torch.device("cpu"))
        encs = [red.encode(x.to(torch.bfloat16) if r == 1 else x, lengths, world_size, shared,
                           noise.Stratum(keys, r, world_size)) for r, x in enumerate(xs)]
        total = sum(e.payload for e in encs)
        mean = red.decode(total, shared, sum(lengths), lengths, world_size)
        return [(e.payload, e.local) for e in encs], mean


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", ROUTES)
def test_compiled_chains_are_the_eager_path_bit_for_bit(name, world_size):
    for lengths in LAYOUTS:
        eager, compiled = _round_trip(name, lengths, world_size, False), _round_trip(name, lengths, world_size, True)
        assert not fused._failed, "torch.compile failed: the eager path ran"
        for (p0, l0), (p1, l1) in zip(eager[0], compiled[0], strict=True):
            assert torch.equal(p0, p1), f"payload {lengths}"
            assert torch.equal(l0, l1), f"own contribution {lengths}"
        assert torch.equal(eager[1], compiled[1]), f"mean {lengths}"


def test_compiled_chains_compile_once_for_every_bucket_size():
    """dynamic=True: new bucket sizes and routes reuse the graphs (no compile per shape)."""
    torch._dynamo.utils.counters.clear()
    for n in (64 * 50, 64 * 77 + 3, 64 * 1000):
        _round_trip("blockq-bq3", [n], 2, True)
    _round_trip("blockq-bq2", [64 * 99], 4, True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 4  # levels and decode, at most one recompile each
