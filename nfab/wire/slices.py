"""`Slices`: the segments of one 1-D tensor at known offsets, as views or as (buffer, offsets)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch


class Slices(Sequence[torch.Tensor]):
    """Segments of one 1-D tensor at known element offsets (a bucket's slices of one group):
    a sequence of its views for any code, made on first use, and `(buffer, offsets)` for a
    compiled pass that reads or writes every segment where it lies in one call."""

    __slots__ = ("buffer", "offsets", "lengths", "_views")

    def __init__(self, buffer: torch.Tensor, offsets: np.ndarray, lengths: Sequence[int]) -> None:
        self.buffer = buffer
        self.offsets = offsets
        self.lengths = lengths
        self._views: list[torch.Tensor] | None = None

    def views(self) -> list[torch.Tensor]:
        if self._views is None:
            self._views = [self.buffer[o : o + n] for o, n in zip(self.offsets.tolist(), self.lengths, strict=True)]
        return self._views

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i):  # type: ignore[override]
        return self.views()[i]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.views())
