"""Reference run, phase points and trials: deterministic, and trials see the reference's batches."""

from __future__ import annotations

import math

import torch

from nfab.calibrate import make_config
from nfab.calibrate.task import Task
from nfab.calibrate.trajectory import checkpoint_grid, phase_points, probe_cosine, run_reference, run_trial


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


def _independent_variance(xs: list, lengths: tuple[int, ...], q, block: int, levels: int) -> torch.Tensor:
    """(2s/M)^2 (W+1)/(12W^2) q^2, each block's s the smallest table scale covering the ranks' max
    |x/q| in it, blocks restarting per parameter: written out from the definition, not from nfab."""
    from nfab.wire.blockq.reducer import SCALES

    w = len(xs)
    absmax = torch.stack([(x / q).abs() for x in xs]).amax(0)
    out, pos = [], 0
    for n in lengths:
        seg = absmax[pos : pos + n]
        for b in range(0, n, block):
            s = SCALES[int(torch.searchsorted(SCALES, seg[b : b + block].max()))]
            out.append(torch.full((min(block, n - b),), float(s)))
        pos += n
    level = torch.cat(out) * (2.0 / (levels - 1))
    return level.square() * (w + 1) / (12.0 * w * w) * q.square()


def test_noise_moment_trial_corrects_v_as_the_hook_does() -> None:
    """Under AdamW a bq4 trial takes each step's rounding variance out of v before the step: after
    two steps v differs from the uncorrected trial's by exactly beta2 (max(v - k var, min(v, var (1-beta2)/2)) - v)."""
    from nfab.calibrate.replay import replay_reducer
    from nfab.calibrate.trajectory import Residuals, Segment, quantization_scale, reduce_step, step_generators

    over = {"data.max_bytes": 50_000, "batch_size": 2, "eval_samples": 4}
    tasks = [Task(make_config("gpt", steps=4, phases=1, overrides={**over, "noise_moment": on}))
             for on in (True, False)]
    assert tasks[0].moment is not None and tasks[1].moment is None
    seg = Segment(0, {"linear": "bq4"}, error_feedback=False)
    region = tasks[0].regions["linear"]
    v = []
    for task in tasks:
        for step in range(2):
            grads, _ = task.rank_grads(step)
            if step == 1:
                xs = [task.gather(g, "linear") for g in grads]
                q = quantization_scale(task, "linear")
                v1 = torch.cat([task.optimizer.state[task.params[i]]["exp_avg_sq"].reshape(-1) for i in region.indices])
            task.apply(reduce_step(task, grads, seg, step_generators(0, step, 4), Residuals()), step)
        v.append(torch.cat([task.optimizer.state[task.params[i]]["exp_avg_sq"].reshape(-1) for i in region.indices]))
    assert tasks[0].moment.applied_steps == 1  # step 0 had no v yet
    red = replay_reducer("bq4", 4)
    var = _independent_variance(xs, region.lengths, q, red.block, red.steps + 1)
    b2 = tasks[0].optimizer.param_groups[0]["betas"][1]
    k = (1 - b2) / b2
    floor = 0.5 * var * (1 - b2)  # Adam reads v / (1 - b2^n): after one update, n = 1
    expect = b2 * (torch.maximum(v1 - k * var, torch.minimum(v1, floor)) - v1)
    floored = v1 - k * var < torch.minimum(v1, floor)
    assert 0 < int(floored.sum()) < floored.numel()  # both branches: corrected, and held at the floor
    torch.testing.assert_close(v[0] - v[1], expect, rtol=1e-4, atol=1e-12)


def test_probe_cosine_reads_the_hooks_strided_sample_in_the_optimizers_space() -> None:
    g = torch.Generator().manual_seed(0)
    truth = torch.randn(3000, generator=g)
    est = truth + torch.randn(3000, generator=g)
    lengths = [2000, 1000]  # every 4th element of the first parameter (500), every 2nd of the second (500)
    idx = torch.cat([torch.arange(0, 2000, 4), 2000 + torch.arange(0, 1000, 2)])
    scale = torch.rand(3000, generator=g) + 0.5

    def cos(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.dot(a, b) / (a.norm() * b.norm()))

    assert math.isclose(probe_cosine(est, truth, lengths, None), cos(est[idx], truth[idx]), rel_tol=1e-5)
    assert math.isclose(probe_cosine(est, truth, lengths, scale),
                        cos(est[idx] / scale[idx], truth[idx] / scale[idx]), rel_tol=1e-5)
