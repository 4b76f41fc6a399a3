"""FSDP2's param groups, read and planned: the layouts, what the front end refuses, the bytes per step.

`frontends/fsdp.py` installs nfab's reduce-scatter from these; `nfab inspect --parallel fsdp` counts a
step's bytes with `plan_layouts` + `step_wire_bytes` on a meta model, no process group needed.
FSDP2 exposes no public accessor for a param group's parameters and their padded shard sizes:
`param_groups`, `group_entries` and `shard_group` are the one place that reads FSDP2's records
(`_get_fsdp_state`, `FSDPParam`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from nfab.errors import NfabError
from nfab.profile.schema import Profile
from nfab.runtime.bindings import classify
from nfab.runtime.control.controller import FP32, Controller, Group
from nfab.runtime.core import rowscatter
from nfab.runtime.core.shards import ShardLayout, build_layout, row_segments
from nfab.wire.blockq.scatter import BlockQScatter
from nfab.wire.contract import allgather_factor, allreduce_factor
from nfab.wire.cost import CostModel
from nfab.wire.qsum.reducer import QSum
from nfab.wire.registry import REDUCERS
from nfab.wire.routes import BLOCK_ROUTES
from nfab.wire.sign.scatter import SignScatter, reduce_scatter_factor

FSDP_ROUTES = ("fp32", "sign", "q8", "q4", "q2", *BLOCK_ROUTES)
"""Routes the FSDP2 front end reduces as asked; bf16/fp16 go FP32 (fallback `fsdp`)."""

Codec = BlockQScatter | SignScatter | QSum
"""A lossy group's reduce-scatter codec (`core/rowscatter.py` runs each)."""


def codec_for(route: str) -> Codec | None:
    """The reduce-scatter codec of a route (None: FP32)."""
    if route == "sign":
        return REDUCERS["signscatter"]  # type: ignore[return-value]
    if route in BLOCK_ROUTES:
        return REDUCERS[f"blockqscatter-{route}"]  # type: ignore[return-value]
    if route in ("q8", "q4", "q2"):
        return REDUCERS[f"qsum-{route}"]  # type: ignore[return-value]
    return None


def fsdp_modules(root: nn.Module) -> list[FSDPModule]:
    """Every `fully_shard` module under (and including) `root`."""
    return [m for m in root.modules() if isinstance(m, FSDPModule)]


def param_groups(module: FSDPModule) -> list[Any]:
    """The module's FSDP2 param groups. torch 2.11 keeps one (`_fsdp_param_group`, or None); 2.13
    keeps a list (`_fsdp_param_groups`, for per-parameter meshes). Read either, so nfab runs on
    the torch a GPU image ships, not only the one this project pins."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def group_entries(module: FSDPModule, names: dict[int, str],
                  regions: dict[str, str]) -> tuple[Any, list[tuple[str, str, int, int]]] | None:
    """The module's one param group and its (name, region, padded shard numel, numel) in reduce order;
    None for a module without parameters of its own. Refused with one line: several param groups,
    HSDP, a dim other than 0 sharded, a custom reduce-scatter already installed."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    groups = param_groups(module)
    if not groups:
        return None
    if len(groups) > 1:
        raise NfabError("nfab.attach: an FSDP2 module with several param groups (per-parameter meshes) "
                        "has no single reduce-scatter to replace")
    pg = groups[0]
    if getattr(pg, "_is_hsdp", False):
        raise NfabError("nfab.attach: HSDP's replicate all-reduce cannot be customised in FSDP2; shard on "
                        "one mesh dimension")
    if type(pg._reduce_scatter_comm) is not DefaultReduceScatter:
        raise NfabError(f"nfab.attach: this FSDP2 module already has a custom reduce-scatter "
                        f"({type(pg._reduce_scatter_comm).__name__}, e.g. symmetric memory): nfab would replace it")
    entries = []
    for fp in pg.fsdp_params:
        if fp.fsdp_placement.dim != 0:
            raise NfabError(f"nfab.attach: a parameter sharded on dim {fp.fsdp_placement.dim} "
                            "(shard_placement_fn): nfab's FSDP2 layout needs dim-0 shards")
        name = names.get(id(fp.sharded_param))
        if name is None:
            raise NfabError("nfab.attach: an FSDP2 parameter is not among the root module's parameters")
        entries.append((name, regions.get(name, "other"), fp.padded_sharded_param_size.numel(),
                        fp._orig_size.numel()))
    return pg, entries


