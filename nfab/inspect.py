"""`nfab inspect`: the plan a model would run under — regions, buckets, routes, bytes.

Works on the meta device, so a 1.3B model's bucket layout, capacity decisions and
modelled bytes per step can be read on a laptop. Buckets follow DDP's initial layout:
parameters in reverse registration order, a small first bucket (1 MiB) and then
`bucket_cap_mb` buckets (DDP later rebuilds in gradient-ready order, which for the
models here is close to the same thing).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from torch import nn

from nfab.errors import NfabError
from nfab.profile.schema import Profile
from nfab.runtime.bindings import classify
from nfab.runtime.control.controller import Controller, Group, route_label
from nfab.runtime.core.hierarchy import level_bytes
from nfab.runtime.core.plan import BucketPlan, Slice
from nfab.wire.cost import CostModel, default_cost_model
from nfab.wire.registry import REDUCERS, candidates
from nfab.wire.routes import ROUTES

FIRST_BUCKET_BYTES = 1 << 20


@dataclass(slots=True)
class RegionRow:
    region: str
    params: int
    elements: int
    route: str
    reducer: str


@dataclass(slots=True)
class BucketRow:
    index: int
    elements: int
    slices: int
    regions: str
    routes: str
    wire_bytes: float
    baseline_wire_bytes: float
    fallbacks: str


@dataclass(slots=True)
class CapacityRow:
    route: str
    reducer: str
    ok: bool
    lane_bits: int | None
    levels: int | None
    bits_per_element: float | None
    reason: str


@dataclass(slots=True)
class LevelRow:
    """Bytes per step and rank at one level of the reduction.

    Flat: one row (`flat`, W ranks). With a hierarchy: `node-local` (the lossy groups'
    reduce-scatter + all-gather in fp32, W = ranks per node), `across nodes` (their route at
    W = nodes) and `all ranks` (FP32 groups, plain all-reduce over W); the totals add them up.
    `baseline_wire_bytes` is what FP32 DDP sends for the elements that level carries.
    """

    level: str
    world_size: int
    wire_bytes: float
    baseline_wire_bytes: float


@dataclass(slots=True)
class Inspection:
    model: str
    world_size: int
    phase: str
    total_params: int
    regions: list[RegionRow] = field(default_factory=list)
    buckets: list[BucketRow] = field(default_factory=list)
    capacity: list[CapacityRow] = field(default_factory=list)
    route_bytes: dict[str, float] = field(default_factory=dict)
    levels: list[LevelRow] = field(default_factory=list)
    hierarchy: tuple[int, int] | None = None
    """(nodes, ranks per node) of a two-level plan; None: flat."""

    @property
    def slow_link_bytes(self) -> float:
        """Bytes per step one node sends across the inter-node link: a flat ring crosses each node
        boundary once, so that is one rank's bytes; two levels send every local rank's shard."""
        if self.hierarchy is None:
            return self.wire_bytes
        local = self.hierarchy[1]
        return sum(lv.wire_bytes * (local if lv.level == "across nodes" else 1)
                   for lv in self.levels if lv.level != "node-local")

    @property
    def slow_link_ratio(self) -> float:
        """How many times fewer bytes than FP32 DDP cross the inter-node link, per node."""
        return self.baseline_wire_bytes / self.slow_link_bytes if self.slow_link_bytes else float("inf")

    @property
    def wire_bytes(self) -> float:
        return sum(b.wire_bytes for b in self.buckets)

    @property
    def baseline_wire_bytes(self) -> float:
        return sum(b.baseline_wire_bytes for b in self.buckets)

    @property
    def ratio(self) -> float:
        """How many times fewer bytes than FP32 DDP (all-reduce of every gradient in fp32)."""
        return self.baseline_wire_bytes / self.wire_bytes if self.wire_bytes else float("inf")

    def to_dict(self, crossovers: list[tuple[int, str]] | None = None) -> dict[str, Any]:
        """Everything the `nfab inspect` tables show (all buckets), with the totals, as JSON-ready data."""
        out = asdict(self)
        out.update(wire_bytes=self.wire_bytes, baseline_wire_bytes=self.baseline_wire_bytes, ratio=self.ratio,
                   slow_link_bytes_per_node=self.slow_link_bytes, slow_link_ratio=self.slow_link_ratio)
        out["hierarchy"] = None if self.hierarchy is None else dict(zip(("nodes", "local_world"), self.hierarchy,
                                                                         strict=True))
        if crossovers is not None:
            out["crossovers"] = [{"from_world_size": w, "cheapest": k} for w, k in crossovers]
        return out


def ddp_buckets(model: nn.Module, bucket_cap_mb: float = 25.0) -> list[list[tuple[str, nn.Parameter]]]:
    """DDP's initial bucket assignment: reverse registration order, size-capped buckets."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    buckets: list[list[tuple[str, nn.Parameter]]] = []
    current: list[tuple[str, nn.Parameter]] = []
    size = 0
    cap = FIRST_BUCKET_BYTES
    for name, p in reversed(params):
        current.append((name, p))
        size += p.numel() * 4
        if size >= cap:
            buckets.append(current)
            current, size, cap = [], 0, int(bucket_cap_mb * (1 << 20))
    if current:
        buckets.append(current)
    return buckets


