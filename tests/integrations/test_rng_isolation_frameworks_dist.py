"""nfab leaves the global random streams alone through the Lightning and Transformers adapters,
on 2 real gloo ranks (CPU), route="q8" with the default cost_model="measure".

The same check as tests/runtime/test_rng_isolation_dist.py (DDP, FSDP2, Accelerate), here inside
the frameworks' own loops. Torch's global CPU generator, numpy's global RandomState and Python's
`random` are read by a framework callback; the models have no dropout and the loaders draw
nothing per batch (shuffle=False under Lightning; the Trainer's sampler draws its seed once, at
the epoch's start, outside the spans read). Each run is checked two ways:

- tightly, around nfab's own code: its attach (Lightning: around the strategy's call into nfab;
  Transformers: a recorder before and one after nfab's callback at `on_train_begin`) and each
  training step (Lightning: `on_train_batch_start` to `on_train_batch_end`, which holds the
  `training_step` where the strategy feeds nfab the loss, the backward where the hook runs, and the
  optimizer step after which it folds and logs the stats; Transformers: `on_step_begin` to a
  recorder after nfab's `on_step_end`), with the framework's own draws outside those spans;
- against the same run without nfab (the framework's plain DDP): the streams read at every point
  are identical, so whatever the framework draws, nfab adds nothing to it.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from nfab.distributed import run_ranks
from tests.runtime.test_rng_isolation_dist import same, seed_everything

STEPS = 4


def streams() -> tuple[Any, ...]:
    """Every global CPU random stream a user's loop draws from, as comparable values."""
    np_state = np.random.get_state()
    return (torch.get_rng_state(), np_state[0], np_state[1].copy(), *np_state[2:], random.getstate())


def moved_spans(points: list[tuple[str, tuple[Any, ...]]], spans: list[tuple[str, str]]) -> list[str]:
    """The spans (start label, end label), each read in order, over which the streams changed."""
    out = []
    for i, (label, state) in enumerate(points):
        for start, end in spans:
            if label == end and i > 0 and points[i - 1][0] == start and not same(points[i - 1][1], state):
                out.append(f"{start}->{end} @{i}")
    return out


def diverged(a: list[tuple[str, tuple[Any, ...]]], b: list[tuple[str, tuple[Any, ...]]]) -> list[str]:
    """Points where the run with nfab and the run without it read different streams (or different points)."""
    la, lb = [p[0] for p in a], [p[0] for p in b]
    if la != lb:
        return [f"points differ: {la} vs {lb}"]
    return [f"{i}:{label}" for i, ((label, x), (_, y)) in enumerate(zip(a, b, strict=True)) if not same(x, y)]


# ---- Lightning --------------------------------------------------------------------------


def _lightning_run(world_size: int, rank: int, root: str, with_nfab: bool) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    import nfab.integrations.lightning_strategy as strategy_module
    from nfab.integrations.lightning import NfabDDPStrategy

    points: list[tuple[str, tuple[Any, ...]]] = []

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.Tanh(),
                                           torch.nn.Linear(64, 4))

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(256, 32, generator=g)
            y = x[:, :4] * 2 + 0.1 * torch.randn(256, 4, generator=g)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16, shuffle=False)

    class Recorder(pl.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            points.append(("batch_start", streams()))

        def on_before_backward(self, *args: Any) -> None:
            points.append(("before_backward", streams()))

        def on_after_backward(self, *args: Any) -> None:
            points.append(("after_backward", streams()))

        def on_train_batch_end(self, *args: Any) -> None:
            points.append(("batch_end", streams()))

    attach = strategy_module.attach_with_defaults

    def recorded_attach(*args: Any, **kwargs: Any) -> Any:
        points.append(("before_attach", streams()))
        out = attach(*args, **kwargs)
        points.append(("after_attach", streams()))
        return out

    torch.manual_seed(0)
    module = Net()
    strategy = NfabDDPStrategy(route="q8") if with_nfab else DDPStrategy()
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS, logger=False,
                         callbacks=[Recorder()], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root)
    seed_everything(rank)
    strategy_module.attach_with_defaults = recorded_attach
    try:
        trainer.fit(module)
    finally:
        strategy_module.attach_with_defaults = attach
    out: dict[str, Any] = {"points": points}
    if with_nfab:
        rt = strategy.runtime
        cost = rt.controller.cost_model
        out.update(mix=[s.route_mix for s in rt.history], cost=cost.source if cost else None)
    return out


