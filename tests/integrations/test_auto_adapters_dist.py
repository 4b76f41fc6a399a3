"""`profile="auto"` through the adapters, on 2 real gloo ranks: Lightning's strategy, the HF Trainer and
Accelerate each calibrate inside the run, write the profile they fitted, and keep replicas identical."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nfab.calibrate.table import read_table
from nfab.distributed import run_ranks

STEPS = 12
WINDOW = 2


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.LayerNorm(128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 4))


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 32, generator=g)
    return torch.utils.data.TensorDataset(x, x[:, :4] * 2 + 0.1 * torch.randn(512, 4, generator=g))


def _result(rt, params) -> dict:
    return {"params": torch.cat([p.detach().reshape(-1) for p in params]),
            "calibrating": [s.calibrating for s in rt.history], "phases": [p.name for p in rt.profile.phases],
            "mix": [s.route_mix for s in rt.history]}


def _lightning(rank: int, world_size: int, out: str) -> dict:
    import lightning.pytorch as pl

    from nfab.integrations.lightning import NfabDDPStrategy

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def train_dataloader(self):  # noqa: ANN201
            return torch.utils.data.DataLoader(_data(), batch_size=16)

    module = Regressor()
    strategy = NfabDDPStrategy(profile="auto", cost_model=None, calibration_out=out, calibration_window=WINDOW)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=out)
    trainer.fit(module)
    return _result(strategy.runtime, module.parameters())


def _transformers(rank: int, world_size: int, out: str) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from nfab.integrations import transformers as nfab_transformers

    class Tokens(torch.utils.data.Dataset):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(0)
            self.ids = (torch.arange(16) % 8 + torch.randint(0, 3, (96, 16), generator=g)) % 64

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=64, n_layer=1, n_head=2))
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=STEPS, learning_rate=1e-3,
                             report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
                             dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    handle = nfab_transformers.attach(trainer, "auto", cost_model=None, calibration_out=out,
                                      calibration_window=WINDOW)
    trainer.train()
    return _result(handle.runtime, trainer.model.parameters())


def _accelerate(rank: int, world_size: int, out: str) -> dict:
    from accelerate import Accelerator

    from nfab.integrations import accelerate as nfab_accelerate

    accelerator = Accelerator(cpu=True)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, loader = accelerator.prepare(model, opt, torch.utils.data.DataLoader(_data(), batch_size=16))
    rt = nfab_accelerate.attach(accelerator, model, "auto", optimizer=opt, total_steps=STEPS, cost_model=None,
                                calibration_out=out, calibration_window=WINDOW)
    batches = iter(loader)
    for _ in range(STEPS):
        x, y = next(batches)
        loss = torch.nn.functional.mse_loss(model(x), y)
        rt.observe_loss(loss)
        accelerator.backward(loss)
        rt.step_stats()
        opt.step()
        opt.zero_grad()
    return _result(rt, accelerator.unwrap_model(model).parameters())


ADAPTERS = {"lightning": _lightning, "transformers": _transformers, "accelerate": _accelerate}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_each_adapter_calibrates_inside_the_run_with_profile_auto(adapter: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip({"lightning": "lightning", "transformers": "transformers", "accelerate": "accelerate"}[adapter])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    res = run_ranks(ADAPTERS[adapter], 2, str(tmp_path), timeout_s=300)
    for r in res:
        assert len(r["calibrating"]) == STEPS and r["calibrating"][:WINDOW] == [True] * WINDOW
        assert r["phases"] == [f"p{i}-inrun" for i in range(3)]  # a window at the start and at each third
    assert torch.equal(res[0]["params"], res[1]["params"])
    assert res[0]["mix"] == res[1]["mix"]
    frame, meta = read_table(tmp_path / "calibration.parquet")
    assert meta["world_size"] == 2 and set(frame["phase"]) == set(res[0]["phases"])
    assert json.loads((tmp_path / "profile.json").read_text())["phases"]
