"""Training runs side by side at a declared link: bytes, final quality and time to accuracy, modelled.

Runs trained with a declared link (`comm.cost_model=link:100mbit`, as `nfab demo` trains them) say what
link they are for; `nfab report` then prices every run of the same model at that link, so FP32, bf16 and
a profile compare as they would on it, whatever this machine's loopback does:

- a step's time is the run's compute, its measured step time on this machine (loopback: the gradient's
  own transfer there is negligible) as `nfab.wire.cost.trimmed_time` takes it: the mean of the fastest
  half without its fastest tenth, step 1's set-up left out. Load only ever makes a step slower, and the
  median moved the demo's modelled times 15% between two runs on a loaded host;
  plus the step's gradient bytes (each rank's, as `StepStats.wire_bytes` counts them, probes included)
  at the link's bandwidth and one link latency per collective: the cost gate's model of a declared
  link (`nfab.wire.cost.declared`). The bytes are exact; only the compute is measured.
- the target is FP32's smoothed final accuracy (the mean of its last `TARGET_EVALS` evaluations) less
  `ACCURACY_POINTS` points; a run reaches it at its first evaluation at or above it (FP32 too).
- time to accuracy is the modelled time at that evaluation, "never" if no evaluation got there.

`bench tta` shapes a real link and times whole steps on it; this model is what a run on one machine can
say about a link it did not have, and it is the same every time the same runs are read.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import pandas as pd

from nfab.report.artifacts import RunArtifacts
from nfab.wire.cost import LinkCost, is_declared, parse_link, trimmed_time

ACCURACY_POINTS = 1.0
"""The target: FP32's smoothed final accuracy less this many points (the demo's quality bar)."""
TARGET_EVALS = 3
"""FP32's last evaluations averaged into its smoothed final accuracy."""
COLUMNS = ("run", "wire_mb", "fewer_bytes_vs_fp32", "fewer_bytes_vs_bf16", "accuracy",
           "accuracy_delta_pts", "modelled_step_ms", "time_to_accuracy_s", "speedup_vs_fp32", "speedup_vs_bf16")


@dataclass(frozen=True, slots=True)
class LinkRun:
    """One run priced at the link: its evaluations against modelled time, and its totals."""

    name: str
    route: str
    is_fp32: bool
    steps: int
    wire_bytes: float
    compute_s: float
    """The measured step time, `trimmed_time` of steps 2.. (of all where there is one)."""
    curve: pd.DataFrame
    """One row per evaluation: step (steps done), time_s (modelled), accuracy, loss."""
    total_s: float


