"""Reference run, phase points and trials: deterministic, and trials see the reference's batches."""

from __future__ import annotations

import math

from nfab.calibrate import make_config
from nfab.calibrate.task import Task
from nfab.calibrate.trajectory import checkpoint_grid, phase_points, run_reference, run_trial


def tiny(model: str = "resnet18", **over) -> Task:
    cfg = make_config(model, steps=6, phases=2, trial_steps=2, overrides={
        "model.width": 4, "batch_size": 8, "eval_samples": 16, **over})
    return Task(cfg)


def test_fp32_trial_reproduces_the_reference_run() -> None:
    task = tiny()
    ref = run_reference(task)
    assert len(ref.loss) == 6 and all(math.isfinite(v) for v in ref.loss + ref.grad_norm)
    assert 0 in ref.checkpoints
    again = run_trial(task, ref.checkpoints[0], 0, 6, {}, error_feedback=False, seed=0, capture=2)
    assert again.train_loss == ref.loss  # bit for bit: same shards, same buffer broadcast, same schedule
    assert len(again.captured) == 2 and len(again.captured[0]) == 4


def test_lossy_trial_changes_only_its_region_path() -> None:
    task = tiny()
    ref = run_reference(task)
    base = run_trial(task, ref.checkpoints[0], 0, 3, {}, error_feedback=False, seed=0)
    sign = run_trial(task, ref.checkpoints[0], 0, 3, {"conv": "sign"}, error_feedback=True, seed=0)
    assert sign.train_loss[0] == base.train_loss[0]  # the first loss comes before any reduction
    assert sign.train_loss[1:] != base.train_loss[1:]
    over = run_trial(task, ref.checkpoints[0], 0, 3, {"conv": "q2"}, error_feedback=False, seed=0)
    assert over.train_loss == base.train_loss  # q2 has no capacity at W=4: the region stays fp32


def test_phase_points_find_a_trend_change() -> None:
    steps = 120
    norms = [math.exp(-0.05 * s) if s < 60 else math.exp(-3.0 + 0.04 * (s - 60)) for s in range(steps)]
    grid = checkpoint_grid(steps, warmup=10)
    pts = phase_points(norms, grid, warmup=10, n=3, tail=12)
    assert pts[0] == (0, "start") and pts[1] == (10, "warmup_end")
    assert pts[2][1] == "trend" and abs(pts[2][0] - 60) <= 10
    flat = phase_points([1.0] * steps, grid, warmup=0, n=4, tail=12)
    assert flat[0] == (0, "start") and [k for _, k in flat[1:]] == ["even"] * 3
    assert all(s <= steps - 12 for s, _ in flat)


def test_gpt_task_has_lm_regions() -> None:
    cfg = make_config("gpt", steps=4, phases=1, overrides={"data.max_bytes": 50_000, "batch_size": 2,
                                                           "eval_samples": 4})
    task = Task(cfg)
    assert {"embedding", "linear", "norm", "bias"} <= set(task.regions)
    grads, loss = task.rank_grads(0)
    assert len(grads) == 4 and math.isfinite(loss)
