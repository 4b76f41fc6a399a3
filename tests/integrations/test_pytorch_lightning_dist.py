"""nfab's strategy under the classic `pytorch_lightning` namespace, on 2 real gloo ranks (CPU).

`pytorch_lightning.Trainer` refuses a strategy built on `lightning.pytorch` ("invalid strategy
name"); `nfab.integrations.pytorch_lightning.NfabDDPStrategy` is built on its own `DDPStrategy`.
The full behaviour (logging, checkpoints) is tested under `lightning.pytorch`
(test_lightning_dist.py): the class is one definition, so here two steps prove the namespace.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("pytorch_lightning")
import pytorch_lightning as ptl  # noqa: E402

from nfab.distributed import run_ranks  # noqa: E402
from nfab.integrations.pytorch_lightning import NfabDDPStrategy  # noqa: E402

STEPS = 2


class _Regressor(ptl.LightningModule):
    """A small MLP on generated data, a classic-namespace LightningModule."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 32, generator=g)
        y = x[:, :4] * 2 + 0.1 * torch.randn(64, 4, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def _fit(rank: int, world_size: int, root: str) -> dict:
    torch.manual_seed(0)
    module = _Regressor()
    before = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    strategy = NfabDDPStrategy(route="sign", cost_model=None)
    trainer = ptl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          default_root_dir=root)
    trainer.fit(module)
    rt = strategy.runtime
    return {"params": torch.cat([p.detach().reshape(-1) for p in module.parameters()]), "before": before,
            "history": [(s.step, s.route_mix, s.loss) for s in rt.history], "total_steps": rt.controller.total_steps}


def test_strategy_is_the_classic_namespaces():
    assert isinstance(NfabDDPStrategy(route="sign"), ptl.strategies.DDPStrategy)


@pytest.mark.world_size(2)
def test_classic_trainer_runs_nfab_on_cpu_gloo(tmp_path: Path):
    res = run_ranks(_fit, 2, str(tmp_path), timeout_s=180)
    for r in res:
        assert r["total_steps"] == STEPS
        assert [h[0] for h in r["history"]] == list(range(STEPS))  # the hook ran every optimizer step
        assert all(set(mix) <= {"signcount", "signgather"} and loss is not None for _, mix, loss in r["history"])
        assert not torch.equal(r["params"], r["before"])  # it trained
    assert res[0]["history"] == res[1]["history"]
    assert torch.equal(res[0]["params"], res[1]["params"])
