"""The simulated task's region access: gathering and scattering by runs is index_select / index_copy_."""

from __future__ import annotations

import pytest
import torch

from nfab.calibrate import make_config
from nfab.calibrate import task as task_mod
from nfab.calibrate.task import Task


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
