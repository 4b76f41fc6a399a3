"""Which short trials a phase needs: replay pre-screen, a bisection over the routes, a bound across EF.

The fit keeps, per (phase, region, EF setting), the cheapest route that passes its
tolerances, and per phase the EF setting whose choices send fewer bytes. A trial is
only worth running when its answer can change that:
- a route whose replay fidelity already fails (cosine, relative error, capacity) would
  fail the fit with any loss delta: no trial (`screen = "replay"`);
- a route no cheaper than the one the fit accepts without a trial cannot be chosen
  (`screen = "cheaper"`), nor can one that a cheaper route matches in replay fidelity
  (`screen = "dominated"`);
- what is left is a chain, cheapest and least faithful first, along which a trial's verdict
  is close to monotone. The search bisects it: the first trial goes to the chain's middle
  (with sign, bq2 and bq3 left, to bq2), a pass leaves the cheaper half to try, a rejection the
  dearer half (`screen = "finer_failed"` below a rejected route; `"cheaper"` above a passing one).
  Cheapest first spent a whole budget on the route least likely to pass: on the CNN recipe
  (ResNet with BatchNorm, SGD) a 100-step calibration afforded one trial, it went to sign with
  error feedback, was rejected, and the block routes were never tried (3.6x where bq2 gives ~10x);
- the second EF setting is searched only while it can still beat the first one's bytes
  (a branch-and-bound over the phase's regions, biggest first; `screen = "bound"`);
- a trial the budget (budget.py) has no room for is not run (`screen = "budget"`).
Which EF setting goes first only decides how much is pruned: adaptive optimizers
(AdamW) try EF off first, SGD tries it on first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nfab.calibrate.fit import MAX_REL_ERROR, passes

Cell = dict[str, Any]
"""One calibration-table row under construction (the table's columns; see table.SCHEMA)."""


@dataclass(frozen=True, slots=True)
class Tolerances:
    """The fit's tolerances, which the search needs to know when a trial passes."""

    cosine: float
    loss: float


def replay_ok(cell: Cell, tol: Tolerances) -> bool:
    """Does the route's replay fidelity leave a trial any chance of passing the fit?"""
    if not cell.get("capacity_ok", True):
        return False
    cos, rel = cell.get("cosine"), cell.get("rel_error")
    if cos is None or not math.isfinite(cos) or cos < tol.cosine:
        return False
    return rel is None or not math.isfinite(rel) or rel <= MAX_REL_ERROR


def ef_order(optimizer: str) -> tuple[bool, bool]:
    """EF off first under adaptive optimizers (where it tends to hurt), on first under SGD."""
    return (True, False) if optimizer == "sgd" else (False, True)


def trial_candidate(cell: Cell, fp32_bits: float) -> bool:
    """A route worth a trial: lossy and under half of FP32's bits (16-bit routes pass on fidelity alone)."""
    bits = cell.get("bits_per_element")
    return (cell["route"] != "fp32" and bits is not None and math.isfinite(bits)
            and bits < 0.5 * fp32_bits)


def _bits(cell: Cell) -> float:
    b = cell.get("bits_per_element")
    return float(b) if b is not None and math.isfinite(b) else math.inf


def fallback_bits(cells: list[Cell], tol: Tolerances, high_cosine: float) -> float:
    """Bits of the cheapest route the fit accepts without a trial (fp32 at worst)."""
    ok = [_bits(c) for c in cells if c.get("trial_steps", 0) == 0 and passes(c, tol.cosine, tol.loss, high_cosine)]
    return min(ok, default=math.inf)


def search_phase(
    cells: Mapping[tuple[str, str, bool], Cell],
    trial_regions: list[tuple[str, int]],
    *,
    candidates: Callable[[str], list[str]],
    order: tuple[bool, bool],
    tol: Tolerances,
    high_cosine: float,
    run: Callable[[str, str, bool], bool],
    allow: Callable[[bool], bool] | None = None,
) -> int:
    """Run the trials one phase needs; `run(region, route, ef)` fills its cell and says if it passed.

    `trial_regions` are (name, numel), biggest first; `candidates(region)` lists the routes
    that may get a trial there; `allow(ef)` says whether the budget still has room for one under
    that EF setting. Returns
    the number of trials run. Every cell of a trial region gets its `screen` reason.
    """
    routes_of = {name: candidates(name) for name, _ in trial_regions}
    other_regions = {r for (r, _, _) in cells} - set(routes_of)
    trials = 0
    best_cost: float | None = None
    for ef in order:
        # bytes of the regions without trials are fixed by their fidelity alone
        total = sum(fallback_bits([c for (r, _, e), c in cells.items() if r == reg and e == ef], tol, high_cosine)
                    * _numel(cells, reg) for reg in other_regions)
        for i, (region, numel) in enumerate(trial_regions):
            mine = [c for (r, _, e), c in cells.items() if r == region and e == ef]
            chosen = fallback_bits(mine, tol, high_cosine)
            rest = sum(_cheapest(cells, reg, ef, routes_of[reg], tol, high_cosine) * n
                       for reg, n in trial_regions[i + 1 :])
            chain = pareto_chain([cells[(region, r, ef)] for r in routes_of[region]], tol, chosen)
            lo, hi = 0, len(chain)
            while lo < hi:  # the cheapest passing route of the chain lies in chain[lo:hi] (or none does)
                mid = (lo + hi) // 2
                cell = chain[mid]
                bits = _bits(cell)
                if best_cost is not None and total + bits * numel + rest >= best_cost:
                    _mark(chain[mid:hi], "bound")  # this EF setting cannot beat the other one from here
                    hi = mid
                elif allow is not None and not allow(ef):
                    _mark(chain[lo:hi], "budget")  # the trial budget is spent: replay fidelity decides
                    break
                else:
                    trials += 1
                    if run(region, cell["route"], ef):
                        chosen = bits
                        _mark(chain[mid + 1 : hi], "cheaper")  # a cheaper route already passes
                        hi = mid
                    else:
                        _mark(chain[lo:mid], "finer_failed")  # a more faithful route failed its trial
                        lo = mid + 1
            total += chosen * numel
        best_cost = total if best_cost is None else min(best_cost, total)
    return trials


def pareto_chain(cells: list[Cell], tol: Tolerances, fallback: float) -> list[Cell]:
    """The cells worth a trial, cheapest first, each more faithful in replay than every cheaper one.

    The others get their `screen`: `replay` (replay fidelity already fails), `cheaper` (no cheaper
    than the route the fit accepts without a trial), `dominated` (a cheaper route is at least as
    faithful in replay: if that one fails its trial, this one would too; if it passes, it wins).
    """
    chain: list[Cell] = []
    for cell in sorted(cells, key=_bits):
        if not replay_ok(cell, tol):
            cell["screen"] = "replay"
        elif _bits(cell) >= fallback:
            cell["screen"] = "cheaper"
        elif chain and _cosine(cell) <= _cosine(chain[-1]):
            cell["screen"] = "dominated"
        else:
            chain.append(cell)
    return chain


def _mark(cells: list[Cell], screen: str) -> None:
    for cell in cells:
        cell["screen"] = screen


def _cosine(cell: Cell) -> float:
    c = cell.get("cosine")
    return float(c) if c is not None and math.isfinite(c) else -math.inf


def _numel(cells: Mapping[tuple[str, str, bool], Cell], region: str) -> int:
    for (r, _, _), c in cells.items():
        if r == region:
            return int(c["numel"])
    return 0


def _cheapest(cells: Mapping[tuple[str, str, bool], Cell], region: str, ef: bool, routes: list[str],
              tol: Tolerances, high_cosine: float) -> float:
    """A lower bound on the region's bits under `ef`: its cheapest route that could still pass."""
    mine = [c for (r, _, e), c in cells.items() if r == region and e == ef]
    tried = [_bits(cells[(region, r, ef)]) for r in routes if replay_ok(cells[(region, r, ef)], tol)]
    return min([*tried, fallback_bits(mine, tol, high_cosine)], default=math.inf)
