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
from itertools import accumulate

import numpy as np
import torch

try:
    from nfab.wire import shared_kernels
except ImportError:  # numba missing: keys come from generators (the same bits)
    shared_kernels = None  # type: ignore[assignment]

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
    # keys made on the host go to `device` without a host sync: a blocking copy waited for the stream
    # (FSDP2's reduce-scatter, which draws from `Seeds`, once per lossy group and module)
    if isinstance(generator, torch.Tensor):  # keys already drawn (`seeded_keys`)
        return generator.to(device, non_blocking=True)
    if isinstance(generator, Seeds):
        return seeded_keys(generator.values).to(device, non_blocking=True)
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
            return self.source.to(device, non_blocking=True)
        return draw_keys(self.source, segments, device)


def stratified(keys: torch.Tensor, world_size: int) -> list[Stratum]:
    """The W ranks' strata over keys drawn once (replay): the same keys, shifts 0..W-1."""
    return [Stratum(keys, r, world_size) for r in range(world_size)]


_FEW_SEGMENTS = 8
"""Up to this many segments the hash adds each segment's key to its slice; more take a gather."""


def _as_i32(words: torch.Tensor) -> torch.Tensor:
    """int64 words < 2**32 as int32 with the same low 32 bits (two's complement)."""
    return (words - ((words >> 31) << 32)).to(torch.int32)  # exact: the value lies in int32's range


def _mix32_(c: torch.Tensor) -> torch.Tensor:
    """lowbias32 of 32-bit words held in int32, in place: products wrap mod 2**32 (as on every
    backend), logical shifts are arithmetic shifts masked to the bits a logical one keeps. In
    place with one scratch buffer: each fresh full-size temporary costs page faults on the
    CPU (a chain of out-of-place ops ran 5x slower than its ops alone)."""
    t = torch.empty_like(c)
    for shift, keep, mul in ((16, 0xFFFF, MIX1), (15, 0x1FFFF, MIX2 - (1 << 32)), (16, 0xFFFF, None)):
        c.bitwise_xor_(torch.bitwise_right_shift(c, shift, out=t).bitwise_and_(keep))
        if mul is not None:
            c.mul_(mul)  # MIX2 enters as its residue below 0: an int32 constant
    return c


def uniform(keys: torch.Tensor, lengths: Sequence[int], shift: int = 0) -> torch.Tensor:
    """The reference: float32 u for every element of the concatenated segments (on keys' device),
    shifted by `shift`/2^24 mod 1 (0: plain independent noise; see Stratum).

    Per element the hash runs in int32 lanes (wrapping products, masked shifts): the same bits
    as the 64-bit statement (`_mix`, `uniform_scalar`) in about a dozen 4-byte passes instead
    of 8-byte ones (int64 bitwise ops are 10x slower than int32 ones on CPU torch)."""
    lengths = list(lengths)
    n = sum(lengths)
    dev = keys.device
    key_lo, key_hi = _as_i32(keys & _MASK32), _as_i32((keys >> 32) & _MASK32)
    # element i of the bucket (segment s from start_s) hashes key_lo[s] + (i - start_s + 1) * golden:
    # per segment, base[s] = key_lo[s] - start_s * golden, added to (i + 1) * golden
    starts = torch.tensor([0, *accumulate(lengths[:-1])], dtype=torch.int64, device="cpu")
    base = _as_i32((key_lo.to(torch.int64) - starts.to(dev, non_blocking=True) * (GOLDEN - (1 << 32))) & _MASK32)
    c = torch.arange(1, n + 1, dtype=torch.int32, device=dev).mul_(GOLDEN - (1 << 32))
    if len(lengths) <= _FEW_SEGMENTS:  # a slice per segment, its key a 0-d device tensor: no gather pass
        at = 0
        for s, m in enumerate(lengths):
            c[at : at + m].add_(base[s]).bitwise_xor_(key_hi[s])
            at += m
    else:  # many small segments: one gather of each key word per element
        counts = torch.tensor(lengths, dtype=torch.int64, device="cpu").to(dev, non_blocking=True)  # no wait
        c.add_(torch.repeat_interleave(base, counts, output_size=n))
        c.bitwise_xor_(torch.repeat_interleave(key_hi, counts, output_size=n))
    u24 = _mix32_(c).bitwise_right_shift_(8).bitwise_and_(_MASK24)
    if shift:
        u24.add_(shift).bitwise_and_(_MASK24)
    return u24.to(torch.float32).mul_(_U24)


def uniform_scalar(key: int, index: int, shift: int = 0) -> float:
    """u for one element in plain Python integers: a third, independent statement of the semantics."""
    m = (1 << 32) - 1
    c = (((key & m) + (index + 1) * GOLDEN) & m) ^ ((key >> 32) & m)
    c = ((c ^ (c >> 16)) * MIX1) & m
    c = ((c ^ (c >> 15)) * MIX2) & m
    c ^= c >> 16
    return (((c >> 8) + shift) & _MASK24) * _U24


_NOISE_CACHE: dict[tuple, torch.Tensor] = {}
_NOISE_CACHE_SIZE = 4


def strata_uniform(keys: torch.Tensor, lengths: tuple[int, ...], shifts: tuple[int, ...]) -> torch.Tensor:
    """The W strata's uniforms (W x n float32): the shared u shifted by each rank's offset on the
    24-bit grid, mod 1 -- `uniform(keys, lengths, shift)` for every shift, hashed once.

    On the host the last four are kept: replay draws the same keys again for the EF-off and EF-on
    windows of a step and for every block route of a region (same seed, `ef_steps` steps), so the
    hash runs once per step and region."""
    host = keys.device.type == "cpu"
    tag = (tuple(keys.tolist()), lengths, shifts) if host else None
    hit = _NOISE_CACHE.get(tag) if tag is not None else None
    if hit is not None:
        return hit
    u24 = uniform(keys, lengths).mul_(1 << 24).to(torch.int32)  # exact: u is a multiple of 2^-24
    shift = torch.tensor(shifts, dtype=torch.int32, device=keys.device).unsqueeze(1)
    u = ((u24 + shift) & ((1 << 24) - 1)).to(torch.float32).mul_(2.0**-24)
    if tag is not None:
        if len(_NOISE_CACHE) >= _NOISE_CACHE_SIZE:
            _NOISE_CACHE.pop(next(iter(_NOISE_CACHE)))
        _NOISE_CACHE[tag] = u
    return u
