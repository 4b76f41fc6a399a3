"""Block-scaled qsum at level counts that are no power of two (`bl5`, `bl6`): names, registry,
and the rounding's statistics against their exact values.

One rank's stochastic rounding of a level coordinate t (fraction f = t - floor t) errs by
(1 - f) steps with probability f and by -f steps otherwise: mean 0, variance f(1 - f) steps²,
fourth moment f(1 - f)((1 - f)³ + f³) steps⁴. The tolerances below are set from these moments
(z-scores), not picked by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from nfab.calibrate.config import DEFAULT_ROUTES
from nfab.profile.routes import parse_route
from nfab.wire.blockq.reducer import BlockQSum, levels_route_name
from nfab.wire.registry import REDUCERS, candidates
from nfab.wire.routes import BLOCK_ROUTES

LENGTHS = [100, 64, 1, 835, 7]
ORDERED = ["bq2", "bl5", "bl6", "bq3"]
"""4, 5, 6 and 8 levels per rank."""
Z = 5.0
"""Standard deviations a statistic may stray (a false alarm about once in 1.7 million runs)."""


def _x(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2000 + rank)
    x = torch.randn(sum(LENGTHS), generator=g) * torch.logspace(-4, 0, sum(LENGTHS))
    x[100:164] = 0.0
    return x


def test_names_registry_and_route_grammar():
    assert levels_route_name(5) == "bl5" and levels_route_name(6, 128) == "bl6-128"
    assert levels_route_name(4) == "bq2" and levels_route_name(256, 256) == "bq8-256"
    bl5 = REDUCERS["blockq-bl5"]
    assert isinstance(bl5, BlockQSum)
    assert (bl5.route, bl5.levels, bl5.steps, bl5.bits, bl5.block) == ("bl5", 5, 4, None, 64)
    assert (REDUCERS["blockq-bq2"].levels, REDUCERS["blockq-bq3"].levels) == (4, 8)
    assert BlockQSum(levels=8).route == "bq3" and BlockQSum(levels=6).capacity(4).levels == 6
    for bad in ({"bits": 3, "levels": 8}, {}, {"levels": 257}, {"levels": 1}, {"bits": 5}):
        with pytest.raises(ValueError):
            BlockQSum(**bad)
    # the registry, the route list and the default sweep agree
    assert {k.split("-", 1)[1] for k in REDUCERS if k.startswith("blockq-")} == set(BLOCK_ROUTES)
    assert {k.split("-", 1)[1] for k in REDUCERS if k.startswith("blockqscatter-")} == set(BLOCK_ROUTES)
    assert {"bl5", "bl6"} <= set(DEFAULT_ROUTES) and "bl5-128" not in BLOCK_ROUTES
    for route in ("bl5", "bl6"):
        assert [(r.name, r.route, r.levels) for r in candidates(route)] == [
            ("blockq", route, int(route[2:])), ("blockqscatter", route, int(route[2:]))]
        assert parse_route(f"linear:{route},norm:fp32") == {"linear": route, "norm": "fp32"}


def _unit_coordinates(red: BlockQSum, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(f, scale): the fraction of every element's level coordinate, in the reference's float32
    operations, and its block scale (one rank: the scale of its own block maxima). An all-zero
    block decodes to exactly 0 whatever its level: f = 0 there (no error)."""
    scale = red.element_scales(red.local_scale(x, LENGTHS), LENGTHS)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    t = (x / safe + 1.0) * (0.5 * red.steps)
    f = torch.where(scale > 0, t - t.floor(), torch.zeros_like(t))
    return f.double(), scale.double()


def _draws(red: BlockQSum, x: torch.Tensor, count: int) -> torch.Tensor:
    """`count` one-rank reductions of x, each with its own key source: errors in unit steps."""
    f, scale = _unit_coordinates(red, x)
    step = torch.where(scale > 0, scale * (2.0 / red.steps), torch.ones_like(scale))
    runs = torch.stack([red.replay([x], LENGTHS, [torch.Generator().manual_seed(9000 + s)]) for s in range(count)])
    return (runs.double() - x.double()) / step


@pytest.mark.parametrize("route", ORDERED)
def test_rounding_is_unbiased_within_its_known_variance(route):
    red, x, count = REDUCERS[f"blockq-{route}"], _x(0), 300
    f, _ = _unit_coordinates(red, x)
    err = _draws(red, x, count).mean(0)  # in steps
    var = f * (1 - f) / count
    # per element: within Z sigma, plus one stray rounding among the draws (float32 t + u at f = 0)
    assert bool((err.abs() <= Z * var.sqrt() + 1.0 / count + 1e-5).all())
    # all elements together: the summed error is a z-score
    assert abs(float(err.sum() / var.sum().sqrt())) < Z


@pytest.mark.parametrize("route", ORDERED)
def test_error_variance_is_the_known_one(route):
    red, x, count = REDUCERS[f"blockq-{route}"], _x(1), 60
    f, _ = _unit_coordinates(red, x)
    sq = _draws(red, x, count).pow(2)  # squared errors in steps
    mean_sq = f * (1 - f)
    var_sq = f * (1 - f) * ((1 - f) ** 3 + f**3) - mean_sq**2
    assert abs(float(sq.sum() - count * mean_sq.sum())) < Z * math.sqrt(count * float(var_sq.sum())) + 1e-3


def test_error_variance_falls_between_bq2_and_bq3():
    """In units of the block scale the variance is f(1 - f) (2/M)²: ordered by M, and so is the
    measured error of W = 4 stratified ranks' mean (the wire's own rounding)."""
    x = _x(2)
    predicted = []
    for route in ORDERED:
        red = REDUCERS[f"blockq-{route}"]
        f, _ = _unit_coordinates(red, x)
        predicted.append(float((f * (1 - f)).mean()) * (2.0 / red.steps) ** 2)
    assert predicted == sorted(predicted, reverse=True)
    w, seeds = 4, 40
    xs = [_x(10 + r) for r in range(w)]
    truth = torch.stack(xs).double().mean(0)
    measured = []
    for route in ORDERED:
        red = REDUCERS[f"blockq-{route}"]
        scale = red.element_scales(torch.stack([red.local_scale(v, LENGTHS) for v in xs]).amax(0), LENGTHS)
        live = scale > 0
        errs = [((red.replay(xs, LENGTHS, [torch.Generator().manual_seed(s)] * w).double() - truth)[live]
                 / scale[live]).pow(2).mean() for s in range(seeds)]
        measured.append(float(torch.stack(errs).mean()))
    assert measured == sorted(measured, reverse=True), measured
    # 5 and 6 levels sit well inside: at least 20% below the coarser neighbour, 20% above the finer one
    assert measured[0] > 1.2 * measured[1] and measured[2] > 1.2 * measured[3]
