"""One step's nfab statistics as the flat, numeric metrics a framework's logger accepts."""

from __future__ import annotations

from collections.abc import Iterable

from nfab.runtime.stats import StepStats

PREFIX = "nfab/"


def step_metrics(stats: StepStats, prefix: str = PREFIX, routes: Iterable[str] = ()) -> dict[str, float]:
    """Compression, bytes, route mix and fallback flags of one step, keyed `nfab/...`.

    Loggers (Lightning's, the Trainer's reporters) take numbers only, so the route mix becomes
    one `nfab/route/<route>` fraction per route and the fallback a 0/1 flag; the reasons stay
    in `Runtime.history` (`StepStats.fallback_reason`). Every value is one all ranks agreed on,
    so no further reduction across ranks is needed (or wanted) when logging it. Each of `routes`
    the step did not use is logged as 0.0, so a logger that keeps each key's last value (Lightning's
    `logged_metrics`) does not hold a route's fraction from an earlier step beside this one's.
    """
    baseline = stats.baseline_wire_bytes
    metrics = {
        f"{prefix}compression": baseline / stats.wire_bytes if stats.wire_bytes else 1.0,
        f"{prefix}wire_bytes": float(stats.wire_bytes),
        f"{prefix}baseline_wire_bytes": float(baseline),
        f"{prefix}fallback": float(stats.fallback),
        f"{prefix}skipped": float(stats.skipped),
        f"{prefix}grad_norm": float(stats.grad_norm),
    }
    metrics.update({f"{prefix}route/{route}": 0.0 for route in routes})
    metrics.update({f"{prefix}route/{route}": frac for route, frac in stats.route_mix.items()})
    if stats.fidelity_cosine is not None:
        metrics[f"{prefix}fidelity_cosine"] = float(stats.fidelity_cosine)
    return metrics


class StepLog:
    """What one framework logger is handed: each optimizer step once, every route seen so far in each.

    A closure that skipped backward, or a second optimizer, leaves the runtime on the same step,
    so a step already logged yields nothing. Routes are remembered across steps so that a route
    the control left (a fallback to FP32, a phase change) is logged as 0.0, not left at its
    last fraction.
    """

    def __init__(self) -> None:
        self._step = -1
        self._routes: set[str] = set()

    def reset(self) -> None:
        """A new run (or a resumed one) on this logger: the next step is logged whatever its number."""
        self._step = -1

    def metrics(self, stats: StepStats | None) -> dict[str, float] | None:
        """The step's metrics, or None when there is no step or it was already logged."""
        if stats is None or stats.step == self._step:
            return None
        self._step = stats.step
        self._routes.update(stats.route_mix)
        return step_metrics(stats, routes=sorted(self._routes))
