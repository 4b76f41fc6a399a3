"""CPU fast paths of the codecs: tensors in, compiled kernels (`kernels.py`) on their memory.

Every function here has a torch reference that runs on any device (`lanes.py`,
`codecs.py`, the reducers' own torch code) and produces the same bits; the reducers
call `supports(...)` and take the fast path only for CPU tensors on a little-endian
machine with numba installed. Tests check both paths against each other bit for bit.

`on_host` is the one dispatch by device: these kernels, the numpy codecs and a callback's
direct flag read run only where it says the values are free to read (CPU tensors); every
other device takes torch ops that never read a value back to the host. `host_paths(False)`
sends CPU tensors down the device path too, so a CPU machine can check it reads nothing
(tests/runtime/test_host_reads_dist.py).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache

import numpy as np
import torch

from nfab.wire.qsum import lanes
from nfab.wire.qsum.lanes import LaneLayout
from nfab.wire.slices import Slices

try:
    from nfab.wire import kernels
    from nfab.wire.qsum import lane_kernels as lanekernels
    from nfab.wire.sign import trit_kernels as tritkernels
    from nfab.wire.sign import vote_kernels as votekernels
except ImportError:  # numba missing or unusable: the torch reference runs instead
    kernels = lanekernels = tritkernels = votekernels = None  # type: ignore[assignment]

AVAILABLE = kernels is not None and sys.byteorder == "little"
_HALF = {torch.bfloat16: True, torch.float16: False}
SIGN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


_host = True


def on_host(*tensors: torch.Tensor) -> bool:
    """Whether host code may read these tensors' values: all on the CPU (where reading is
    free), unless `host_paths(False)` is in effect. False on CUDA and every other device."""
    if not _host:
        return False
    for t in tensors:  # a loop, not all(genexpr): asked many times per bucket
        if not t.is_cpu:
            return False
    return True


def host_device(device: torch.device) -> bool:
    """`on_host` for values still to be made on `device`."""
    return _host and device.type == "cpu"


@contextmanager
def host_paths(enabled: bool) -> Iterator[None]:
    """Let CPU tensors take the host paths (default) or, with False, the device paths every
    other device takes (process-wide: the hook's callbacks run on other threads)."""
    global _host
    was, _host = _host, enabled
    try:
        yield
    finally:
        _host = was


def supports(*tensors: torch.Tensor) -> bool:
    """Whether the compiled CPU path may run on these tensors (on the host, contiguous)."""
    if not (AVAILABLE and on_host(*tensors)):
        return False
    for t in tensors:
        if not t.is_contiguous():
            return False
    return True


def sign_supports(x: torch.Tensor) -> bool:
    """Whether `sign_votes` runs on `x` (1-D, contiguous, fp32/bf16/fp16, on CPU)."""
    return supports(x) and x.dim() == 1 and x.dtype in SIGN_DTYPES


def segment_bounds(lengths: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Start and end offsets (int64) of the concatenated segments, for the kernels (read-only:
    made once per layout)."""
    return _segment_bounds(tuple(lengths))


@lru_cache(maxsize=256)
def _segment_bounds(lengths: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
    starts = ends - np.asarray(lengths, dtype=np.int64)
    starts.flags.writeable = ends.flags.writeable = False  # shared by every caller of this layout
    return starts, ends


def sign_votes(x: torch.Tensor, lengths: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(votes x >= 0 packed 1 bit per element little-endian, float64 |x| sum per segment).

    One pass over `x`; bf16 and fp16 are read as they are (no fp32 copy).
    """
    return sign_votes_views([x], lengths, split=True)


_NO_SQ = np.empty(0, dtype=np.float64)


def sq_total(sqs: np.ndarray) -> torch.Tensor:
    """The segments' float64 x^2 sums as one 0-d fp32 tensor (an encoder's |x|^2 share)."""
    return torch.from_numpy(np.array(sqs.sum(), dtype=np.float32))


def sign_votes_views(views: Sequence[torch.Tensor], lengths: Sequence[int], split: bool = False,
                     sqs: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`sign_votes` of the concatenation of `views` (one segment each, or `lengths` over one
    view when `split`), read in place: a mixed bucket's slices need no gathered copy. With
    `sqs` (float64, one per segment), each segment's x^2 sum is taken on the same read."""
    lengths = list(lengths)
    n = sum(lengths)
    words = np.zeros(n // 64 + 2, dtype=np.uint64)  # whole words, one of room for a shifted store
    sums = np.zeros(len(lengths), dtype=np.float64)
    sq = _NO_SQ if sqs is None else sqs
    starts, ends = segment_bounds(lengths)
    if split:
        _sign_kernel(views[0], starts, ends, np.zeros(len(lengths), dtype=np.int64), words, sums, sq)
        return words.view(np.uint8)[: -(-n // 8)], sums
    span = slices_span(views)
    if span is not None:  # the slices where they lie in the bucket: one call for all of them
        x, at = span
        _sign_kernel(x, at, at + (ends - starts), starts - at, words, sums, sq)
    else:
        zero = np.zeros(1, dtype=np.int64)
        for si, v in enumerate(views):  # each view alone, its votes at its place in the concatenation
            _sign_kernel(v, zero, ends[si : si + 1] - starts[si], starts[si : si + 1], words, sums[si : si + 1],
                         sq[si : si + 1])
    return words.view(np.uint8)[: -(-n // 8)], sums


_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def gather(slices: Slices) -> torch.Tensor | None:
    """The slices' values as one new contiguous tensor (`torch.cat` of their views) in one
    compiled copy, without making a view per slice; None off the host."""
    b = slices.buffer
    if not (supports(b) and b.dim() == 1 and b.element_size() in _BITS):
        return None
    assert kernels is not None
    lengths = np.asarray(slices.lengths, dtype=np.int64)
    out = torch.empty(int(lengths.sum()), dtype=b.dtype, device=b.device)  # the host: named, not the default
    bits = _BITS[b.element_size()]
    kernels.gather_segments(b.view(torch.uint8).numpy().view(bits), slices.offsets, lengths,
                            out.view(torch.uint8).numpy().view(bits))
    return out


def concat(slices: Slices) -> torch.Tensor:
    """The slices' values as one new tensor: `gather` on the host, `torch.cat` of their views
    elsewhere (the same values)."""
    out = gather(slices)
    return out if out is not None else torch.cat(slices.views())


def slices_sq(slices: Slices) -> torch.Tensor | None:
    """|x|^2 of fp32 slices (0-d fp32 on the host) read where they lie, no gathered copy; None
    when the compiled path does not apply."""
    b = slices.buffer
    if not (supports(b) and b.dim() == 1 and b.dtype == torch.float32):
        return None
    assert kernels is not None
    tot = kernels.segments_sq(b.numpy(), slices.offsets, np.asarray(slices.lengths, dtype=np.int64))
    return torch.from_numpy(np.array(tot, dtype=np.float32))


def slices_span(views: Sequence[torch.Tensor]) -> tuple[torch.Tensor, np.ndarray] | None:
    """(bucket, element offsets) of `Slices` on the host, for one kernel call over all of them
    where they lie; None for anything else (a plain list of tensors goes view by view)."""
    if isinstance(views, Slices) and supports(views.buffer) and views.buffer.dim() == 1:
        return views.buffer, views.offsets
    return None


def _sign_kernel(x: torch.Tensor, starts, ends, bases, words, sums, sqs) -> None:
    """Segment s = x[starts[s] : ends[s]]; element j's vote goes to bit bases[s] + j; x^2 sums
    into `sqs` unless it is empty."""
    assert kernels is not None
    if x.dtype == torch.float32:
        kernels.sign_bits_f32(x.numpy(), starts, ends, bases, words, sums, sqs)
    else:
        kernels.sign_bits_half(x.view(torch.int16).numpy().view(np.uint16), _HALF[x.dtype], starts, ends, bases,
                               words, sums, sqs)


@lru_cache(maxsize=64)
def _spread(lane_bits: int) -> np.ndarray:
    assert lanekernels is not None
    return lanekernels.spread_table(lane_bits)


@lru_cache(maxsize=1)
def _expand() -> np.ndarray:
    assert kernels is not None
    return kernels.count_expand_table()


_NP = {torch.uint8: np.uint8, torch.int32: np.int32, torch.int64: np.int64}


def _bits_to_lanes(padded: np.ndarray, numel: int, layout: LaneLayout, out: np.ndarray) -> None:
    """The compiled spread of `numel` votes into `out` (every container written, so it may come
    from np.empty): the uint8 kernel or the wide one."""
    assert lanekernels is not None
    spread = _spread(layout.lane_bits)
    if out.itemsize == 1:
        lanekernels.bits_to_byte_lanes(padded, numel, layout.lanes, out, spread)
    else:
        lanekernels.bits_to_wide_lanes(padded, numel, layout.lane_bits, layout.lanes, out, spread,
                                       _whole_groups(padded, numel, layout, out, spread))


def _whole_groups(padded: np.ndarray, numel: int, layout: LaneLayout, out: np.ndarray, spread: np.ndarray) -> int:
    """Fill the leading whole containers of the W = 4..7 and 16..31 layouts a group at a time
    (one pass, scalar byte-table lookups); how many it wrote (0 for other layouts)."""
    assert lanekernels is not None
    m = out.size
    if layout.lane_bits == 3 and layout.lanes == 21 and numel > 16 * m:
        done = min(m, (numel - 16 * m) // 5) & ~7  # the last block's elements all below numel
        lanekernels.spread_21x3(padded, m, done, spread, out)
        return done
    if layout.lane_bits == 5 and layout.lanes == 6:
        done = min(m, numel // 6) & ~3
        lanekernels.spread_6x5(padded, done, spread, out)
        return done
    return 0


def votes_to_lanes(bits: np.ndarray, numel: int, layout: LaneLayout) -> torch.Tensor:
    """Packed votes -> count lane containers: the same tensor as `lanes.pack(x >= 0, layout)`."""
    assert kernels is not None
    out = np.empty(layout.containers_for(numel), dtype=_NP[layout.container])
    padded = np.zeros(bits.size + 2, dtype=np.uint8)  # two zero bytes: the kernel reads 16-bit windows
    padded[: bits.size] = bits
    _bits_to_lanes(padded, numel, layout, out)
    return torch.from_numpy(out)


def votes_to_shard_lanes(bits: np.ndarray, numel: int, shard: int, world_size: int,
                         layout: LaneLayout) -> torch.Tensor:
    """Packed votes of `numel` elements, zero-padded to W shards of `shard` elements (a multiple
    of 8), each lane-packed on its own and laid end to end: the tensor of
    `torch.cat([votes_to_lanes(shard r's votes, shard, layout) for r in range(W)])`, written in
    place (one buffer, no per-shard copies or concatenation)."""
    assert kernels is not None and shard % 8 == 0
    step, m = shard // 8, layout.containers_for(shard)
    padded = np.zeros(world_size * step + 2, dtype=np.uint8)  # two zero bytes: the kernel reads 16-bit windows
    padded[: bits.size] = bits
    out = np.empty(world_size * m, dtype=_NP[layout.container])
    for r in range(world_size):  # a shard's window may read 2 bytes of the next: masked off by `shard`
        _bits_to_lanes(padded[r * step : (r + 1) * step + 2], shard, layout, out[r * m : (r + 1) * m])
    return torch.from_numpy(out)


def decode_bit_rows(rows: np.ndarray, start: int, numel: int, table: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[i] = table[how many of the W (<= 255) packed bit rows have bit start + i set]."""
    assert kernels is not None
    kernels.decode_bit_rows(rows, start, numel, table.astype(np.float32, copy=False), out, _expand())
    return out


_UNITS = np.array([-1.0, 0.0, 1.0], dtype=np.float32)


def majority_bit_rows(rows: np.ndarray, start: int, numel: int, world_size: int, scale: float,
                      out: np.ndarray) -> np.ndarray:
    """`decode_bit_rows` with the majority table times `scale` (sign(2c - W) * s, a tie 0 * s),
    by bit-sliced counting: out (fp32) gets the same bits."""
    assert votekernels is not None
    votekernels.majority_rows(rows, start, numel, world_size // 2, world_size % 2 == 0, _UNITS, np.float32(scale),
                              out.view(np.uint32))
    return out


def _targets(out: torch.Tensor | Sequence[torch.Tensor],
             lengths: Sequence[int]) -> tuple[torch.Tensor, np.ndarray] | None:
    """Where a decode writes: one fp32 host tensor and each segment's offset in it (`out` one
    tensor of all segments, or `Slices`); None otherwise (per-segment destinations)."""
    if isinstance(out, torch.Tensor):
        span = (out.reshape(-1), segment_bounds(lengths)[0]) if supports(out) else None
    else:
        span = slices_span(out)
    return span if span is not None and span[0].dtype == torch.float32 else None


def majority_into(rows: np.ndarray, lengths: Sequence[int], world_size: int, scales: np.ndarray,
                  out: torch.Tensor | Sequence[torch.Tensor]) -> bool:
    """`majority_bit_rows` of every segment (scale scales[s]) into `out` (one fp32 tensor of all
    segments, or `Slices`) in one compiled call; False otherwise (the caller then decodes
    segment by segment)."""
    assert votekernels is not None
    span = _targets(out, lengths)
    if span is None:
        return False
    starts, ends = segment_bounds(lengths)
    votekernels.majority_segments(rows, starts, ends - starts, world_size // 2, world_size % 2 == 0, _UNITS,
                                  np.ascontiguousarray(scales, dtype=np.float32), span[0].numpy().view(np.uint32),
                                  span[1])
    return True


def gathered_levels(rows: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, lengths: Sequence[int],
                    out: torch.Tensor | Sequence[torch.Tensor]) -> bool:
    """qsum's gathered decode for one-lane uint8 levels: the mean of the W rows, each decoded
    with its own rank's scales (`scales`: W x segments), written into `out` (one fp32 tensor of
    all segments, or `Slices`) in one compiled pass; False when it does not apply (the caller
    then decodes by table, rank by rank: the same bits). Only the segments' columns of `rows`
    are read: a row may run on past them."""
    if not (AVAILABLE and rows.dtype == torch.uint8 and rows.dim() == 2 and on_host(rows, values, scales)):
        return False
    span = _targets(out, lengths)
    if span is None:
        return False
    assert kernels is not None
    starts, ends = segment_bounds(lengths)
    kernels.gathered_levels(rows.numpy(), _f32(values), _f32(scales), starts, ends,
                            np.float32(1.0 / rows.shape[0]), span[0].numpy(), span[1])
    return True


def _f32(t: torch.Tensor) -> np.ndarray:
    """A host tensor's values as a float32 numpy array, strides and all (no copy when already fp32)."""
    return (t if t.dtype == torch.float32 else t.to(torch.float32)).numpy()


def decode_table(containers: torch.Tensor, layout: LaneLayout, numel: int, values: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """`lanes.decode_table`: one compiled pass on CPU, the torch reference elsewhere (same values)."""
    fast = supports(containers) and values.numel() == layout.max_value + 1 and (
        out is None or (supports(out) and out.dtype == torch.float32))
    if not fast:
        return lanes.decode_table(containers, layout, numel, values, out)
    assert kernels is not None
    res = torch.empty(numel, dtype=torch.float32, device="cpu") if out is None else out  # compiled: CPU
    if numel == 0:
        return res
    table = values.detach().to(torch.float32).contiguous().numpy()
    assert lanekernels is not None
    decode = lanekernels.decode_byte_lanes if containers.element_size() == 1 else lanekernels.decode_wide_lanes
    decode(containers.numpy(), layout.lane_bits, layout.lanes, numel, table, res.view(-1).numpy())
    return res


QSUM_DTYPES = SIGN_DTYPES


def decode_levels(levels: torch.Tensor, step: float, scales: torch.Tensor, lengths: Sequence[int],
                  out: torch.Tensor | None) -> torch.Tensor | None:
    """Summed one-lane (uint8) qsum levels -> (level * step - 1) * segment scale, fp32, on the
    CPU into `out` (or a new tensor); None when the compiled path does not apply (the caller
    then decodes by table: the same bits, `fl(fl(fl(l * step) - 1) * s)` either way)."""
    if not (supports(levels) and levels.dtype == torch.uint8 and on_host(scales)
            and (out is None or (supports(out) and out.dtype == torch.float32))):
        return None
    n = sum(lengths)
    assert kernels is not None and levels.numel() >= n
    res = torch.empty(n, dtype=torch.float32, device="cpu") if out is None else out  # compiled: CPU
    starts, ends = segment_bounds(lengths)
    kernels.decode_levels(levels.numpy(), starts, ends, np.float32(step), np.float32(1.0),
                          scales.reshape(-1).to(torch.float32).numpy(), res.view(-1).numpy())
    return res


def qsum_supports(x: torch.Tensor) -> bool:
    """Whether `qsum_levels` runs on `x` (1-D, contiguous, fp32/bf16/fp16, on CPU)."""
    return supports(x) and x.dim() == 1 and x.dtype in QSUM_DTYPES


def qsum_levels(x: torch.Tensor, keys: torch.Tensor, scales: torch.Tensor, lengths: Sequence[int],
                max_level: int, layout: LaneLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(levels uint8, lane containers) of qsum's stochastic rounding, fused in one pass.

    `keys` are the segments' noise keys (`nfab.wire.noise`; the noise is computed in the
    kernel, never stored), `scales` the safe (non-zero) per-segment scales; bf16/fp16 are
    read as they are. Same bits as the torch reference.
    """
    assert kernels is not None
    n = x.numel()
    starts, ends = segment_bounds(lengths)
    levels = np.empty(n, dtype=np.uint8)
    k = keys.numpy()
    sc = scales.to(torch.float32).contiguous().numpy()
    one, half_m = np.float32(1.0), np.float32(0.5 * max_level)
    if x.dtype == torch.float32:
        kernels.qsum_levels(x.numpy(), k, starts, ends, sc, one, half_m, max_level, levels)
    else:
        kernels.qsum_levels_half(x.view(torch.int16).numpy().view(np.uint16), _HALF[x.dtype], k, starts, ends, sc,
                                 one, half_m, max_level, levels)
    if layout.lanes == 1:  # one-lane containers are the levels: the payload is `levels` itself
        lv = torch.from_numpy(levels)
        return lv, lv
    containers = np.empty(layout.containers_for(n), dtype=np.uint8)
    assert lanekernels is not None
    lanekernels.pack_bytes(levels, layout.lane_bits, containers)
    return torch.from_numpy(levels), torch.from_numpy(containers)


def qsum_own_levels(slices: Slices, seeds: np.ndarray, max_level: int,
                    with_sq: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """(levels uint8, own scales fp32, x^2 sum fp32 0-d or None) of fp32 `slices` read where they
    lie, each segment rounded in its own max |x| with the key its seed draws first
    (`kernels.qsum_own_scale`: one call for the group); None off the host or for other dtypes."""
    b = slices.buffer
    if not (supports(b) and b.dim() == 1 and b.dtype == torch.float32):
        return None
    assert kernels is not None
    lengths = np.asarray(slices.lengths, dtype=np.int64)
    levels = np.empty(int(lengths.sum()), dtype=np.uint8)
    amax = np.empty(lengths.size, dtype=np.uint32)
    sqs = np.empty(lengths.size if with_sq else 0, dtype=np.float64)
    kernels.qsum_own_scale(b.numpy(), slices.offsets, lengths, seeds, np.float32(1.0), np.float32(0.5 * max_level),
                           max_level, levels, amax, amax.view(np.float32), sqs)
    sq = sq_total(sqs) if with_sq else None
    return torch.from_numpy(levels), torch.from_numpy(amax.view(np.float32)), sq


def segment_max_abs(x: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """max |x| per segment (fp32) in one compiled integer pass over fp32/bf16/fp16 `x` (1-D, CPU).

    A NaN in a segment gives NaN (as torch's max does); its payload is whichever NaN had the
    largest bits, so compare NaNs by isnan, not by bits.
    """
    assert kernels is not None
    starts, ends = segment_bounds(lengths)
    if x.dtype == torch.float32:
        out = np.empty(len(starts), dtype=np.uint32)
        kernels.segment_max_abs_bits(x.view(torch.int32).numpy().view(np.uint32), np.uint32(0x7FFFFFFF),
                                     starts, ends, out)
        return torch.from_numpy(out.view(np.float32))
    half = np.empty(len(starts), dtype=np.uint16)
    kernels.segment_max_abs_bits(x.view(torch.int16).numpy().view(np.uint16), np.uint16(0x7FFF), starts, ends, half)
    return torch.from_numpy(half.view(np.int16)).view(x.dtype).to(torch.float32)  # widening is exact


@lru_cache(maxsize=1)
def _trit_digits() -> np.ndarray:
    b = np.arange(256, dtype=np.int64)[:, None]
    return ((b // np.array([1, 3, 9, 27, 81])[None, :]) % 3).astype(np.uint8)


def decode_trits(packed: np.ndarray, start: int, numel: int, table: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[i] = table[base-3 digit start + i of `packed` (5 digits per byte, digit j times 3**j)].

    The byte's 5 values come from one row of a 256 x 5 value table (`table` looked up by the
    digits once per call); pairs of bytes are written as 5 uint64 words."""
    assert tritkernels is not None
    rows = np.ascontiguousarray(table.astype(np.float32, copy=False)[_trit_digits()]).view(np.uint32)
    tritkernels.decode_trits(packed, start, numel, rows, out.view(np.uint32))
    return out


@lru_cache(maxsize=64)
def _digit_tables(lane_bits: int, half: int, ternary: bool) -> tuple[np.ndarray, ...]:
    """The owner's tables for uint8 count lanes: count -> digit, and its trit or bit tables."""
    assert tritkernels is not None
    counts = np.arange(1 << lane_bits)
    digit = (counts > half).astype(np.uint8)
    if ternary:
        digit += (counts >= half).astype(np.uint8)  # 0 neg, 1 tie, 2 pos
    if lane_bits <= 4 and 8 % lane_bits == 0:  # 5 counts' bits: 2 tables of <= 4096 rows
        fused = tritkernels.trit_tables(digit, lane_bits) if ternary else (tritkernels.bit_table(digit, lane_bits),)
    else:
        fused = ()
    for t in (digit, *fused):
        t.flags.writeable = False  # shared by every call of this world size
    return (digit, *fused)


def shard_majority(containers: torch.Tensor, layout: LaneLayout, shard: int, half: int,
                   ternary: bool) -> torch.Tensor:
    """A shard's summed count lanes -> its packed majority (uint8): bit i = count > half (odd W,
    `lanes.pack` of 1-bit lanes), or 5 trits a byte (even W, 0 below half, 1 at it, 2 above),
    `shard` a multiple of 40. uint8 lanes that fill the byte go straight from container bytes
    to digit bytes by table (one pass); others decode to digits first (the table decode)."""
    assert lanekernels is not None and tritkernels is not None and shard % 40 == 0
    digit, *fused = _digit_tables(layout.lane_bits, half, ternary)
    src = containers.numpy()
    out = np.empty(shard // 5 if ternary else shard // 8, dtype=np.uint8)
    if src.dtype == np.uint8 and fused:
        if ternary:
            tritkernels.byte_lanes_to_trits(src, layout.lane_bits, fused[0], fused[1], out)
        else:
            tritkernels.byte_lanes_to_bits(src, layout.lane_bits, fused[0], out)
        return torch.from_numpy(out)
    if src.dtype == np.uint8:
        digits = np.empty(shard, dtype=np.uint8)
        lanekernels.byte_lane_digits(src, layout.lane_bits, layout.lanes, shard, digit, digits)
    elif ternary:  # wide containers (W=4, W >= 16): the table decode with uint32 digits (its pairs
        # move as uint64 words as fp32 values do), packed from there (no float pass or narrowing copy)
        wide = np.empty(shard, dtype=np.uint32)
        lanekernels.decode_wide_lanes(src, layout.lane_bits, layout.lanes, shard, digit.astype(np.uint32), wide)
        lanekernels.pack_trits(wide, out)
        return torch.from_numpy(out)
    else:
        values = torch.from_numpy(digit.astype(np.float32))
        digits = decode_table(containers, layout, shard, values).numpy().astype(np.uint8)
    if not ternary:
        return torch.from_numpy(np.packbits(digits, bitorder="little"))  # 1-bit lanes: lane l = bit l
    lanekernels.pack_trits(digits, out)
    return torch.from_numpy(out)
