"""The FP32 reference trajectory, phase points, and short trials from phase checkpoints.

A trial continues from a checkpoint for K steps with some region classes on a lossy
route (the rest FP32), reducing each step's W shard gradients through the route's
reducer with or without error feedback, exactly as the hook would; the FP32 trial
from the same checkpoint sees the same batches, so the loss delta is the route's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from nfab.calibrate.replay import fp32_mean, reduce_virtual, replay_reducer
from nfab.calibrate.task import Task

Tick = Callable[[], None]


@dataclass(slots=True)
class Reference:
    """What the FP32 reference run saw, step by step, and its checkpoints."""

    loss: list[float] = field(default_factory=list)
    """Mean training loss of the W shards at each step (what the hook's control word agrees on)."""
    grad_norm: list[float] = field(default_factory=list)
    """Norm of the mean (DDP) gradient at each step."""
    lr: list[float] = field(default_factory=list)
    checkpoints: dict[int, dict] = field(default_factory=dict)
    """Step -> model and optimizer state before that step (in memory)."""


def checkpoint_grid(steps: int, warmup: int, points: int = 24) -> list[int]:
    """Steps with a checkpoint: every steps//points, plus the start and the warm-up end."""
    every = max(1, steps // points)
    grid = set(range(0, steps, every)) | {0}
    if 0 < warmup < steps:
        grid.add(warmup)
    return sorted(grid)


def run_reference(task: Task, tick: Tick | None = None) -> Reference:
    """Train `cfg.steps` FP32 steps (mean of the W shard gradients), checkpointing on the grid."""
    ref = Reference()
    grid = set(checkpoint_grid(task.cfg.steps, task.warmup_steps))
    for step in range(task.cfg.steps):
        if step in grid:
            ref.checkpoints[step] = task.checkpoint()
        grads, loss = task.rank_grads(step)
        mean = fp32_mean(grads)
        ref.loss.append(loss)
        ref.grad_norm.append(float(torch.linalg.vector_norm(mean)))
        ref.lr.append(task.lr_at(step))
        task.apply(mean, step)
        if tick:
            tick()
    return ref


def _smooth(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        lo, hi = max(0, i - window // 2), min(len(values), i + window // 2 + 1)
        out.append(sum(values[lo:hi]) / (hi - lo))
    return out


def phase_points(
    grad_norm: list[float], grid: list[int], warmup: int, n: int, *, tail: int = 0
) -> list[tuple[int, str]]:
    """Up to `n` phase starts (step, kind) on the checkpoint grid.

    Kinds: `start` (step 0), `warmup_end`, `trend` (where the smoothed log gradient-norm
    slope changes most; at least a quarter of the largest change), then `even` (spread
    out as a fallback). Points stay `tail` steps clear of the end of the run.
    """
    steps = len(grad_norm)
    points: list[tuple[int, str]] = [(0, "start")]
    if 0 < warmup < steps - tail and n > 1:
        points.append((warmup, "warmup_end"))
    logs = [math.log(max(g, 1e-30)) if math.isfinite(g) else 0.0 for g in grad_norm]
    w = max(3, steps // 12)
    sm = _smooth(logs, w)
    gap = max(1, steps // (2 * n))
    scores = {}
    for c in grid:
        if c - w < 0 or c + w >= steps or c > steps - tail:
            continue
        before = (sm[c] - sm[c - w]) / w
        after = (sm[c + w] - sm[c]) / w
        scores[c] = abs(after - before)
    top = max(scores.values(), default=0.0)
    for c, s in sorted(scores.items(), key=lambda kv: -kv[1]):
        if len(points) >= n or top <= 0 or s < 0.25 * top:
            break
        if all(abs(c - p) >= gap for p, _ in points):
            points.append((c, "trend"))
    usable = [c for c in grid if c <= steps - tail]
    while len(points) < n:
        free = [c for c in usable if all(c != p for p, _ in points)]
        if not free:
            break
        best = max(free, key=lambda c: min(abs(c - p) for p, _ in points))
        points.append((best, "even"))
    return sorted(points)


@dataclass(slots=True)
class TrialResult:
    """The end of a K-step continuation: held-out loss, training losses, captured gradients."""

    eval_loss: float
    """Held-out loss averaged over the trial's last quarter of steps (at least the last one)."""
    train_loss: list[float]
    captured: list[list[torch.Tensor]] = field(default_factory=list)
    """Per-rank flat gradients of the first `capture` steps (the FP32 trial keeps them)."""

    @property
    def tail_loss(self) -> float:
        k = max(1, len(self.train_loss) // 2)
        return sum(self.train_loss[-k:]) / k


def run_trial(
    task: Task,
    ckpt: dict,
    start: int,
    steps: int,
    routes: Mapping[str, str],
    *,
    error_feedback: bool,
    seed: int,
    capture: int = 0,
    tick: Tick | None = None,
) -> TrialResult:
    """K steps from `ckpt` with `routes` (region -> route; others FP32); restores nothing after."""
    task.restore(ckpt)
    w = task.cfg.world_size
    gens = [torch.Generator().manual_seed(seed * 1_000_003 + r) for r in range(w)]
    residuals: dict[str, list[torch.Tensor | None]] = {}
    index = {name: task.region_index(name) for name in routes}
    losses: list[float] = []
    evals: list[float] = []
    captured: list[list[torch.Tensor]] = []
    scored = max(1, steps // 4)
    for step in range(start, start + steps):
        grads, loss = task.rank_grads(step)
        losses.append(loss)
        if not math.isfinite(loss):
            return TrialResult(math.inf, losses)
        if len(captured) < capture:
            captured.append([g.clone() for g in grads])
        mean = fp32_mean(grads)
        for region, route in routes.items():
            reducer = replay_reducer(route, w)
            if route == "fp32" or reducer is None:
                continue
            idx = index[region]
            xs = [g.index_select(0, idx) for g in grads]
            res = residuals.get(region)
            if res is not None:
                xs = [x if e is None else x + e for x, e in zip(xs, res, strict=True)]
            est, locals_ = reduce_virtual(reducer, xs, task.regions[region].lengths, gens)
            if error_feedback and reducer.lossy:
                residuals[region] = [x - loc if loc is not None else None for x, loc in zip(xs, locals_, strict=True)]
            mean.index_copy_(0, idx, est)
        task.apply(mean, step)
        if step >= start + steps - scored:
            evals.append(task.eval_loss())
        if tick:
            tick()
    ev = sum(evals) / len(evals)
    return TrialResult(ev if math.isfinite(ev) else math.inf, losses, captured)
