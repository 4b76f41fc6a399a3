"""Builders the training loop composes: model/data pairing, optimizer, schedule, batches.

Pure or nearly pure functions, so the parent can validate with them before launching
(`check_pairing`) and the loop stays a short setup / loop / cleanup.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import default_collate

from nfab.data import SpecDataset, make_loader
from nfab.errors import ConfigError
from nfab.models import ModelSpec
from nfab.train.config import OptimConfig, ScheduleConfig

DEFAULT_LR = {"sgd": 0.05, "adamw": 3e-3}
DEFAULT_WEIGHT_DECAY = {"sgd": 5e-4, "adamw": 0.01}


def check_pairing(spec: ModelSpec, data: SpecDataset) -> None:
    """Refuse a model and data set that cannot train together (one line)."""
    d = data.spec
    if spec.task != d.task:
        raise ConfigError(f"model {spec.name} is a {spec.task} model but data set {d.name} is {d.task}")
    if spec.task == "classification":
        if spec.num_classes is not None and d.num_classes is not None and spec.num_classes != d.num_classes:
            raise ConfigError(f"model {spec.name} has {spec.num_classes} classes, data set {d.name} {d.num_classes}"
                              " (set model.num_classes)")
        if spec.in_channels is not None and d.input_shape[0] != spec.in_channels:
            raise ConfigError(f"model {spec.name} takes {spec.in_channels} input channels, data set {d.name} has "
                              f"{d.input_shape[0]} (set model.in_channels or data.channels)")
        if spec.image_size is not None and d.input_shape[-1] != spec.image_size:
            raise ConfigError(f"model {spec.name} takes {spec.image_size}px images, data set {d.name} has "
                              f"{d.input_shape[-1]}px (set model.image_size or data.image_size)")
    else:
        if d.vocab_size is not None and spec.vocab_size is not None and d.vocab_size > spec.vocab_size:
            raise ConfigError(f"data set {d.name} has vocab {d.vocab_size}, model {spec.name} only {spec.vocab_size}")
        if spec.block_size is not None and d.input_shape[0] > spec.block_size:
            raise ConfigError(f"data set {d.name} windows are {d.input_shape[0]} tokens, longer than model "
                              f"{spec.name}'s block_size {spec.block_size} (set data.block_size)")


def optimizer_family(spec: ModelSpec, cfg: OptimConfig) -> str:
    return spec.optimizer if cfg.name == "auto" else cfg.name


def build_optimizer(spec: ModelSpec, module: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """SGD momentum (CNN default) or AdamW without decay on 1-D tensors (Transformer default)."""
    family = optimizer_family(spec, cfg)
    lr = cfg.lr if cfg.lr is not None else DEFAULT_LR[family]
    wd = cfg.weight_decay if cfg.weight_decay is not None else DEFAULT_WEIGHT_DECAY[family]
    params = [p for p in module.parameters() if p.requires_grad]
    if family == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=wd)
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(cfg.betas))  # type: ignore[arg-type]


def lr_factor(step: int, total_steps: int, cfg: ScheduleConfig) -> float:
    """Multiplier of the peak lr at `step`: linear warm-up, then cosine to `min_lr_ratio` (or flat)."""
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else int(0.05 * total_steps)
    if step < warmup:
        return (step + 1) / warmup
    if cfg.name == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total_steps - warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def loss_fn(task: str, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (per token for LMs)."""
    if task == "lm":
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())
    return F.cross_entropy(logits, target)


class BatchStream:
    """This rank's training batches, epoch after epoch, with a resumable position.

    Uses `make_loader`'s seeded `DistributedSampler`; the position is (epoch, batch index),
    so a resumed run sees exactly the batches an uninterrupted one would.
    """

    def __init__(self, dataset: SpecDataset, *, batch_size: int, rank: int, world_size: int, seed: int) -> None:
        loader = make_loader(dataset, batch_size=batch_size, rank=rank, world_size=world_size, seed=seed)
        self.dataset, self.sampler, self.batch_size = dataset, loader.sampler, batch_size
        self.epoch, self.index = 0, 0
        self._order: list[int] | None = None

    def _batches_per_epoch(self) -> int:
        return len(self.sampler) // self.batch_size  # type: ignore[arg-type]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.index >= self._batches_per_epoch():
            self.epoch, self.index, self._order = self.epoch + 1, 0, None
        if self._order is None:
            self.sampler.set_epoch(self.epoch)  # type: ignore[attr-defined]
            self._order = list(self.sampler)
        lo = self.index * self.batch_size
        batch = [self.dataset[i] for i in self._order[lo:lo + self.batch_size]]
        self.index += 1
        return default_collate(batch)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.index, self._order = int(state["epoch"]), int(state["index"]), None


def fp32_wire_bytes(module: nn.Module, world_size: int) -> int:
    """Bytes one rank sends per step in a ring FP32 allreduce of all trainable gradients."""
    numel = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return int(round(2 * (world_size - 1) / world_size * 4 * numel))
