"""build_dataset: registry names, options and one-line errors."""

from __future__ import annotations

import pytest

from nfab.data import DATASETS, PATH_DATASETS, build_dataset
from nfab.errors import ConfigError


def test_registries_are_explicit() -> None:
    assert set(DATASETS) == {"digits", "stdlib-text", "synthetic-images"}
    assert set(PATH_DATASETS) == {"cifar10", "npy", "npz", "parquet", "text", "tokens"}


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("imagenet", {}, "unknown data set 'imagenet'"),
        ("mnist:/tmp/x", {}, "unknown data set kind 'mnist'"),
        ("text:", {}, "needs a path"),
        ("digits", {"image_szie": 32}, "unknown option 'image_szie'"),
        ("synthetic-images", {"num_samples": "9"}, 'option num_samples must be an integer, got "9"'),
        ("synthetic-images", {"num_classes": 0}, "num_classes must be >= 1"),
    ],
)
def test_build_dataset_errors(name: str, options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        build_dataset(name, split="train", seed=0, **options)
    assert "\n" not in str(info.value)


def test_bad_split() -> None:
    with pytest.raises(ConfigError, match="split must be one of"):
        build_dataset("digits", split="val", seed=0)  # type: ignore[arg-type]