def inspect_model(
    name: str,
    model: nn.Module,
    profile: Profile,
    world_size: int,
    *,
    explicit: bool,
    step: int = 0,
    total_steps: int | None = None,
    cost_model: CostModel | None | Literal["default"] = "default",
    bucket_cap_mb: float = 25.0,
    head_modules: tuple[str, ...] | None = None,
    hierarchy: tuple[int, int] | None = None,
) -> Inspection:
    """Plan a model under a profile at W without running anything.

    `hierarchy` = (nodes, ranks per node) plans the two-level path as the hook runs it: routes
    decided at W = nodes, lossy groups node-local + across nodes, FP32 groups over all ranks.
    """
    if hierarchy is not None and hierarchy[0] * hierarchy[1] != world_size:
        raise NfabError(f"--hierarchy {hierarchy[0]}x{hierarchy[1]} is {hierarchy[0] * hierarchy[1]} ranks, "
                        f"not the world size {world_size}")
    route_world = hierarchy[0] if hierarchy is not None else world_size
    cm = default_cost_model(world_size) if isinstance(cost_model, str) else cost_model  # None: no gate, as attach
    bindings = classify(model, head_modules)
    ctl = Controller(profile, route_world, cm, explicit=explicit, total_steps=total_steps)
    phase = ctl.phase(step)
    out = Inspection(name, world_size, phase.name, sum(b.numel for b in bindings.values()), hierarchy=hierarchy)
    per_level = {"node-local": [0.0, 0.0], "across nodes": [0.0, 0.0], "all ranks": [0.0, 0.0]}
    per_region: dict[str, RegionRow] = {}
    for b in bindings.values():
        row = per_region.setdefault(b.region, RegionRow(b.region, 0, 0, "", ""))
        row.params += 1
        row.elements += b.numel
        wanted = profile.route_for(phase, b.name, b.region)  # a name glob beats the class
        if wanted not in row.route.split(","):
            row.route = ",".join(filter(None, [row.route, wanted]))
    for i, bucket in enumerate(ddp_buckets(model, bucket_cap_mb)):
        slices, off = [], 0
        for pname, p in bucket:
            region = bindings[pname].region if pname in bindings else "other"
            slices.append(Slice(off, p.numel(), pname, region))
            off += p.numel()
        plan = BucketPlan(tuple(id(p) for _, p in bucket), tuple(slices), off)
        routes = ctl.routes(plan, phase, frozenset())
        wire = 0.0
        labels = []
        for g in routes.groups:
            b = _group_bytes(g, world_size, hierarchy, per_level)
            wire += b
            out.route_bytes[g.label] = out.route_bytes.get(g.label, 0.0) + b
            labels.append(f"{g.label}:{g.numel / plan.numel:.0%}")
            for s in g.slices:
                r = per_region[s.region]
                if g.label not in r.reducer.split(","):
                    r.reducer = ",".join(filter(None, [r.reducer, g.label]))
        out.buckets.append(BucketRow(
            i, plan.numel, len(slices), ",".join(sorted(plan.regions())), " ".join(labels), wire,
            REDUCERS["allreduce-fp32"].wire_bytes(plan.numel, world_size),
            ", ".join(sorted({f"{why}({reg})" for why, reg in routes.fallbacks})),
        ))
    out.regions = sorted(per_region.values(), key=lambda r: -r.elements)
    if hierarchy is None:
        out.levels = [LevelRow("flat", world_size, out.wire_bytes, out.baseline_wire_bytes)]
    else:
        worlds = {"node-local": hierarchy[1], "across nodes": hierarchy[0], "all ranks": world_size}
        out.levels = [LevelRow(level, worlds[level], b, base) for level, (b, base) in per_level.items()]
    for route in ROUTES:
        for red in candidates(route):
            cap = red.capacity(route_world)
            bpe = red.bits_per_element(route_world) if cap.ok else None
            out.capacity.append(CapacityRow(route, red.name, cap.ok, cap.lane_bits, cap.levels, bpe, cap.reason))
    return out


def _group_bytes(g: Group, world_size: int, hierarchy: tuple[int, int] | None,
                 per_level: dict[str, list[float]]) -> float:
    """A group's bytes per rank, added to its level(s) with FP32 DDP's bytes for the same elements."""
    red = REDUCERS[g.key]
    fp32 = REDUCERS["allreduce-fp32"].wire_bytes(g.numel, world_size)
    if hierarchy is None or not g.lossy:
        b = red.wire_bytes(g.numel, world_size, len(g.slices))
        _add(per_level["all ranks"], b, fp32)
        return b
    lb = level_bytes(g.numel, red, hierarchy[0], hierarchy[1], 4, len(g.slices))
    _add(per_level["node-local"], lb.local, fp32)
    _add(per_level["across nodes"], lb.cross, fp32)
    return lb.local + lb.cross


def _add(acc: list[float], wire: float, baseline: float) -> None:
    acc[0] += wire
    acc[1] += baseline


def crossovers(cost_model: CostModel, numel: int, max_world: int = 1024) -> list[tuple[int, str]]:
    """World sizes where the cheapest sign path (or fp32) changes, for a tensor of `numel`."""
    out: list[tuple[int, str]] = []
    prev = None
    keys = ["allreduce-fp32"] + [k for k, r in REDUCERS.items() if r in candidates("sign")]
    for w in range(2, max_world + 1):
        options = {k: cost_model.time(k, numel, w) for k in keys if REDUCERS[k].capacity(w).ok}
        best = route_label(min(options, key=options.__getitem__))
        if best != prev:
            out.append((w, best))
            prev = best
    return out
