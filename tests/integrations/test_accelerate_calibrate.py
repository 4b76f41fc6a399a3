"""An Accelerate user calibrates through the Python API (`nfab.calibrate` with the loop's own model factory,
dataset and loss), then attaches the profile it wrote with `nfab.integrations.accelerate.attach` on 2 gloo
ranks: the example in docs/integrations.md, run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402

import nfab  # noqa: E402
from nfab.distributed import run_ranks  # noqa: E402
from nfab.integrations import accelerate as nfab_accelerate  # noqa: E402
from nfab.profile.schema import Profile  # noqa: E402

STEPS = 4


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))


def regression_data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 32, generator=g)
    return torch.utils.data.TensorDataset(x, x[:, :4] * 2 + 0.1 * torch.randn(512, 4, generator=g))


def mse(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _train(rank: int, world_size: int, profile: str) -> dict:
    accelerator = Accelerator(cpu=True)
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(regression_data(), batch_size=16)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    runtime = nfab_accelerate.attach(accelerator, model, profile, optimizer=opt, total_steps=STEPS, cost_model=None)
    batches = iter(loader)
    for _ in range(STEPS):
        loss = mse(model, next(batches))
        runtime.observe_loss(loss)
        accelerator.backward(loss)
        runtime.step_stats()  # each step's stats folded right after its backward
        opt.step()
        opt.zero_grad()
    return {"routes": [p.routes for p in runtime.controller.profile.phases], "steps": [s.step for s in runtime.history],
            "params": torch.cat([p.detach().reshape(-1) for p in accelerator.unwrap_model(model).parameters()])}


@pytest.mark.world_size(2)
def test_calibrate_the_loops_objects_then_attach_in_accelerate(tmp_path: Path) -> None:
    result = nfab.calibrate(build_model, regression_data(), loss=mse, optimizer={"name": "adamw", "lr": 0.01},
                            batch_size=16, world_size=2, steps=10, quick=True, validate=False, out=tmp_path / "cal")
    assert result.meta["loss"].endswith(":mse") and len(result.table) > 0
    res = run_ranks(_train, 2, str(result.profile_path), timeout_s=180)
    calibrated = [p.routes for p in Profile.load(result.profile_path).phases]
    for r in res:
        assert r["routes"] == calibrated and r["steps"] == list(range(STEPS))
    assert torch.equal(res[0]["params"], res[1]["params"])
