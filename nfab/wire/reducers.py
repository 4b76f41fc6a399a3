"""Reducers: aggregation paths that turn W ranks' gradients into their mean.

Each reducer is split into pure steps so the hook runtime can batch and overlap them:

    encode (local, pure) -> one payload collective (async) -> decode (pure)

plus a per-segment scale vector that the runtime averages across ranks in its control
word. `reduce` runs the whole path on a real process group; `replay` runs the same
arithmetic for W virtual ranks in one process (calibration). For the integer paths
(`signcount`, `signgather`, `qsum`) the payload sum is exact, so replay is bit-identical
to the real reduction.

Wire bytes count what each rank sends under the collective's algorithm: ring all-reduce
sends 2(W-1)/W of its payload, all-gather sends (W-1)/W of W payloads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from nfab.errors import CapacityError
from nfab.wire import codecs
from nfab.wire import lanes as _lanes
from nfab.wire.lanes import LaneLayout, count_lane_bits, decode_table, layout_for, pack, unpack


@dataclass(frozen=True, slots=True)
class Capacity:
    """Can a reducer be exact at this world size, and with which lanes or levels?"""

    reducer: str
    world_size: int
    ok: bool
    lane_bits: int | None = None
    levels: int | None = None
    reason: str = ""


class Encoded:
    """One rank's encoded contribution.

    `payload` goes into the reducer's collective; `scales` (one fp32 per segment, or
    None) are averaged across ranks; `local` is what this rank's contribution decodes
    to on its own, in gradient units (None for lossless paths) — error feedback keeps
    `x - local` for the next step. A reducer may hand `make_local` instead of `local`:
    then `local` is computed on first use (from state the encoder kept, never from the
    payload, which an in-place collective may overwrite), so paths without error
    feedback never pay for it.
    """

    __slots__ = ("payload", "scales", "_local", "_make_local")

    def __init__(
        self,
        payload: torch.Tensor,
        scales: torch.Tensor | None,
        local: torch.Tensor | None = None,
        make_local: Callable[[], torch.Tensor] | None = None,
    ) -> None:
        self.payload = payload
        self.scales = scales
        self._local = local
        self._make_local = make_local

    @property
    def local(self) -> torch.Tensor | None:
        if self._local is None and self._make_local is not None:
            self._local = self._make_local()
            self._make_local = None
        return self._local

    @local.setter
    def local(self, value: torch.Tensor | None) -> None:
        self._local, self._make_local = value, None

    def __repr__(self) -> str:
        return f"Encoded(payload={self.payload!r}, scales={self.scales!r}, local={self.local!r})"


def allreduce_factor(world_size: int) -> float:
    """Fraction of the payload each rank sends in a ring all-reduce: 2(W-1)/W."""
    return 2.0 * (world_size - 1) / world_size


def allgather_factor(world_size: int) -> float:
    """Payloads each rank sends in a ring all-gather: (W-1)/W of W payloads = W-1."""
    return float(world_size - 1)


# torch renamed all_gather_into_tensor to all_gather_single; use whichever this torch has.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_scales(scales: torch.Tensor, world_size: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather per-segment scales and average them in rank order (deterministic)."""
    out = torch.empty(world_size * scales.numel(), dtype=scales.dtype, device=scales.device)
    _all_gather_flat(out, scales.contiguous(), group=group)
    return mean_of_ranks(out.view(world_size, -1))


def mean_of_ranks(stacked: torch.Tensor) -> torch.Tensor:
    """Mean over dim 0 of a (W, k) stack: the one formula both `reduce` and `replay` use."""
    return stacked.sum(0) / stacked.shape[0]


