"""digits and synthetic-images: fixed splits, shapes, seeding, learnability."""

from __future__ import annotations

import pytest
import torch

from nfab.data import build_dataset
from nfab.errors import ConfigError


def test_digits_split_is_fixed_and_complete() -> None:
    train = build_dataset("digits", split="train", seed=0)
    test = build_dataset("digits", split="test", seed=7)
    assert len(train) + len(test) == 1797 and len(test) == 359
    assert train.spec.num_classes == 10 and train.spec.input_shape == (1, 8, 8)
    assert torch.equal(build_dataset("digits", split="test", seed=0).images, test.images)
    assert abs(float(train.images.mean())) < 1e-4 and abs(float(train.images.std()) - 1) < 1e-3
    # No test image appears in train.
    flat_train = {tuple(x.flatten().tolist()) for x in train.images}
    overlap = sum(tuple(x.flatten().tolist()) in flat_train for x in test.images)
    assert overlap < 5  # a few digits are pixel-identical duplicates in the source data


def test_digits_resized_rgb() -> None:
    ds = build_dataset("digits", split="test", seed=0, image_size=32, channels=3)
    x, y = ds[0]
    assert x.shape == (3, 32, 32) and ds.spec.input_shape == (3, 32, 32)
    assert y.dtype == torch.int64 and 0 <= int(y) < 10
    assert torch.equal(x[0], x[2])


def test_digits_bad_channels() -> None:
    with pytest.raises(ConfigError, match="channels must be 1 or 3"):
        build_dataset("digits", split="train", seed=0, channels=2)


def test_synthetic_images_seeded_and_shaped() -> None:
    opts = {"image_size": 12, "channels": 1, "num_classes": 5, "num_samples": 40}
    a = build_dataset("synthetic-images", split="train", seed=3, **opts)
    b = build_dataset("synthetic-images", split="train", seed=3, **opts)
    c = build_dataset("synthetic-images", split="train", seed=4, **opts)
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.images, c.images)
    assert a[0][0].shape == (1, 12, 12) and len(a) == 40 and a.spec.num_classes == 5
    assert torch.bincount(a.labels).tolist() == [8] * 5  # balanced classes


def test_synthetic_images_are_learnable_across_splits() -> None:
    """Class means of train classify test well: same templates, different noise."""
    train = build_dataset("synthetic-images", split="train", seed=0, image_size=8, num_samples=500)
    test = build_dataset("synthetic-images", split="test", seed=0, image_size=8, num_samples=200)
    assert not torch.equal(train.images[:10], test.images[:10])
    means = torch.stack([train.images[train.labels == k].mean(0) for k in range(10)]).flatten(1)
    pred = torch.cdist(test.images.flatten(1), means).argmin(1)
    assert (pred == test.labels).float().mean() > 0.9