def shard_group(root: nn.Module) -> dist.ProcessGroup | None:
    """The process group FSDP2 reduce-scatters over (the root's shard group)."""
    assert isinstance(root, FSDPModule)
    groups = param_groups(root)
    if not groups:
        groups = next((g for g in map(param_groups, fsdp_modules(root)) if g), [])
        if not groups:
            raise NfabError("nfab.attach: this FSDP2 model has no sharded parameters")
    return groups[0].mesh_info.shard_process_group


def check_options(profile: Profile, *, explicit: bool, error_feedback: bool | str, hierarchy: object,
                  qsum_scale: str = "exact") -> None:
    """What the FSDP2 front end refuses, one line each: error feedback, a hierarchy, delayed qsum scales,
    an explicit route it cannot reduce as asked."""
    if qsum_scale != "exact":
        raise NfabError(f"qsum_scale={qsum_scale!r} is not offered on FSDP2: its q8/q4/q2 shards agree their "
                        "scale in the step (exact)")
    if error_feedback is True:
        raise NfabError("error_feedback=True is not offered on FSDP2: a residual per parameter would keep a "
                        "full-size gradient on every rank")
    if hierarchy not in (None, "flat"):
        raise NfabError("hierarchy= is not offered on FSDP2: its reduce-scatter is one level")
    if explicit:
        bad = sorted(r for r in profile.routes_used() if r not in FSDP_ROUTES)
        if bad:
            raise NfabError(f"route {', '.join(bad)} is not offered on FSDP2 (routes: {', '.join(FSDP_ROUTES)})")


@dataclass(frozen=True, slots=True)
class StepBytes:
    """Reduce-scatter bytes one rank sends per step: nfab's, and plain FSDP2's in fp32 and bf16."""

    nfab: float
    fsdp_fp32: float
    fsdp_bf16: float
    route_elements: dict[str, int]


def step_wire_bytes(layouts: list[ShardLayout], profile: Profile, *, explicit: bool = True, step: int = 0,
                    total_steps: int | None = None, cost_model: CostModel | None = None) -> StepBytes:
    """What a step of `profile` sends per rank over `layouts` (one per FSDP2 module, at their W), with
    no process group (`nfab inspect --parallel fsdp`, on meta): the counts `ShardedRuntime` reports."""
    if not layouts:
        return StepBytes(0.0, 0.0, 0.0, {})
    w = layouts[0].world_size
    ctl = Controller(profile, w, ShardCost(cost_model) if cost_model is not None else None, explicit=explicit,
                     total_steps=total_steps)
    phase = ctl.phase(step)
    nbytes, fp32, bf16, elements = 0.0, 0.0, 0.0, {}
    for lay in layouts:
        nbytes += allgather_factor(w) * 8.0  # the control word
        fp32 += rowscatter.plain_bytes(lay.chunk, w, 4)
        bf16 += rowscatter.plain_bytes(lay.chunk, w, 2)
        real = lay.by_name()
        for g in ctl.routes(lay.plan(), phase, frozenset()).groups:
            label, b = group_bytes(lay, g, w)
            elements[label] = elements.get(label, 0) + sum(real[s.name].numel for s in g.slices)
            nbytes += b
    return StepBytes(nbytes, fp32, bf16, elements)


