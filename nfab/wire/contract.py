"""The reducer contract and what every aggregation path shares.

A reducer is split into pure steps so the hook runtime can batch and overlap them:

    encode (local, pure) -> one payload collective (async) -> decode (pure)

plus a per-segment scale vector that the runtime averages across ranks in its control
word. `reduce` runs the whole path on a real process group; `replay` runs the same
arithmetic for W virtual ranks in one process (calibration).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from nfab.errors import CapacityError
from nfab.wire import segments
from nfab.wire.qsum.host import decode_table


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
    then `local` is computed on first use, so paths without error feedback never pay for
    it. Read it before launching the payload: an in-place collective overwrites the
    payload, and one-lane qsum keeps no second copy of its levels (a second fresh 4M-element
    array per encode cost 1.8 ms of page faults, 0.7x its rounding pass); the hook and the
    two-level path read it right after encode, and replay's `combine` sums copies. `sq`,
    when the encoder took it on its own read of the values (`encode_views(...,
    with_sq=True)`), is the x^2 sum of everything it encoded (fp32, 0-d).
    """

    __slots__ = ("payload", "scales", "_local", "_make_local", "sq")

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
        self.sq: torch.Tensor | None = None

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
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# likewise reduce_scatter_tensor -> reduce_scatter_single: (output, input, op, group, async_op)
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def gather_scales(scales: torch.Tensor, world_size: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather per-segment scales and average them in rank order (deterministic)."""
    out = torch.empty(world_size * scales.numel(), dtype=scales.dtype, device=scales.device)
    all_gather_flat(out, scales.contiguous(), group=group)
    return mean_of_ranks(out.view(world_size, -1))


def mean_of_ranks(stacked: torch.Tensor) -> torch.Tensor:
    """Mean over dim 0 of a (W, k) stack: the one formula both `reduce` and `replay` use."""
    return stacked.sum(0) / stacked.shape[0]


class ScaleAgreement(Enum):
    """How a reducer's ranks agree the scale they round in before encoding (`Reducer.scale_agreement`).

    The runtime asks this instead of naming a codec: it decides what a group's encoding waits for,
    what the control word carries, and where the delayed amax history applies."""

    NONE = "none"
    """Nothing agreed before encoding: lossless, or each rank's per-slice scales (sign's mean |x|)
    are averaged over ranks after the collective (`gather_scales`, or the control word)."""
    PER_SLICE = "slice"
    """One fp32 max |x| per slice, MAX-agreed (qsum): exactly, or from the delayed amax history,
    which is kept per parameter -- so each rank's max |x| rides the control word to feed it."""
    PER_BLOCK = "block"
    """One uint8 scale code per block, MAX-agreed exactly every step (block-scaled qsum): a block
    has no history of its own, and the agreed codes are the whole scale (the decode and its rounding
    variance, `runtime/control/moment.py`, read nothing else), so no max |x| goes in the word."""


