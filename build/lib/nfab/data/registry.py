"""The data set registry and `build_dataset`.

Plain names (`digits`) map to builders in `DATASETS`; names with a path
(`cifar10:/data/cifar`, `text:notes.txt`) map to builders in `PATH_DATASETS`, which
take the path as their `path` option.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nfab.data.cifar import cifar10
from nfab.data.images import digits, synthetic_images
from nfab.data.spec import SPLITS, SpecDataset, Split
from nfab.data.text import stdlib_text, text_file
from nfab.errors import ConfigError
from nfab.models.options import check_options

DATASETS: dict[str, Callable[..., SpecDataset]] = {
    "digits": digits,
    "stdlib-text": stdlib_text,
    "synthetic-images": synthetic_images,
}
"""Data sets that need nothing from disk beyond installed packages."""

PATH_DATASETS: dict[str, Callable[..., SpecDataset]] = {
    "cifar10": cifar10,
    "text": text_file,
}
"""Data sets read from a local path, named `KIND:PATH`."""


def build_dataset(name: str, *, split: Split, seed: int, **options: Any) -> SpecDataset:
    """Build `split` of data set `name`; its `DataSpec` is `dataset.spec`.

    The held-out split never depends on `seed`; `seed` drives generated data
    (synthetic-images) and is recorded in the spec. Unknown names, options, missing
    paths and malformed files are `ConfigError`s with one line.
    """
    if split not in SPLITS:
        raise ConfigError(f"split must be one of {SPLITS}, got {split!r}")
    kind, sep, path = name.partition(":")
    if sep:
        builder = PATH_DATASETS.get(kind)
        if builder is None:
            raise ConfigError(f"unknown data set kind {kind!r} in {name!r}; path kinds: {sorted(PATH_DATASETS)}")
        if not path:
            raise ConfigError(f"data set {name!r} needs a path: {kind}:PATH")
        check_options(f"data set {kind}", builder, {"path": path, **options})
        return builder(path=path, split=split, seed=seed, **options)
    builder = DATASETS.get(name)
    if builder is None:
        known = sorted(DATASETS) + [f"{k}:PATH" for k in sorted(PATH_DATASETS)]
        raise ConfigError(f"unknown data set {name!r}; choose one of {known}")
    check_options(f"data set {name}", builder, options)
    return builder(split=split, seed=seed, **options)