class Reducer(ABC):
    """An aggregation path. Subclasses implement capacity, bytes, encode, launch, decode."""

    name: str
    route: str
    lossy: bool = True
    needs_shared_scale: bool = False
    """True when ranks must agree on a scale (all-reduce MAX) before encoding."""

    @abstractmethod
    def capacity(self, world_size: int) -> Capacity: ...

    def check(self, world_size: int) -> Capacity:
        """Capacity at W, or a `CapacityError` saying why the reducer cannot be exact."""
        cap = self.capacity(world_size)
        if not cap.ok:
            raise CapacityError(f"{self.name} ({self.route}) cannot run at W={world_size}: {cap.reason}")
        return cap

    @abstractmethod
    def payload_bytes(self, numel: int, world_size: int) -> int:
        """Bytes of this rank's payload tensor (before the collective's algorithm factor)."""

    @abstractmethod
    def wire_bytes(self, numel: int, world_size: int, segments: int = 1) -> float:
        """Bytes each rank sends for `numel` elements in `segments` scaled slices."""

    def bits_per_element(self, world_size: int, numel: int = 1 << 20) -> float:
        """Wire bits per gradient element for a large tensor (scales amortised)."""
        return 8.0 * self.wire_bytes(numel, world_size) / numel

    @abstractmethod
    def encode(
        self,
        x: torch.Tensor,
        lengths: Sequence[int],
        world_size: int,
        shared_scale: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> Encoded: ...

    @abstractmethod
    def launch(self, payload: torch.Tensor, world_size: int, group: dist.ProcessGroup | None) -> torch.futures.Future:
        """Start the one payload collective asynchronously; the future's value is the result."""

    def combine(self, payloads: Sequence[torch.Tensor]) -> torch.Tensor:
        """What the collective computes, for W virtual ranks in one process (replay).

        The default is the SUM all-reduce, added in rank order; all-gather paths override.
        """
        out = payloads[0].clone()
        for p in payloads[1:]:
            out += p
        return out

    @abstractmethod
    def decode(
        self,
        reduced: torch.Tensor,
        scale_mean: torch.Tensor | None,
        numel: int,
        lengths: Sequence[int],
        world_size: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The mean gradient estimate (fp32, length `numel`) from the reduced payload.

        With `out` (fp32, `numel` elements, e.g. a slice of the DDP bucket) the estimate is
        written there and `out` is returned; the values are the same either way.
        """

    # ---- shared scales (qsum) -----------------------------------------------------
    def local_scale(self, x: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        """This rank's candidate for the shared scale (reduced with MAX across ranks)."""
        return codecs.segment_max_abs(x, lengths)

    # ---- whole paths --------------------------------------------------------------
    def reduce(
        self,
        x: torch.Tensor,
        lengths: Sequence[int] | None = None,
        group: dist.ProcessGroup | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Mean of every rank's `x` through this path, on a real process group."""
        world_size = dist.get_world_size(group)
        self.check(world_size)
        x = x.reshape(-1).to(torch.float32)
        lengths = [x.numel()] if lengths is None else list(lengths)
        if x.numel() == 0:
            return x.clone()  # gloo rejects empty collectives: nothing to send
        shared = None
        if self.needs_shared_scale:
            shared = self.local_scale(x, lengths)
            dist.all_reduce(shared, op=dist.ReduceOp.MAX, group=group)
        enc = self.encode(x, lengths, world_size, shared, generator)
        fut = self.launch(enc.payload, world_size, group)
        scale_mean = None
        if enc.scales is not None:
            scale_mean = gather_scales(enc.scales, world_size, group)
        if shared is not None:
            scale_mean = shared
        reduced = fut.wait()
        return self.decode(reduced, scale_mean, x.numel(), lengths, world_size)

    def replay(
        self,
        xs: Sequence[torch.Tensor],
        lengths: Sequence[int] | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> torch.Tensor:
        """The same arithmetic as `reduce` for W virtual ranks in one process."""
        world_size = len(xs)
        self.check(world_size)
        flat = [x.reshape(-1).to(torch.float32) for x in xs]
        numel = flat[0].numel()
        lengths = [numel] if lengths is None else list(lengths)
        if numel == 0:
            return flat[0].clone()
        gens = list(generators) if generators is not None else [None] * world_size
        shared = None
        if self.needs_shared_scale:
            shared = torch.stack([self.local_scale(x, lengths) for x in flat]).amax(0)
        encs = [self.encode(x, lengths, world_size, shared, g) for x, g in zip(flat, gens, strict=True)]
        reduced = self.combine([e.payload for e in encs])
        scale_mean = None
        if encs[0].scales is not None:
            scale_mean = mean_of_ranks(torch.stack([e.scales for e in encs]))  # type: ignore[misc]
        if shared is not None:
            scale_mean = shared
        return self.decode(reduced, scale_mean, numel, lengths, world_size)


def _allreduce_future(payload: torch.Tensor, group: dist.ProcessGroup | None) -> torch.futures.Future:
    work = dist.all_reduce(payload, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _decode_scaled(containers, layout, numel, values, scales, lengths, out=None) -> torch.Tensor:
    """Table decode times the per-segment scale; one segment folds the scale into the table.

    fl(value * scale) is the same number either way, so both branches give identical bits.
    """
    if len(lengths) == 1:
        return decode_table(containers, layout, numel, values * scales.reshape(-1)[0], out)
    return codecs.scale_segments_(decode_table(containers, layout, numel, values, out), scales, lengths)


def _into(out: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """`value`, copied into `out` when one is given."""
    if out is None:
        return value
    return out.copy_(value.view(out.shape))


class AllReduce(Reducer):
    """Plain SUM all-reduce in fp32, bf16 or fp16, pre-scaled by 1/W (as DDP does) to avoid overflow."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self.route = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
        self.name = "allreduce"
        self.lossy = dtype != torch.float32

    def capacity(self, world_size: int) -> Capacity:
        return Capacity(self.name, world_size, ok=world_size >= 1)

    def payload_bytes(self, numel: int, world_size: int) -> int:
        return numel * torch.finfo(self.dtype).bits // 8

    def wire_bytes(self, numel: int, world_size: int, segments: int = 1) -> float:
        return allreduce_factor(world_size) * self.payload_bytes(numel, world_size)

    def encode(self, x, lengths, world_size, shared_scale=None, generator=None) -> Encoded:
        payload = (x * (1.0 / world_size)).to(self.dtype)  # DDP's own pre-scale
        local = payload.to(torch.float32) * world_size if self.lossy else None
        return Encoded(payload, None, local)

    def launch(self, payload, world_size, group):
        return _allreduce_future(payload, group)

    def decode(self, reduced, scale_mean, numel, lengths, world_size, out=None):
        return _into(out, reduced.to(torch.float32))


class _SignReducer(Reducer):
    """Shared decode for sign votes: a positive count per element -> vote x mean scale."""

    route = "sign"

    def __init__(self, vote: str = "majority") -> None:
        codecs.vote_table(2, vote)  # validate early
        self.vote = vote

    def _sign_encode(self, x: torch.Tensor, lengths: Sequence[int], layout: LaneLayout) -> Encoded:
        """Votes packed into `layout`, per-segment mean |x|, and (lazily) this rank's ±scale values."""
        lengths = list(lengths)
        n = x.numel()
        if n and _lanes.sign_pack_supported(x, layout):
            gather = layout.lane_bits == 1  # the payload is the packed votes themselves
            payload, sums, packed = _lanes.sign_pack(x, lengths, layout, want_bits=not gather)
            scales = torch.from_numpy((sums / np.maximum(np.asarray(lengths, dtype=np.float64), 1)).astype(np.float32))
            bits = payload.numpy().copy() if gather else packed
            return Encoded(payload, scales, make_local=lambda: codecs.sign_values_packed(bits, n, scales, lengths))
        bits = codecs.sign_bits(x)
        scales = codecs.segment_mean_abs(x, lengths)
        return Encoded(pack(bits, layout), scales, make_local=lambda: codecs.sign_values(bits, scales, lengths))

    def _vote_values(self, layout: LaneLayout, world_size: int, device: torch.device) -> torch.Tensor:
        """Vote per lane value, padded with 0 to the lane's range (sums above W never occur)."""
        table = torch.zeros(layout.max_value + 1, dtype=torch.float32, device=device)
        table[: world_size + 1] = codecs.vote_table(world_size, self.vote, device)
        return table

    def _decode_containers(self, containers, layout, scale_mean, numel, lengths, world_size, out=None):
        """Count lanes -> vote x mean scale, by table (one lookup per group of lanes on CPU)."""
        assert scale_mean is not None
        return _decode_scaled(containers, layout, numel, self._vote_values(layout, world_size, containers.device),
                              scale_mean, lengths, out)

    def _decode_counts(self, counts, scale_mean, lengths, world_size, out=None) -> torch.Tensor:
        table = codecs.vote_table(world_size, self.vote, counts.device)
        res = _into(out, table[counts.to(torch.int64)])
        assert scale_mean is not None
        return codecs.scale_segments_(res, scale_mean, lengths)


class SignCount(_SignReducer):
    """Compact sign-count aggregation: lane-packed 1-counts in ONE integer SUM all-reduce.

    Each rank puts its positive votes (0/1) into lanes of ceil(log2(W+1)) bits; the SUM
    of the containers yields, per element, how many ranks voted positive, c in [0, W].
    """

    name = "signcount"

    def layout(self, world_size: int) -> LaneLayout:
        return layout_for(count_lane_bits(world_size))

    def capacity(self, world_size: int) -> Capacity:
        bits = count_lane_bits(world_size)
        if bits > 63:
            return Capacity(self.name, world_size, False, bits, reason="count lanes wider than 63 bits")
        return Capacity(self.name, world_size, True, lane_bits=bits)

    def payload_bytes(self, numel: int, world_size: int) -> int:
        lay = self.layout(world_size)
        return lay.containers_for(numel) * lay.storage_bits // 8

    def wire_bytes(self, numel: int, world_size: int, segments: int = 1) -> float:
        return (allreduce_factor(world_size) * self.payload_bytes(numel, world_size)
                + allgather_factor(world_size) * 4 * segments)

    def encode(self, x, lengths, world_size, shared_scale=None, generator=None) -> Encoded:
        return self._sign_encode(x, lengths, self.layout(world_size))

    def launch(self, payload, world_size, group):
        return _allreduce_future(payload, group)

    def decode(self, reduced, scale_mean, numel, lengths, world_size, out=None):
        return self._decode_containers(reduced, self.layout(world_size), scale_mean, numel, lengths, world_size, out)


class SignGather(_SignReducer):
    """Packed 1-bit signs via all-gather, counted locally: cheaper than signcount at small W."""

    name = "signgather"
    _layout = layout_for(1)

    def capacity(self, world_size: int) -> Capacity:
        return Capacity(self.name, world_size, ok=world_size >= 1, lane_bits=1)

    def payload_bytes(self, numel: int, world_size: int) -> int:
        return self._layout.containers_for(numel)

    def wire_bytes(self, numel: int, world_size: int, segments: int = 1) -> float:
        return allgather_factor(world_size) * (self.payload_bytes(numel, world_size) + 4 * segments)

    def encode(self, x, lengths, world_size, shared_scale=None, generator=None) -> Encoded:
        return self._sign_encode(x, lengths, self._layout)

    def launch(self, payload, world_size, group):
        out = torch.empty(world_size * payload.numel(), dtype=payload.dtype, device=payload.device)
        work = _all_gather_flat(out, payload, group=group, async_op=True)
        return work.get_future().then(lambda _: out)

    def combine(self, payloads):
        return torch.cat(list(payloads))

    def decode(self, reduced, scale_mean, numel, lengths, world_size, out=None):
        rows = reduced.view(world_size, -1)
        count_layout = layout_for(count_lane_bits(world_size))
        if (_lanes._numpy_ok(reduced) and count_layout.lane_bits <= 4 and numel
                and (out is None or (out.dtype == torch.float32 and out.is_contiguous() and _lanes._numpy_ok(out)))):
            # bit-sliced counts, one table lookup per group of elements (vote x scale folded in)
            assert scale_mean is not None
            lengths = list(lengths)
            vals = self._vote_values(count_layout, world_size, reduced.device)
            if len(lengths) == 1:
                vals = vals * scale_mean.reshape(-1)[0]
            res = torch.empty(numel, dtype=torch.float32) if out is None else out
            _lanes.decode_bit_rows(rows.contiguous().numpy(), numel, vals.numpy(), res.view(-1).numpy())
            return res if len(lengths) == 1 else codecs.scale_segments_(res, scale_mean, lengths)
        small = world_size <= 255
        counts = torch.zeros(numel, dtype=torch.uint8 if small else torch.int32, device=reduced.device)
        for r in range(world_size):
            counts += unpack(rows[r], self._layout, numel)
        if small and count_layout.container == torch.uint8:
            # re-lane the counts (one multiply per word) and decode a container per lookup
            return self._decode_containers(pack(counts, count_layout), count_layout, scale_mean, numel,
                                           lengths, world_size, out)
        return self._decode_counts(counts, scale_mean, lengths, world_size, out)


class QSum(Reducer):
    """Stochastically rounded levels, offset to non-negative, lane-packed and summed exactly.

    Lanes are `bits` wide. For the W-rank sum to fit, each rank gets M = floor((2^bits-1)/W)
    steps, i.e. M+1 levels spanning [-s, s] with s the per-segment max |x| agreed across
    ranks (all-reduce MAX). Levels shrink as W grows; below 2 levels (M < 1) the reducer
    is over capacity.
    """

    name = "qsum"
    needs_shared_scale = True

    def __init__(self, bits: int) -> None:
        if bits not in (2, 4, 8):
            raise ValueError(f"qsum supports 2, 4 or 8 bit lanes, got {bits}")
        self.bits = bits
        self.route = f"q{bits}"
        self._layout = layout_for(bits)

    def max_level(self, world_size: int) -> int:
        return ((1 << self.bits) - 1) // world_size

    def capacity(self, world_size: int) -> Capacity:
        m = self.max_level(world_size)
        if m < 1:
            return Capacity(self.name, world_size, False, self.bits, m + 1,
                            reason=f"{self.bits}-bit lanes leave fewer than 2 levels per rank")
        return Capacity(self.name, world_size, True, lane_bits=self.bits, levels=m + 1)

    def payload_bytes(self, numel: int, world_size: int) -> int:
        return self._layout.containers_for(numel) * self._layout.storage_bits // 8

    def wire_bytes(self, numel: int, world_size: int, segments: int = 1) -> float:
        # the MAX all-reduce of scales is a ring all-reduce of `segments` fp32 values
        return allreduce_factor(world_size) * (self.payload_bytes(numel, world_size) + 4 * segments)

    def level_values(self, world_size: int, count: int, device: torch.device) -> torch.Tensor:
        """Lane value (a sum of `count` ranks' levels) -> mean value in units of the scale."""
        m = self.max_level(world_size)
        levels = torch.arange(self._layout.max_value + 1, dtype=torch.float32, device=device)
        return levels * (2.0 / (m * count)) - 1.0

    def encode(self, x, lengths, world_size, shared_scale=None, generator=None) -> Encoded:
        assert shared_scale is not None, "qsum needs the shared (MAX) scale"
        m = self.max_level(world_size)
        t = torch.empty_like(x, dtype=torch.float32)
        start = 0
        for n, s in zip(lengths, shared_scale.tolist(), strict=True):
            torch.div(x[start : start + n], s if s > 0 else 1.0, out=t[start : start + n])
            start += n
        t.add_(1.0).mul_(0.5 * m)  # level coordinate in [0, m] for |x| <= scale
        t.add_(_uniform_noise(t, lengths, generator))
        levels = t.floor_().clamp_(0, m).to(torch.uint8)  # unbiased stochastic rounding
        payload = pack(levels, self._layout)
        local = _decode_scaled(payload, self._layout, x.numel(), self.level_values(world_size, 1, x.device),
                               shared_scale, lengths)
        return Encoded(payload, None, local)

    def launch(self, payload, world_size, group):
        return _allreduce_future(payload, group)

    def decode(self, reduced, scale_mean, numel, lengths, world_size, out=None):
        assert scale_mean is not None
        return _decode_scaled(reduced, self._layout, numel, self.level_values(world_size, world_size, reduced.device),
                              scale_mean, lengths, out)


def _uniform_noise(
    t: torch.Tensor, lengths: Sequence[int], generator: torch.Generator | Sequence[torch.Generator] | None
) -> torch.Tensor:
    """U[0,1) rounding noise: from one generator, or one generator per segment.

    Per-segment generators (the runtime seeds one per parameter and step) make the noise
    a parameter sees independent of which bucket, and which neighbours, it travels with —
    so a resumed run, whose first step uses DDP's initial buckets, rounds exactly as the
    uninterrupted run did with the rebuilt ones.
    """
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand(t.shape, generator=generator, device=t.device, dtype=t.dtype)
    parts = [torch.rand(n, generator=g, device=t.device, dtype=t.dtype)
             for n, g in zip(lengths, generator, strict=True)]
    return torch.cat(parts) if parts else torch.empty_like(t)


REDUCERS: dict[str, Reducer] = {
    "allreduce-fp32": AllReduce(torch.float32),
    "allreduce-bf16": AllReduce(torch.bfloat16),
    "allreduce-fp16": AllReduce(torch.float16),
    "signcount": SignCount(),
    "signgather": SignGather(),
    "qsum-q8": QSum(8),
    "qsum-q4": QSum(4),
    "qsum-q2": QSum(2),
}


def candidates(route: str) -> list[Reducer]:
    """Reducers that can carry a route; `sign` has two (chosen by cost and capacity)."""
    if route == "fp32":
        return [REDUCERS["allreduce-fp32"]]
    if route in ("bf16", "fp16"):
        return [REDUCERS[f"allreduce-{route}"]]
    if route in ("q8", "q4", "q2"):
        return [REDUCERS[f"qsum-{route}"]]
    if route == "sign":
        return [REDUCERS["signgather"], REDUCERS["signcount"]]
    raise ValueError(f"unknown route {route!r}; routes are {', '.join(codecs.ROUTES)}")
