"""Reducer-side replay: W virtual ranks' gradients through a route, as the lanes sum them.

`reduce_virtual` is `Reducer.replay`'s arithmetic (encode per rank, `combine`, decode)
that also hands back each rank's own decode (`Encoded.local`), which error feedback
needs: a rank keeps `x - local` and adds it to its next gradient, as the hook does.
For the integer paths the result is bit-identical to the real gloo reduction.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nfab.wire.registry import REDUCERS, BlockQSum, Reducer, candidates


def replay_reducer(route: str, world_size: int) -> Reducer | None:
    """The reducer a replay uses for a route at W (None: every candidate is over capacity).

    `sign` has two reducers with the same decode (signgather counts the gathered bits
    locally, signcount sums them in lanes): the replay uses signcount, and its values
    stand for both.
    """
    if route == "sign" and REDUCERS["signcount"].capacity(world_size).ok:
        return REDUCERS["signcount"]
    ok = [r for r in candidates(route) if r.capacity(world_size).ok]
    return ok[0] if ok else None


def cheapest_wire(route: str, numel: int, world_size: int, segments: int) -> tuple[str, float] | None:
    """(reducer name, bytes each rank sends) of the route's cheapest reducer with capacity."""
    best: tuple[str, float] | None = None
    for red in candidates(route):
        if not red.capacity(world_size).ok:
            continue
        b = red.wire_bytes(numel, world_size, segments)
        if best is None or b < best[1]:
            best = (red.name, b)
    return best


