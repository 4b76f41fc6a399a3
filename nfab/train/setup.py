"""Builders the training loop composes: batches, loss, bytes (optimizer, schedule and pairing
come from `nfab.config`, shared with calibration), so the loop stays a short setup / loop / cleanup.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

from nfab.config.optim import build_optimizer, lr_factor
from nfab.config.pairing import check_pairing
from nfab.data import SpecDataset, make_loader
from nfab.loss import UserLoss, default_loss, takes_target

__all__ = ["BatchStream", "build_optimizer", "check_pairing", "loss_fn", "lr_factor", "plain_logits"]


def clip_and_step(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor], grad_clip: float | None,
                  scaler: torch.amp.GradScaler | None, skipped: bool = False) -> None:
    """The end of a recipe's step: the gradient clipped to `grad_clip` unscaled (the optimizer's, not the
    loss-scaled one), then the optimizer's step: through an enabled `scaler` (it skips a non-finite step
    itself and lowers its scale), else unless nfab reported the step `skipped` (its buckets non-finite)."""
    if grad_clip is not None:
        if scaler is not None:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    if scaler is not None and scaler.is_enabled():
        scaler.step(optimizer)
        scaler.update()
    elif not skipped:
        optimizer.step()


def loss_fn(task: str, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (per token for LMs)."""
    if task == "lm":
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())
    return F.cross_entropy(logits, target)


def plain_logits(step_loss: UserLoss, model: torch.nn.Module, batch: Any) -> bool:
    """Whether a batch is nfab's own kind, `(x, y)` whose `model(x)` gives logits for cross-entropy: the
    default loss, no target taken by `forward`. Evaluation then also counts accuracy for classifiers."""
    return step_loss.fn is default_loss and isinstance(batch, tuple | list) and len(batch) == 2 \
        and not takes_target(model)


class BatchStream:
    """This rank's training batches, epoch after epoch, with a resumable position.

    Uses `make_loader`'s seeded `DistributedSampler`; the position is (epoch, batch index),
    so a resumed run sees exactly the batches an uninterrupted one would.
    """

    def __init__(self, dataset: SpecDataset, *, batch_size: int, rank: int, world_size: int, seed: int,
                 collate: Callable[[list[Any]], Any] = default_collate) -> None:
        loader = make_loader(dataset, batch_size=batch_size, rank=rank, world_size=world_size, seed=seed)
        self.dataset, self.sampler, self.batch_size = dataset, loader.sampler, batch_size
        self.collate = collate
        self.epoch, self.index = 0, 0
        self._order: list[int] | None = None

    def _batches_per_epoch(self) -> int:
        return len(self.sampler) // self.batch_size  # type: ignore[arg-type]

    def next(self) -> Any:
        if self.index >= self._batches_per_epoch():
            self.epoch, self.index, self._order = self.epoch + 1, 0, None
        if self._order is None:
            self.sampler.set_epoch(self.epoch)  # type: ignore[attr-defined]
            self._order = list(self.sampler)
        lo = self.index * self.batch_size
        batch = [self.dataset[i] for i in self._order[lo:lo + self.batch_size]]
        self.index += 1
        return self.collate(batch)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.index, self._order = int(state["epoch"]), int(state["index"]), None

