"""Cost model: is a compressed path cheaper than FP32 all-reduce on *this* link?

time(path, numel, W) = latency + wire_bytes / bandwidth + codec time
where wire_bytes comes from the reducer (what each rank sends under the collective's
algorithm), latency and bandwidth are measured per collective kind on the real backend,
and codec time is the measured encode+decode cost per element. Compression often does
not pay on fast links; nfab must never be the slow path, so the runtime admits a
compressed route only when this model says it is cheaper.

`measure(group)` runs real collectives, interleaved over sizes and started together (a barrier
before each), takes a low trimmed statistic of many repetitions, and all-reduces every figure with MAX
once, so all ranks hold the same model and take the same routing decisions. A fit whose figures no
link could produce (a latency at or below zero, a bandwidth above a local memory copy's, a line that
misses its points) is kept with its problems named (`CostModel.implausible`): the gate then keeps
FP32, the choice that is always correct. `declared("link:100mbit,50us")` prices a link the user
names, measuring nothing. The gate itself (`gate`) has hysteresis: see GATE_MARGIN.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from nfab.errors import ConfigError, NfabError
from nfab.wire.registry import REDUCERS, Reducer


@dataclass(frozen=True, slots=True)
class LinkCost:
    """One collective kind's latency (s) and effective bandwidth (wire bytes per second)."""

    latency_s: float
    bandwidth_bps: float


