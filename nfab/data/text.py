"""Byte-level language-model data: the Python standard library's sources, or any text file.

Bytes are the vocabulary (256 symbols), so no tokenizer is needed and any machine with
Python has a corpus. Samples are fixed strided windows: `x` is `block_size` bytes and
`y` the same window shifted by one, so an epoch has a defined length and the sampler's
seed alone decides the order.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import sysconfig
from pathlib import Path

import torch

from nfab.data.spec import DataSpec, SpecDataset, Split
from nfab.errors import ConfigError

BYTE_VOCAB = 256
TEST_FRACTION = 0.1  # the last 10% of the bytes are held out
DEFAULT_MAX_BYTES = 2_000_000
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class ByteWindows(SpecDataset):
    """(x, y) int64 windows of `block_size` bytes at offsets 0, stride, 2*stride, ..."""

    def __init__(self, data: torch.Tensor, *, block_size: int, stride: int, spec: DataSpec) -> None:
        self.data = data
        self.block_size = block_size
        self.stride = stride
        self.spec = spec

    def __len__(self) -> int:
        return num_windows(len(self.data), self.block_size, self.stride)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = index * self.stride
        chunk = self.ids(start, start + self.block_size + 1)
        return chunk[:-1], chunk[1:]

    def ids(self, start: int, end: int) -> torch.Tensor:
        """Symbols `start:end` as int64 (a subclass reads them from another store)."""
        return self.data[start:end].long()


def num_windows(n_bytes: int, block_size: int, stride: int) -> int:
    """Windows of block_size + 1 bytes (input plus shifted target) that fit in n_bytes."""
    if n_bytes < block_size + 1:
        return 0
    return (n_bytes - block_size - 1) // stride + 1


def stdlib_sources(max_bytes: int) -> bytes:
    """The first `max_bytes` of the stdlib's `.py` files, walked in sorted order.

    Directories are visited depth-first with sorted names and the walk stops once the
    cap is reached, so the corpus is deterministic for a Python version and building it
    reads only as much as it keeps.
    """
    root = sysconfig.get_paths()["stdlib"]
    parts: list[bytes] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(f for f in filenames if f.endswith(".py")):
            try:
                blob = (Path(dirpath) / name).read_bytes()
            except OSError:
                continue
            parts.append(blob[: max_bytes - total])
            total += len(parts[-1])
            if total >= max_bytes:
                return b"".join(parts)
    return b"".join(parts)


def _windows(
    corpus: bytes, *, name: str, split: Split, block_size: int, stride: int | None, options: dict[str, object]
) -> ByteWindows:
    """Split `corpus` (last 10% held out) and window the requested part."""
    if block_size < 1:
        raise ConfigError(f"{name}: block_size must be >= 1, got {block_size}")
    stride = block_size if stride is None else stride
    if stride < 1:
        raise ConfigError(f"{name}: stride must be >= 1, got {stride}")
    cut = len(corpus) - int(TEST_FRACTION * len(corpus))
    part = corpus[:cut] if split == "train" else corpus[cut:]
    empty = torch.empty(0, dtype=torch.uint8, device="cpu")
    data = torch.frombuffer(bytearray(part), dtype=torch.uint8) if part else empty
    n = num_windows(len(data), block_size, stride)
    if n == 0:
        raise ConfigError(
            f"{name}: the {split} split has {len(data)} bytes, too few for one window of "
            f"block_size {block_size} (+1); use a larger text or a smaller block_size"
        )
    spec = DataSpec(
        name=name,
        split=split,
        task="lm",
        input_shape=(block_size,),
        num_samples=n,
        vocab_size=BYTE_VOCAB,
        # The stdlib corpus differs between Python versions: record which bytes were used.
        options={
            **options,
            "block_size": block_size,
            "stride": stride,
            "corpus_sha256": hashlib.sha256(corpus).hexdigest(),
        },
    )
    return ByteWindows(data, block_size=block_size, stride=stride, spec=spec)


def stdlib_text(
    *,
    split: Split,
    seed: int,
    block_size: int = 64,
    max_bytes: int = DEFAULT_MAX_BYTES,
    stride: int | None = None,
) -> ByteWindows:
    """Byte windows over this Python's stdlib sources (2 MB by default; stride = block_size)."""
    if max_bytes < 1:
        raise ConfigError(f"stdlib-text: max_bytes must be >= 1, got {max_bytes}")
    corpus = stdlib_sources(max_bytes)
    options = {"seed": seed, "max_bytes": max_bytes}
    return _windows(corpus, name="stdlib-text", split=split, block_size=block_size, stride=stride, options=options)


def text_file(
    *,
    path: str,
    split: Split,
    seed: int,
    block_size: int = 64,
    max_bytes: int | None = None,
    stride: int | None = None,
) -> ByteWindows:
    """Byte windows over a local UTF-8 text file (optionally only its first `max_bytes`)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"text: {file} is a folder, not a text file" if file.is_dir()
                          else f"text file not found: {file}")
    if max_bytes is not None and max_bytes < 1:
        raise ConfigError(f"text: max_bytes must be >= 1, got {max_bytes}")
    with file.open("rb") as f:
        corpus = f.read() if max_bytes is None else f.read(max_bytes)
    if b"\0" in corpus:
        nul = corpus.index(b"\0")
        raise ConfigError(f"{file}: a binary file, not text (a NUL byte at {nul}); token ids are tokens:PATH")
    # A `max_bytes` cap may cut the last multi-byte character: only then is a trailing
    # incomplete sequence fine (the incremental decoder with final=False allows exactly that).
    try:
        codecs.getincrementaldecoder("utf-8")().decode(corpus, final=max_bytes is None)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{file}: not UTF-8 text (byte {exc.start}: {exc.reason})") from exc
    options = {"seed": seed, "max_bytes": max_bytes}
    return _windows(corpus, name=f"text:{path}", split=split, block_size=block_size, stride=stride, options=options)
