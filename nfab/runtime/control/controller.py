"""Controller: profile phase + health + capacity + cost model -> a route per bucket slice.

Everything here is a pure function of (profile, step, agreed health state, world size,
agreed cost model), so every rank computes the same routes and launches the same
collectives in the same order without talking first. Every decision that moves a slice
off the route its profile asked for is returned with its reason.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import numpy as np

from nfab.errors import CapacityError
from nfab.profile.schema import Phase, Profile
from nfab.runtime.core.plan import BucketPlan, Slice
from nfab.wire.cost import CostModel, gate, predicted_saving
from nfab.wire.registry import REDUCERS, candidates

log = logging.getLogger(__name__)

FP32 = "allreduce-fp32"


def route_label(key: str) -> str:
    """The route name statistics use for a reducer key (sign split by reducer; a block route's two
    reducers give the same values, so both are the route: `bq3`)."""
    for prefix in ("blockq-", "blockqscatter-"):
        if key.startswith(prefix):
            return key.removeprefix(prefix)
    return {"allreduce-fp32": "fp32", "allreduce-bf16": "bf16", "allreduce-fp16": "fp16",
            "qsum-q8": "q8", "qsum-q4": "q4", "qsum-q2": "q2"}.get(key, key)


@dataclass(frozen=True, slots=True)
class Group:
    """The slices of one bucket that share a reducer: one collective for all of them.

    Groups are made once per (plan, phase, demoted regions) and reused every step (the
    controller caches them), so what the hook asks of them on every bucket — lengths,
    offsets, element count, label — is computed here once, not per call."""

    key: str
    slices: tuple[Slice, ...]
    whole: bool
    """The group is the entire bucket buffer, in order: reduce it in place, no copy."""
    lengths: tuple[int, ...] = field(init=False, compare=False)
    offsets: np.ndarray = field(init=False, compare=False, repr=False)
    """Each slice's element offset in the bucket (int64, read-only): `Slices` and the kernels."""
    numel: int = field(init=False, compare=False)
    label: str = field(init=False, compare=False)
    lossy: bool = field(init=False, compare=False)

    def __post_init__(self) -> None:
        lengths = tuple(s.numel for s in self.slices)
        offsets = np.fromiter((s.offset for s in self.slices), dtype=np.int64, count=len(self.slices))
        offsets.flags.writeable = False  # shared by every step's encode and decode
        for name, value in (("lengths", lengths), ("offsets", offsets), ("numel", sum(lengths)),
                            ("label", route_label(self.key)), ("lossy", REDUCERS[self.key].lossy)):
            object.__setattr__(self, name, value)


@dataclass(frozen=True, slots=True)
class BucketRoutes:
    """A bucket's groups for one step, and why any slice left its profile route."""

    groups: tuple[Group, ...]
    fallbacks: tuple[tuple[str, str], ...]  # (reason, region)
    has_lossy: bool = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "has_lossy", any(g.lossy for g in self.groups))


