"""The simulated task's region access: gathering and scattering by runs is index_select / index_copy_."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nfab.calibrate import make_config
from nfab.calibrate import task as task_mod
from nfab.calibrate.task import Task
from nfab.config.optim import autocast


@pytest.mark.parametrize("by_index", [False, True])
def test_region_runs_gather_and_scatter_match_the_index(by_index: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if by_index:  # regions of many runs take the indexed gather
        monkeypatch.setattr(task_mod, "GATHER_RUNS", 0)
    task = Task(make_config("resnet18", steps=4, phases=1, overrides={"model.width": 4, "batch_size": 8}))
    n = sum(p.numel() for p in task.params)
    flat = torch.randn(n, generator=torch.Generator().manual_seed(3))
    for region in task.regions:
        idx = task.region_index(region)
        runs = task.region_runs(region)
        assert sum(b - a for a, b in runs) == idx.numel() and all(b > a for a, b in runs)
        got = task.gather(flat, region)
        assert torch.equal(got, flat.index_select(0, idx))
        got[:1] += 1.0  # a copy: the flat gradient is untouched
        assert torch.equal(flat.index_select(0, idx)[:1] + 1.0, got[:1])
        values = torch.randn(idx.numel())
        a, b = flat.clone(), flat.clone()
        task.scatter(a, region, values)
        b.index_copy_(0, idx, values)
        assert torch.equal(a, b)
    assert len(task.region_runs("conv")) > 1  # runs merge neighbours only: conv is interleaved with norms


def test_a_calibration_shorter_than_its_config_records_the_run_it_is_for() -> None:
    """`--steps` below the config's `steps`: the profile is for the longer run (attach widens its
    spike and jump thresholds for it); without `--steps` nothing is recorded."""
    shipped = make_config("resnet18")
    assert shipped.run_steps is None
    short = make_config("resnet18", steps=shipped.steps // 3)
    assert (short.steps, short.run_steps) == (shipped.steps // 3, shipped.steps)


def _gpt(**over: object) -> Task:
    return Task(make_config("gpt", steps=4, phases=1, overrides={"data.max_bytes": 50_000, "batch_size": 2,
                                                                 "eval_samples": 4, **over}))


def test_a_step_is_the_settings_recipe_accumulated_clipped_and_autocast() -> None:
    """A calibration step steps the setting's recipe as `nfab train` does. It used to be one fp32
    micro-batch, unclipped, whatever the setting said (the recipe profiles of docs/study.md were
    calibrated so)."""
    plain, accum = _gpt(), _gpt(accum_steps=2)
    # accumulation: each rank's gradient is the mean over the global batches 2s and 2s + 1, bit for bit
    # (the loss halved before backward, then added: exact in binary floating point)
    a, b = plain.rank_grads(2)[0], plain.rank_grads(3)[0]
    got, loss = accum.rank_grads(1)
    assert all(torch.equal(g, (x + y) / 2) for g, x, y in zip(got, a, b, strict=True))
    assert loss == (plain.rank_grads(2)[1] + plain.rank_grads(3)[1]) / 2
    # clipping: the optimizer steps on the mean clipped to the setting's norm
    clipped = _gpt(**{"optim.grad_clip": 0.05})
    mean = torch.stack(clipped.rank_grads(0)[0]).mean(0)
    assert float(mean.norm()) > 0.05
    clipped.apply(mean.clone(), 0)
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in clipped.params]))
    assert abs(float(norm) - 0.05) < 1e-6
    plain.apply(mean.clone(), 0)
    assert not all(torch.equal(p, q) for p, q in zip(plain.params, clipped.params, strict=True))
    # precision: the forward under bf16 autocast gives another gradient, close to fp32's
    bf16 = torch.cat(_gpt(precision="bf16").rank_grads(0)[0])
    fp32 = torch.cat(_gpt().rank_grads(0)[0])
    assert not torch.equal(bf16, fp32) and float(torch.nn.functional.cosine_similarity(bf16, fp32, 0)) > 0.95


def _plain_fp16_grad(task: Task, scale: float) -> torch.Tensor:
    """Rank 0's gradient at step 0 from a plain fp16 loop: `GradScaler("cpu", init_scale=scale)`, the loss
    scaled, backward, `unscale_`."""
    x, y = task.stream.batches(0)[0]
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    with autocast("fp16", "cpu"):
        loss = F.cross_entropy(task.model(x).flatten(0, 1), y.flatten())
    scaler.scale(loss / 1).backward()
    scaler.unscale_(task.optimizer)
    return torch.cat([task_mod._grad(p).reshape(-1) for p in task.params])


def test_an_fp16_step_runs_under_the_loss_scale_nfab_train_runs_under() -> None:
    """Under fp16 a calibration step scales its loss as `nfab train`'s GradScaler does (2^16 to start,
    halved on an overflow) and divides the gradients by it: a plain GradScaler loop's gradients, bit
    for bit. Until 2026-12-05 it ran at scale 1, where the fp16 backward loses small gradients."""
    task = _gpt(precision="fp16")
    assert task.loss_scale is not None and task.loss_scale.scale == 2.0**16
    got = task.rank_grads(0)[0][0]
    assert torch.equal(got, _plain_fp16_grad(_gpt(precision="fp16"), 2.0**16))
    assert not torch.equal(got, _plain_fp16_grad(_gpt(precision="fp16"), 1.0))  # what scale 1 gave
    # an overflow: the step is taken again at half the scale until it is finite; the checkpoint keeps the scale
    over = _gpt(precision="fp16")
    over.loss_scale.scale = 2.0**40
    ckpt = over.checkpoint()
    grads = over.rank_grads(0)[0]
    settled = over.loss_scale.scale
    assert settled < 2.0**40 and all(bool(torch.isfinite(g).all()) for g in grads)
    assert torch.equal(grads[0], _plain_fp16_grad(_gpt(precision="fp16"), settled))
    over.restore(ckpt)
    assert over.loss_scale.scale == 2.0**40
    assert _gpt().loss_scale is None and _gpt(precision="bf16").loss_scale is None
