"""The control word: a small fp32 vector every rank all-gathers beside a bucket's payload.

Pure build and parse, no state. A control word is a fixed head of named fields followed
by per-slice columns (sign scales, qsum max |x|) whose positions a `Layout` records when
the word is built. Every rank all-gathers the words (W rows), so the table every rank
parses holds the same bits; everything the runtime decides from it (skip a non-finite
bucket, the grad norm and loss health sees, the fidelity probe, qsum scale histories) is
therefore a function of values all ranks hold bit for bit.

Head fields (`Head`):
- `bucket_sq`: this rank's |g|^2 of this bucket before communication (non-finite when
  any element is: the bucket's non-finite flag costs no extra pass);
- `carried_sq`: this rank's |g|^2 of the FP32-only buckets launched since the previous
  control word (they send none of their own);
- `loss`, `has_loss`: this rank's loss (the step's first word only);
- `cosine`, `has_cosine`: the fidelity cosine this rank measured on the previous step's
  probe (the step's first word only: a probe's result is known after its own step).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from nfab.runtime import reads


class Head(enum.IntEnum):
    """Named columns at the start of every control word."""

    BUCKET_SQ = 0
    CARRIED_SQ = 1
    LOSS = 2
    HAS_LOSS = 3
    COSINE = 4
    HAS_COSINE = 5


HEAD_LEN = len(Head)


@dataclass(frozen=True, slots=True)
class Columns:
    """Where one group's per-slice values sit in the control word (a half-open range)."""

    start: int
    stop: int

    def of(self, table: torch.Tensor) -> torch.Tensor:
        """This range's columns of a (W, n) table (a view; on the host taken through numpy)."""
        return reads.of(table.device).columns(table, self.start, self.stop)


@dataclass(frozen=True, slots=True)
class StepValues:
    """What the step's first control word carries beside a bucket's own fields (this rank's)."""

    loss: torch.Tensor | None = None
    cosine: torch.Tensor | float | None = None


class Builder:
    """Collects a bucket's per-slice columns while its groups encode, then builds the word."""

    def __init__(self) -> None:
        self._cols: list[torch.Tensor] = []
        self._next = HEAD_LEN

    def add(self, values: torch.Tensor) -> Columns:
        """Append `values` (fp32, one per slice); the columns they will occupy."""
        cols = Columns(self._next, self._next + values.numel())
        if not (values.dim() == 1 and values.dtype == torch.float32):
            values = values.reshape(-1).to(torch.float32)
        self._cols.append(values)
        self._next = cols.stop
        return cols

    def build(self, bucket_sq: torch.Tensor, carried_sq: torch.Tensor | None, step: StepValues) -> torch.Tensor:
        """The word on `bucket_sq`'s device (`carried_sq` None: 0); no value is read back to the host (on the host,
        where reading is free, it is assembled in numpy: the same bits, a few calls fewer)."""
        return reads.of(bucket_sq.device).word(HEAD_LEN, _head_fields(bucket_sq, carried_sq, step), self._cols,
                                               bucket_sq.device)


def _head_fields(bucket_sq: torch.Tensor, carried_sq: torch.Tensor | None,
                 step: StepValues) -> list[tuple[Head, torch.Tensor | float]]:
    """The head fields a word sets (the others stay 0)."""
    fields: list[tuple[Head, torch.Tensor | float]] = [(Head.BUCKET_SQ, bucket_sq)]
    if carried_sq is not None:
        fields.append((Head.CARRIED_SQ, carried_sq))
    if step.loss is not None:
        fields += [(Head.LOSS, step.loss), (Head.HAS_LOSS, 1.0)]
    if step.cosine is not None:
        fields += [(Head.COSINE, step.cosine), (Head.HAS_COSINE, 1.0)]
    return fields


def table(gathered: torch.Tensor, world_size: int) -> torch.Tensor:
    """The all-gathered words as a (W, n) table, row r = rank r's word."""
    return gathered.view(world_size, -1)


def nonfinite(table_: torch.Tensor) -> torch.Tensor | bool:
    """True when any rank saw a non-finite element in this bucket: a 0-d device tensor, or on
    the host (where reading is free) a bool."""
    return reads.of(table_.device).nonfinite_column(table_, Head.BUCKET_SQ)


@dataclass(frozen=True, slots=True)
class Agreed:
    """The head of one bucket's table, read on the host (identical on every rank)."""

    nonfinite: bool
    grad_sq: float
    """Sum over ranks of |g|^2 (this bucket and the FP32-only buckets it carries), finite parts."""
    loss: float | None
    """Mean of the ranks' losses (rank order), when the word carried them."""
    cosine: float | None
    """Mean of the ranks' probe cosines (rank order), when the word carried them."""


def agree(rows: list[list[float]]) -> Agreed:
    """Parse a table's head from host floats; the same arithmetic, in rank order, on every rank."""
    bad = any(not _finite(r[Head.BUCKET_SQ]) for r in rows)
    sq = 0.0
    for r in rows:
        sq += r[Head.BUCKET_SQ] if _finite(r[Head.BUCKET_SQ]) else 0.0
        sq += r[Head.CARRIED_SQ] if _finite(r[Head.CARRIED_SQ]) else 0.0
    return Agreed(bad, sq, _mean_of(rows, Head.LOSS, Head.HAS_LOSS), _mean_of(rows, Head.COSINE, Head.HAS_COSINE))


def carried_nonfinite(rows: list[list[float]]) -> bool:
    """True when an FP32-only bucket this word carries was non-finite on some rank."""
    return any(not _finite(r[Head.CARRIED_SQ]) for r in rows)


def _mean_of(rows: list[list[float]], value: Head, has: Head) -> float | None:
    vals = [r[value] for r in rows if r[has] > 0]
    if not vals:
        return None
    total = 0.0
    for v in vals:
        total += v
    return total / len(vals)


def _finite(v: float) -> bool:
    return v == v and v not in (float("inf"), float("-inf"))
