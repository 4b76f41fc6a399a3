"""Data files in the formats real projects keep, written from data that ships with packages."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits


def digits_npz(path: Path) -> Path:
    """Keras' layout: x_train (N, 1, 8, 8) uint8, y_train (N,) int64, x_test, y_test."""
    d = load_digits()
    x = (d.images * (255 / 16)).round().astype(np.uint8)[:, None]
    y = d.target.astype(np.int64)
    cut = 1500
    np.savez(path, x_train=x[:cut], y_train=y[:cut], x_test=x[cut:], y_test=y[cut:])
    return path


def digits_rows_npy(path: Path) -> Path:
    """Digits as (N, 64) float32 rows in [0, 1], inputs alone (an autoencoder's data)."""
    np.save(path, (load_digits().data / 16).astype(np.float32))
    return path


def nanogpt_dir(folder: Path, chars: int = 60_000) -> Path:
    """nanoGPT's shakespeare_char layout: train.bin / val.bin (uint16 ids) and meta.pkl (vocab_size, stoi)."""
    import inspect
    import json

    text = (inspect.getsource(json) * 20)[:chars]
    vocab = sorted(set(text))
    stoi = {c: i for i, c in enumerate(vocab)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    cut = int(0.9 * len(ids))
    folder.mkdir(parents=True, exist_ok=True)
    ids[:cut].tofile(folder / "train.bin")
    ids[cut:].tofile(folder / "val.bin")
    with (folder / "meta.pkl").open("wb") as f:
        pickle.dump({"vocab_size": len(vocab), "stoi": stoi, "itos": dict(enumerate(vocab))}, f)
    return folder
