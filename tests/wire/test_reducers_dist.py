"""Reducers on real gloo ranks (W = 2, 3, 4) against an independent reference."""

import pytest
import torch
import torch.distributed as dist

from nfab.distributed import run_ranks
from nfab.errors import CapacityError
from nfab.wire.registry import REDUCERS, QSum, SignCount

LENGTHS = [37, 1000, 3, 513]  # odd sizes: not a multiple of any lane count


def rank_input(rank: int, numel: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(numel, generator=g)
    x[::7] = x[::7].abs()  # many elements where ranks agree, and some ties at even W
    x[3::11] = 0.0  # exact zeros on every rank (an unused embedding row): one bit cannot abstain
    x[4 + rank] = -0.0  # and a zero on one rank only
    return x


def votes(x: torch.Tensor, tie: int) -> torch.Tensor:
    """A sign vote, computed apart from nfab: x > 0; an exact zero votes positive when tie is even
    (`Reducer.reduce` passes tie = group rank)."""
    return (x > 0) | ((x == 0) & (tie % 2 == 0))


def _reduce_all(rank: int, world_size: int, names: list[str]) -> dict[str, torch.Tensor]:
    x = rank_input(rank, sum(LENGTHS))
    out = {}
    for name in names:
        red = REDUCERS[name]
        if not red.capacity(world_size).ok:
            continue
        gen = torch.Generator().manual_seed(100 + rank)
        out[name] = red.reduce(x.clone(), LENGTHS, generator=gen)
    plain = x.clone() * (1.0 / world_size)  # pre-scaled, as DDP does before its all-reduce
    dist.all_reduce(plain)
    out["plain"] = plain
    # a strided (non-contiguous) view goes through as well
    base = rank_input(rank, 2 * sum(LENGTHS), seed=5)
    out["strided"] = REDUCERS["signcount"].reduce(base[::2], LENGTHS)
    out["empty"] = REDUCERS["signcount"].reduce(torch.empty(0), [0])
    return out


@pytest.mark.world_size(4)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_reducers_match_independent_reference(world_size):
    names = list(REDUCERS)
    results = run_ranks(_reduce_all, world_size, names, timeout_s=120)
    inputs = [rank_input(r, sum(LENGTHS)) for r in range(world_size)]
    stacked = torch.stack(inputs)
    # every rank ends with the same bits
    for name in results[0]:
        for r in range(1, world_size):
            assert torch.equal(results[0][name], results[r][name]), name
    res = results[0]
    # fp32 all-reduce equals dist.all_reduce
    assert torch.equal(res["allreduce-fp32"], res["plain"])
    # sign paths: independent majority vote x mean of per-segment mean |x|
    positives = torch.stack([votes(x, r) for r, x in enumerate(inputs)]).sum(0)
    vote = torch.sign(2 * positives - world_size).float()
    scales = torch.stack(
        [torch.stack([p.abs().mean() for p in torch.split(x, LENGTHS)]) for x in inputs]
    ).mean(0)
    expected = vote * torch.repeat_interleave(scales, torch.tensor(LENGTHS))
    for name in ("signcount", "signgather"):
        assert torch.allclose(res[name], expected, rtol=1e-6, atol=0), name
        if world_size % 2 == 0:
            ties = positives == world_size // 2
            assert ties.any() and (res[name][ties] == 0).all()
            assert (res[name][(stacked == 0).all(0)] == 0).all(), "every rank's zero must cancel"
        else:  # one vote is left over: ranks 0 and 2 vote +, rank 1 - (tie = group rank)
            zeros = res[name][(stacked == 0).all(0)]
            assert zeros.numel() > 10 and (zeros > 0).all()
    # replay (one process) is bit-identical to the real reduction for the integer paths
    for name in ("signcount", "signgather", "qsum-q8", "qsum-q4", "qsum-q2"):
        if name not in res:
            continue
        gens = [torch.Generator().manual_seed(100 + r) for r in range(world_size)]
        replay = REDUCERS[name].replay(inputs, LENGTHS, generators=gens)
        assert torch.equal(replay, res[name]), name
    # qsum is unbiased with error well inside one level step
    for name in ("qsum-q8", "qsum-q4"):
        red = REDUCERS[name]
        step = 2.0 / red.max_level(world_size)
        smax = torch.stack([torch.stack([p.abs().max() for p in torch.split(x, LENGTHS)])
                            for x in inputs]).amax(0)
        tol = torch.repeat_interleave(smax, torch.tensor(LENGTHS)) * step
        assert ((res[name] - res["plain"]).abs() <= tol + 1e-6).all(), name
    # low precision all-reduce is close to fp32
    assert torch.allclose(res["allreduce-bf16"], res["plain"], atol=2e-2, rtol=2e-2)
    assert torch.allclose(res["allreduce-fp16"], res["plain"], atol=2e-3, rtol=2e-3)
    assert res["empty"].numel() == 0


def test_capacity_is_typed_and_explicit():
    q2 = QSum(2)
    assert q2.capacity(3).ok and q2.capacity(3).levels == 2
    assert not q2.capacity(4).ok
    with pytest.raises(CapacityError, match="W=4"):
        q2.replay([torch.ones(4)] * 4)
    assert QSum(8).capacity(255).ok and not QSum(8).capacity(256).ok
    assert SignCount().capacity(4).lane_bits == 3


def test_wire_bytes_follow_the_collective_algorithm():
    n = 1 << 20
    fp32 = REDUCERS["allreduce-fp32"]
    assert fp32.wire_bytes(n, 4) == 2 * 3 / 4 * 4 * n
    sc = REDUCERS["signcount"]
    assert sc.wire_bytes(n, 4) <= fp32.wire_bytes(n, 4) / 10
    sg = REDUCERS["signgather"]
    assert sg.wire_bytes(n, 2) < sc.wire_bytes(n, 2)  # small W: gather is cheaper
    assert sc.wire_bytes(n, 16) < sg.wire_bytes(n, 16)  # large W: counting wins
