"""CIFAR-10 from the standard python-pickle batches in a local directory (no download).

CIFAR-10 ships as pickles (`data_batch_1..5`, `test_batch`: a dict with `b"data"`, a
uint8 (N, 3072) array in channel-major RGB order, and `b"labels"`, N ints in 0..9).
Pickles can run code on load, so the reader uses an unpickler that only admits the
numpy classes an array needs; anything else, and any wrong type or shape, is a
`ConfigError` naming the file.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nfab.data.images import ImageDataset, resize
from nfab.data.spec import DataSpec, Split
from nfab.errors import ConfigError

TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILES = ("test_batch",)
NUM_CLASSES = 10
PIXELS = 3 * 32 * 32
# Per-channel statistics of the CIFAR-10 train set (the usual normalisation constants).
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)

_NUMPY_GLOBALS = {
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"),
    # what Python 3 writes: numpy >= 2 stores an array under protocol 5 as `_frombuffer`, and a
    # protocol <= 2 pickle from Python 3 stores bytes through `_codecs.encode` (no code runs in either)
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
    ("_codecs", "encode"),
}


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles plain containers and numpy arrays, and refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _NUMPY_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 batch file -> (uint8 (N, 3, 32, 32) images, int64 (N,) labels)."""
    if not path.is_file():
        raise ConfigError(f"CIFAR-10 batch file not found: {path}")
    try:
        with path.open("rb") as f:
            batch = _ArrayUnpickler(f, encoding="bytes").load()
    except Exception as exc:  # truncated, not a pickle, or a forbidden global
        raise ConfigError(f"{path}: not a CIFAR-10 python batch ({exc})") from exc
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise ConfigError(f"{path}: expected a dict with b'data' and b'labels'")
    data, labels = batch[b"data"], batch[b"labels"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2:
        raise ConfigError(f"{path}: b'data' must be a uint8 (N, {PIXELS}) array")
    if data.shape[0] == 0:
        raise ConfigError(f"{path}: holds no images")
    if data.shape[1] != PIXELS:
        raise ConfigError(f"{path}: b'data' has {data.shape[1]} columns, expected {PIXELS}")
    try:
        labels_arr = np.asarray(labels)
    except Exception as exc:
        raise ConfigError(f"{path}: b'labels' is not a list of ints") from exc
    if labels_arr.shape != (data.shape[0],) or not np.issubdtype(labels_arr.dtype, np.integer):
        raise ConfigError(f"{path}: b'labels' must be {data.shape[0]} ints")
    if labels_arr.size and (labels_arr.min() < 0 or labels_arr.max() >= NUM_CLASSES):
        raise ConfigError(f"{path}: labels outside 0..{NUM_CLASSES - 1}")
    return data.reshape(-1, 3, 32, 32), labels_arr.astype(np.int64)


def _batch_dir(path: Path) -> Path:
    """Accept the batch directory itself or the folder the CIFAR tarball unpacks into."""
    if not path.exists():
        raise ConfigError(f"CIFAR-10 directory not found: {path}")
    if not path.is_dir():
        raise ConfigError(f"CIFAR-10 path is not a directory: {path}")
    nested = path / "cifar-10-batches-py"
    return nested if nested.is_dir() else path


class _Normalise:
    """uint8 (3, 32, 32) -> standardised float, resized to `image_size` (per sample, lazily).

    Kept lazy so the 50,000 train images stay 150 MB of uint8 instead of 600 MB of float.
    """

    def __init__(self, image_size: int) -> None:
        self.image_size = image_size
        self.mean = torch.tensor(MEAN, device="cpu").view(3, 1, 1)
        self.std = torch.tensor(STD, device="cpu").view(3, 1, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = (x.float() / 255.0 - self.mean) / self.std
        return resize(x.unsqueeze(0), self.image_size).squeeze(0)


def cifar10(
    *,
    path: str,
    split: Split,
    seed: int,
    image_size: int = 32,
    num_samples: int | None = None,
) -> ImageDataset:
    """CIFAR-10 `split` from `path`; `num_samples` keeps the first N (for quick runs)."""
    if image_size < 1:
        raise ConfigError(f"cifar10: image_size must be >= 1, got {image_size}")
    if num_samples is not None and num_samples < 1:
        raise ConfigError(f"cifar10: num_samples must be >= 1, got {num_samples}")
    root = _batch_dir(Path(path).expanduser())
    names = TRAIN_FILES if split == "train" else TEST_FILES
    batches = [read_batch(root / name) for name in names]
    images = torch.from_numpy(np.concatenate([b[0] for b in batches]))
    labels = torch.from_numpy(np.concatenate([b[1] for b in batches]))
    if num_samples is not None:
        images, labels = images[:num_samples], labels[:num_samples]
    spec = DataSpec(
        name=f"cifar10:{path}",
        split=split,
        task="classification",
        input_shape=(3, image_size, image_size),
        num_samples=len(labels),
        num_classes=NUM_CLASSES,
        options={"seed": seed, "image_size": image_size, "num_samples": num_samples},
    )
    return ImageDataset(images, labels, spec, transform=_Normalise(image_size))
