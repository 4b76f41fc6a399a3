"""Rounding noise for qsum: U[0,1) per element, a pure function of (seed, rank, step,
parameter, element index) — so it does not depend on which bucket, or which neighbours, a
parameter travels with (a resumed run's first step, on DDP's initial buckets, rounds
exactly as the uninterrupted run did on the rebuilt ones), and every rank follows the
same seed schedule while rounding independently of the others.

Large slices draw from their own generator on the bucket's device (seeded per step).
Small slices — a bucket's norms and biases, often dozens — share one counter-based hash
over all their elements instead: a generator per slice per step costs more than the
slice's own encoding. Which way a slice goes depends only on its own size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

SMALL_SLICE = 1 << 14
"""Slices below this many elements take counter-based noise."""
_M32 = 0xFFFF_FFFF
_MUL = 0x45D9F3B  # < 2^27: a 32-bit value times it stays below 2^59, exact in int64


def slice_key(seed: int, rank: int, step: int, param: int) -> int:
    """The 63-bit key of one parameter's noise at one step on one rank."""
    return hash((seed, rank, step, param)) & 0x7FFF_FFFF_FFFF


def group_noise(keys: Sequence[int], lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """U[0,1) noise for consecutive slices (fp32, sum(lengths) elements) on `device`."""
    parts: list[torch.Tensor] = []
    small_keys: list[int] = []
    small_lengths: list[int] = []
    order: list[tuple[bool, int]] = []  # (small?, index into its list)
    for key, n in zip(keys, lengths, strict=True):
        if n < SMALL_SLICE:
            order.append((True, len(small_keys)))
            small_keys.append(key)
            small_lengths.append(n)
        else:
            g = torch.Generator(device=device)
            g.manual_seed(key)
            order.append((False, len(parts)))
            parts.append(torch.rand(n, generator=g, device=device))
    if not parts:  # all small: one counter pass, already in slice order
        return _counter_noise(small_keys, small_lengths, device) if small_keys else torch.empty(0, device=device)
    small = _counter_noise(small_keys, small_lengths, device).split(small_lengths) if small_keys else ()
    pieces = [small[i] if is_small else parts[i] for is_small, i in order]
    return torch.cat(pieces) if pieces else torch.empty(0, device=device)


def _counter_noise(keys: Sequence[int], lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """hash32((i - start) ^ key32) per element i of each slice, top 24 bits -> [0, 1).

    The per-slice part (its 32-bit key, less its start so the counter restarts at 0 in
    every slice) is folded on the host: one repeat and one xor per element, then the mix.
    """
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    total = starts[-1] + lengths[-1]
    # (i - start) ^ k for i in [start, start + n) is i ^ (start ^ k) only when start ^ k keeps
    # i's low bits apart; use the exact form: a per-slice offset, then the xor with the key
    offset = torch.tensor([-st for st in starts], dtype=torch.int64, device=device)
    key32 = torch.tensor([(k ^ (k >> 32)) & _M32 for k in keys], dtype=torch.int64, device=device)
    counts = torch.tensor(lengths, dtype=torch.int64, device=device)
    per_slice = torch.stack([offset, key32])
    expanded = torch.repeat_interleave(per_slice, counts, dim=1, output_size=total)
    x = (torch.arange(total, dtype=torch.int64, device=device) + expanded[0]) ^ expanded[1]
    return (_hash32(x) >> 8).to(torch.float32) * (1.0 / (1 << 24))


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (xor-shift-multiply, three rounds) on int64 values in [0, 2^32)."""
    x = ((x >> 16) ^ x) * _MUL & _M32
    x = ((x >> 16) ^ x) * _MUL & _M32
    return (x >> 16) ^ x