@dataclass(frozen=True, slots=True)
class ShardCost:
    """A `CostModel` priced for FSDP2: the controller's pick and cost gate compare what a group of
    `numel` elements per row costs as this front end reduces it (W rows in, one row out) -- FP32 as
    one reduce-scatter, a block route as its code MAX all-reduce plus its all-to-all, sign as its
    count-lane reduce-scatter plus its scales' all-gather, qsum as its scales' MAX all-reduce plus
    its lanes' reduce-scatter -- not as DDP's all-reduce."""

    base: CostModel

    @property
    def implausible(self) -> tuple[str, ...]:
        """The base measurement's problems: non-empty, the gate keeps FP32 (`Controller`)."""
        return self.base.implausible

    def time(self, key: str, numel: int, world_size: int | None = None, segments: int = 1) -> float:
        w = world_size or self.base.world_size
        rs = self.base.reducescatter or self.base.allreduce
        codec = codec_for(REDUCERS[key].route)
        if codec is None:
            return rs.latency_s + rowscatter.plain_bytes(numel, w, 4) / rs.bandwidth_bps
        if isinstance(codec, QSum):  # its rows' containers reduce-scattered, every row's scales MAX-agreed
            payload = reduce_scatter_factor(w) * w * codec.payload_bytes(numel, w)
            ar = self.base.allreduce
            return (rs.latency_s + payload / rs.bandwidth_bps + ar.latency_s
                    + allreduce_factor(w) * w * 2 * segments * 4 / ar.bandwidth_bps  # real + padding
                    + self.base.codec_s_per_element.get(key, 0.0) * w * numel)
        payload = reduce_scatter_factor(w) * codec.payload_bytes(w * rowscatter.padded_row(codec, numel, w), w)
        t = rs.latency_s + payload / rs.bandwidth_bps
        if isinstance(codec, BlockQScatter):  # the codes: one uint8 per block of every row, MAX all-reduced
            ar = self.base.allreduce
            t += ar.latency_s + allreduce_factor(w) * w * codec.blocks_for(numel, segments) / ar.bandwidth_bps
            name = f"blockqscatter-{codec.route}"
        else:  # every row's segment scales, all-gathered
            ag = self.base.allgather
            t += ag.latency_s + allgather_factor(w) * w * 2 * segments * 4 / ag.bandwidth_bps
            name = "signscatter"
        return t + self.base.codec_s_per_element.get(name, 0.0) * w * numel

    def cheaper_than_fp32(self, key: str, numel: int, world_size: int | None = None, segments: int = 1) -> bool:
        return self.time(key, numel, world_size, segments) < self.time(FP32, numel, world_size)

    def to_json(self) -> str:
        """The link constants it prices with (`base`'s JSON): what a benchmark records of the cost model."""
        return self.base.to_json()


def group_bytes(layout: ShardLayout, group: Group, world_size: int) -> tuple[str, float]:
    """One routed group's route label and the bytes one rank sends for it (what the front end counts):
    FP32 (or a route the front end sends FP32, fallback `fsdp`) as a plain reduce-scatter, else the
    codec's share and its scales."""
    codec = codec_for(REDUCERS[group.key].route)
    if codec is None:
        return "fp32", rowscatter.plain_bytes(group.numel, world_size, 4)
    padded = rowscatter.row_numel(codec, group.numel, world_size)
    names = tuple(s.name for s in group.slices)
    segments = [row_segments(layout, names, r, padded) for r in range(world_size)]
    return codec.route, rowscatter.lossy_bytes(codec, segments, world_size)


def plan_layouts(root: nn.Module, units: list[nn.Module], world_size: int,
                 head_modules: tuple[str, ...] | None = None) -> list[ShardLayout]:
    """The layouts `fully_shard` on each of `units` and on `root` would give at `world_size`, without
    sharding anything (a meta model at W = 512 is fine): each unit owns its parameters not owned by a
    unit inside it, in `named_parameters` order, each padded to ceil(d0 / W) rows per rank."""
    regions = {n: b.region for n, b in classify(root, head_modules).items()}
    names = {id(p): n for n, p in root.named_parameters()}
    owned: set[int] = set()
    out = []
    for unit in [*units, root]:  # inner units first: as FSDP2 assigns parameters
        entries = []
        for p in unit.parameters():
            if id(p) in owned or not p.requires_grad:
                continue
            owned.add(id(p))
            rows = p.shape[0] if p.dim() else 1
            per_row = p.numel() // max(rows, 1)
            shard_rows = -(-rows // world_size)
            name = names[id(p)]
            entries.append((name, regions.get(name, "other"), shard_rows * per_row, p.numel()))
        if entries:
            out.append(build_layout(entries, world_size))
    return out