@dataclass(frozen=True, slots=True)
class CostModel:
    """Measured constants for one backend and world size."""

    backend: str
    world_size: int
    allreduce: LinkCost
    allgather: LinkCost
    codec_s_per_element: dict[str, float] = field(default_factory=dict)
    """Encode+decode seconds per element, keyed by reducer key (see REDUCERS)."""
    source: str = "default"
    reducescatter: LinkCost | None = None
    """Reduce-scatter's own constants (gloo's can be far from half an all-reduce); None:
    priced as the all-reduce link (a ring all-reduce is a reduce-scatter plus an all-gather)."""
    implausible: tuple[str, ...] = ()
    """Why the measured figures cannot describe a real link (empty: they can). Non-empty, the cost gate
    keeps every region at FP32 (`Controller`): a route is never admitted on numbers nothing could produce."""

    def time(self, key: str, numel: int, world_size: int | None = None, segments: int = 1) -> float:
        """Modelled seconds for reducer `key` to reduce `numel` elements."""
        w = world_size or self.world_size
        red = REDUCERS[key]
        # one latency per collective, each kind at its own measured bandwidth. qsum's scale agreement is
        # not priced as a round: the runtime's delayed scales ride the control word.
        links = {"allreduce": self.allreduce, "allgather": self.allgather,
                 "reducescatter": self.reducescatter or self.allreduce, "blocking": self.allreduce}
        # "blocking": the bytes of the blocking rounds (all-reduces), whose latency is counted below
        t = sum((0.0 if kind == "blocking" else links[kind].latency_s) + b / links[kind].bandwidth_bps
                for kind, b in red.link_bytes(numel, w, segments).items())
        t += red.blocking_rounds * self.allreduce.latency_s  # e.g. blockq's uint8 MAX of block codes
        return t + self.codec_s_per_element.get(key, 0.0) * numel

    def cheaper_than_fp32(self, key: str, numel: int, world_size: int | None = None, segments: int = 1) -> bool:
        return self.time(key, numel, world_size, segments) < self.time("allreduce-fp32", numel, world_size)

    def link_line(self) -> str:
        """The all-reduce link in words: `12.70 Gbit/s, 333 us latency`."""
        link = self.allreduce
        return f"{link.bandwidth_bps * 8 / 1e9:.2f} Gbit/s, {link.latency_s * 1e6:.0f} us latency"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        try:
            return cls(
                backend=str(d["backend"]),
                world_size=int(d["world_size"]),
                allreduce=LinkCost(**d["allreduce"]),
                allgather=LinkCost(**d["allgather"]),
                codec_s_per_element={str(k): float(v) for k, v in d.get("codec_s_per_element", {}).items()},
                source=str(d.get("source", "file")),
                reducescatter=LinkCost(**d["reducescatter"]) if d.get("reducescatter") else None,
                implausible=tuple(str(p) for p in d.get("implausible", ())),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise NfabError(f"malformed cost model: {exc}") from exc

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise NfabError(f"cannot read cost model {path}: {exc}") from exc


def default_cost_model(world_size: int, bandwidth_bps: float = 1.25e9, latency_s: float = 50e-6) -> CostModel:
    """A 10 Gbit/s-like link with no codec cost: used only when nothing was measured."""
    link = LinkCost(latency_s, bandwidth_bps)
    return CostModel("unmeasured", world_size, link, link, {}, source="default")


def best_time(fn, reps: int, clock=time.perf_counter) -> float:
    """Best of `reps` timed calls after one warm-up call (connection set-up, allocation).

    `clock=time.process_time` times CPU seconds instead of wall seconds: on a shared
    machine that leaves out the time the process waited for a core."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def measure_codecs(world_size: int, numel: int = 1 << 18, reps: int = 9,
                   device: torch.device | str = "cpu") -> dict[str, float]:
    """Encode+decode seconds per element for every reducer that can run at W (one process),
    on `device` (where the gradients live): `trimmed_time` of `reps` calls, as the links are timed
    (a codec priced at its best call against a link at its median favoured low bits under load)."""
    x = torch.randn(numel, generator=torch.Generator(device=device).manual_seed(0), device=device)  # never the user's
    done = _synchronizer(device)
    out: dict[str, float] = {}
    for key, red in REDUCERS.items():
        if key == "allreduce-fp32" or not red.capacity(world_size).ok:
            continue
        run = codec_work(red, x, world_size)
        out[key] = trimmed_time(timed(lambda r=run: done(r()), reps)) / numel
    return out


def _synchronizer(device: torch.device | str):
    """On CUDA a call returns when its kernels are queued: wait for them, so the timer measures
    the work (attach-time measurement, never in the hook). Elsewhere the call has finished."""
    if torch.device(device).type == "cuda":
        return lambda result=None: torch.cuda.synchronize(device)
    return lambda result=None: result


def codec_work(red: Reducer, x: torch.Tensor, world_size: int) -> Callable[[], torch.Tensor]:
    """One rank's codec work per step as a closure: its scale, its encode, its owner step (two-phase
    reducers: on its one shard) and the decode of a reduced payload into a preallocated output, as the
    hook decodes into its bucket. What the network computes (the payloads' sum, for W copies of this
    rank's payload) is made once, outside: no rank does it."""
    lengths = [x.numel()]

    def agreed() -> torch.Tensor | None:  # what the hook's agreement MAX all-reduces (blockq: its codes)
        return red.agree_input(red.local_scale(x, lengths)) if red.needs_shared_scale else None

    shared = agreed()
    noise = torch.Generator(device=x.device).manual_seed(0)  # the rounding's, never torch's global generator
    enc = red.encode(x, lengths, world_size, shared, noise)
    payloads = [enc.payload] * world_size
    reduced = red.combine(payloads)
    share = red.owner_share(payloads, 0)
    scale = enc.scales if enc.scales is not None else shared
    out = torch.empty_like(x)

    def run() -> torch.Tensor:
        red.encode(x, lengths, world_size, agreed(), noise)
        if share is not None:
            red.owner_step(share, world_size)
        return red.decode(reduced, scale, x.numel(), lengths, world_size, out=out)

    return run


MIN_BANDWIDTH_BPS = 1e6  # 8 Mbit/s: anything slower is a measurement accident
MAX_BANDWIDTH_BPS = 1e12
MIN_LATENCY_S = 1e-6
MAX_LATENCY_S = 0.1
REPS = 15
"""Timed repetitions of each collective figure (after one warm-up)."""
COPY_HEADROOM = 2.0
"""A link is implausible above this many times the bandwidth of a local copy of the same bytes: loopback
and shared memory copy every byte at least once, and nothing moves bytes between ranks faster than that."""
MAX_RESIDUAL = 0.5
"""A fit is implausible when its line misses its points by more than this (RMS of the relative errors)."""
GATE_MARGIN = 0.15
"""The gate's hysteresis: FP32 -> low bits only at a predicted saving of 15% or more; back to FP32 only
when low bits are predicted 15% dearer. In between a route keeps what it had, so the 5-10% a noisy
figure moves the prediction cannot flip a route (`gate`)."""


def trimmed_time(samples: Sequence[float]) -> float:
    """The mean of the fastest half of `samples` without its fastest tenth.

    Timing noise on a shared machine is one-sided: a neighbour taking the core makes a call slower,
    nothing makes it faster than its cost. The slow half (a median's neighbourhood under load) is what
    moved runs' figures 2-6x apart on a 2-core host; the fastest tenth is the luck of one call."""
    ordered = sorted(samples)
    n = len(ordered)
    kept = ordered[n // 10 : max(n // 2, n // 10 + 1)]
    return sum(kept) / len(kept)


def timed(fn: Callable[[], object], reps: int, clock=time.perf_counter) -> list[float]:
    """Seconds of `reps` calls of `fn` after one warm-up call."""
    fn()
    out = []
    for _ in range(reps):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


def median_time(fn, reps: int) -> float:
    """Median of `reps` timed calls after one warm-up call."""
    times = sorted(timed(fn, reps))
    return times[len(times) // 2]


@dataclass(frozen=True, slots=True)
class LineFit:
    """Least-squares time = latency + bytes * seconds_per_byte, unclamped, with its relative RMS error."""

    latency_s: float
    seconds_per_byte: float
    residual: float


def fit_line(points: Sequence[tuple[float, float]]) -> LineFit:
    """The least-squares line through (bytes, seconds) points, as measured (nothing clamped)."""
    n = len(points)
    mb = sum(b for b, _ in points) / n
    mt = sum(t for _, t in points) / n
    var = sum((b - mb) ** 2 for b, _ in points)
    slope = sum((b - mb) * (t - mt) for b, t in points) / var if var > 0 else 0.0
    latency = mt - slope * mb
    rel = [(latency + slope * b - t) / t for b, t in points if t > 0]
    residual = math.sqrt(sum(r * r for r in rel) / len(rel)) if rel else math.inf
    return LineFit(latency, slope, residual)


def fit_link(points: Sequence[tuple[float, float]]) -> LinkCost:
    """Least-squares time = latency + bytes / bandwidth over (bytes, seconds) points, clamped.

    Clamping keeps one noisy sample from claiming an infinite or negative bandwidth; `implausible`
    names such a fit, so that the gate does not trust the clamped figures either."""
    fit = fit_line(points)
    slope = min(max(fit.seconds_per_byte, 1.0 / MAX_BANDWIDTH_BPS), 1.0 / MIN_BANDWIDTH_BPS)
    latency = min(max(fit.latency_s, MIN_LATENCY_S), MAX_LATENCY_S)
    return LinkCost(latency_s=latency, bandwidth_bps=1.0 / slope)


def implausible(kind: str, fit: LineFit, copy_bps: float) -> list[str]:
    """What in one collective's fit no real link produces (empty: nothing); `copy_bps`, the bandwidth of a
    local copy of the same bytes."""
    out = []
    if fit.latency_s <= 0:
        out.append(f"{kind} latency {fit.latency_s * 1e6:.0f} us")
    elif fit.latency_s > MAX_LATENCY_S:
        out.append(f"{kind} latency {fit.latency_s * 1e3:.0f} ms")
    if fit.seconds_per_byte <= 0:
        out.append(f"{kind} time falling with size")
    elif 1.0 / fit.seconds_per_byte > COPY_HEADROOM * copy_bps:
        out.append(f"{kind} {8 / fit.seconds_per_byte / 1e9:.1f} Gbit/s, over {COPY_HEADROOM:g}x a local copy's "
                   f"{copy_bps * 8 / 1e9:.1f}")
    if fit.residual > MAX_RESIDUAL:
        out.append(f"{kind} line missing its points by {fit.residual:.0%}")
    return out


def predicted_saving(model: CostModel, key: str, numel: int, world_size: int | None = None,
                     segments: int = 1) -> float:
    """The fraction of FP32's modelled time that reducer `key` saves on `numel` elements (negative: dearer).
    `model`: a `CostModel` or anything that prices like one (FSDP2's `ShardCost`)."""
    fp32 = model.time("allreduce-fp32", numel, world_size)
    return 1.0 - model.time(key, numel, world_size, segments) / fp32 if fp32 > 0 else 0.0


def gate(saving: float, compressing: bool, margin: float = GATE_MARGIN) -> bool:
    """Whether a route compresses, given its predicted `saving` and whether it `compressing` now.

    FP32 switches to low bits at a saving of `margin` or more; low bits switch back only at a saving of
    `-margin` or less (dearer by the margin). A route starts at FP32, so a first decision needs the whole
    margin, and a figure inside the band leaves the route as it was."""
    return saving > -margin if compressing else saving >= margin


_RATE = re.compile(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)(kbit|mbit|gbit)(/s)?", re.IGNORECASE)
_DELAY = re.compile(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)(us|ms|s)", re.IGNORECASE)
_RATE_UNITS = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8}  # bytes per second per unit
_DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
DECLARED_LATENCY_S = 50e-6
"""A declared link's latency when the declaration names none (a switched data-centre hop)."""
LINK_FORMS = "link:BANDWIDTH[,LATENCY], e.g. link:100mbit, link:25gbit,20us (units kbit/mbit/gbit, us/ms/s)"


def is_declared(choice: object) -> bool:
    """Whether a cost-model choice declares a link (`link:...`)."""
    return isinstance(choice, str) and choice.strip().lower().startswith("link:")


def parse_link(spec: str) -> LinkCost:
    """`link:100mbit` / `link:25gbit,20us` -> its LinkCost; anything else is one ConfigError line."""
    text = spec.strip()
    if not is_declared(text):
        raise ConfigError(f"cost model {spec!r}: a declared link is {LINK_FORMS}")
    rate, sep, delay = text[len("link:"):].replace(" ", "").partition(",")
    m = _RATE.fullmatch(rate)
    if m is None or float(m[1]) <= 0:
        raise ConfigError(f"cost model {spec!r}: bandwidth {rate!r} is not a positive number with a unit; "
                          f"a declared link is {LINK_FORMS}")
    latency = DECLARED_LATENCY_S
    if sep:
        d = _DELAY.fullmatch(delay)
        if d is None or not float(d[1]) * _DELAY_UNITS[d[2].lower()] <= MAX_LATENCY_S:
            raise ConfigError(f"cost model {spec!r}: latency {delay!r} is not a number with a unit, at most "
                              f"{MAX_LATENCY_S * 1e3:.0f} ms; a declared link is {LINK_FORMS}")
        latency = float(d[1]) * _DELAY_UNITS[d[2].lower()]
    return LinkCost(latency_s=latency, bandwidth_bps=float(m[1]) * _RATE_UNITS[m[2].lower()])


def declared(spec: str, world_size: int, backend: str = "declared") -> CostModel:
    """The cost model of a declared link: every collective at its bandwidth and latency, nothing measured
    (no codec time either: a declaration is for a link slow enough that the bytes decide)."""
    link = parse_link(spec)
    return CostModel(backend, world_size, link, link, {}, source=f"declared ({spec.strip()})", reducescatter=link)


def resolve(choice: str | Path | CostModel | None, group: dist.ProcessGroup | None,
            device: torch.device | str = "cpu") -> CostModel | None:
    """`attach`'s `cost_model` as the model the gate uses: "measure" measures on `group` and `device` (a
    collective: every rank calls it), "link:..." is declared, another string or a path is a JSON file,
    a `CostModel` or None is itself."""
    if choice == "measure":
        return measure(group, device=device)
    if is_declared(choice):
        return declared(str(choice), dist.get_world_size(group), dist.get_backend(group))
    if isinstance(choice, str | Path):
        return CostModel.load(choice)
    return choice


def measure(group: dist.ProcessGroup | None = None, large_numel: int = 1 << 20, reps: int = REPS,
            device: torch.device | str = "cpu") -> CostModel:
    """Measure the cost model on the live process group; all ranks get identical constants.

    Collectives and codecs run on `device` and `group`, as the hook runs them: the gradients' device
    (CUDA under NCCL, whose collectives accept no CPU tensors), sizes up to `large_numel` (4 MB: the
    bucket cap `nfab train` gives the hook). Four sizes per collective (all-reduce, all-gather,
    reduce-scatter), `reps` rounds over all twelve in turn (a burst of load falls on every size,
    not on one), each call after a barrier (the figure is the collective, not a peer's lateness);
    `trimmed_time` of each, a least-squares line through them. One all-reduce (MAX: the slowest
    rank's figures) then gives every rank the same numbers; a fit no link could produce is named in
    `implausible`.
    """
    from nfab.wire.contract import all_gather_flat, reduce_scatter_flat

    w = dist.get_world_size(group)
    sizes = (256, large_numel // 64, large_numel // 8, large_numel)
    fp32 = REDUCERS["allreduce-fp32"]
    done = _synchronizer(device)
    calls: list[Callable[[], object]] = []
    for n in sizes:
        buf = torch.zeros(n, device=device)
        calls.append(lambda b=buf: dist.all_reduce(b, group=group))
    for n in sizes:
        src = torch.zeros(n * 4, dtype=torch.uint8, device=device)
        dst = torch.empty(n * 4 * w, dtype=torch.uint8, device=device)
        calls.append(lambda s=src, d=dst: all_gather_flat(d, s, group=group))
    for n in sizes:  # int32 count lanes, as signscatter sends them
        full = torch.zeros(-(-n // w) * w, dtype=torch.int32, device=device)
        part = torch.empty(full.numel() // w, dtype=torch.int32, device=device)
        calls.append(lambda f=full, p=part: reduce_scatter_flat(p, f, group=group))
    samples: list[list[float]] = [[] for _ in calls]
    for r in range(reps + 1):  # round 0 warms up (connections, allocation)
        for call, out in zip(calls, samples, strict=True):
            done(dist.barrier(group=group))
            t0 = time.perf_counter()
            done(call())
            if r:
                out.append(time.perf_counter() - t0)
    src, dst = torch.zeros(large_numel, device=device), torch.empty(large_numel, device=device)
    copy_s = trimmed_time(timed(lambda: done(dst.copy_(src)), reps))
    codec = measure_codecs(w, device=device)
    keys = sorted(codec)
    vec = torch.tensor([trimmed_time(s) for s in samples] + [copy_s] + [codec[k] for k in keys],
                       dtype=torch.float64, device=device)
    dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    v = vec.tolist()
    k = len(sizes)
    copy_bps = large_numel * 4 / v[3 * k]
    points = {
        "all-reduce": [(fp32.wire_bytes(n, w), t) for n, t in zip(sizes, v[:k], strict=True)],
        "all-gather": [((w - 1) * n * 4.0, t) for n, t in zip(sizes, v[k : 2 * k], strict=True)],
        "reduce-scatter": [((w - 1) / w * (-(-n // w) * w) * 4.0, t)
                           for n, t in zip(sizes, v[2 * k : 3 * k], strict=True)],
    }
    problems = tuple(p for kind, pts in points.items() for p in implausible(kind, fit_line(pts), copy_bps))
    ar, ag, rs = (fit_link(pts) for pts in points.values())
    return CostModel(dist.get_backend(group), w, ar, ag, dict(zip(keys, v[3 * k + 1 :], strict=True)),
                     source="measured", reducescatter=rs, implausible=problems)
