"""One step's nfab statistics as the flat, numeric metrics a framework's logger accepts."""

from __future__ import annotations

from nfab.runtime.stats import StepStats

PREFIX = "nfab/"


def step_metrics(stats: StepStats, prefix: str = PREFIX) -> dict[str, float]:
    """Compression, bytes, route mix and fallback flags of one step, keyed `nfab/...`.

    Loggers (Lightning's, the Trainer's reporters) take numbers only, so the route mix becomes
    one `nfab/route/<route>` fraction per route and the fallback a 0/1 flag; the reasons stay
    in `Runtime.history` (`StepStats.fallback_reason`). Every value is one all ranks agreed on,
    so no further reduction across ranks is needed (or wanted) when logging it.
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
    metrics.update({f"{prefix}route/{route}": frac for route, frac in stats.route_mix.items()})
    if stats.fidelity_cosine is not None:
        metrics[f"{prefix}fidelity_cosine"] = float(stats.fidelity_cosine)
    return metrics

