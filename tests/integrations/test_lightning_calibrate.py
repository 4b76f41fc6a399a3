"""nfab.integrations.lightning.calibrate: calibrate from a LightningModule and LightningDataModule as the user
built them, then fit with the profile through NfabDDPStrategy on 2 gloo ranks; the classic namespace's
`calibrate` on a module with `train_dataloaders=`. Small MLPs on sklearn's digits (shipped, no download)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("sklearn")
import lightning.pytorch as pl  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

from nfab.distributed import run_ranks  # noqa: E402
from nfab.errors import UserCodeError  # noqa: E402
from nfab.integrations import lightning as nfab_lightning  # noqa: E402
from nfab.profile.schema import Profile  # noqa: E402

FIT_STEPS = 3


def _digits() -> torch.utils.data.TensorDataset:
    x, y = load_digits(return_X_y=True)
    return torch.utils.data.TensorDataset(torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y))


class _Digits(pl.LightningModule):
    """A user's classifier: `training_step` returns Lightning's dict, logs, and its optimizer is AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
        self.steps_seen = 0

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.steps_seen += 1
        self.log("train_loss", loss)
        return {"loss": loss}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.02, betas=(0.9, 0.98))


class _Broken(_Digits):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        raise RuntimeError("forgot to unpack the batch")


class _DigitsData(pl.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.stages: list[str | None] = []

    def setup(self, stage: str | None = None) -> None:
        self.stages.append(stage)
        whole = _digits()
        self.train, self.val = torch.utils.data.random_split(whole, [1500, len(whole) - 1500],
                                                             generator=torch.Generator().manual_seed(0))

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.train, batch_size=16, shuffle=True)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.val, batch_size=64)


def _trainer(**kwargs: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, **kwargs)


def _fit(rank: int, world_size: int, root: str, profile: str) -> dict:
    torch.manual_seed(0)
    module = _Digits()
    strategy = nfab_lightning.NfabDDPStrategy(profile, cost_model=None)
    trainer = _trainer(devices=world_size, strategy=strategy, max_steps=FIT_STEPS, default_root_dir=root,
                       limit_val_batches=0)
    trainer.fit(module, _DigitsData())
    rt = strategy.runtime
    return {"routes": [p.routes for p in rt.controller.profile.phases], "steps": [s.step for s in rt.history],
            "params": torch.cat([p.detach().reshape(-1) for p in module.parameters()])}


@pytest.mark.world_size(2)
def test_calibrate_from_module_and_datamodule_then_fit_with_the_strategy(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module, data = _Digits(), _DigitsData()
    trainer = _trainer(devices=1, max_steps=12, gradient_clip_val=1.0, precision="32-true")
    result = nfab_lightning.calibrate(module, data, trainer=trainer, out=tmp_path / "cal", world_size=2,
                                      quick=True, validate=False)

    meta = result.meta
    assert "_Digits.training_step" in meta["loss"] and module.steps_seen == 0  # run on nfab's copies only
    assert data.stages == ["fit"]  # set up as Lightning would
    assert meta["optimizer"] == {"name": "adamw", "lr": 3e-3, "momentum": 0.9, "weight_decay": 0.02,
                                 "betas": [0.9, 0.98], "grad_clip": 1.0}  # configure_optimizers' AdamW
    assert (meta["batch_size"], meta["steps"], meta["precision"], meta["world_size"]) == (16, 12, "fp32", 2)
    assert meta["eval_data"] is not None  # the datamodule's val set
    assert len(result.table) > 0 and result.table["cosine"].notna().any()
    assert result.profile_path is not None and result.profile_path.is_file()

    res = run_ranks(_fit, 2, str(tmp_path / "fit"), str(result.profile_path), timeout_s=180)
    calibrated = [p.routes for p in Profile.load(result.profile_path).phases]
    for r in res:
        assert r["routes"] == calibrated and r["steps"] == list(range(FIT_STEPS))
    assert torch.equal(res[0]["params"], res[1]["params"])


def test_a_failing_training_step_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(UserCodeError, match=r"_Broken\.training_step.* raised RuntimeError: forgot to unpack"):
        nfab_lightning.calibrate(_Broken(), _DigitsData(), world_size=2, steps=4, quick=True, validate=False,
                                 out=tmp_path / "cal")
    assert not (tmp_path / "cal" / "profile.json").exists()


def test_the_classic_namespace_calibrates_from_train_dataloaders() -> None:
    ptl = pytest.importorskip("pytorch_lightning")
    from nfab.integrations import pytorch_lightning as nfab_ptl

    class Classic(ptl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(64, 10)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.8)

    loader = torch.utils.data.DataLoader(_digits(), batch_size=32)
    result = nfab_ptl.calibrate(Classic(), train_dataloaders=loader, world_size=2, steps=8, quick=True,
                                validate=False)
    assert "Classic.training_step" in result.meta["loss"] and result.meta["batch_size"] == 32
    assert result.meta["optimizer"]["name"] == "sgd" and result.meta["optimizer"]["momentum"] == 0.8
    assert result.profile.phases and result.table_path is None