def reduce_virtual(
    reducer: Reducer,
    xs: Sequence[torch.Tensor],
    lengths: Sequence[int],
    generators: Sequence[torch.Generator | None] | None = None,
    *,
    with_locals: bool = True,
    step: int = 0,
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """(mean estimate, each rank's local decode) for flat fp32 `xs` of W virtual ranks (`step`: the
    hook's, for the sign routes' zero votes, `Reducer.encode`'s tie).
    Without `with_locals` the locals are None and never decoded (`Reducer.replay_mean`): a replay
    without error feedback (validation, trials, half of every fidelity window) never reads them,
    and decoding them costs about as much as the decode itself (q8 on resnet18's 697k conv
    elements: 31 of the 54 ms a simulated step spent reducing)."""
    if with_locals:
        return reducer.replay_with_locals(xs, lengths, generators, step)
    return reducer.replay_mean(xs, lengths, generators, step), [None] * len(xs)


def fp32_mean(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """DDP's mean: each rank pre-scales by 1/W, the sum runs in rank order."""
    inv = 1.0 / len(xs)
    out = xs[0] * inv
    for x in xs[1:]:
        out += x * inv
    return out


@dataclass(frozen=True, slots=True)
class Fidelity:
    """How close a route's estimate is to the true mean gradient (averaged over steps)."""

    cosine: float
    rel_error: float
    sign_agreement: float
    cum_cosine: float
    """Cosine of the summed estimates to the summed true means over the window."""
    encode_decode_s: float
    """Seconds for one replayed reduction (W encodes + combine + decode) in one process."""


NAN_FIDELITY = Fidelity(math.nan, math.nan, math.nan, math.nan, math.nan)


def true_means(steps: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """The exact mean gradient of each step (accumulated in fp64)."""
    return [torch.stack(list(grads)).to(torch.float64).mean(0).to(torch.float32) for grads in steps]


@dataclass(frozen=True, slots=True)
class Truths:
    """A window's true means where fidelity is measured (divided by the optimizer's scale when there is
    one), with the norms, signs and window sum every route's comparison reads: made once per region and
    phase (`truth_window`), not once per route and EF setting."""

    values: list[torch.Tensor]
    norms: list[float]
    signs: list[torch.Tensor]
    total: torch.Tensor
    """The sum of `values` over the window, added in step order."""
    total_norm: float


def truth_window(truths: Sequence[torch.Tensor], scale: torch.Tensor | None = None) -> Truths:
    """`Truths` of the true means `truths` (see `true_means`), divided by `scale` if given."""
    values = [t / scale for t in truths] if scale is not None else list(truths)
    total = values[0].clone()
    for v in values[1:]:
        total.add_(v)
    return Truths(values, [float(torch.linalg.vector_norm(v)) for v in values], [torch.sign(v) for v in values],
                  total, float(torch.linalg.vector_norm(total)))


def _cos_to(a: torch.Tensor, b: torch.Tensor, nb: float) -> float:
    """Cosine of a and b, b's norm given (both zero: 1; one zero: 0)."""
    na = float(torch.linalg.vector_norm(a))
    if na == 0.0 and nb == 0.0:
        return 1.0
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(torch.dot(a, b)) / (na * nb)


class _Window:
    """Running fidelity sums over a replay window (one error-feedback setting)."""

    def __init__(self, truths: Truths) -> None:
        self.truths = truths
        self.cos: list[float] = []
        self.rel: list[float] = []
        self.agree: list[float] = []
        self.secs: list[float] = []
        self.sum_est: torch.Tensor | None = None

    def add(self, est: torch.Tensor, secs: float, scale: torch.Tensor | None = None) -> None:
        """The next step's estimate (in gradient units: divided by `scale` here, as the truths were)."""
        i = len(self.cos)
        true, nt = self.truths.values[i], self.truths.norms[i]
        if scale is not None:  # compare where the optimizer acts: both divided by sqrt(v) + eps
            est = est / scale
        self.secs.append(secs)
        self.cos.append(_cos_to(est, true, nt))
        self.rel.append(float(torch.linalg.vector_norm(est - true)) / nt if nt > 0 else 0.0)
        self.agree.append(float((torch.sign(est) == self.truths.signs[i]).to(torch.float32).mean()))
        self.sum_est = est.clone() if self.sum_est is None else self.sum_est.add_(est)

    def fidelity(self) -> Fidelity:
        n = len(self.cos)
        assert self.sum_est is not None and n == len(self.truths.values)
        return Fidelity(sum(self.cos) / n, sum(self.rel) / n, sum(self.agree) / n,
                        _cos_to(self.sum_est, self.truths.total, self.truths.total_norm), sum(self.secs) / n)


def _step(reducer: Reducer, xs: list[torch.Tensor], lengths: Sequence[int], gens: list[torch.Generator],
          scale: torch.Tensor | None = None, *, with_locals: bool = True, step: int = 0
          ) -> tuple[torch.Tensor, list[torch.Tensor | None], float]:
    t0 = time.perf_counter()
    est, locals_ = reduce_scaled(reducer, xs, lengths, gens, scale, with_locals=with_locals, step=step)
    return est, locals_, time.perf_counter() - t0


def reduce_scaled(reducer: Reducer, xs: Sequence[torch.Tensor], lengths: Sequence[int],
                  gens: Sequence[torch.Generator | None] | None, scale: torch.Tensor | None, *,
                  with_locals: bool = True, step: int = 0) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """`reduce_virtual`, with block-scaled qsum rounding in the optimizer's preconditioned space
    as the hook does (`scale`: per element sqrt(v) + eps, `Preconditioner.quantization_scale`)."""
    if scale is None or not isinstance(reducer, BlockQSum):
        return reduce_virtual(reducer, xs, lengths, gens, with_locals=with_locals, step=step)
    est, locals_ = reduce_virtual(reducer, [x / scale for x in xs], lengths, gens, with_locals=with_locals, step=step)
    return est * scale, [None if loc is None else loc * scale for loc in locals_]


def _carry(xs: list[torch.Tensor], locals_: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    return [x - loc if loc is not None else None for x, loc in zip(xs, locals_, strict=True)]


def measure(
    reducer: Reducer,
    steps: Sequence[Sequence[torch.Tensor]],
    lengths: Sequence[int],
    *,
    error_feedback: bool,
    seed: int = 0,
    truths: Sequence[torch.Tensor] | Truths | None = None,
    scale: torch.Tensor | None = None,
) -> Fidelity:
    """Replay consecutive steps (`steps[t][rank]` flat gradients) through `reducer`.

    With error feedback each rank carries e <- x + e - local from step to step, so the
    later steps show what EF recovers (or, for a biased codec, what it accumulates).
    `truths` (the true mean per step, see `true_means`, or their `truth_window` for this `scale`) saves
    recomputing them per route.
    `scale` (an adaptive optimizer's per-element sqrt(v) + eps at the window's start): the
    fidelity is measured after dividing by it, where Adam acts, and block-scaled qsum rounds there.
    """
    truths = _truths(steps, truths, scale)
    gens = [torch.Generator().manual_seed(seed * 7919 + r) for r in range(len(steps[0]))]
    residuals: list[torch.Tensor | None] = [None] * len(steps[0])
    window = _Window(truths)
    for i, grads in enumerate(steps, 1):
        xs = [g if e is None else g + e for g, e in zip(grads, residuals, strict=True)]
        carry = error_feedback and reducer.lossy and i < len(steps)  # the last residual is never used
        est, locals_, secs = _step(reducer, xs, lengths, gens, scale, with_locals=carry, step=i)
        if carry:
            residuals = _carry(xs, locals_)
        window.add(est, secs, scale)
    return window.fidelity()


def _truths(steps: Sequence[Sequence[torch.Tensor]], truths: Sequence[torch.Tensor] | Truths | None,
            scale: torch.Tensor | None) -> Truths:
    if isinstance(truths, Truths):
        return truths
    return truth_window(true_means(steps) if truths is None else truths, scale)


def measure_both(
    reducer: Reducer,
    steps: Sequence[Sequence[torch.Tensor]],
    lengths: Sequence[int],
    *,
    seed: int = 0,
    truths: Sequence[torch.Tensor] | Truths | None = None,
    scale: torch.Tensor | None = None,
) -> tuple[Fidelity, Fidelity]:
    """`measure` without and with error feedback, bit for bit, sharing their common first step
    (no residual exists yet, and both draw the same stochastic rounding): W-1 of every 2W replays."""
    truths = _truths(steps, truths, scale)
    w = len(steps[0])
    gens = [torch.Generator().manual_seed(seed * 7919 + r) for r in range(w)]
    off, on = _Window(truths), _Window(truths)
    xs = list(steps[0])
    est, locals_, secs = _step(reducer, xs, lengths, gens, scale, with_locals=reducer.lossy, step=1)
    off.add(est, secs, scale)
    on.add(est, secs, scale)  # each window keeps its own sum (a copy of the first estimate)
    residuals = _carry(xs, locals_) if reducer.lossy else [None] * w
    gens_on = []
    for g in gens:
        twin = torch.Generator()
        twin.set_state(g.get_state())
        gens_on.append(twin)
    for i, grads in enumerate(steps[1:], 2):
        est, _, secs = _step(reducer, list(grads), lengths, gens, scale, with_locals=False, step=i)
        off.add(est, secs, scale)
        xs = [g if e is None else g + e for g, e in zip(grads, residuals, strict=True)]
        carry = reducer.lossy and i < len(steps)  # the window's last residual is never used
        est, locals_, secs = _step(reducer, xs, lengths, gens_on, scale, with_locals=carry, step=i)
        if carry:
            residuals = _carry(xs, locals_)
        on.add(est, secs, scale)
    return off.fidelity(), on.fidelity()
