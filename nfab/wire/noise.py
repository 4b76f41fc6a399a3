"""Counter-based rounding noise: u = hash(key, index) in [0, 1), defined once, computed anywhere.

The semantics (the one definition both implementations follow, bit for bit), on 32-bit words
(mod 2**32; i = index in the segment; key_lo, key_hi = the 64-bit key's low and high halves):

    c = (key_lo + (i + 1) * 0x9E3779B9) ^ key_hi      (a Weyl counter, keyed)
    c = (c ^ (c >> 16)) * 0x7FEB352D
    c = (c ^ (c >> 15)) * 0x846CA68B
    c =  c ^ (c >> 16)                                (>> logical)
    u = (c >> 8) * 2**-24                             (24 bits: exact in float32, u < 1)

i.e. the counter through `lowbias32` (C. Wellons' hash-prospector: a bijection of 32-bit words
with near-ideal avalanche), cut to 24 bits. Within a segment the counter never repeats (the
golden step is odd), so neither does u's word. 32-bit words, not splitmix64's 64: AVX2 has no
64-bit multiply (`vpmullq` is AVX-512), and emulated, the hash took ~60% of qsum's rounding
pass; in 32-bit lanes the compiled kernel hashes 8 elements per instruction. Nothing is
materialised that a kernel must read: the compiled CPU kernels (`kernels.noise_u`) compute u
where they round, and `uniform` here is the torch reference (int64 ops, on any device: CPU,
CUDA, meta).

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

from nfab.wire import shared_kernels

GOLDEN = 0x9E3779B9
MIX1 = 0x7FEB352D
MIX2 = 0x846CA68B
_MASK32 = (1 << 32) - 1
_U24 = 2.0**-24
_MASK24 = (1 << 24) - 1

Generators = torch.Generator | Sequence[torch.Generator | None] | None
"""One generator for every segment, one per segment, or None (torch's default generator)."""


def _mix(c: torch.Tensor) -> torch.Tensor:
    """lowbias32 of 32-bit words held in int64 (non-negative, < 2**32). No product leaves int64:
    MIX1 < 2**31, and MIX2 enters as MIX2 - 2**32 (the same residue mod 2**32), so |c * m| < 2**63."""
    c = c ^ (c >> 16)
    c = (c * MIX1) & _MASK32
    c = c ^ (c >> 15)
    c = (c * (MIX2 - (1 << 32))) & _MASK32
    return c ^ (c >> 16)


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
    if shared_kernels is None:
        return draw_keys([torch.Generator().manual_seed(s) for s in seeds], len(seeds), torch.device("cpu"))
    out = np.empty(len(seeds), dtype=np.uint64)
    shared_kernels.first_draw_keys(np.asarray(seeds, dtype=np.uint64), out)
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
    key_lo, key_hi = seg_key & _MASK32, (seg_key >> 32) & _MASK32
    step = ((index + 1) & _MASK32) * (GOLDEN - (1 << 32))  # GOLDEN's residue below 0: no overflow
    u24 = _mix(((key_lo + step) & _MASK32) ^ key_hi) >> 8
    if shift:
        u24 = (u24 + shift) & _MASK24
    return u24.to(torch.float32) * _U24


def uniform_scalar(key: int, index: int, shift: int = 0) -> float:
    """u for one element in plain Python integers: a third, independent statement of the semantics."""
    m = (1 << 32) - 1
    c = (((key & m) + (index + 1) * GOLDEN) & m) ^ ((key >> 32) & m)
    c = ((c ^ (c >> 16)) * MIX1) & m
    c = ((c ^ (c >> 15)) * MIX2) & m
    c ^= c >> 16
    return (((c >> 8) + shift) & _MASK24) * _U24