class Controller:
    """Route decisions for one runtime (one world size, one agreed cost model)."""

    def __init__(
        self,
        profile: Profile,
        world_size: int,
        cost_model: CostModel | None,
        *,
        explicit: bool,
        total_steps: int | None = None,
    ) -> None:
        self.profile = profile
        self.world_size = world_size
        self.cost_model = cost_model
        self.explicit = explicit
        self.total_steps = total_steps
        # per instance, keyed by (plan, phase position, demoted regions): they recur every step
        self._phases = {id(p): p for p in profile.phases}
        self._routes_cached = functools.cache(self._routes)
        self._lossy_cached = functools.cache(self._lossy_regions)
        self._last_phase: tuple[int, Phase] | None = None
        self._model_lossy: dict[int, tuple[str, ...]] = {}
        self.admitted: dict[str, list[str]] = {}
        self._compressing: dict[tuple[str, int, int], bool] = {}
        """The gate's state per (reducer, elements, slices): its hysteresis (`cost.gate`)."""
        self.capacity_notes: dict[str, str] = {}
        for route in sorted(profile.routes_used() | {"fp32"}):
            keys = [r for r in candidates(route) if r.capacity(world_size).ok]
            self.admitted[route] = [k for k, v in REDUCERS.items() if v in keys]
            if not keys:
                reason = "; ".join(r.capacity(world_size).reason for r in candidates(route))
                if profile.fallback.on_capacity == "error":
                    raise CapacityError(f"route {route} cannot run exactly at W={world_size}: {reason}")
                self.capacity_notes[route] = reason
                log.warning("route %s over capacity at W=%d (%s): falling back to fp32", route, world_size, reason)
        if not profile.check_world_size(world_size):
            msg = (f"world size {world_size} is outside the profile's range "
                   f"[{profile.world_size.min}, {profile.world_size.max}]")
            if profile.fallback.on_capacity == "error":
                raise CapacityError(msg)
            log.warning("%s: routes still checked per reducer capacity", msg)

    def phase(self, step: int) -> Phase:
        """The phase in force at `step` (asked by every bucket: the last answer is kept)."""
        last = self._last_phase
        if last is None or last[0] != step:
            last = self._last_phase = (step, self.profile.phase_at(step, self.total_steps))
        return last[1]

    def wanted_route(self, phase: Phase, s: Slice) -> str:
        """The route the profile asks for: a name glob beats the region class."""
        return self._wanted(phase, s.name, s.region)

    def _wanted(self, phase: Phase, name: str, region: str) -> str:
        return self.profile.route_for(phase, name, region)

    def lossy_regions(self, plan: BucketPlan, phase: Phase) -> frozenset[str]:
        """Regions of a bucket whose profile route (before any fallback) is not fp32 (cached)."""
        return self._lossy_cached(plan, id(phase))

    def model_lossy(self, phase: Phase, regions: dict[str, str]) -> tuple[str, ...]:
        """The regions (sorted) holding a parameter the profile routes lossy at `phase`, of a model
        whose parameters have `regions` (name -> region); kept per phase (the probes rotate over them)."""
        key = id(phase)
        if key not in self._model_lossy:
            self._model_lossy[key] = tuple(sorted({r for n, r in regions.items()
                                                   if self._wanted(phase, n, r) != "fp32"}))
        return self._model_lossy[key]

    def gated_everywhere(self, regions: dict[str, str], numels: dict[str, int]) -> bool:
        """Whether the cost gate keeps FP32 for every lossy route of every phase, even with all of
        the model's elements on that route in one bucket (the size most favourable to compression:
        a collective's latency is paid once). `regions`, `numels`: per parameter name. False
        without a cost model, with an explicit route, the gate off, or nothing lossy."""
        fb = self.profile.fallback
        if self.cost_model is None or self.explicit or not fb.cost_gate:
            return False
        lossy_any = False
        for phase in self.profile.phases:
            by_route: dict[str, tuple[int, int]] = {}
            for name, region in regions.items():
                route = self._wanted(phase, name, region)
                if route == "fp32":
                    continue
                if region in fb.pinned:
                    return False
                n, k = by_route.get(route, (0, 0))
                by_route[route] = (n + numels[name], k + 1)
            for route, (numel, segments) in by_route.items():
                key = self._pick(route, numel, segments)
                if key is None or key == FP32:
                    continue
                lossy_any = True
                if self._pays(key, numel, segments, compressing=False):
                    return False
        return lossy_any

    def reprice(self, cost_model: CostModel) -> None:
        """Decide again under a new (re-measured) cost model: each group's route moves only where
        `cost.gate`'s margin says so, so one noisy figure cannot flip it back and forth."""
        self.cost_model = cost_model
        self._routes_cached.cache_clear()

    def _pays(self, key: str, numel: int, segments: int, *, compressing: bool) -> bool:
        """Whether reducer `key` on `numel` elements in `segments` slices is modelled to pay off against
        FP32 by the gate's margin; never on figures the measurement found implausible."""
        assert self.cost_model is not None
        if getattr(self.cost_model, "implausible", ()):
            return False
        return gate(predicted_saving(self.cost_model, key, numel, self.world_size, segments), compressing)

    def _admit(self, key: str, numel: int, segments: int) -> bool:
        """The cost gate for one group, with its state: a group that compresses keeps compressing until
        low bits are dearer by the margin (`cost.gate`)."""
        state = (key, numel, segments)
        self._compressing[state] = self._pays(key, numel, segments, compressing=self._compressing.get(state, False))
        return self._compressing[state]

    def _lossy_regions(self, plan: BucketPlan, phase_id: int) -> frozenset[str]:
        phase = self._phases[phase_id]
        return frozenset(s.region for s in plan.slices if self.wanted_route(phase, s) != "fp32")

    def _pick(self, route: str, numel: int, segments: int) -> str | None:
        keys = self.admitted.get(route, [])
        if not keys:
            return None
        if len(keys) == 1:
            return keys[0]
        if self.cost_model is None:  # no link model: the fewest bytes on the wire
            return min(keys, key=lambda k: REDUCERS[k].wire_bytes(numel, self.world_size, segments))
        return min(keys, key=lambda k: self.cost_model.time(k, numel, self.world_size, segments))  # type: ignore[union-attr]

    def routes(self, plan: BucketPlan, phase: Phase, demoted: frozenset[str]) -> BucketRoutes:
        """Groups for a bucket at a phase with a set of demoted regions (cached)."""
        return self._routes_cached(plan, id(phase), demoted)

    def _routes(self, plan: BucketPlan, phase_id: int, demoted: frozenset[str]) -> BucketRoutes:
        phase = self._phases[phase_id]
        fallbacks: list[tuple[str, str]] = []
        by_route: dict[str, list[Slice]] = {}
        for s in plan.slices:
            route = self.wanted_route(phase, s)
            if route != "fp32" and s.region in demoted:
                fallbacks.append(("health", s.region))
                route = "fp32"
            by_route.setdefault(route, []).append(s)
        by_key: dict[str, list[Slice]] = {}
        for route, slices in by_route.items():
            numel = sum(s.numel for s in slices)
            key = self._pick(route, numel, len(slices))
            if key is None:
                fallbacks.extend(("capacity", s.region) for s in slices)
                key = FP32
            elif (key != FP32 and not self.explicit and self.profile.fallback.cost_gate
                  and self.cost_model is not None
                  and not any(s.region in self.profile.fallback.pinned for s in slices)
                  and not self._admit(key, numel, len(slices))):
                fallbacks.extend(("cost", s.region) for s in slices)
                key = FP32
            by_key.setdefault(key, []).extend(slices)
        groups = []
        for key in sorted(by_key):
            slices = sorted(by_key[key], key=lambda s: s.offset)
            whole = len(by_key) == 1
            groups.append(Group(key, tuple(slices), whole))
        return BucketRoutes(tuple(groups), tuple(sorted(set(fallbacks))))
