"""In-memory image classification data: scikit-learn digits and generated images.

Both are small enough to hold as one float tensor, are built in milliseconds and need
no download: digits ships inside scikit-learn, synthetic images are generated from the
seed. Digits is easy (plumbing, speed); synthetic images scale to any size and class
count, so a model's input shape can be matched without real data.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from nfab.data.spec import DataSpec, SpecDataset, Split
from nfab.errors import ConfigError

DIGITS_SPLIT_SEED = 0  # the test split is fixed: it must not move with the run's seed
DIGITS_TEST_FRACTION = 0.2


class ImageDataset(SpecDataset):
    """(image, label) pairs from tensors; `transform` runs per sample (e.g. uint8 -> float)."""

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        spec: DataSpec,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if images.shape[0] != labels.shape[0]:
            raise ValueError(f"{images.shape[0]} images but {labels.shape[0]} labels")
        self.images = images
        self.labels = labels.long()
        self.spec = spec
        self.transform = transform

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.images[index]
        if self.transform is not None:
            x = self.transform(x)
        return x, self.labels[index]


def resize(images: torch.Tensor, image_size: int) -> torch.Tensor:
    """Bilinear resize of an (N, C, H, W) float batch to square `image_size`, if needed."""
    if images.shape[-1] == image_size and images.shape[-2] == image_size:
        return images
    return F.interpolate(images, size=(image_size, image_size), mode="bilinear", align_corners=False)


def _check_positive(where: str, **values: int) -> None:
    for key, value in values.items():
        if value < 1:
            raise ConfigError(f"{where}: {key} must be >= 1, got {value}")


def _check_channels(where: str, channels: int) -> None:
    if channels not in (1, 3):
        raise ConfigError(f"{where}: channels must be 1 or 3, got {channels}")


def digits(*, split: Split, seed: int, image_size: int = 8, channels: int = 1) -> ImageDataset:
    """scikit-learn's 1,797 8x8 handwritten digits, 10 classes, standardised.

    The test split is the last 20% of a permutation with a fixed seed (not `seed`), so
    every run evaluates on the same images; mean and std come from the train split only.
    """
    from sklearn.datasets import load_digits  # local: sklearn import costs ~0.5 s

    _check_positive("digits", image_size=image_size)
    _check_channels("digits", channels)
    bunch = load_digits()
    images = torch.from_numpy(bunch.images.astype(np.float32) / 16.0).unsqueeze(1)  # (N,1,8,8)
    labels = torch.from_numpy(bunch.target.astype(np.int64))
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(DIGITS_SPLIT_SEED), device="cpu")
    n_test = round(DIGITS_TEST_FRACTION * len(labels))
    train_idx, test_idx = order[:-n_test], order[-n_test:]
    mean, std = images[train_idx].mean(), images[train_idx].std()
    idx = train_idx if split == "train" else test_idx
    x = resize((images[idx] - mean) / std, image_size).expand(-1, channels, -1, -1).contiguous()
    spec = DataSpec(
        name="digits",
        split=split,
        task="classification",
        input_shape=tuple(x.shape[1:]),
        num_samples=len(idx),
        num_classes=10,
        options={"seed": seed, "image_size": image_size, "channels": channels},
    )
    return ImageDataset(x, labels[idx], spec)


def _split_stream(seed: int, split: Split) -> int:
    """A well-mixed 63-bit seed per (seed, split): train and test noise never coincide."""
    state = np.random.SeedSequence([seed, 0 if split == "train" else 1]).generate_state(2)
    return int((int(state[0]) << 31) ^ int(state[1])) & ((1 << 63) - 1)


def synthetic_images(
    *,
    split: Split,
    seed: int,
    image_size: int = 32,
    channels: int = 3,
    num_classes: int = 10,
    num_samples: int | None = None,
    noise: float = 1.0,
) -> ImageDataset:
    """Class-conditional images: a smooth per-class template plus Gaussian noise.

    Templates are drawn from `seed` alone (4x4 noise upsampled, so they look like
    blobs a CNN can learn), hence train and test with the same seed share them; the
    noise stream differs per split. Default size: 2,048 train / 512 test samples.
    """
    if num_samples is None:
        num_samples = 2048 if split == "train" else 512
    _check_positive("synthetic-images", image_size=image_size, num_classes=num_classes, num_samples=num_samples)
    _check_channels("synthetic-images", channels)
    if noise < 0:
        raise ConfigError(f"synthetic-images: noise must be >= 0, got {noise}")
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(num_classes, channels, 4, 4, generator=g, device="cpu")
    templates = resize(coarse, image_size)
    templates = templates / templates.flatten(1).std(dim=1).clamp_min(1e-6)[:, None, None, None]
    g = torch.Generator().manual_seed(_split_stream(seed, split))
    cpu = torch.device("cpu")  # generated on the host, whatever the default device
    labels = (torch.arange(num_samples, device=cpu) % num_classes)[torch.randperm(num_samples, generator=g, device=cpu)]
    images = templates[labels] + noise * torch.randn(num_samples, channels, image_size, image_size, generator=g,
                                                     device=cpu)
    spec = DataSpec(
        name="synthetic-images",
        split=split,
        task="classification",
        input_shape=(channels, image_size, image_size),
        num_samples=num_samples,
        num_classes=num_classes,
        options={
            "seed": seed,
            "image_size": image_size,
            "channels": channels,
            "num_classes": num_classes,
            "num_samples": num_samples,
            "noise": noise,
        },
    )
    return ImageDataset(images, labels, spec)
