"""Data in the files real projects keep (tokens:, npz:, npy:, parquet:) and a user's data factory,
each read from a small file in its real format that the test writes."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from bench.projects import files
from nfab.data import build_dataset
from nfab.errors import ConfigError, UserCodeError


def test_nanogpts_token_folder_reads_train_val_and_meta(tmp_path: Path) -> None:
    folder = files.nanogpt_dir(tmp_path / "shakespeare_char", chars=3000)
    ids = np.fromfile(folder / "train.bin", dtype=np.uint16)
    val = np.fromfile(folder / "val.bin", dtype=np.uint16)
    vocab = pickle.loads((folder / "meta.pkl").read_bytes())["vocab_size"]
    train = build_dataset(f"tokens:{folder}", split="train", seed=0, block_size=16)
    test = build_dataset(f"tokens:{folder}", split="test", seed=0, block_size=16)
    assert train.spec.task == "lm" and train.spec.vocab_size == vocab
    x, y = train[2]
    assert x.dtype == torch.int64 and torch.equal(x, torch.from_numpy(ids[32:48].astype(np.int64)))
    assert torch.equal(y, torch.from_numpy(ids[33:49].astype(np.int64)))
    assert len(test) == (len(val) - 17) // 16 + 1
    assert torch.equal(test[0][0], torch.from_numpy(val[:16].astype(np.int64)))


def test_a_uint32_token_file_without_meta_takes_its_largest_id(tmp_path: Path) -> None:
    ids = np.arange(1000, dtype=np.uint32) * 70  # ids beyond uint16
    ids.tofile(tmp_path / "corpus.bin")
    data = build_dataset(f"tokens:{tmp_path / 'corpus.bin'}", split="train", seed=0, block_size=8, dtype="uint32")
    assert data.spec.vocab_size == 999 * 70 + 1 and int(data[0][0][1]) == 70
    held = build_dataset(f"tokens:{tmp_path / 'corpus.bin'}", split="test", seed=0, block_size=8, dtype="uint32")
    assert int(held[0][0][0]) == 900 * 70  # the last 10% held out
    with pytest.raises(ConfigError, match="not a whole number of uint32 ids"):
        (tmp_path / "odd.bin").write_bytes(b"\0" * 6)
        build_dataset(f"tokens:{tmp_path / 'odd.bin'}", split="train", seed=0, dtype="uint32")


def test_a_binary_file_given_as_text_is_refused_in_one_line(tmp_path: Path) -> None:
    folder = files.nanogpt_dir(tmp_path / "d", chars=2000)
    with pytest.raises(ConfigError, match=r"a binary file, not text .* token ids are tokens:PATH") as info:
        build_dataset(f"text:{folder / 'train.bin'}", split="train", seed=0)
    assert "\n" not in str(info.value)


def test_an_npz_in_keras_layout_is_a_classifiers_data(tmp_path: Path) -> None:
    path = files.digits_npz(tmp_path / "digits.npz")
    arrays = np.load(path)
    train = build_dataset(f"npz:{path}", split="train", seed=0)
    test = build_dataset(f"npz:{path}", split="test", seed=0)
    assert train.spec.task == "classification" and train.spec.num_classes == 10
    assert train.spec.input_shape == (1, 8, 8) and len(train) == 1500 and len(test) == len(arrays["x_test"])
    x, y = train[3]
    assert x.dtype == torch.float32 and float(x.max()) <= 1.0 and int(y) == int(arrays["y_train"][3])


def test_npz_keys_npy_rows_and_regression_targets(tmp_path: Path) -> None:
    np.savez(tmp_path / "r.npz", features=np.ones((20, 3), np.float64), value=np.arange(20, dtype=np.float32))
    data = build_dataset(f"npz:{tmp_path / 'r.npz'}", split="train", seed=0, x="features", y="value")
    assert data.spec.task == "custom" and len(data) == 18 and data[1][1].dtype == torch.float32
    with pytest.raises(ConfigError, match=r"no input array 'x'; arrays are \['features', 'value'\]"):
        build_dataset(f"npz:{tmp_path / 'r.npz'}", split="train", seed=0)
    rows = files.digits_rows_npy(tmp_path / "rows.npy")
    alone = build_dataset(f"npy:{rows}", split="test", seed=0)
    assert alone.spec.task == "custom" and isinstance(alone[0], torch.Tensor) and alone[0].shape == (64,)


def test_parquet_columns_with_a_split_column(tmp_path: Path) -> None:
    frame = pd.DataFrame({"a": np.arange(10.0), "b": np.arange(10.0) * 2, "label": np.arange(10) % 3,
                          "kind": pd.Categorical(list("xy") * 5), "split": ["train"] * 7 + ["val"] * 3})
    frame.to_parquet(tmp_path / "t.parquet")
    train = build_dataset(f"parquet:{tmp_path / 't.parquet'}", split="train", seed=0)
    test = build_dataset(f"parquet:{tmp_path / 't.parquet'}", split="test", seed=0)
    assert len(train) == 7 and len(test) == 3 and train.spec.num_classes == 3
    x, y = test[0]
    assert torch.equal(x, torch.tensor([7.0, 14.0])) and int(y) == 1
    with pytest.raises(ConfigError, match="no column 'price'"):
        build_dataset(f"parquet:{tmp_path / 't.parquet'}", split="train", seed=0, y="price")


def test_a_user_data_factory_is_called_with_train_and_val() -> None:
    train = build_dataset("bench.projects.contrastive:data", split="train", seed=0)
    test = build_dataset("bench.projects.contrastive:data", split="test", seed=0)
    assert train.spec.task == "custom" and len(train) == 1500 and len(test) == 297
    assert set(train[0]) == {"a", "b"}


def broken_data(split: str) -> object:
    if split == "val":
        raise FileNotFoundError("val.jsonl")
    return [1, 2, 3]


def not_a_dataset(split: str) -> object:
    return iter([1, 2])


def test_a_user_data_factory_that_raises_or_returns_no_dataset_is_one_line() -> None:
    with pytest.raises(UserCodeError, match=r"data .*:broken_data raised FileNotFoundError for split='val': "
                                            r"val.jsonl") as info:
        build_dataset(f"{__name__}:broken_data", split="test", seed=0)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="not a map-style Dataset"):
        build_dataset(f"{__name__}:not_a_dataset", split="train", seed=0)