def declared_link(run: RunArtifacts) -> str | None:
    """The link a run declared (`comm.cost_model` in its config.json, `link:...`), or None."""
    try:
        cfg = json.loads((run.path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    choice = ((cfg.get("comm") or {}) if isinstance(cfg, dict) else {}).get("cost_model")
    return choice.strip() if is_declared(choice) else None


def step_link_s(wire_bytes: pd.Series, collectives: pd.Series | None, link: LinkCost) -> pd.Series:
    """Each step's time on the link: its bytes at the bandwidth plus one latency per collective (at least 1)."""
    n = pd.Series(1.0, index=wire_bytes.index) if collectives is None else collectives.fillna(1).clip(lower=1)
    return wire_bytes.astype(float) / link.bandwidth_bps + n.astype(float) * link.latency_s


def price(name: str, route: str, is_fp32: bool, metrics: pd.DataFrame, link: LinkCost) -> LinkRun:
    """A run's metrics priced at `link` (see the module docstring)."""
    times = metrics["step_time_s"].astype(float) if "step_time_s" in metrics else pd.Series(0.0, index=metrics.index)
    compute = trimmed_time((times.iloc[1:] if len(times) > 1 else times).tolist())
    collectives = metrics["collectives"] if "collectives" in metrics else None
    clock = (compute + step_link_s(metrics["wire_bytes"], collectives, link)).cumsum()
    evals = metrics["eval_accuracy"].notna() | metrics["eval_loss"].notna()
    curve = pd.DataFrame({"step": metrics.loc[evals, "step"].astype(int) + 1, "time_s": clock[evals],
                          "accuracy": metrics.loc[evals, "eval_accuracy"].astype(float),
                          "loss": metrics.loc[evals, "eval_loss"].astype(float)}).reset_index(drop=True)
    return LinkRun(name=name, route=route, is_fp32=is_fp32, steps=len(metrics),
                   wire_bytes=float(metrics["wire_bytes"].sum()), compute_s=compute, curve=curve,
                   total_s=float(clock.iloc[-1]) if len(clock) else 0.0)


def accuracy_target(fp32_curve: pd.DataFrame, evals: int = TARGET_EVALS, points: float = ACCURACY_POINTS) -> float:
    """FP32's mean accuracy over its last `evals` evaluations, less `points` points (a fraction in [0, 1])."""
    last = fp32_curve["accuracy"].dropna().iloc[-evals:]
    return float(last.mean()) - points / 100.0 if len(last) else math.nan


def time_to(curve: pd.DataFrame, target: float) -> float | None:
    """The modelled time of the first evaluation at or above the target accuracy; None if none got there."""
    hit = curve[curve["accuracy"] >= target]
    return None if hit.empty else float(hit["time_s"].iloc[0])


def _ratio(base: float | None, this: float | None) -> float | None:
    return None if base is None or this is None or this <= 0 else base / this


def link_table(runs: list[LinkRun], target: float) -> pd.DataFrame:
    """One row per run: bytes (and how many times fewer than FP32's and bf16's), final accuracy and its
    difference from FP32's in points, the modelled step, time to the target and how much sooner than
    FP32 and bf16 (base / this: > 1 is sooner)."""
    fp32 = next((r for r in runs if r.is_fp32), None)
    bf16 = next((r for r in runs if r.route == "bf16"), None)

    def final(r: LinkRun | None) -> float:
        return math.nan if r is None or r.curve.empty else float(r.curve["accuracy"].iloc[-1])

    tta = {r.name: time_to(r.curve, target) for r in runs}
    rows: list[dict[str, Any]] = []
    for r in runs:
        rows.append({
            "run": r.name, "wire_mb": r.wire_bytes / 1e6,
            "fewer_bytes_vs_fp32": None if fp32 is None or not r.wire_bytes else fp32.wire_bytes / r.wire_bytes,
            "fewer_bytes_vs_bf16": None if bf16 is None or not r.wire_bytes else bf16.wire_bytes / r.wire_bytes,
            "accuracy": final(r), "accuracy_delta_pts": (final(r) - final(fp32)) * 100,
            "modelled_step_ms": 1e3 * r.total_s / max(r.steps, 1), "time_to_accuracy_s": tta[r.name],
            "speedup_vs_fp32": None if fp32 is None else _ratio(tta[fp32.name], tta[r.name]),
            "speedup_vs_bf16": None if bf16 is None else _ratio(tta[bf16.name], tta[r.name]),
        })
    return pd.DataFrame(rows, columns=list(COLUMNS))


def link_view(arts: list[RunArtifacts]) -> tuple[str, pd.DataFrame, float] | None:
    """Where some run declared a link: (the link, the table of every complete run of the FP32 run's model
    priced at it, the target accuracy); None where no run declared one or there is no complete FP32 run."""
    links = [link for a in arts if (link := declared_link(a)) is not None]
    fp32 = next((a for a in arts if a.complete and a.summary is not None and a.summary.is_fp32
                 and a.metrics is not None), None)
    if not links or fp32 is None or fp32.summary is None:
        return None
    link, model = links[0], (fp32.summary.model, fp32.summary.dataset, fp32.summary.world_size)
    cost = parse_link(link)
    priced = [price(a.name, "fp32" if a.summary.is_fp32 else a.summary.route or "profile", a.summary.is_fp32,
                    a.metrics, cost)
              for a in arts if a.complete and a.summary is not None and a.metrics is not None
              and (a.summary.model, a.summary.dataset, a.summary.world_size) == model]
    fp32_run = next(r for r in priced if r.is_fp32)
    target = accuracy_target(fp32_run.curve)
    if math.isnan(target):
        return None
    return link, link_table(priced, target), target