class Reducer(ABC):
    """An aggregation path. Subclasses implement capacity, bytes, encode, launch, decode."""

    name: str
    route: str
    lossy: bool = True
    scale_agreement: ScaleAgreement = ScaleAgreement.NONE
    """How ranks agree the scale they round in before encoding (`ScaleAgreement`)."""
    own_scale_when_gathered: bool = False
    """True when, in a gathered bucket (one all-gather: nothing is summed on the wire), each rank
    rounds in its OWN per-slice scale instead of an agreed one, sends that scale in the control
    word, and every rank decodes each rank's row with that row's scales (`QSum.encode_own_views`,
    `QSum.decode_gathered`). Why: ranks agree a scale only so that their levels can be summed; a
    rank's own max never saturates, gives finer levels and costs no agreement round."""
    stratified_rounding: bool = False
    """True when the ranks round with the SAME noise keys, each shifted by its rank
    (`noise.Stratum`), instead of independent keys: the W ranks' rounding errors partly cancel in
    the sum (block-scaled qsum; `runtime/control/moment.py` gives the variance). The runtime then
    seeds the group's noise without the rank, and hands the reducer a stratum."""
    blocking_rounds: int = 0
    """Collectives the hook must wait for before encoding (block-scaled qsum's code agreement)."""
    payload_collectives: int = 1
    """Collectives `launch` starts for the payload (two for the reduce-scatter / all-to-all + all-gather
    reducers): counted in the step's statistics."""

    @property
    def needs_shared_scale(self) -> bool:
        """True when ranks must agree on a scale (all-reduce MAX) before encoding."""
        return self.scale_agreement is not ScaleAgreement.NONE

    def row_numel(self, numel: int, world_size: int) -> int:
        """Elements of one row of a row-wise reduce-scatter's (W, `numel`) input as this codec's
        segment tables cover it (`runtime/core/rowscatter.py`, FSDP2): the row as it is, unless the
        codec lays its rows out padded (sign: whole vote bytes, the tail a segment of its own)."""
        return numel

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

    def collective_factor(self, world_size: int) -> float:
        """Bytes each rank sends per payload byte under this reducer's collective (ring all-reduce)."""
        return allreduce_factor(world_size)

    def link_bytes(self, numel: int, world_size: int, segments: int = 1) -> dict[str, float]:
        """`wire_bytes` split by the kind of collective that sends them ("allreduce",
        "allgather", "reducescatter"): the cost model prices each kind with its own measured
        latency and bandwidth, one latency per collective. "blocking" holds the bytes of the
        `blocking_rounds` when listed apart (all-reduce bandwidth; their latency is counted once,
        per round)."""
        return {"allreduce": self.wire_bytes(numel, world_size, segments)}

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
        tie: int = 0,
    ) -> Encoded:
        """This rank's payload of `x` (segments `lengths`), for W = `world_size`. `tie`: which way
        an exact zero votes on the sign routes (positive when tie is even; one bit cannot
        abstain): the hook passes group rank + step, so that the ranks' zeros cancel. The other
        routes keep a zero exactly and ignore it."""

    def reads_sq(self, buffer: torch.Tensor) -> bool:
        """Whether `encode_views(..., with_sq=True)` takes the x^2 sum of views of `buffer` on its
        own read (sets `Encoded.sq`)."""
        return False

    def encode_views(self, views: Sequence[torch.Tensor], lengths: Sequence[int], world_size: int,
                     with_sq: bool = False, tie: int = 0) -> Encoded:
        """`encode` of the concatenated `views` (segments read in place, e.g. a mixed
        bucket's slices), for reducers that need no shared scale or noise. Reducers that
        can read the views directly override this to skip the gathered copy; with `with_sq`
        those that `reads_sq` set `Encoded.sq`."""
        return self.encode(torch.cat(list(views)), lengths, world_size, tie=tie)

    @abstractmethod
    def launch(self, payload: torch.Tensor, world_size: int, group: dist.ProcessGroup | None) -> torch.futures.Future:
        """Start the one payload collective asynchronously; the future's value is the result."""

    # ---- two-phase reducers: a reduce-scatter or all-to-all, the shard owner's step, an all-gather ----
    def owner_share(self, payloads: Sequence[torch.Tensor], rank: int) -> torch.Tensor | None:
        """What rank `rank` holds after the first of two collectives, made from W ranks' payloads in
        one process; None for a reducer with one collective (no owner step). Benchmarks and the cost
        model time `owner_step` on it: it is codec work each rank does on its shard."""
        return None

    def owner_step(self, received: torch.Tensor, world_size: int) -> torch.Tensor:
        """The shard owner's work between the two collectives (what it all-gathers)."""
        raise NotImplementedError(f"{self.name} sends one collective: it has no owner step")

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
        out: Out = None,
    ) -> Any:
        """The mean gradient estimate (fp32, length `numel`) from the reduced payload.

        With `out` (fp32, `numel` elements, e.g. a slice of the DDP bucket) the estimate is
        written there and `out` is returned; with a list of per-segment destinations (see
        `Out`) each segment is written to its own and the list is returned. The values are
        the same either way.
        """

    # ---- shared scales (qsum) -----------------------------------------------------
    def local_scale(self, x: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        """This rank's candidate for the shared scale (reduced with MAX across ranks)."""
        return segments.segment_max_abs(x, lengths)

    def agree_input(self, local: torch.Tensor) -> torch.Tensor:
        """What the agreement MAX all-reduces for `local_scale`'s values (the hook batches a
        bucket's agreements into one collective: `runtime/core/agreement.py`); may be `local` itself."""
        return local

    def agree(self, local: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        """The shared scale every rank encodes with: the MAX over ranks of `local_scale` (a
        blocking collective; a new tensor, `local` is kept). Its bytes are its element size."""
        shared = self.agree_input(local).clone()
        dist.all_reduce(shared, op=dist.ReduceOp.MAX, group=group)
        return shared

    # ---- whole paths --------------------------------------------------------------
    def reduce(
        self,
        x: torch.Tensor,
        lengths: Sequence[int] | None = None,
        group: dist.ProcessGroup | None = None,
        generator: torch.Generator | None = None,
        step: int = 0,
    ) -> torch.Tensor:
        """Mean of every rank's `x` through this path, on a real process group (`step`: the zeros'
        tie on the sign routes is group rank + step, as in the hook)."""
        world_size = dist.get_world_size(group)
        self.check(world_size)
        x = x.reshape(-1).to(torch.float32)
        lengths = [x.numel()] if lengths is None else list(lengths)
        if x.numel() == 0:
            return x.clone()  # gloo rejects empty collectives: nothing to send
        shared = None
        if self.needs_shared_scale:
            shared = self.agree(self.local_scale(x, lengths), group)
        enc = self.encode(x, lengths, world_size, shared, generator, tie=dist.get_rank(group) + step)
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
        step: int = 0,
    ) -> torch.Tensor:
        """The same arithmetic as `reduce` for W virtual ranks in one process (virtual rank r
        is group rank r)."""
        return self.replay_mean(xs, lengths, generators, step)

    def replay_mean(
        self,
        xs: Sequence[torch.Tensor],
        lengths: Sequence[int] | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
        step: int = 0,
    ) -> torch.Tensor:
        """`replay_with_locals(...)[0]`, bit for bit, without decoding any rank's own contribution
        (a replay without error feedback never reads it; `Encoded.make_local` stays unmade)."""
        return self._replay(xs, lengths, generators, step)[0]

    def replay_with_locals(
        self,
        xs: Sequence[torch.Tensor],
        lengths: Sequence[int] | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
        step: int = 0,
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """`replay`, plus each virtual rank's own decoded contribution (error feedback keeps x - local)."""
        mean, encs = self._replay(xs, lengths, generators, step)
        return mean, [e.local for e in encs] if encs else [None] * len(xs)

    def _replay(
        self,
        xs: Sequence[torch.Tensor],
        lengths: Sequence[int] | None,
        generators: Sequence[torch.Generator | None] | None,
        step: int = 0,
    ) -> tuple[torch.Tensor, list[Encoded]]:
        """The W virtual ranks' mean and their encodings (none for an empty input)."""
        world_size = len(xs)
        self.check(world_size)
        flat = [x.reshape(-1).to(torch.float32) for x in xs]
        numel = flat[0].numel()
        lengths = [numel] if lengths is None else list(lengths)
        if numel == 0:
            return flat[0].clone(), []
        gens = list(generators) if generators is not None else [None] * world_size
        shared = None
        if self.needs_shared_scale:
            shared = torch.stack([self.local_scale(x, lengths) for x in flat]).amax(0)
        encs = [self.encode(x, lengths, world_size, shared, g, tie=r + step)
                for r, (x, g) in enumerate(zip(flat, gens, strict=True))]
        reduced = self.combine([e.payload for e in encs])
        scale_mean = None
        if encs[0].scales is not None:
            scale_mean = mean_of_ranks(torch.stack([e.scales for e in encs]))  # type: ignore[misc]
        if shared is not None:
            scale_mean = shared
        return self.decode(reduced, scale_mean, numel, lengths, world_size), encs


class TwoPhaseReducer(Reducer):
    """A payload sent as a ring all-reduce's two halves with work between them: a first collective
    (reduce-scatter or all-to-all, `scatter`) leaves each rank its shard, the shard's owner reduces it
    (`owner_step`), and an all-gather hands every rank every owner's result. `launch` runs the first
    collective to completion and launches the all-gather itself, so both are launched from the
    caller (the hook body, in bucket order), never from a future callback."""

    payload_collectives = 2

    @abstractmethod
    def scatter(self, payload: torch.Tensor, world_size: int, group: dist.ProcessGroup | None) -> torch.Tensor:
        """The first collective, run to completion: what this rank holds of it (`owner_share` on a real group)."""

    @abstractmethod
    def owner_share(self, payloads: Sequence[torch.Tensor], rank: int) -> torch.Tensor: ...

    @abstractmethod
    def owner_step(self, received: torch.Tensor, world_size: int) -> torch.Tensor: ...

    def launch(self, payload, world_size, group):
        mine = self.owner_step(self.scatter(payload, world_size, group), world_size)
        out = torch.empty(world_size * mine.numel(), dtype=mine.dtype, device=mine.device)
        work = all_gather_flat(out, mine, group=group, async_op=True)
        return work.get_future().then(lambda _: out)

    def combine(self, payloads):
        """The first collective, every owner's step and the all-gather, for W virtual ranks (rank order)."""
        w = len(payloads)
        return torch.cat([self.owner_step(self.owner_share(payloads, r), w) for r in range(w)])


def allreduce_future(payload: torch.Tensor, group: dist.ProcessGroup | None) -> torch.futures.Future:
    work = dist.all_reduce(payload, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


Out = torch.Tensor | Sequence[torch.Tensor] | None
"""Where a decode writes: nowhere (a new tensor), one fp32 tensor of `numel` elements, or
one destination view per segment (a mixed bucket's slices: decoded, scaled and written
to their own offsets in one pass, with no temporary group tensor to scatter)."""


def split_out(out: Out) -> tuple[torch.Tensor | None, list[torch.Tensor] | None]:
    """(one destination tensor or None, per-segment destinations or None)."""
    if out is None or isinstance(out, torch.Tensor):
        return out, None
    dests = list(out)
    if len(dests) == 1:
        return dests[0], None
    return None, dests


def finish_segments(unit: torch.Tensor, scales: torch.Tensor, lengths: Sequence[int], out: Out) -> Any:
    """Scale a decode's unit values per segment, in place or into per-segment destinations."""
    _, dests = split_out(out)
    if dests is not None:
        segments.scale_segments_into(unit, scales, lengths, dests)
        return dests
    return segments.scale_segments_(unit, scales, lengths)


def decode_scaled(containers, layout, numel, values, scales, lengths, out: Out = None) -> Any:
    """Table decode times the per-segment scale; one segment folds the scale into the table.

    fl(value * scale) is the same number either way, so both branches give identical bits.
    """
    one, dests = split_out(out)
    if len(lengths) == 1:
        return decode_table(containers, layout, numel, values * scales.reshape(-1)[0], one)
    return finish_segments(decode_table(containers, layout, numel, values, one), scales, lengths, out)


def write_into(out: Out, value: torch.Tensor) -> Any:
    """`value`, copied into `out` (one tensor, or per-segment destinations) when one is given."""
    one, dests = split_out(out)
    if dests is not None:
        for part, d in zip(torch.split(value.reshape(-1), [t.numel() for t in dests]), dests, strict=True):
            d.copy_(part)
        return dests
    if one is None:
        return value
    return one.copy_(value.view(one.shape))


