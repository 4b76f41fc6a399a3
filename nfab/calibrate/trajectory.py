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

from nfab.calibrate.replay import fp32_mean, reduce_scaled, replay_reducer
from nfab.calibrate.task import Task
from nfab.runtime.control.fidelity import sample, sample_layout
from nfab.runtime.control.moment import replay_variance
from nfab.wire.blockq.reducer import BlockQSum

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
    eval_loss: dict[int, float] = field(default_factory=dict)
    """Step -> held-out loss after that many steps (on `eval_points`): what validation compares with."""


def checkpoint_grid(steps: int, warmup: int, points: int = 24) -> list[int]:
    """Steps with a checkpoint: every steps//points, plus the start and the warm-up end."""
    every = max(1, steps // points)
    grid = set(range(0, steps, every)) | {0}
    if 0 < warmup < steps:
        grid.add(warmup)
    return sorted(grid)


EVAL_POINTS = 12
"""Held-out evaluations along a reference or validation run (plus the start and the end)."""


def eval_points(steps: int, points: int = EVAL_POINTS) -> list[int]:
    """Steps after which the held-out loss is measured: every steps//points, and the end."""
    every = max(1, steps // points)
    return sorted(set(range(0, steps, every)) | {steps})


def run_reference(task: Task, tick: Tick | None = None, *, trial_steps: int = 0) -> Reference:
    """Train `cfg.steps` FP32 steps (mean of the W shard gradients), checkpointing on the grid.

    With `trial_steps` K it also keeps the state K steps after every grid point: the FP32
    continuation a trial from that point is compared with is then the reference itself
    (bit-identical: same shards, same schedule), and needs no run of its own.
    """
    ref = Reference()
    steps = task.cfg.steps
    grid = set(checkpoint_grid(steps, task.warmup_steps))
    if trial_steps > 0:
        grid |= {g + trial_steps for g in grid if g + trial_steps < steps}
    evals = set(eval_points(steps))
    for step in range(steps):
        if step in grid:
            ref.checkpoints[step] = task.checkpoint()
        if step in evals:
            ref.eval_loss[step] = task.eval_loss()
        grads, loss = task.rank_grads(step)
        mean = fp32_mean(grads)
        ref.loss.append(loss)
        ref.grad_norm.append(float(torch.linalg.vector_norm(mean)))
        ref.lr.append(task.lr_at(step))
        task.apply(mean, step)
        if tick:
            tick()
    ref.eval_loss[steps] = task.eval_loss()
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


def step_generators(seed: int, step: int, world_size: int) -> list[torch.Generator]:
    """Each virtual rank's stochastic-rounding generator for one step: a function of (seed, step, rank)
    alone, so a run restarted from a checkpoint at any step draws exactly what the whole run drew."""
    return [torch.Generator().manual_seed(seed * 1_000_003 + step * 7_919 + r) for r in range(world_size)]


@dataclass(frozen=True, slots=True)
class Segment:
    """From step `start` on (until the next segment), these region routes (others FP32) with this EF setting."""

    start: int
    routes: Mapping[str, str]
    error_feedback: bool


@dataclass(slots=True)
class Residuals:
    """Error-feedback residuals per region and rank, with the (route, EF) they were made under.

    A residual belongs to its route: when a region changes route or EF is off, it is dropped.
    """

    by_region: dict[str, list[torch.Tensor | None]] = field(default_factory=dict)
    made_by: dict[str, str] = field(default_factory=dict)

    def clone(self) -> Residuals:
        return Residuals({k: [None if t is None else t.clone() for t in v] for k, v in self.by_region.items()},
                         dict(self.made_by))


def reduce_step(task: Task, grads: list[torch.Tensor], seg: Segment, gens: list[torch.Generator],
                residuals: Residuals, probe: dict[str, float] | None = None, step: int = 0) -> torch.Tensor:
    """The mean gradient the hook would produce at `step`: FP32 mean, each routed region replaced by its reducer's.
    `probe`, when given, receives each routed region's `probe_cosine`: what the hook's probe would read."""
    w = task.cfg.world_size
    routed = {region: (route, reducer) for region, route in seg.routes.items()
              if route != "fp32" and region in task.regions and (reducer := replay_reducer(route, w)) is not None}
    # every element is overwritten when every region is routed: no FP32 mean to compute first
    mean = torch.empty_like(grads[0]) if routed.keys() == task.regions.keys() else fp32_mean(grads)
    for region, (route, reducer) in routed.items():
        xs = [task.gather(g, region) for g in grads]
        # what the hook's probe compares with: the FP32 mean before error feedback where it reads in the
        # optimizer's space, after it where it reads plain cosines (encode.prepare_group)
        after_ef = probe is not None and seg.error_feedback and quantization_scale(task, region) is None
        truth = fp32_mean(xs) if probe is not None and not after_ef else None
        res = residuals.by_region.get(region) if residuals.made_by.get(region) == route else None
        if res is not None and seg.error_feedback:
            xs = [x if e is None else x + e for x, e in zip(xs, res, strict=True)]
        if probe is not None and truth is None:
            truth = fp32_mean(xs)
        # block-scaled qsum rounds in the optimizer's preconditioned space, as the hook does
        scale = quantization_scale(task, region) if isinstance(reducer, BlockQSum) else None
        carry = seg.error_feedback and reducer.lossy  # else no rank's own decode is needed
        lengths = task.regions[region].lengths
        est, locals_ = reduce_scaled(reducer, xs, lengths, gens, scale, with_locals=carry, step=step)
        if truth is not None and probe is not None:
            probe[region] = probe_cosine(est, truth, lengths, quantization_scale(task, region))
        if task.moment is not None and isinstance(reducer, BlockQSum):  # the hook's decode records the same
            task.moment.record(task.region_names(region), lengths, replay_variance(reducer, xs, lengths, scale))
        if carry:
            residuals.by_region[region] = [x - loc if loc is not None else None
                                           for x, loc in zip(xs, locals_, strict=True)]
            residuals.made_by[region] = route
        else:
            residuals.by_region.pop(region, None)
            residuals.made_by.pop(region, None)
        task.scatter(mean, region, est)
    return mean


def probe_cosine(est: torch.Tensor, truth: torch.Tensor, lengths: tuple[int, ...] | list[int],
                 scale: torch.Tensor | None) -> float:
    """Cosine of a region's reduced estimate against its FP32 mean on the hook's probe sample (every
    k-th element of each parameter, at most 512 of them), divided by the optimizer's sqrt(v) + eps where
    it keeps one: the number the runtime's fidelity probe compares with `Health.min_fidelity_cosine`."""
    layout = sample_layout(tuple(lengths), est.device)
    e, t = sample(est, layout), sample(truth, layout)
    if scale is not None:
        w = sample(scale, layout)
        e, t = e / w, t / w
    den = float(torch.linalg.vector_norm(e) * torch.linalg.vector_norm(t))
    return float(torch.dot(e, t)) / den if den > 0 else 1.0


def quantization_scale(task: Task, region: str) -> torch.Tensor | None:
    """The region's per-element preconditioning scale, as `encode` builds it in the hook
    (`Preconditioner.flat_scale`), or None."""
    return task.preconditioner.flat_scale(task.region_names(region), task.regions[region].lengths, torch.device("cpu"))


@dataclass(slots=True)
class TrialResult:
    """The end of a K-step continuation: held-out loss, training losses, captured gradients."""

    eval_loss: float
    """Held-out loss after the trial's last step."""
    train_loss: list[float]
    captured: list[list[torch.Tensor]] = field(default_factory=list)
    """Per-rank flat gradients of the first `capture` steps (the FP32 trial keeps them)."""
    stopped_early: bool = False
    """The trial was cut short: its training loss was already far above the FP32 continuation's."""

    @property
    def tail_loss(self) -> float:
        k = max(1, len(self.train_loss) // 2)
        return sum(self.train_loss[-k:]) / k


def train_delta(losses: list[float], base: list[float], floor: float = 0.0) -> float:
    """Relative training-loss increase over the second half of `losses`, against `base` on the same steps
    (relative to at least `floor`: a classifier's training loss near zero makes any wobble a large ratio)."""
    n = len(losses)
    k = max(1, n // 2)
    ours, theirs = sum(losses[n - k : n]) / k, sum(base[n - k : n]) / k
    if not math.isfinite(ours):
        return math.inf
    d = max(theirs, floor)
    return (ours - theirs) / d if d else math.nan


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
    base: TrialResult | None = None,
    stop_above: float | None = None,
    evaluate: bool = True,
    floor: float = 0.0,
) -> TrialResult:
    """K steps from `ckpt` with `routes` (region -> route; others FP32); restores nothing after.
    Without `evaluate` the held-out loss is not measured (nan): a capture needs only the gradients.

    Early stop: with `base` (the FP32 continuation) and `stop_above`, a trial whose training
    loss over its last quarter of steps is already more than `stop_above` above the base's
    (from half-way on) ends there: it would fail its tolerance anyway (relative to at least `floor`,
    as `train_delta` judges it).
    """
    task.restore(ckpt)
    w = task.cfg.world_size
    seg = Segment(start, routes, error_feedback)
    residuals = Residuals()
    losses: list[float] = []
    captured: list[list[torch.Tensor]] = []
    for step in range(start, start + steps):
        grads, loss = task.rank_grads(step)
        losses.append(loss)
        if not math.isfinite(loss):
            return TrialResult(math.inf, losses, stopped_early=True)
        if len(captured) < capture:
            captured.append([g.clone() for g in grads])
        mean = reduce_step(task, grads, seg, step_generators(seed, step, w), residuals, step=step)
        task.apply(mean, step)
        done = step - start + 1
        if tick:
            tick()
        if (base is not None and stop_above is not None and done < steps and done >= max(2, steps // 2)):
            window = max(2, steps // 4)
            ours = sum(losses[done - window : done]) / window
            theirs = sum(base.train_loss[done - window : done]) / window
            if theirs > 0 and (ours - theirs) / max(theirs, floor) > stop_above:
                return TrialResult(task.eval_loss(), losses, captured, stopped_early=True)
    if not evaluate:
        return TrialResult(math.nan, losses, captured)
    ev = task.eval_loss()
    return TrialResult(ev if math.isfinite(ev) else math.inf, losses, captured)


def reference_continuation(task: Task, ref: Reference, start: int, steps: int, capture: int = 0) -> TrialResult:
    """The FP32 trial from `start`, read off the reference run: its losses, its state after `steps`
    steps (evaluated), and the first `capture` steps' per-rank gradients (re-run: a few steps only).
    Falls back to running it when the reference kept no state there (a start within `steps` of the
    run's end: the sweep asks for it only when a trial there needs it)."""
    end = start + steps
    if end not in ref.checkpoints or end > len(ref.loss):
        return run_trial(task, ref.checkpoints[start], start, steps, {}, error_feedback=False, seed=0,
                         capture=capture)
    captured = fp32_capture(task, ref, start, capture)
    task.restore(ref.checkpoints[end])
    return TrialResult(task.eval_loss(), list(ref.loss[start:end]), captured)


def fp32_capture(task: Task, ref: Reference, start: int, capture: int) -> list[list[torch.Tensor]]:
    """Per-rank gradients of the `capture` FP32 steps from `start` (what replay measures routes on),
    re-run from the reference's checkpoint there: the same bits the reference computed."""
    if not capture:
        return []
    return run_trial(task, ref.checkpoints[start], start, capture, {}, error_feedback=False, seed=0,
                     capture=capture, evaluate=False).captured


@dataclass(slots=True)
class ScheduleRun:
    """A run that follows route segments: held-out losses on the eval points, checkpoints, where it stopped."""

    eval_loss: dict[int, float] = field(default_factory=dict)
    saved: dict[int, tuple[dict, Residuals]] = field(default_factory=dict)
    """Step -> (model/optimizer state, residuals) before that step, for restarting there."""
    probe: dict[int, float] = field(default_factory=dict)
    """Step -> the lowest `probe_cosine` of its lossy regions (steps with one)."""
    stopped_at: int | None = None
    """Set when `abort` ended the run early (the step after the last eval)."""


def segment_at(segments: list[Segment], step: int) -> Segment:
    current = segments[0]
    for seg in segments:
        if seg.start <= step:
            current = seg
    return current


def run_schedule(
    task: Task,
    ckpt: dict,
    start: int,
    stop: int,
    segments: list[Segment],
    *,
    seed: int,
    eval_at: set[int],
    save_at: set[int],
    residuals: Residuals | None = None,
    abort: Callable[[int, float], bool] | None = None,
    tick: Tick | None = None,
) -> ScheduleRun:
    """Steps [start, stop) from `ckpt`, each step reduced under the segment in force.

    Held-out loss is measured after every step count in `eval_at` (and the run ends early
    when `abort(step, loss)` says so); state before each step in `save_at` is kept.
    """
    task.restore(ckpt)
    w = task.cfg.world_size
    residuals = residuals.clone() if residuals is not None else Residuals()
    run = ScheduleRun()
    for step in range(start, stop):
        if step in save_at:
            run.saved[step] = (task.checkpoint(), residuals.clone())
        if step in eval_at and step != start:
            run.eval_loss[step] = loss = task.eval_loss()
            if abort is not None and abort(step, loss):
                run.stopped_at = step
                return run
        grads, _ = task.rank_grads(step)
        probe: dict[str, float] = {}
        mean = reduce_step(task, grads, segment_at(segments, step), step_generators(seed, step, w), residuals,
                           probe, step)
        if probe:
            run.probe[step] = min(probe.values())
        task.apply(mean, step)
        if tick:
            tick()
    if stop in eval_at:
        run.eval_loss[stop] = task.eval_loss()
    return run
