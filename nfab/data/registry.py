"""The data set registry and `build_dataset`.

Plain names (`digits`) map to builders in `DATASETS`; names with a path
(`cifar10:/data/cifar`, `tokens:data/shakespeare`, `npz:images.npz`) map to builders in
`PATH_DATASETS`, which take the path as their `path` option; any other `module.path:factory`
is the user's own data (`nfab.data.user`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nfab.data.cifar import cifar10
from nfab.data.files import npy, npz, parquet, tokens
from nfab.data.images import digits, synthetic_images
from nfab.data.spec import SPLITS, SpecDataset, Split
from nfab.data.text import stdlib_text, text_file
from nfab.data.user import user_dataset
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
    "npy": npy,
    "npz": npz,
    "parquet": parquet,
    "text": text_file,
    "tokens": tokens,
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
            if is_factory_name(name):
                return user_dataset(name, split=split, seed=seed, **options)
            raise ConfigError(f"unknown data set kind {kind!r} in {name!r}; file kinds: {sorted(PATH_DATASETS)}, "
                              "or a module.path:factory of your own")
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


def is_factory_name(name: str) -> bool:
    """`module.path:factory` (dotted identifiers on both sides), not a file kind's `KIND:PATH`."""
    from nfab.models.registry import LIVE

    module, _, attr = name.partition(":")
    return name in LIVE or (all(p.isidentifier() for p in module.split("."))
                            and all(p.isidentifier() for p in attr.split(".")))
