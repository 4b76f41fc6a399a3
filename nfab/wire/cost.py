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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from nfab.errors import NfabError
from nfab.wire.reducers import REDUCERS, Reducer, SignGather


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

    def time(self, key: str, numel: int, world_size: int | None = None, segments: int = 1) -> float:
        """Modelled seconds for reducer `key` to reduce `numel` elements."""
        w = world_size or self.world_size
        red = REDUCERS[key]
        link = self.allgather if isinstance(red, SignGather) else self.allreduce
        t = link.latency_s + red.wire_bytes(numel, w, segments) / link.bandwidth_bps
        if red.needs_shared_scale:
            t += self.allreduce.latency_s  # the blocking MAX of scales
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


def best_time(fn, reps: int) -> float:
    """Best of `reps` timed calls after one warm-up call (connection set-up, allocation)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_codecs(world_size: int, numel: int = 1 << 18, reps: int = 3) -> dict[str, float]:
    """Encode+decode seconds per element for every reducer that can run at W (one process)."""
    x = torch.randn(numel)
    out: dict[str, float] = {}
    for key, red in REDUCERS.items():
        if key == "allreduce-fp32" or not red.capacity(world_size).ok:
            continue
        out[key] = best_time(lambda r=red: _encode_decode(r, x, world_size), reps) / numel
    return out


def _encode_decode(red: Reducer, x: torch.Tensor, world_size: int) -> torch.Tensor:
    lengths = [x.numel()]
    shared = red.local_scale(x, lengths) if red.needs_shared_scale else None
    enc = red.encode(x, lengths, world_size, shared)
    # decode a payload of the reduced shape (the all-gather result is W payloads)
    payload = enc.payload.repeat(world_size) if isinstance(red, SignGather) else enc.payload
    scale = enc.scales if enc.scales is not None else shared
    return red.decode(payload, scale, x.numel(), lengths, world_size)


def _fit(small: tuple[float, float], large: tuple[float, float]) -> LinkCost:
    (b1, t1), (b2, t2) = small, large
    bw = (b2 - b1) / max(t2 - t1, 1e-9)
    lat = max(t1 - b1 / bw, 1e-7)
    return LinkCost(latency_s=lat, bandwidth_bps=bw)


def measure(group: dist.ProcessGroup | None = None, large_numel: int = 1 << 18, reps: int = 3) -> CostModel:
    """Measure the cost model on the live process group; all ranks get identical constants."""
    w = dist.get_world_size(group)
    small_numel = 256
    fp32 = REDUCERS["allreduce-fp32"]
    gather = REDUCERS["signgather"]
    points: dict[str, list[tuple[float, float]]] = {"allreduce": [], "allgather": []}
    for n in (small_numel, large_numel):
        buf = torch.zeros(n)
        t = best_time(lambda b=buf: dist.all_reduce(b, group=group), reps)
        points["allreduce"].append((fp32.wire_bytes(n, w), t))
        nbytes = n * 4
        src = torch.zeros(nbytes, dtype=torch.uint8)
        dst = torch.empty(nbytes * w, dtype=torch.uint8)
        from nfab.wire.reducers import _all_gather_flat

        t = best_time(lambda s=src, d=dst: _all_gather_flat(d, s, group=group), reps)
        points["allgather"].append(((w - 1) * nbytes, t))
    codec = measure_codecs(w)
    keys = sorted(codec)
    # agree: every rank takes the slowest rank's numbers (MAX), so decisions match
    vec = torch.tensor(
        [points["allreduce"][0][1], points["allreduce"][1][1], points["allgather"][0][1], points["allgather"][1][1]]
        + [codec[k] for k in keys],
        dtype=torch.float64,
    )
    dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
    v = vec.tolist()
    ar = _fit((points["allreduce"][0][0], v[0]), (points["allreduce"][1][0], v[1]))
    ag = _fit((points["allgather"][0][0], v[2]), (points["allgather"][1][0], v[3]))
    del gather
    return CostModel(dist.get_backend(group), w, ar, ag, dict(zip(keys, v[4:], strict=True)), source="measured")
