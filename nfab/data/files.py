"""Data in the files real projects keep: token ids (`tokens:`), arrays (`npz:` / `npy:`), Parquet columns.

Each reads a local path with what nfab already depends on (numpy, pyarrow) and gives nfab's usual
samples: `(x, y)` windows of token ids for a language model, `(x, y)` rows for a classifier, or the
rows alone (`x`) for an objective the user's loss defines (an autoencoder, a denoiser). The held-out
split is the project's own where the files have one (nanoGPT's `val.bin`, `x_test` in an `.npz`, a
`split` column), else the last `TEST_FRACTION` of the rows: fixed, never moved by the seed.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nfab.data.spec import DataSpec, SpecDataset, Split
from nfab.data.text import ByteWindows, num_windows
from nfab.errors import ConfigError

TEST_FRACTION = 0.1
"""Where a file holds no held-out part of its own, its last 10% of rows (or tokens) are held out."""

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32, "int32": np.int32, "int64": np.int64}


class TokenWindows(ByteWindows):
    """`ByteWindows` over a memory map of token ids: (x, y) int64 windows of `block_size` ids."""

    def ids(self, start: int, end: int) -> torch.Tensor:
        return torch.from_numpy(self.data[start:end].astype(np.int64))


def _token_files(path: Path) -> tuple[Path, Path | None, Path | None]:
    """(train.bin, val.bin or None, meta.pkl or None): `path` is nanoGPT's data folder or its train file."""
    if path.is_dir():
        train = path / "train.bin"
        if not train.is_file():
            raise ConfigError(f"tokens: {path} has no train.bin (nanoGPT's layout: train.bin, val.bin, meta.pkl)")
        folder = path
    elif path.is_file():
        train, folder = path, path.parent
    else:
        raise ConfigError(f"token file not found: {path}")
    val = folder / "val.bin" if train.name == "train.bin" and (folder / "val.bin").is_file() else None
    meta = folder / "meta.pkl" if (folder / "meta.pkl").is_file() else None
    return train, val, meta


def _vocab_from_meta(meta: Path) -> int | None:
    try:
        with meta.open("rb") as f:
            data = pickle.load(f)  # noqa: S301  (the user's own file, named by the user)
    except Exception as exc:  # a damaged pickle is the user's to fix: one line
        raise ConfigError(f"tokens: cannot read {meta}: {type(exc).__name__}: {exc}") from exc
    vocab = data.get("vocab_size") if isinstance(data, dict) else None
    return int(vocab) if isinstance(vocab, int) else None


def tokens(*, path: str, split: Split, seed: int, block_size: int = 64, stride: int | None = None,
           dtype: str = "uint16", vocab_size: int | None = None) -> TokenWindows:
    """Windows over a token-id file: nanoGPT's `train.bin` / `val.bin` (uint16; `dtype=uint32` for larger
    vocabularies), its vocabulary from `meta.pkl`, `vocab_size=`, else the largest id plus one."""
    if dtype not in TOKEN_DTYPES:
        raise ConfigError(f"tokens: dtype must be one of {sorted(TOKEN_DTYPES)}, got {dtype!r}")
    if block_size < 1 or (stride is not None and stride < 1):
        raise ConfigError(f"tokens: block_size and stride must be >= 1, got {block_size}, {stride}")
    train, val, meta = _token_files(Path(path).expanduser())
    width = np.dtype(TOKEN_DTYPES[dtype]).itemsize
    size = train.stat().st_size
    if size % width:
        raise ConfigError(f"tokens: {train} has {size} bytes, not a whole number of {dtype} ids (dtype=...)")
    ids = np.memmap(train, dtype=TOKEN_DTYPES[dtype], mode="r")
    if val is not None:
        part = ids if split == "train" else np.memmap(val, dtype=TOKEN_DTYPES[dtype], mode="r")
    else:
        cut = len(ids) - int(TEST_FRACTION * len(ids))
        part = ids[:cut] if split == "train" else ids[cut:]
    vocab = vocab_size or (_vocab_from_meta(meta) if meta is not None else None)
    if vocab is None:
        vocab = int(ids.max()) + 1 if len(ids) else 1
        if val is not None and len(part):
            vocab = max(vocab, int(part.max()) + 1)
    stride = block_size if stride is None else stride
    n = num_windows(len(part), block_size, stride)
    if n == 0:
        raise ConfigError(f"tokens: the {split} split of {path} has {len(part)} tokens, too few for one window of "
                          f"block_size {block_size} (+1)")
    spec = DataSpec(name=f"tokens:{path}", split=split, task="lm", input_shape=(block_size,), num_samples=n,
                    vocab_size=vocab, options={"seed": seed, "block_size": block_size, "stride": stride,
                                               "dtype": dtype, "vocab_size": vocab})
    return TokenWindows(part, block_size=block_size, stride=stride, spec=spec)  # type: ignore[arg-type]


class ArrayRows(SpecDataset):
    """Rows of an input array, paired with a target array's rows where there is one."""

    def __init__(self, x: np.ndarray, y: np.ndarray | None, spec: DataSpec) -> None:
        self.x, self.y, self.spec = x, y, spec

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> Any:
        x = torch.as_tensor(_as_float(self.x[index]))
        if self.y is None:
            return x
        y = self.y[index]
        return x, torch.as_tensor(y if np.issubdtype(self.y.dtype, np.floating) else np.int64(y))


def _as_float(row: np.ndarray) -> np.ndarray:
    """Inputs as float32 (uint8 images scaled to [0, 1]); integer inputs of other kinds (token ids) as int64."""
    if row.dtype == np.uint8:
        return row.astype(np.float32) / 255.0
    if np.issubdtype(row.dtype, np.floating):
        return row.astype(np.float32)
    return row.astype(np.int64)


