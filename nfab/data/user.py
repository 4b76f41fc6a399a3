"""A user's own data: `module.path:factory`, called as `factory(split="train")` and `factory(split="val")`.

Each call returns a map-style Dataset (`__len__` and `__getitem__`) whose samples are whatever the user's
loss reads: `(x, y)` tuples, dicts, tensors. nfab deals them to ranks as `DistributedSampler` would and
collates them with `default_collate` (or the collate function given to `nfab.calibrate`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset, default_collate

from nfab.data.spec import DataSpec, SpecDataset, Split
from nfab.errors import ConfigError, UserCodeError

USER_SPLITS: dict[str, str] = {"train": "train", "test": "val"}
"""nfab's split name -> the one a user's factory is called with."""


class UserDataset(SpecDataset):
    """A user's map-style Dataset with a `DataSpec` of task `custom`: its samples are its loss's business."""

    def __init__(self, data: Dataset, spec: DataSpec) -> None:
        self.data, self.spec = data, spec

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.data[index]


def _input_shape(sample: Any) -> tuple[int, ...]:
    first = sample[0] if isinstance(sample, tuple | list) and sample else sample
    return tuple(first.shape) if isinstance(first, torch.Tensor) else ()


def user_dataset(target: str, *, split: Split, seed: int, **options: Any) -> SpecDataset:
    """Call the user's data factory for `split` and describe what it returned (one line on any failure)."""
    from nfab.models.registry import load_factory

    factory = load_factory(target, what="data")
    try:
        data = factory(split=USER_SPLITS[split], **options)
    except Exception as exc:  # user code: one line naming the factory and its exception
        text = str(exc).splitlines()[0] if str(exc) else ""
        raise UserCodeError(f"data {target} raised {type(exc).__name__} for split={USER_SPLITS[split]!r}: "
                            f"{text}") from exc
    if isinstance(data, SpecDataset):
        return data
    if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        raise ConfigError(f"data {target} returned {type(data).__name__} for split={USER_SPLITS[split]!r}, not a "
                          "map-style Dataset (__len__ and __getitem__)")
    n = len(data)
    if n == 0:
        raise ConfigError(f"data {target} returned an empty data set for split={USER_SPLITS[split]!r}")
    try:
        shape = _input_shape(data[0])
    except Exception as exc:
        raise UserCodeError(f"data {target}[0] raised {type(exc).__name__}: {exc}") from exc
    spec = DataSpec(name=target, split=split, task="custom", input_shape=shape, num_samples=n,
                    options={"seed": seed, **options})
    return UserDataset(data, spec)


Collate = Callable[[list[Any]], Any]


def resolve_collate(name: str | None) -> Collate:
    """`data.collate` as a function: the user's `module.path:fn`, else torch's `default_collate`."""
    if name is None:
        return default_collate
    from nfab.models.registry import load_factory

    return load_factory(name, what="collate")
