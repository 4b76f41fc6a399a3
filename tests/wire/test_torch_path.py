"""The torch path (what CUDA and every other non-CPU device take) against the compiled CPU path,
on every reducer of every route, on CPU: `dispatch.host_paths(False)` sends CPU tensors down
the torch path.

Bit for bit: the replayed mean and every rank's own decoded contribution (fp32 inputs), and
the payload a bf16 bucket encodes to. One exception, stated: the sign routes' per-segment
scale (mean |x|) is a float sum whose order each path chooses (the compiled pass sums 4096-
element chunks in vector lanes, torch its own way), so it agrees to float32 rounding, not to
the bit; the votes, and so every sign, are bit-equal.
"""

from __future__ import annotations

import pytest
import torch

from nfab.wire import dispatch
from nfab.wire.registry import REDUCERS

LENGTHS = [37, 1000, 3, 513, 0, 4096 + 77]  # odd sizes, an empty segment, one past a 4096-element chunk
SIGN = {"signcount", "signgather", "signscatter"}

pytestmark = pytest.mark.skipif(not dispatch.AVAILABLE, reason="numba not installed: only the torch path runs")


def _inputs(world_size: int, dtype: torch.dtype) -> list[torch.Tensor]:
    out = []
    for r in range(world_size):
        x = torch.randn(sum(LENGTHS), generator=torch.Generator().manual_seed(r), device="cpu")
        x[::7] = x[::7].abs()  # elements where ranks agree, and ties at even W
        x[3::13] = 0.0  # exact zeros on every rank: a sign vote by the tie
        x[5::26] = -0.0
        out.append(x.to(dtype))
    return out


def _run(name: str, world_size: int, host: bool) -> tuple:
    red = REDUCERS[name]
    with dispatch.host_paths(host):
        gens = [torch.Generator().manual_seed(100 + r) for r in range(world_size)]
        mean, locals_ = red.replay_with_locals(_inputs(world_size, torch.float32), LENGTHS, generators=gens, step=3)
        encs = []
        for r, x in enumerate(_inputs(world_size, torch.bfloat16)):
            shared = red.local_scale(x.float(), LENGTHS) if red.needs_shared_scale else None
            encs.append(red.encode(x, LENGTHS, world_size, shared, torch.Generator().manual_seed(5 + r), tie=r + 1))
    return mean, locals_, [e.payload for e in encs], [e.scales for e in encs]


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", list(REDUCERS))
def test_torch_path_is_the_compiled_path_bit_for_bit(name, world_size):
    if not REDUCERS[name].capacity(world_size).ok:
        pytest.skip("over capacity")
    host, torch_path = _run(name, world_size, True), _run(name, world_size, False)
    assert all(_same(a, b) for a, b in zip(host[2], torch_path[2], strict=True)), "bf16 payload"
    if name not in SIGN:
        assert torch.equal(host[0], torch_path[0]), "mean"
        assert all(_same(a, b) for a, b in zip(host[1], torch_path[1], strict=True)), "own contribution"
        assert all(_same(a, b) for a, b in zip(host[3], torch_path[3], strict=True)), "bf16 scales"
        return
    assert torch.equal(torch.sign(host[0]), torch.sign(torch_path[0]))  # the votes: bit-equal
    assert torch.allclose(host[0], torch_path[0], rtol=2e-6, atol=0)  # the scales: float32 rounding
    for a, b in zip(host[3], torch_path[3], strict=True):
        assert torch.allclose(a, b, rtol=2e-6, atol=0)