def _rows_spec(name: str, split: Split, x: np.ndarray, y: np.ndarray | None, options: dict[str, Any]) -> DataSpec:
    """Integer targets make a classifier's data (classes: the largest label plus one); anything else is
    the user's loss's to read."""
    if y is not None and np.issubdtype(y.dtype, np.integer) and y.ndim == 1:
        classes = int(y.max()) + 1 if len(y) else 1
        return DataSpec(name=name, split=split, task="classification", input_shape=tuple(x.shape[1:]),
                        num_samples=len(x), num_classes=classes, options=options)
    return DataSpec(name=name, split=split, task="custom", input_shape=tuple(x.shape[1:]), num_samples=len(x),
                    options=options)


def _split_rows(x: np.ndarray, y: np.ndarray | None, split: Split) -> tuple[np.ndarray, np.ndarray | None]:
    cut = len(x) - int(TEST_FRACTION * len(x))
    rows = slice(0, cut) if split == "train" else slice(cut, len(x))
    return x[rows], None if y is None else y[rows]


def _checked(name: str, x: np.ndarray, y: np.ndarray | None, split: Split) -> None:
    if y is not None and len(x) != len(y):
        raise ConfigError(f"{name}: {len(x)} inputs but {len(y)} targets")
    if len(x) == 0:
        raise ConfigError(f"{name}: the {split} split is empty")


def npz(*, path: str, split: Split, seed: int, x: str | None = None, y: str | None = None) -> ArrayRows:
    """Arrays in an `.npz`: `x_train`/`y_train` and `x_test`/`y_test` where the file has them (Keras'
    layout), else `x=`/`y=` keys (default: `x` and `y`, else the file's only array as inputs alone)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"npz file not found: {file}")
    try:
        arrays = dict(np.load(file, allow_pickle=False))
    except Exception as exc:  # not an npz, or object arrays: one line
        raise ConfigError(f"npz: cannot read {file}: {type(exc).__name__}: {exc}") from exc
    name, own = f"npz:{path}", "test" if split == "test" else "train"
    if x is None and f"x_{own}" in arrays:
        xs, ys = arrays[f"x_{own}"], arrays.get(f"y_{own}")
    else:
        key_x = x or ("x" if "x" in arrays else next(iter(arrays)) if len(arrays) == 1 else None)
        if key_x is None or key_x not in arrays:
            raise ConfigError(f"{name}: no input array {key_x or 'x'!r}; arrays are {sorted(arrays)} (give x=KEY)")
        key_y = y or ("y" if "y" in arrays else None)
        if key_y is not None and key_y not in arrays:
            raise ConfigError(f"{name}: no target array {key_y!r}; arrays are {sorted(arrays)}")
        xs, ys = _split_rows(arrays[key_x], arrays[key_y] if key_y else None, split)
    _checked(name, xs, ys, split)
    return ArrayRows(xs, ys, _rows_spec(name, split, xs, ys, {"seed": seed, "x": x, "y": y}))


def npy(*, path: str, split: Split, seed: int, y: str | None = None) -> ArrayRows:
    """One array in an `.npy` (memory-mapped) as inputs alone, or with targets from the `.npy` at `y=`."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"npy file not found: {file}")
    try:
        xs = np.load(file, mmap_mode="r", allow_pickle=False)
        ys = np.load(Path(y).expanduser(), mmap_mode="r", allow_pickle=False) if y else None
    except Exception as exc:
        raise ConfigError(f"npy: cannot read {file if not y else (file, y)}: {type(exc).__name__}: {exc}") from exc
    xs, ys = _split_rows(xs, ys, split)
    _checked(f"npy:{path}", xs, ys, split)
    return ArrayRows(xs, ys, _rows_spec(f"npy:{path}", split, xs, ys, {"seed": seed, "y": y}))


def parquet(*, path: str, split: Split, seed: int, x: list[str] | None = None, y: str | None = None) -> ArrayRows:
    """Numeric Parquet columns as inputs (`x=[...]`, default every numeric column but the target) and the
    target column `y=` (default `label`, `target` or `y` where present). A `split` column of
    train/test (or val) values is the split; else the last rows are held out."""
    import pyarrow.parquet as pq

    file = Path(path).expanduser()
    if not file.exists():
        raise ConfigError(f"parquet file not found: {file}")
    try:
        frame = pq.read_table(file).to_pandas()
    except Exception as exc:
        raise ConfigError(f"parquet: cannot read {file}: {type(exc).__name__}: {exc}") from exc
    name = f"parquet:{path}"
    target = y or next((c for c in ("label", "target", "y") if c in frame.columns), None)
    if target is not None and target not in frame.columns:
        raise ConfigError(f"{name}: no column {target!r}; columns are {list(frame.columns)}")
    if "split" in frame.columns:
        wanted = {"train"} if split == "train" else {"test", "val", "validation"}
        frame = frame[frame["split"].astype(str).isin(wanted)]
        parts = None
    else:
        parts = split
    from pandas.api.types import is_bool_dtype, is_numeric_dtype

    inputs = x or [c for c in frame.columns
                   if c not in (target, "split") and is_numeric_dtype(frame[c]) and not is_bool_dtype(frame[c])]
    missing = [c for c in inputs if c not in frame.columns]
    if missing or not inputs:
        raise ConfigError(f"{name}: no input column {missing[0]!r}" if missing else f"{name}: no numeric input column")
    xs = frame[inputs].to_numpy()
    ys = frame[target].to_numpy() if target is not None else None
    if parts is not None:
        xs, ys = _split_rows(xs, ys, parts)
    _checked(name, xs, ys, split)
    return ArrayRows(xs, ys, _rows_spec(name, split, xs, ys, {"seed": seed, "x": inputs, "y": target}))
