"""A step's small values (control words, flags, |x|^2 shares, coalesced rows) where reading them
is free and where it is not: one ops pair, chosen by `nfab.wire.dispatch` from the device.

`DeviceReads` is what every device takes (CUDA included, and the CPU under `host_paths(False)`):
torch ops that never read a value back, so the step never waits for the device. `HostReads` is
the CPU's (with or without the compiled kernels): the same values through numpy and Python, a
few calls fewer, bits unchanged. `of(device)` gives the one for a device; the runtime calls it
and never asks which it is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from nfab.wire import dispatch, noise

NUMPY = {torch.uint8: np.uint8, torch.int8: np.int8, torch.int32: np.int32, torch.int64: np.int64,
         torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}
"""Dtypes numpy reads as they are (others, e.g. bf16, take the device ops)."""


class DeviceReads:
    """Torch ops on the values' device: nothing read back."""

    def columns(self, table: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Columns start..stop of a (W, n) table (a view)."""
        return table[:, start:stop]

    def nonfinite_column(self, table: torch.Tensor, col: int) -> torch.Tensor | bool:
        """Whether any row's entry in column `col` is non-finite (a 0-d device tensor)."""
        return ~torch.isfinite(table[:, col]).all()

    def word(self, length: int, fields: Sequence[tuple[int, torch.Tensor | float]], cols: Sequence[torch.Tensor],
             device: torch.device) -> torch.Tensor:
        """An fp32 head of `length` zeros with `fields` set (index, value), then `cols` (fp32) after it."""
        head = torch.zeros(length, dtype=torch.float32, device=device)
        for at, value in fields:
            head[at] = value
        return torch.cat([head, *cols]) if cols else head

    def part_rows(self, rows: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """Bytes offset..offset+nbytes of every row of a (W, bytes) uint8 table, viewed as `dtype`."""
        return rows[:, offset : offset + nbytes].view(dtype)

    def pack_row(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int], gap_ends: Sequence[int],
                 device: torch.device) -> torch.Tensor:
        """One uint8 row: each tensor's bytes at its offset, zeros after it up to its gap's end."""
        pieces: list[torch.Tensor] = []
        for t, at, gap_end in zip(tensors, offsets, gap_ends, strict=True):
            pieces.append(t.contiguous().view(torch.uint8))
            nbytes = t.numel() * t.element_size()
            if gap_end > at + nbytes:
                pieces.append(torch.zeros(gap_end - at - nbytes, dtype=torch.uint8, device=device))
        return torch.cat(pieces)

    def gathered_rows(self, world_size: int, numel: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """An all-gather's uint8 output of W rows of `numel` bytes: (flat, (W, numel) view of it)."""
        rows = torch.empty(world_size * numel, dtype=torch.uint8, device=device)
        return rows, rows.view(world_size, -1)

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a + b of two 0-d fp32 tensors."""
        return a + b

    def amax_rows(self, cols: torch.Tensor) -> torch.Tensor:
        """Each column's max over the rows (NaN if any is)."""
        return cols.amax(dim=0)

    def known_true(self, flag: torch.Tensor) -> bool:
        """A 0-d bool's value where reading it is free; False (unknown) here."""
        return False

    def spoil_if(self, buffer: torch.Tensor, flag: torch.Tensor) -> None:
        """Fill `buffer` with NaN where the 0-d bool `flag` is set, masked on the device."""
        buffer.masked_fill_(flag, float("nan"))

    def noise_source(self, seeds: Sequence[int], device: torch.device) -> list[torch.Generator] | noise.Seeds:
        """One rounding-noise source per seed: generators on `device`."""
        return [torch.Generator(device=device).manual_seed(seed) for seed in seeds]


class HostReads(DeviceReads):
    """The CPU's: numpy slices and views (the same memory), values read as Python scalars."""

    def columns(self, table: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return torch.from_numpy(table.numpy()[:, start:stop])

    def nonfinite_column(self, table: torch.Tensor, col: int) -> torch.Tensor | bool:
        return not bool(np.isfinite(table.numpy()[:, col]).all())

    def word(self, length: int, fields: Sequence[tuple[int, torch.Tensor | float]], cols: Sequence[torch.Tensor],
             device: torch.device) -> torch.Tensor:
        head = np.zeros(length, dtype=np.float32)
        for at, value in fields:
            head[at] = _host_value(value)
        if not cols:
            return torch.from_numpy(head)
        return torch.from_numpy(np.concatenate([head, *(c.detach().numpy() for c in cols)]))

    def part_rows(self, rows: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in NUMPY:
            return super().part_rows(rows, offset, nbytes, dtype)
        return torch.from_numpy(rows.numpy()[:, offset : offset + nbytes].view(NUMPY[dtype]))

    def pack_row(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int], gap_ends: Sequence[int],
                 device: torch.device) -> torch.Tensor:
        if not all(t.dtype in NUMPY and t.is_contiguous() for t in tensors):
            return super().pack_row(tensors, offsets, gap_ends, device)
        row = np.empty(gap_ends[-1] if gap_ends else 0, dtype=np.uint8)
        for t, at, gap_end in zip(tensors, offsets, gap_ends, strict=True):
            nbytes = t.numel() * t.element_size()
            row[at : at + nbytes] = t.detach().numpy().reshape(-1).view(np.uint8)
            row[at + nbytes : gap_end] = 0
        return torch.from_numpy(row)

    def gathered_rows(self, world_size: int, numel: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        gathered = np.empty((world_size, numel), dtype=np.uint8)  # numpy's allocation and shape: no dispatch
        return torch.from_numpy(gathered.reshape(-1)), torch.from_numpy(gathered)

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.array(a.numpy() + b.numpy(), dtype=np.float32))

    def amax_rows(self, cols: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.max(cols.numpy(), axis=0))

    def known_true(self, flag: torch.Tensor) -> bool:
        return bool(flag)

    def spoil_if(self, buffer: torch.Tensor, flag: torch.Tensor) -> None:
        if bool(flag):
            buffer.fill_(math.nan)

    def noise_source(self, seeds: Sequence[int], device: torch.device) -> list[torch.Generator] | noise.Seeds:
        """The seeds themselves (`noise.Seeds`): the keys are computed from them (the generators'
        bits), never drawn from a generator made per slice."""
        return noise.Seeds(np.array(seeds, dtype=np.uint64))


def _host_value(v: torch.Tensor | float) -> np.ndarray | float:
    """A host scalar as numpy reads it: an fp32 tensor's own bits; anything else converted as
    torch's assignment into an fp32 word converts it (round to nearest)."""
    if isinstance(v, torch.Tensor):
        return v.detach().numpy() if v.dtype == torch.float32 else float(v)
    return v


def of(device: torch.device) -> DeviceReads:
    """The reads for `device` (`dispatch.ops`: chosen once per device)."""
    return dispatch.ops(device, DeviceReads, read_ops=HostReads)