def _lightning(rank: int, world_size: int, root: str) -> dict:
    plain = _lightning_run(world_size, rank, str(Path(root) / "plain"), with_nfab=False)
    nfab_run = _lightning_run(world_size, rank, str(Path(root) / "nfab"), with_nfab=True)
    spans = [("before_attach", "after_attach"), ("batch_start", "before_backward"),
             ("before_backward", "after_backward"), ("after_backward", "batch_end")]
    return {"moved": moved_spans(nfab_run["points"], spans), "plain_moved": moved_spans(plain["points"], spans),
            # the plain run has no attach: its reads are the steps'
            "diverged": diverged([p for p in nfab_run["points"] if not p[0].endswith("attach")], plain["points"]),
            "labels": [p[0] for p in nfab_run["points"]], "mix": nfab_run["mix"], "cost": nfab_run["cost"]}


@pytest.mark.world_size(2)
def test_the_lightning_strategy_leaves_the_global_random_streams_alone(tmp_path: Path):
    pytest.importorskip("lightning")
    res = run_ranks(_lightning, 2, str(tmp_path), timeout_s=300)
    for r in res:
        labels = r["labels"]
        assert labels[:2] == ["before_attach", "after_attach"], labels  # nfab attached, read around it
        assert labels[2:] == ["batch_start", "before_backward", "after_backward", "batch_end"] * STEPS, labels
        assert r["moved"] == [], r["moved"]  # nothing moved around attach nor anywhere inside a step
        assert r["plain_moved"] == [], r["plain_moved"]  # (the plain run: Lightning draws nothing there either)
        assert r["diverged"] == [], r["diverged"]  # every step's reads match the run without nfab exactly
        assert len(r["mix"]) == STEPS and all(set(m) != {"fp32"} for m in r["mix"]), r["mix"]  # the rounding ran
        assert r["cost"] == "measured"


# ---- Transformers -----------------------------------------------------------------------


class _Regressor(torch.nn.Module):
    """No dropout; returns the loss as the Trainer wants it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.Tanh(),
                                       torch.nn.Linear(64, 4))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}


class _Pairs(torch.utils.data.Dataset):
    def __init__(self, n: int = 128) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 32, generator=g)
        self.y = self.x[:, :4] * 2 + 0.1 * torch.randn(n, 4, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


def _transformers_run(rank: int, out: str, with_nfab: bool) -> dict:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from nfab.integrations import transformers as nfab_transformers

    points: list[tuple[str, tuple[Any, ...]]] = []

    class Before(TrainerCallback):
        """Added before nfab's callback: its hooks run just before nfab's."""

        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            points.append(("before_attach", streams()))

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            points.append(("step_begin", streams()))

    class After(TrainerCallback):
        """Added after nfab's callback: its hooks run just after nfab's."""

        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            points.append(("after_attach", streams()))

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            points.append(("step_end", streams()))

    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=4, max_steps=STEPS, learning_rate=1e-3, logging_steps=1,
        report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )
    torch.manual_seed(0)
    trainer = Trainer(model=_Regressor(), args=args, train_dataset=_Pairs())
    trainer.add_callback(Before())
    handle = nfab_transformers.attach(trainer, route="q8") if with_nfab else None
    trainer.add_callback(After())
    seed_everything(rank)
    trainer.train()
    res: dict[str, Any] = {"points": points}
    if handle is not None:
        rt = handle.runtime
        cost = rt.controller.cost_model
        res.update(mix=[s.route_mix for s in rt.history], cost=cost.source if cost else None)
    return res


def _transformers(rank: int, world_size: int, root: str) -> dict:
    import os

    os.environ["HF_HUB_OFFLINE"] = "1"
    plain = _transformers_run(rank, str(Path(root) / "plain"), with_nfab=False)
    nfab_run = _transformers_run(rank, str(Path(root) / "nfab"), with_nfab=True)
    spans = [("before_attach", "after_attach"), ("step_begin", "step_end")]
    return {"moved": moved_spans(nfab_run["points"], spans), "plain_moved": moved_spans(plain["points"], spans),
            "diverged": diverged(nfab_run["points"], plain["points"]),
            "labels": [p[0] for p in nfab_run["points"]], "mix": nfab_run["mix"], "cost": nfab_run["cost"]}


@pytest.mark.world_size(2)
def test_the_transformers_adapter_leaves_the_global_random_streams_alone(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    res = run_ranks(_transformers, 2, str(tmp_path), timeout_s=300)
    for r in res:
        labels = r["labels"]
        assert labels == ["before_attach", "after_attach"] + ["step_begin", "step_end"] * STEPS, labels
        assert r["moved"] == [], r["moved"]  # nothing moved around nfab's attach nor inside any step
        assert r["plain_moved"] == [], r["plain_moved"]  # (the Trainer draws nothing there either)
        assert r["diverged"] == [], r["diverged"]  # and every read matches the run without nfab exactly
        assert len(r["mix"]) == STEPS and all(set(m) != {"fp32"} for m in r["mix"]), r["mix"]  # the rounding ran
        assert r["cost"] == "measured"
