"""`DataSpec` and the dataset base class every nfab data set derives from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from torch.utils.data import Dataset

from nfab.models.spec import TASKS

DataTask = Literal["classification", "lm", "custom"]
DATA_TASKS: tuple[str, ...] = (*TASKS, "custom")

Split = Literal["train", "test"]
SPLITS: tuple[str, ...] = ("train", "test")
"""nfab's split names; a user's data factory is called with `split="train"` and `split="val"`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DataSpec:
    """What a training loop needs to know to pair a data set with a model."""

    name: str
    """Registry name, or `cifar10:PATH` / `text:PATH` as given."""
    split: Split
    """`"train"` or `"test"` (the held-out part, fixed independently of the seed)."""
    task: DataTask
    """`"classification"`: (input, integer label) pairs; `"lm"`: (tokens, next tokens) windows; `"custom"`:
    samples only the user's loss reads (a user's Dataset, regression targets, inputs alone)."""
    input_shape: tuple[int, ...]
    """One sample's input shape: (C, H, W) for images, (block_size,) for text; () where unknown."""
    num_samples: int
    """Samples in this split (the length of the data set)."""
    num_classes: int | None = None
    """Classification: number of classes."""
    vocab_size: int | None = None
    """LM: vocabulary size (256: bytes)."""
    options: dict[str, object] = field(default_factory=dict)
    """Resolved builder options (including seed), recorded for provenance."""

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {self.split!r}")
        if self.task not in DATA_TASKS:
            raise ValueError(f"task must be one of {DATA_TASKS}, got {self.task!r}")
        if self.task == "classification" and self.num_classes is None:
            raise ValueError("a classification DataSpec needs num_classes")
        if self.task == "lm" and self.vocab_size is None:
            raise ValueError("an lm DataSpec needs vocab_size")


class SpecDataset(Dataset):
    """A map-style data set that carries its `DataSpec`: (input, target) pairs for nfab's own kinds, any
    sample the user's loss reads for a user's."""

    spec: DataSpec

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, index: int) -> Any:
        raise NotImplementedError
