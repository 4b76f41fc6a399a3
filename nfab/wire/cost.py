"""Cost model: is a compressed path cheaper than FP32 all-reduce on *this* link?

time(path, numel, W) = latency + wire_bytes / bandwidth + codec time
where wire_bytes comes from the reducer (what each rank sends under the collective's
algorithm), latency and bandwidth are measured per collective kind on the real backend,
and codec time is the measured encode+decode cost per element. Compression often does
not pay on fast links; nfab must never be the slow path, so the runtime admits a
compressed route only when this model says it is cheaper.

`measure(group)` runs real collectives; every constant is then all-reduced with MAX so
all ranks hold the same model and take the same routing decisions.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from nfab.errors import NfabError
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


def measure_codecs(world_size: int, numel: int = 1 << 18, reps: int = 3,
                   device: torch.device | str = "cpu") -> dict[str, float]:
    """Encode+decode seconds per element for every reducer that can run at W (one process),
    on `device` (where the gradients live)."""
    x = torch.randn(numel, generator=torch.Generator(device=device).manual_seed(0), device=device)  # never the user's
    done = _synchronizer(device)
    out: dict[str, float] = {}
    for key, red in REDUCERS.items():
        if key == "allreduce-fp32" or not red.capacity(world_size).ok:
            continue
        run = codec_work(red, x, world_size)
        out[key] = best_time(lambda r=run: done(r()), reps) / numel
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


def median_time(fn, reps: int) -> float:
    """Median of `reps` timed calls after one warm-up call (robust to a noisy neighbour)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def fit_link(points: list[tuple[float, float]]) -> LinkCost:
    """Least-squares time = latency + bytes / bandwidth over (bytes, seconds) points, clamped.

    Clamping keeps one noisy sample from claiming an infinite or negative bandwidth, which
    would flip every routing decision.
    """
    n = len(points)
    mb = sum(b for b, _ in points) / n
    mt = sum(t for _, t in points) / n
    var = sum((b - mb) ** 2 for b, _ in points)
    slope = sum((b - mb) * (t - mt) for b, t in points) / var if var > 0 else 0.0
    slope = min(max(slope, 1.0 / MAX_BANDWIDTH_BPS), 1.0 / MIN_BANDWIDTH_BPS)
    latency = min(max(mt - slope * mb, MIN_LATENCY_S), MAX_LATENCY_S)
    return LinkCost(latency_s=latency, bandwidth_bps=1.0 / slope)


def measure(group: dist.ProcessGroup | None = None, large_numel: int = 1 << 18, reps: int = 5,
            device: torch.device | str = "cpu") -> CostModel:
    """Measure the cost model on the live process group; all ranks get identical constants.

    Collectives and codecs run on `device`: the gradients' device (CUDA under NCCL, whose
    collectives accept no CPU tensors).

    Three sizes per collective (all-reduce, all-gather, reduce-scatter), median of `reps`
    each, a least-squares line through them;
    every rank then takes the slowest rank's timings (MAX) so all decide alike.
    """
    from nfab.wire.contract import all_gather_flat, reduce_scatter_flat

    w = dist.get_world_size(group)
    sizes = (256, large_numel // 8, large_numel)
    fp32 = REDUCERS["allreduce-fp32"]
    done = _synchronizer(device)
    timings: list[float] = []
    for n in sizes:
        buf = torch.zeros(n, device=device)
        timings.append(median_time(lambda b=buf: done(dist.all_reduce(b, group=group)), reps))
    for n in sizes:
        src = torch.zeros(n * 4, dtype=torch.uint8, device=device)
        dst = torch.empty(n * 4 * w, dtype=torch.uint8, device=device)
        timings.append(median_time(lambda s=src, d=dst: done(all_gather_flat(d, s, group=group)), reps))
    for n in sizes:  # int32 count lanes, as signscatter sends them
        full = torch.zeros(-(-n // w) * w, dtype=torch.int32, device=device)
        part = torch.empty(full.numel() // w, dtype=torch.int32, device=device)
        timings.append(median_time(lambda f=full, p=part: done(reduce_scatter_flat(p, f, group=group)), reps))
    codec = measure_codecs(w, device=device)
    keys = sorted(codec)
    vec = torch.tensor(timings + [codec[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    v = vec.tolist()
    k = len(sizes)
    ar = fit_link([(fp32.wire_bytes(n, w), t) for n, t in zip(sizes, v[:k], strict=True)])
    ag = fit_link([((w - 1) * n * 4.0, t) for n, t in zip(sizes, v[k : 2 * k], strict=True)])
    rs = fit_link([((w - 1) / w * (-(-n // w) * w) * 4.0, t) for n, t in zip(sizes, v[2 * k : 3 * k], strict=True)])
    return CostModel(dist.get_backend(group), w, ar, ag, dict(zip(keys, v[3 * k :], strict=True)), source="measured",
                     reducescatter=rs)
