"""NfabDDPStrategy (lightning.pytorch) on 2 real gloo ranks (CPU): the hook runs, stats are logged, replicas agree.

The classic `pytorch_lightning` namespace: test_pytorch_lightning_dist.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.loggers.logger import Logger  # noqa: E402

from nfab.distributed import run_ranks  # noqa: E402
from nfab.errors import NfabError  # noqa: E402
from nfab.integrations.lightning import NfabDDPStrategy  # noqa: E402
from nfab.integrations.metrics import step_metrics  # noqa: E402
from nfab.profile.schema import Profile  # noqa: E402

STEPS = 6
PROBE_EVERY = Profile.static("sign").health.probe_every


class _Regressor(pl.LightningModule):
    """A small MLP on generated data: big enough that 1-bit signs beat their control words."""

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
        x = torch.randn(256, 32, generator=g)
        y = x[:, :4] * 2 + 0.1 * torch.randn(256, 4, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


class _MemoryLogger(Logger):
    """Keeps what Lightning logs, on every rank (Lightning's own loggers write on rank 0 only)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))


def _baseline(stats) -> int:
    """Plain DDP's bytes for the step, read through the metrics the adapters log."""
    return int(step_metrics(stats)["nfab/baseline_wire_bytes"])


def _fit(rank: int, world_size: int, root: str) -> dict:
    torch.manual_seed(0)
    module = _Regressor()
    strategy = NfabDDPStrategy(route="sign", cost_model=None)
    logger = _MemoryLogger()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS, logger=logger,
        accumulate_grad_batches=2, log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(module)
    rt = strategy.runtime
    return {
        "params": torch.cat([p.detach().reshape(-1) for p in module.parameters()]),
        "total_steps": rt.controller.total_steps,
        "error_feedback": rt.error_feedback,
        "history": [(s.step, s.wire_bytes, _baseline(s), s.route_mix, s.loss) for s in rt.history],
        "logged": [m for _, m in logger.rows if any(k.startswith("nfab/") for k in m)],
    }


@pytest.mark.world_size(2)
def test_strategy_attaches_on_cpu_gloo_and_logs_each_step(tmp_path: Path):
    res = run_ranks(_fit, 2, str(tmp_path), timeout_s=180)
    for r in res:
        assert r["error_feedback"] is True  # error_feedback="auto" saw the strategy's SGD
        assert r["total_steps"] == STEPS  # from trainer.estimated_stepping_batches (optimizer steps)
        # the hook ran once per optimizer step: Lightning accumulates under DDP's no_sync
        assert [h[0] for h in r["history"]] == list(range(STEPS))
        for step, wire, baseline, mix, loss in r["history"]:
            if step % PROBE_EVERY:  # a fidelity-probe step also sends a sample in FP32
                assert baseline / wire > 1.0
            assert set(mix) <= {"signcount", "signgather"}
            assert loss is not None and loss > 0  # the training loss reached the health monitor
        assert len(r["logged"]) == STEPS
        for step, m in enumerate(r["logged"]):
            compression = m["nfab/compression"]
            assert compression == pytest.approx(r["history"][step][2] / r["history"][step][1])
            assert compression > 1.0 or step % PROBE_EVERY == 0
            assert sum(v for k, v in m.items() if k.startswith("nfab/route/")) == pytest.approx(1.0)
            assert m["nfab/fallback"] == 0.0
    assert res[0]["history"] == res[1]["history"]
    assert torch.equal(res[0]["params"], res[1]["params"])


def test_a_bad_profile_or_route_is_refused_where_the_strategy_is_built():
    """Not at `fit()`, inside some 26 frames of Lightning on every rank."""
    with pytest.raises(NfabError, match="cannot read profile /nonexistent.json"):
        NfabDDPStrategy("/nonexistent.json")
    with pytest.raises(NfabError, match="unknown route 'q3'"):
        NfabDDPStrategy(route="q3")


def test_strategy_needs_one_of_profile_or_route():
    with pytest.raises(NfabError, match="exactly one"):
        NfabDDPStrategy()
    with pytest.raises(NfabError, match="exactly one"):
        NfabDDPStrategy(profile="p.json", route="sign")


class _Small(_Regressor):
    """64 samples: one epoch is 2 optimizer steps at W=2, so a checkpoint after 2 steps is an epoch end."""

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 32, generator=g)
        y = x[:, :4] * 2 + 0.1 * torch.randn(64, 4, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def _ckpt_fit(world_size: int, root: str, steps: int, ckpt: str | None) -> tuple[_Small, NfabDDPStrategy, pl.Trainer]:
    torch.manual_seed(0)
    module = _Small()
    strategy = NfabDDPStrategy(route="sign", cost_model=None, error_feedback=True, total_steps=4)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=root)
    trainer.fit(module, ckpt_path=ckpt)
    return module, strategy, trainer


def _nfab_state(module: torch.nn.Module, strategy: NfabDDPStrategy) -> dict:
    rt = strategy.runtime
    return {"params": torch.cat([p.detach().reshape(-1) for p in module.parameters()]), "step": rt.step,
            "residuals": {k: v.clone() for k, v in rt.residuals.items()}, "health": rt.health.to_dict()}


def _first_half(rank: int, world_size: int, root: str) -> dict:
    full = _nfab_state(*_ckpt_fit(world_size, root, 3, None)[:2])  # the uninterrupted run
    module, strategy, trainer = _ckpt_fit(world_size, root, 2, None)
    trainer.save_checkpoint(str(Path(root) / "half.ckpt"))  # every rank calls it; rank 0 writes
    return {"full": full, "half": _nfab_state(module, strategy)}


def _resumed(rank: int, world_size: int, root: str) -> dict:
    module, strategy, _ = _ckpt_fit(world_size, root, 3, str(Path(root) / "half.ckpt"))
    return _nfab_state(module, strategy)


@pytest.mark.world_size(2)
def test_checkpoint_carries_every_ranks_nfab_state(tmp_path: Path):
    first = run_ranks(_first_half, 2, str(tmp_path), timeout_s=180)
    resumed = run_ranks(_resumed, 2, str(tmp_path), timeout_s=180)  # a fresh process group
    saved = torch.load(tmp_path / "half.ckpt", weights_only=True)["nfab"]
    assert saved["world_size"] == 2 and [s["step"] for s in saved["ranks"]] == [2, 2]
    for r, (a, b) in enumerate(zip(first, resumed, strict=True)):
        assert a["half"]["residuals"] and a["half"]["step"] == 2
        # rank r's own residuals went into the checkpoint (they differ between ranks)
        assert all(torch.equal(v, saved["ranks"][r]["residuals"][k]) for k, v in a["half"]["residuals"].items())
        full = a["full"]
        assert b["step"] == full["step"] == 3 and b["health"] == full["health"]
        assert b["residuals"].keys() == full["residuals"].keys()
        assert all(torch.equal(b["residuals"][k], full["residuals"][k]) for k in full["residuals"])
        assert torch.equal(b["params"], full["params"])
    assert not all(torch.equal(first[0]["half"]["residuals"][k], first[1]["half"]["residuals"][k])
                   for k in first[0]["half"]["residuals"])
    assert torch.equal(resumed[0]["params"], resumed[1]["params"])
