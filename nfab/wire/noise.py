"""Counter-based rounding noise: u = hash(key, index) in [0, 1), defined once, computed anywhere.

The semantics (the one definition both implementations follow, bit for bit):

    z = key + (i + 1) * 0x9E3779B97F4A7C15           (mod 2**64; i = index in the segment)
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z =  z ^ (z >> 31)                                (>> logical, on 64-bit words)
    u = (z >> 40) * 2**-24                            (24 bits: exact in float32, u < 1)

i.e. the (i+1)-th output of splitmix64 started at `key`, cut to 24 bits. Nothing is
materialised that a kernel must read: the compiled CPU kernel (`kernels.qsum_encode`)
computes u where it rounds, and `uniform` here is the torch reference (int64 ops, on any
device: CPU, CUDA, meta).

Keys come from the caller's generators — one 64-bit draw per segment — so the seed schedule
is the one the runtime and calibration already share (a generator per (seed, rank, step,
parameter) in the hook, per (seed, step, rank) in replay): ranks draw different keys and
round independently, and replay and the hook draw the same keys and round the same bits.
A parameter's noise depends only on its own key and its own element index, never on its
neighbours in a bucket.

*Stratified* (correlated) rounding: the W ranks draw the SAME key and rank r shifts its u by
r/W (mod 1, on the 24-bit grid: `shift = (r << 24) // W`). Each rank's u is still uniform, so
each rank still rounds without bias, but for one element the W ranks' u are evenly spaced, so
their rounding errors largely cancel in the sum: the mean's rounding noise shrinks by up to
W in variance at no cost in bytes (the block-scaled routes use it; on the held-out GPT it
cut the Adam-preconditioned error of bq3's mean by 1.6-2x in simulation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nfab.wire import fastpath

GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
_U24 = 2.0**-24
_MASK24 = (1 << 24) - 1

Generators = torch.Generator | Sequence[torch.Generator | None] | None
"""One generator for every segment, one per segment, or None (torch's default generator)."""


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 words (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


@dataclass(frozen=True, slots=True)
class Seeds:
    """One CPU generator seed per segment, standing for the generators `manual_seed` would make:
    their keys are computed on the host (`seeded_keys`), or inside a kernel that takes the
    seeds (`kernels.qsum_own_scale`), never drawn from a generator made per segment."""

    values: np.ndarray
    """uint64, one per segment."""


def draw_keys(generator: Generators | torch.Tensor | Seeds, segments: int, device: torch.device) -> torch.Tensor:
    """One int64 key per segment (on `device`), drawn from the generator(s).

    A single generator (or None) gives all keys in one draw; a list gives one key from each
    generator, so a parameter's key depends only on its own generator.
    """
    if isinstance(generator, torch.Tensor):  # keys already drawn (`seeded_keys`)
        return generator.to(device)
    if isinstance(generator, Seeds):
        return seeded_keys(generator.values).to(device)
    if generator is None or isinstance(generator, torch.Generator):
        return torch.randint(-(1 << 63), (1 << 63) - 1, (segments,), generator=generator, device=device,
                             dtype=torch.int64)
    gens = list(generator)
    if len(gens) != segments:
        raise ValueError(f"{len(gens)} generators for {segments} segments")
    if not gens:
        return torch.zeros(0, dtype=torch.int64, device=device)
    return torch.cat([torch.randint(-(1 << 63), (1 << 63) - 1, (1,), generator=g, device=device,
                                    dtype=torch.int64) for g in gens])


def seeded_keys(seeds: Sequence[int] | np.ndarray) -> torch.Tensor:
    """The int64 keys (CPU) that `draw_keys` draws from one CPU generator per seed, each
    seeded with `manual_seed(seed)`: the same bits, computed without making a generator per
    segment (`kernels.first_draw_keys`; generators where numba is missing)."""
    if fastpath.kernels is None:
        return draw_keys([torch.Generator().manual_seed(s) for s in seeds], len(seeds), torch.device("cpu"))
    out = np.empty(len(seeds), dtype=np.uint64)
    fastpath.kernels.first_draw_keys(np.asarray(seeds, dtype=np.uint64), out)
    return torch.from_numpy(out.view(np.int64))


@dataclass(frozen=True, slots=True)
class Stratum:
    """One rank's place in stratified rounding: the key source every rank shares (generators,
    or the int64 keys already drawn), this rank and the world size."""

    source: Generators | torch.Tensor | Seeds
    rank: int
    world_size: int

    @property
    def shift(self) -> int:
        """This rank's offset on the 24-bit grid: floor(rank * 2^24 / W)."""
        return ((self.rank % self.world_size) << 24) // self.world_size

    def keys(self, segments: int, device: torch.device) -> torch.Tensor:
        if isinstance(self.source, torch.Tensor):
            return self.source.to(device)
        return draw_keys(self.source, segments, device)


def stratified(keys: torch.Tensor, world_size: int) -> list[Stratum]:
    """The W ranks' strata over keys drawn once (replay): the same keys, shifts 0..W-1."""
    return [Stratum(keys, r, world_size) for r in range(world_size)]


def uniform(keys: torch.Tensor, lengths: Sequence[int], shift: int = 0) -> torch.Tensor:
    """The reference: float32 u for every element of the concatenated segments (on keys' device),
    shifted by `shift`/2^24 mod 1 (0: plain independent noise; see Stratum)."""
    lengths = list(lengths)
    n = sum(lengths)
    dev = keys.device
    counts = torch.tensor(lengths, dtype=torch.int64, device="cpu").to(dev, non_blocking=True)  # no wait for the device
    starts = torch.cumsum(counts, 0) - counts
    seg_key = torch.repeat_interleave(keys, counts, output_size=n)
    index = torch.arange(n, dtype=torch.int64, device=dev) - torch.repeat_interleave(starts, counts, output_size=n)
    z = seg_key + (index + 1) * _signed(GOLDEN)
    z = (z ^ _shr(z, 30)) * _signed(MIX1)
    z = (z ^ _shr(z, 27)) * _signed(MIX2)
    z = z ^ _shr(z, 31)
    u24 = _shr(z, 40)
    if shift:
        u24 = (u24 + shift) & _MASK24
    return u24.to(torch.float32) * _U24


def uniform_scalar(key: int, index: int, shift: int = 0) -> float:
    """u for one element in plain Python integers: a third, independent statement of the semantics."""
    m = (1 << 64) - 1
    z = (key + (index + 1) * GOLDEN) & m
    z = ((z ^ (z >> 30)) * MIX1) & m
    z = ((z ^ (z >> 27)) * MIX2) & m
    z ^= z >> 31
    return (((z >> 40) + shift) & _MASK24) * _U24
