"""Block-scaled qsum: stochastic levels with one scale per block, summed exactly in lanes.

Why: under Adam-style optimizers each coordinate is divided by its own RMS, so what hurts
is a scale too coarse for the small coordinates, not too few bits. On the held-out GPT
(AdamW, W=4) one scale per tensor at 16 levels cost +4.9% validation loss; one scale
per 64 elements at 8 levels +0.8%, at 16 levels -0.3% (DESIGN.md, "What is already
known").

Wire format, per group of parameter slices (blocks never straddle two slices, so a
parameter's encoding does not depend on its bucket neighbours):

1. *Scale code per block*: each rank computes its block's max |x| and the smallest code
   c in 0..255 with SCALES[c] >= max |x|, where SCALES[c] = 2^((c - 160) / 4) (a quarter
   octave per code, 2^-39.75 .. 2^23.75; code 0 is an all-zero block). The code is
   monotone in max |x|, so a MAX all-reduce of the uint8 codes gives every rank the code
   of the largest block max over ranks: one byte per block, and the agreed scale covers
   every rank's elements (nothing saturates below 2^23.75).
2. *Levels*: x / scale in [-1, 1] is stochastically rounded to one of L levels (M = L - 1
   steps), unbiased. `bq<bits>` routes have L = 2^bits (bq2 = 4 levels, bq3 = 8, bq4 = 16,
   bq8 = 256); `bl5` and `bl6` have 5 and 6 levels (64-element blocks only): the rounding
   noise's variance goes as 1/M^2, so they sit between bq2 and bq3 in both bytes and error,
   where the 1%-at-8x target lies. Nothing here needs L to be a power of two: the packings
   below take W * M + 1 values for any M.
   The rounding is *stratified* across ranks (`noise.Stratum`): every rank draws the same
   key per segment and rank r shifts its uniform by r/W, so each rank stays unbiased while
   the W ranks' rounding errors of one element largely cancel in the sum. It costs no bytes;
   on the held-out GPT it cut the Adam-preconditioned error of bq3's mean by 1.6-2x and made
   4 levels (bq2) about as accurate as 8 independently rounded ones (simulation, W=4).
3. *Lanes sized for W*: the W-rank sum of levels is at most W * M, so lanes that hold
   W * M + 1 values never carry; one integer SUM all-reduce adds them exactly. The lanes are
   bit lanes (`wire/lanes.py`) or base-(W*M+1) digits of an int64 (`wire/radix.py`),
   whichever packs denser: bq3 at W=4 is 5-bit lanes, 6 per int32 = 5.33 bits/element; bq2
   at W=4 is 17 base-13 digits per int64 = 3.76 bits/element (before the ring's factor).
   Both in the chunked element order (`lanes.chunked_layout`): each lane or digit of a chunk
   of 64 containers is one 64-element block, so packing and decoding read and write
   contiguous rows, and the CPU kernels' decode unpacks and scales in one pass.

Decode: mean = (2 * sum / (M * W) - 1) * scale, per element. Replay does the same
arithmetic for W virtual ranks and is bit-identical to the real reduction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch
import torch.distributed as dist

from nfab.wire import noise
from nfab.wire.blockq import grid, radix, replay
from nfab.wire.blockq import ops as blockq_ops
from nfab.wire.blockq.ops import blockkernels, pack_any  # noqa: F401  (tests reach the kernels here)
from nfab.wire.blockq.radix import RadixLayout
from nfab.wire.blockq.table import CODE_OFFSET, SCALES  # noqa: F401  (read here by callers)
from nfab.wire.contract import (
    Capacity,
    Encoded,
    Reducer,
    ScaleAgreement,
    allreduce_factor,
    allreduce_future,
    split_out,
    write_into,
)
from nfab.wire.qsum.lanes import LaneLayout, chunked_layout, unpack
from nfab.wire.segments import nonfinite_sum

DEFAULT_BLOCK = 64
LEVEL_BITS = (2, 3, 4, 8)
"""Bits of levels of the `bq<bits>` routes (2^bits levels), registered at every block size."""
EXTRA_LEVELS = (5, 6)
"""Level counts that are no power of two (`bl5`, `bl6`), registered at 64-element blocks only."""
BLOCKS = (DEFAULT_BLOCK, 128, 256)


def route_name(bits: int, block: int = DEFAULT_BLOCK) -> str:
    """`bq3` for 64-element blocks, `bq4-128` for other block sizes."""
    return f"bq{bits}" if block == DEFAULT_BLOCK else f"bq{bits}-{block}"


def levels_route_name(levels: int, block: int = DEFAULT_BLOCK) -> str:
    """The route of `levels` levels per rank: `bq<bits>` for 2^bits levels with bits in LEVEL_BITS,
    else `bl<levels>` ("block-scaled, <levels> levels": `bl5`, `bl6-128`). Its own prefix, since
    `bq<n>` reads as n bits everywhere (README, profiles, users' configs)."""
    bits = _exact_bits(levels)
    if bits in LEVEL_BITS:
        return route_name(bits, block)
    return f"bl{levels}" if block == DEFAULT_BLOCK else f"bl{levels}-{block}"


def scale_codes(block_max: torch.Tensor) -> torch.Tensor:
    """Smallest code whose scale covers each block's max |x| (uint8; 255 above the top; a NaN block
    max codes as 0)."""
    block_max = block_max.to(torch.float32).contiguous()
    return blockq_ops.ops(block_max.device).scale_codes(block_max)


class BlockQSum(Reducer):
    """Stochastic levels with one agreed 8-bit scale code per block, lane-packed and summed exactly."""

    name = "blockq"
    scale_agreement = ScaleAgreement.PER_BLOCK
    """One uint8 code per block, MAX-agreed exactly every step: a block's scale has no history."""
    stratified_rounding = True
    """The ranks' noise is one stratified draw (`noise.Stratum`): their rounding errors partly
    cancel in the sum, a smaller variance than independent noise (`runtime/control/moment.py`)."""
    blocking_rounds = 1  # the uint8 MAX all-reduce of the block codes, before encoding

    def __init__(self, bits: int | None = None, block: int = DEFAULT_BLOCK, *, levels: int | None = None) -> None:
        """`bits` (in LEVEL_BITS: 2^bits levels) or `levels` (2..256: uint8 levels), not both."""
        if (bits is None) == (levels is None):
            raise ValueError("block-scaled qsum takes bits or levels, one of them")
        if bits is not None and bits not in LEVEL_BITS:
            raise ValueError(f"block-scaled qsum supports {LEVEL_BITS} bits of levels, got {bits}")
        levels = 1 << bits if bits is not None else levels
        assert levels is not None
        if not 2 <= levels <= 256:
            raise ValueError(f"block-scaled qsum takes 2..256 levels (uint8), got {levels}")
        if block < 8:
            raise ValueError(f"block size must be >= 8 elements, got {block}")
        self.levels = levels
        self.steps = levels - 1
        self.bits = bits if bits is not None else _exact_bits(levels)  # None for bl5, bl6: no whole log2
        self.block = block
        self.route = levels_route_name(levels, block)

    # ---- capacity and bytes -------------------------------------------------------
    def lane_bits(self, world_size: int) -> int:
        """Bits that hold the W-rank sum of levels: ceil(log2(W * M + 1))."""
        return max(1, math.ceil(math.log2(world_size * self.steps + 1)))

    def layout(self, world_size: int) -> LaneLayout | RadixLayout:
        """Bit lanes, or base-(W*M+1) digits of an int64 where those pack denser."""
        return _packing(self.lane_bits(world_size), world_size * self.steps + 1)

    def capacity(self, world_size: int) -> Capacity:
        b = self.lane_bits(world_size)
        if b > 31:
            return Capacity(self.name, world_size, False, b, self.steps + 1,
                            reason=f"the sum of {world_size} ranks' levels needs {b}-bit lanes (> 31)")
        return Capacity(self.name, world_size, True, lane_bits=b, levels=self.steps + 1)

    def blocks_for(self, numel: int, segments: int = 1) -> int:
        """Blocks (scale codes) for `numel` elements in `segments` slices (an upper bound when segments > 1)."""
        return -(-numel // self.block) + max(segments - 1, 0)

    def payload_bytes(self, numel: int, world_size: int) -> int:
        layout = self.layout(world_size)
        return layout.containers_for(numel) * layout.storage_bits // 8

    def wire_bytes(self, numel: int, world_size: int, segments: int = 1) -> float:
        # lanes on a ring all-reduce, plus the ring MAX all-reduce of one uint8 code per block
        return allreduce_factor(world_size) * (self.payload_bytes(numel, world_size)
                                               + self.blocks_for(numel, segments))

    # ---- scales -------------------------------------------------------------------
    def local_scale(self, x: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        """This rank's max |x| per block (fp32; non-finite when the block holds NaN/Inf)."""
        return blockq_ops.ops(x.device).local_scale(self, x, list(lengths))

    def local_scale_reference(self, x: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        """`local_scale` in torch ops (any device)."""
        parts = grid.pieces(tuple(lengths), self.block)
        if parts is not None:  # row maxima of block views: no per-element index
            out = grid.block_amax(x, parts, self.blocks_in(lengths))
            bad = ~torch.isfinite(out).all()  # a row's amax keeps its NaN or inf: the flag from the maxima
        else:
            bid, nblocks = grid.block_index(tuple(lengths), self.block, x.device)
            out = torch.zeros(nblocks, dtype=torch.float32, device=x.device)
            out.scatter_reduce_(0, bid, x.abs().to(torch.float32), "amax", include_self=True)  # bf16/fp16 too
            bad = nonfinite_sum(x)  # scatter's amax may drop a NaN: flag from the values
        # flag the whole group, on the device (no host read)
        out[:1] = torch.where(bad, torch.full_like(out[:1], math.nan), out[:1])
        return out

    def agree_input(self, block_max: torch.Tensor) -> torch.Tensor:
        """This rank's per-block uint8 scale codes (a NaN block max codes as 0: the bucket's
        |g|^2 already flags it): their MAX is the MAX of the fp32 block maxima's codes (monotone)."""
        return scale_codes(block_max)

    def agree(self, block_max: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        """The agreed codes: this rank's per-block codes, MAX all-reduced as uint8 (blocking):
        one byte per block, the same codes as the MAX of the fp32 block maxima (monotone)."""
        codes = self.agree_input(block_max)
        dist.all_reduce(codes, op=dist.ReduceOp.MAX, group=group)
        return codes

    def blocks_in(self, lengths: Sequence[int]) -> int:
        """Blocks (scale codes) of a bucket of segments `lengths` (blocks restart per segment)."""
        return sum(-(-n // self.block) for n in lengths)

    def scale_blocks_(self, flat: torch.Tensor, shared: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        """flat (fp32, one value per element) times its block's agreed scale, in place: broadcast over
        block views where the layout allows (`grid`), else a gathered per-element scale. Same bits."""
        parts = grid.pieces(tuple(lengths), self.block)
        if parts is None:
            return flat.mul_(self.element_scales(shared, lengths))
        return grid.mul_blocks_(flat, self.block_scales(shared), parts)

    def element_scales(self, shared: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        """The agreed scale of every element (its block's)."""
        bid, nblocks = grid.block_index(tuple(lengths), self.block, shared.device)
        assert shared.numel() == nblocks, f"{shared.numel()} scale codes for {nblocks} blocks"
        return self.block_scales(shared)[bid]

    def block_scales(self, shared: torch.Tensor) -> torch.Tensor:
        """The agreed scale of each block (fp32; 0 for an all-zero block)."""
        codes = shared if shared.dtype == torch.uint8 else scale_codes(shared)
        return blockq_ops.ops(codes.device).block_scales(codes)

    # ---- encode / launch / decode ---------------------------------------------------
    def encode(self, x, lengths, world_size, shared_scale=None, generator=None, tie=0) -> Encoded:
        """Levels of `x` against the agreed block scales (`shared_scale`: uint8 codes, or the
        MAX-agreed fp32 block max, which maps to the same codes). `generator` is this rank's
        `noise.Stratum` (stratified rounding); plain generators round independently."""
        lengths = list(lengths)
        m = self.steps
        levels = self.round_levels(x, lengths, shared_scale, generator)
        payload = self.pack_levels(levels, world_size)

        def local() -> torch.Tensor:  # from the levels: the payload may be reduced in place
            return self.scale_blocks_(unit_values(levels, m), shared_scale, lengths)

        return Encoded(payload, None, make_local=local)

    def round_levels(self, x: torch.Tensor, lengths: Sequence[int], shared_scale: torch.Tensor | None,
               generator: Any = None) -> torch.Tensor:
        """`encode`'s stochastically rounded levels (uint8, one per element) before packing. FSDP2's
        rows pack them per row."""
        assert shared_scale is not None, "block-scaled qsum needs the agreed block scales"
        stratum = generator if isinstance(generator, noise.Stratum) else noise.Stratum(generator, 0, 1)
        return blockq_ops.ops(x.device).levels(self, x, list(lengths), shared_scale, stratum)

    def pack_levels(self, levels: torch.Tensor, world_size: int) -> torch.Tensor:
        """This rank's payload from its levels: lanes sized for the W-rank sum (`layout`)."""
        return blockq_ops.ops(levels.device).pack(levels, self.layout(world_size))

    def _levels(self, x: torch.Tensor, lengths: list[int], shared: torch.Tensor,
                stratum: noise.Stratum) -> torch.Tensor:
        """The reference (torch ops, any device): stochastically rounded levels, uint8."""
        m = self.steps
        parts = grid.pieces(tuple(lengths), self.block)
        if parts is None:
            scale = self.element_scales(shared, lengths)
            t = torch.div(x.to(torch.float32), torch.where(scale > 0, scale, torch.ones_like(scale)))
        else:  # the safe divisor per block, broadcast over block views
            scale = self.block_scales(shared)
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            t = grid.div_blocks(x, safe, parts, torch.empty(x.numel(), dtype=torch.float32, device=x.device))
        t.add_(1.0).mul_(0.5 * m)  # level coordinate in [0, m]
        t.add_(noise.uniform(stratum.keys(len(lengths), x.device), lengths, stratum.shift))  # see nfab.wire.noise
        return t.floor_().clamp_(0, m).to(torch.uint8)  # unbiased stochastic rounding

    def launch(self, payload, world_size, group):
        return allreduce_future(payload, group)

    def decode(self, reduced, scale_mean, numel, lengths, world_size, out=None) -> Any:
        assert scale_mean is not None, "block-scaled qsum decodes with the agreed block scales"
        return blockq_ops.ops(reduced.device).decode(self, reduced, scale_mean, numel, list(lengths),
                                                     self.layout(world_size), world_size, out)

    def decode_reference(self, reduced: torch.Tensor, scale_mean: torch.Tensor, numel: int, lengths: list[int],
                         layout: LaneLayout | RadixLayout, world_size: int, out: Any) -> Any:
        """`decode` in torch ops (any device)."""
        one, _ = split_out(out)  # a contiguous fp32 bucket slice is decoded into directly
        direct = one if one is not None and one.dtype == torch.float32 and one.is_contiguous() else None
        total = self.steps * world_size
        mean = self.scale_blocks_(unit_values(_unpacked(reduced, layout, numel), total, out=direct), scale_mean,
                                  lengths)
        return mean if direct is not None else write_into(out, mean)

    def sum_values(self, layout: LaneLayout | RadixLayout, world_size: int, device: torch.device) -> torch.Tensor:
        """Unit mean of every W-rank sum of levels S: 2 * S / (M * W) - 1 (fp32 table)."""
        total = self.steps * world_size
        return torch.arange(layout.max_value + 1, dtype=torch.float32, device=device) * (2.0 / total) - 1.0

    # ---- stratified rounding on the whole paths -------------------------------------
    def reduce(self, x, lengths=None, group=None, generator=None, step=0) -> torch.Tensor:
        """`Reducer.reduce`, rounding stratified: `generator` is the key source, the same on every rank."""
        if not isinstance(generator, noise.Stratum):
            generator = noise.Stratum(generator, dist.get_rank(group), dist.get_world_size(group))
        return super().reduce(x, lengths, group, generator, step)

    def replay_with_locals(self, xs, lengths=None, generators=None, step=0):
        """`Reducer.replay_with_locals`, rounding stratified like `reduce`: the W virtual ranks
        share the keys of `generators[0]` (the key source `reduce` gets on every rank)."""
        gens = self._strata(xs, lengths, generators)
        summed = self._replay_summed(xs, lengths, gens)
        return summed if summed is not None else super().replay_with_locals(xs, lengths, gens)

    def replay_mean(self, xs, lengths=None, generators=None, step=0) -> torch.Tensor:
        """`replay_with_locals(...)[0]`, bit for bit, without decoding each rank's own levels
        (a replay without error feedback never reads them)."""
        gens = self._strata(xs, lengths, generators)
        summed = self._replay_summed(xs, lengths, gens, with_locals=False)
        return summed[0] if summed is not None else super().replay_with_locals(xs, lengths, gens)[0]

    def _strata(self, xs, lengths, generators) -> list:
        gens = list(generators) if generators is not None else [None]
        if not isinstance(gens[0], noise.Stratum):
            segments = len(lengths) if lengths is not None else 1
            keys = noise.draw_keys(gens[0], segments, xs[0].device)
            gens = noise.stratified(keys, len(xs))
        return gens

    def _replay_summed(self, xs, lengths, gens, with_locals: bool = True
                       ) -> tuple[torch.Tensor, list[torch.Tensor | None]] | None:
        """`replay_with_locals`'s values in far fewer passes (`replay.summed`); None outside its case."""
        self.check(len(xs))
        return replay.summed(xs, lengths, gens, self.block, self.steps, self.element_scales, with_locals)


def unit_values(ints: torch.Tensor, steps: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """2 * v / steps - 1 for every whole number v (fp32; into `out` when given): the entries of the
    table `torch.arange(steps + 1) * (2 / steps) - 1` (`sum_values`, the compiled decode's) computed
    by the same fp32 ops per element instead of gathered, so the same bits without an index pass."""
    res = out.view(-1) if out is not None else torch.empty(ints.numel(), dtype=torch.float32, device=ints.device)
    res.copy_(ints.reshape(-1))  # exact: small whole numbers
    return res.mul_(2.0 / steps).sub_(1.0)


def _unpacked(reduced: torch.Tensor, layout: LaneLayout | RadixLayout, numel: int) -> torch.Tensor:
    """The first `numel` lane values or digits of `reduced` (the eager unpacking)."""
    if isinstance(layout, RadixLayout):
        return radix.unpack(reduced, layout, numel, torch.float32)
    return unpack(reduced, layout, numel)


@lru_cache(maxsize=64)
def _packing(lane_bits: int, values: int) -> LaneLayout | RadixLayout:
    """The denser of bit lanes of `lane_bits` and int64 digits in base `values`, both in the chunked
    element order (`lanes.chunked_layout`, `radix.chunked_radix_layout`)."""
    lanes = chunked_layout(lane_bits)
    digits = radix.chunked_radix_layout(values)
    return digits if digits.bits_per_element < lanes.bits_per_element else lanes


def _exact_bits(levels: int) -> int | None:
    """log2(levels) when it is a whole number."""
    bits = levels.bit_length() - 1
    return bits if levels == 1 << bits else None


def block_reducers() -> dict[str, BlockQSum]:
    """The registered block-scaled routes, keyed by reducer key (`blockq-bq3`, `blockq-bl5`, ...)."""
    reds = [BlockQSum(bits, block) for bits in LEVEL_BITS for block in BLOCKS]
    reds += [BlockQSum(levels=levels) for levels in EXTRA_LEVELS]
    return {f"blockq-{red.route}": red for red in reds}
