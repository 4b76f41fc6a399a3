"""stdlib-text and text:PATH: windows, fixed held-out split, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nfab.data import build_dataset
from nfab.data.text import stdlib_sources
from nfab.errors import ConfigError


def test_stdlib_text_windows_and_split() -> None:
    train = build_dataset("stdlib-text", split="train", seed=0, block_size=32, max_bytes=200_000)
    test = build_dataset("stdlib-text", split="test", seed=0, block_size=32, max_bytes=200_000)
    assert train.spec.vocab_size == 256 and train.spec.input_shape == (32,)
    corpus = stdlib_sources(200_000)
    assert len(corpus) == 200_000
    assert bytes(train.data.tolist()) + bytes(test.data.tolist()) == corpus
    assert len(test.data) == 20_000
    assert len(train) == (180_000 - 33) // 32 + 1
    x, y = train[5]
    assert x.dtype == torch.int64 and x.shape == (32,) and torch.equal(x[1:], y[:-1])
    assert bytes(x.tolist()) == corpus[160:192]


def test_stdlib_text_default_is_deterministic() -> None:
    a = build_dataset("stdlib-text", split="test", seed=0)
    b = build_dataset("stdlib-text", split="test", seed=1)
    assert len(a.data) == 200_000 and torch.equal(a.data, b.data)


def test_text_file(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("héllo wörld, " * 200, encoding="utf-8")
    ds = build_dataset(f"text:{path}", split="train", seed=0, block_size=16, stride=8)
    x, y = ds[1]
    assert torch.equal(x[1:], y[:-1]) and ds.spec.options["stride"] == 8
    # A cap that cuts "é" (2 bytes) in half is fine.
    build_dataset(f"text:{path}", split="train", seed=0, block_size=8, max_bytes=1001)


def test_text_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="text file not found"):
        build_dataset(f"text:{tmp_path / 'missing.txt'}", split="train", seed=0)
    with pytest.raises(ConfigError, match="is a folder, not a text file"):
        build_dataset(f"text:{tmp_path}", split="train", seed=0)
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"abc\xff\xfe" * 100)
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        build_dataset(f"text:{binary}", split="train", seed=0)
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    with pytest.raises(ConfigError, match="too few for one window"):
        build_dataset(f"text:{short}", split="test", seed=0)
