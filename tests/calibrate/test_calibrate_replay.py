"""Replay of W virtual ranks equals the real gloo reduction of the same inputs."""

from __future__ import annotations

import pytest
import torch

from nfab.calibrate.replay import fp32_mean, measure, reduce_virtual, replay_reducer
from nfab.distributed import run_ranks
from nfab.wire.registry import REDUCERS

LENGTHS = [300, 7, 1024, 129]  # parameter numels of one region class, as the runtime's groups have them


def rank_grad(rank: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(sum(LENGTHS), generator=g) * torch.linspace(0.1, 3.0, sum(LENGTHS))
    x[::5] = x[::5].abs()  # agreement on some elements, ties at even W on others
    return x


def _gloo(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    x = rank_grad(rank)
    out = {"signcount": REDUCERS["signcount"].reduce(x.clone(), LENGTHS),
           "signgather": REDUCERS["signgather"].reduce(x.clone(), LENGTHS),
           "allreduce-fp32": REDUCERS["allreduce-fp32"].reduce(x.clone(), LENGTHS)}
    if REDUCERS["qsum-q8"].capacity(world_size).ok:
        out["qsum-q8"] = REDUCERS["qsum-q8"].reduce(x.clone(), LENGTHS,
                                                    generator=torch.Generator().manual_seed(50 + rank))
    return out


@pytest.mark.world_size(4)
@pytest.mark.parametrize("world_size", [3, 4])
def test_replay_is_bit_identical_to_gloo(world_size: int) -> None:
    real = run_ranks(_gloo, world_size, timeout_s=120)[0]
    xs = [rank_grad(r) for r in range(world_size)]
    est, locals_ = reduce_virtual(REDUCERS["signcount"], xs, LENGTHS)
    assert torch.equal(est, real["signcount"])
    # the same numbers as the wire layer's own replay, and signgather decodes identically
    assert torch.equal(est, REDUCERS["signcount"].replay(xs, LENGTHS))
    assert torch.equal(est, real["signgather"])
    assert torch.equal(replay_reducer("sign", world_size).replay(xs, LENGTHS), real["signgather"])
    # each rank's local decode is what its encode says (error feedback keeps x - local)
    for x, loc in zip(xs, locals_, strict=True):
        assert torch.equal(loc, REDUCERS["signcount"].encode(x, LENGTHS, world_size).local)
    gens = [torch.Generator().manual_seed(50 + r) for r in range(world_size)]
    q8, _ = reduce_virtual(REDUCERS["qsum-q8"], xs, LENGTHS, gens)
    assert torch.equal(q8, real["qsum-q8"])
    # fp32 sums in gloo's ring order, not rank order: equal up to rounding
    torch.testing.assert_close(fp32_mean(xs), real["allreduce-fp32"], rtol=1e-6, atol=1e-7)


def test_replay_reducer_capacity() -> None:
    assert replay_reducer("q2", 4) is None  # 2-bit lanes leave < 2 levels per rank at W=4
    assert replay_reducer("q2", 3) is REDUCERS["qsum-q2"]
    assert replay_reducer("sign", 4) is REDUCERS["signcount"]
    assert replay_reducer("fp32", 4) is REDUCERS["allreduce-fp32"]


def test_error_feedback_recovers_the_sum() -> None:
    """Over a few steps EF's summed estimate tracks the summed mean better than no EF."""
    steps = [[rank_grad(r, seed=s) for r in range(4)] for s in range(6)]
    plain = measure(REDUCERS["signcount"], steps, LENGTHS, error_feedback=False)
    ef = measure(REDUCERS["signcount"], steps, LENGTHS, error_feedback=True)
    assert ef.cum_cosine > plain.cum_cosine
    exact = measure(REDUCERS["allreduce-fp32"], steps, LENGTHS, error_feedback=True)
    assert exact.cosine == pytest.approx(1.0, abs=1e-6) and exact.rel_error < 1e-6
    assert exact.sign_agreement == 1.0


@pytest.mark.parametrize("route", ["sign", "q4", "q8", "bq3", "bf16"])
def test_measure_both_is_measure_without_and_with_ef_bit_for_bit(route: str) -> None:
    from nfab.calibrate.replay import measure_both

    steps = [[rank_grad(r, seed=s) for r in range(4)] for s in range(3)]
    reducer = replay_reducer(route, 4)
    assert reducer is not None
    off, on = measure_both(reducer, steps, LENGTHS, seed=5)
    for ef, got in ((False, off), (True, on)):
        want = measure(reducer, steps, LENGTHS, error_feedback=ef, seed=5)
        assert (got.cosine, got.rel_error, got.sign_agreement, got.cum_cosine) == (
            want.cosine, want.rel_error, want.sign_agreement, want.cum_cosine)
    if reducer.lossy and route != "bf16":
        assert off.cum_cosine != on.cum_cosine  # EF changed the later steps


def test_block_scaled_replay_rounds_in_the_preconditioned_space_and_sign_does_not():
    """`reduce_scaled` divides blockq's inputs by the optimizer's scale and multiplies the
    result back (what the hook does under Adam); any other reducer ignores the scale."""
    from nfab.calibrate.replay import reduce_scaled

    # coordinates whose RMS differs by three decades inside every block, as Adam's v does
    g = torch.Generator().manual_seed(11)
    scale = 10.0 ** (-3 * torch.rand(sum(LENGTHS), generator=g))
    xs = [rank_grad(r) * scale for r in range(4)]
    bq = REDUCERS["blockq-bq2"]
    gens = [torch.Generator().manual_seed(3)] + [None] * 3
    est, locals_ = reduce_scaled(bq, xs, LENGTHS, gens, scale)
    gens = [torch.Generator().manual_seed(3)] + [None] * 3
    plain, plain_locals = reduce_virtual(bq, [x / scale for x in xs], LENGTHS, gens)
    assert torch.equal(est, plain * scale)
    assert all(torch.equal(a, b * scale) for a, b in zip(locals_, plain_locals, strict=True))
    # where Adam acts (divided by the scale) the error is far smaller than plain block scales give
    unscaled, _ = reduce_virtual(bq, xs, LENGTHS, [torch.Generator().manual_seed(3)] + [None] * 3)
    truth = torch.stack(xs).mean(0)
    ours, theirs = float(((est - truth) / scale).norm()), float(((unscaled - truth) / scale).norm())
    assert ours < 0.2 * theirs
    sign = REDUCERS["signcount"]
    assert torch.equal(reduce_scaled(sign, xs, LENGTHS, None, scale)[0], reduce_virtual(sign, xs, LENGTHS, None)[0])


@pytest.mark.parametrize("world_size", [3, 4])
def test_replay_mean_equals_the_replay_with_locals_bit_for_bit(world_size: int) -> None:
    """Replays without error feedback skip the ranks' local decodes: every registered reducer
    must give the very mean its full replay gives (same generators, same bits)."""
    from nfab.wire.registry import REDUCERS

    lengths = [700, 64, 3, 1233]
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(sum(lengths), generator=g) * torch.logspace(-3, 1, sum(lengths)) for _ in range(world_size)]
    checked = 0
    for name, red in REDUCERS.items():
        if not red.capacity(world_size).ok:
            continue

        def gens() -> list[torch.Generator]:
            return [torch.Generator().manual_seed(40 + r) for r in range(world_size)]

        full, locals_ = red.replay_with_locals(xs, lengths, gens())
        assert torch.equal(red.replay_mean(xs, lengths, gens()), full), name
        est, none = reduce_virtual(red, xs, lengths, gens(), with_locals=False)
        assert torch.equal(est, full) and none == [None] * world_size, name
        checked += 1
    assert checked >= 10
