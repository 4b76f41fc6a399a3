"""The CIFAR-10 reader on small batch files written in exactly the CIFAR-10 format."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from nfab.data import build_dataset
from nfab.data.cifar import MEAN, STD
from nfab.errors import ConfigError

PER_BATCH = 20


def write_batch(path: Path, seed: int, n: int = PER_BATCH) -> dict:
    rng = np.random.default_rng(seed)
    batch = {
        b"batch_label": f"batch {seed}".encode(),
        b"labels": [int(v) for v in rng.integers(0, 10, n)],
        b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        b"filenames": [f"img_{seed}_{i}.png".encode() for i in range(n)],
    }
    with path.open("wb") as f:
        pickle.dump(batch, f)
    return batch


@pytest.fixture
def cifar_dir(tmp_path: Path) -> Path:
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    for i in range(1, 6):
        write_batch(root / f"data_batch_{i}", seed=i)
    write_batch(root / "test_batch", seed=0)
    return root


def test_cifar10_reads_train_and_test(cifar_dir: Path) -> None:
    train = build_dataset(f"cifar10:{cifar_dir}", split="train", seed=0)
    test = build_dataset(f"cifar10:{cifar_dir}", split="test", seed=0)
    assert len(train) == 5 * PER_BATCH and len(test) == PER_BATCH
    assert train.spec.num_classes == 10 and train.spec.input_shape == (3, 32, 32)
    raw = write_batch(cifar_dir.parent / "again", seed=1)  # same content as data_batch_1
    x, y = train[3]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32
    assert int(y) == raw[b"labels"][3]
    # Channel-major layout: the first 1024 values are the red plane.
    red = raw[b"data"][3, :1024].reshape(32, 32) / 255.0
    torch.testing.assert_close(x[0], torch.from_numpy((red - MEAN[0]) / STD[0]).float())


def test_cifar10_accepts_parent_dir_and_resizes(cifar_dir: Path) -> None:
    ds = build_dataset(f"cifar10:{cifar_dir.parent}", split="test", seed=0, image_size=16, num_samples=7)
    assert len(ds) == 7 and ds[0][0].shape == (3, 16, 16)


def test_cifar10_missing_dir_and_file(cifar_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="directory not found"):
        build_dataset(f"cifar10:{tmp_path / 'nope'}", split="train", seed=0)
    (cifar_dir / "data_batch_4").unlink()
    with pytest.raises(ConfigError, match="data_batch_4"):
        build_dataset(f"cifar10:{cifar_dir}", split="train", seed=0)


def _dump(path: Path, obj: object) -> None:
    path.write_bytes(pickle.dumps(obj))


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"not a pickle at all", "not a CIFAR-10 python batch"),
        ([1, 2, 3], "expected a dict"),
        ({b"data": np.zeros((2, 3072), np.float32), b"labels": [0, 1]}, "uint8"),
        ({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, "100 columns"),
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}, "must be 2 ints"),
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, "outside 0..9"),
        (os.getcwd, "refusing to load"),
    ],
)
def test_cifar10_malformed_batches(cifar_dir: Path, payload: object, message: str) -> None:
    target = cifar_dir / "test_batch"
    if isinstance(payload, bytes):
        target.write_bytes(payload)
    else:
        _dump(target, payload)
    with pytest.raises(ConfigError, match=message) as info:
        build_dataset(f"cifar10:{cifar_dir}", split="test", seed=0)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_cifar10_reads_batches_python_3_writes_at_any_protocol(cifar_dir: Path, protocol: int) -> None:
    """Protocol 5 stores an array as numpy's `_frombuffer`, protocol 2 from Python 3 stores bytes via
    `_codecs.encode`: both were refused as foreign globals, so a user's own batches did not load."""
    raw = write_batch(cifar_dir.parent / "scratch", seed=9)
    (cifar_dir / "test_batch").write_bytes(pickle.dumps(raw, protocol=protocol))
    test = build_dataset(f"cifar10:{cifar_dir}", split="test", seed=0)
    assert len(test) == PER_BATCH and int(test[5][1]) == raw[b"labels"][5]


def test_a_broken_test_batch_is_refused_before_the_ranks_start(cifar_dir: Path, tmp_path: Path) -> None:
    """Only the train split was read before launch: a broken test_batch failed inside rank 0, after
    the run dir was made (and an empty one said "b'labels' must be 0 ints")."""
    from nfab.train.launch import resolve_config, validate

    _dump(cifar_dir / "test_batch", {b"data": np.zeros((0, 3072), np.uint8), b"labels": []})
    run_dir = tmp_path / "run"
    cfg = resolve_config(None, [], ["comm.route=sign", f"run_dir={run_dir}"],
                         names={"model": "resnet18", "data": f"cifar10:{cifar_dir}"})
    with pytest.raises(ConfigError, match="test_batch: holds no images"):
        validate(cfg)
    assert not run_dir.exists()
