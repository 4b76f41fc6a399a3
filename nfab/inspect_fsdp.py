"""`nfab inspect --parallel fsdp`: the reduce-scatter plan of a model under FSDP2, on paper (meta device).

FSDP2 (`fully_shard` per shard unit, a Transformer's blocks, then the root) reduce-scatters one
flat gradient per unit: W rows, each the concatenation of every parameter's padded dim-0 shard
(`nfab.runtime.core.shards`). nfab replaces that reduce-scatter on every unit; this module plans
each unit's row as nfab's FSDP2 front end does (the same layout, `plan_layouts`; the same
controller; the same byte count, `rowscatter.lossy_bytes`) and adds up, per unit, what one
rank sends per step:

- an FP32 group: FSDP2's own ring reduce-scatter, (W-1)/W of the group's W rows;
- a lossy group (`sign`, `bqN`): its codec's reduce-scatter share (the count lanes, or the
  block levels' all-to-all) plus its scales (sign's all-gathered mean |x|, the blocks' agreed
  codes), padded to whole containers as the front end pads them;
- every unit: the all-gathered control word, 8 bytes per rank.

The baselines are FSDP2's reduce-scatter of the same rows in FP32 (4 bytes per element) and in
bf16 (`MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)`, 2 bytes).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from torch import nn

from nfab.profile.schema import Profile
from nfab.runtime.control.controller import Controller
from nfab.runtime.core import rowscatter
from nfab.runtime.core.shards import ShardLayout
from nfab.runtime.frontends.fsdp_layout import ShardCost, group_bytes, plan_layouts
from nfab.wire.contract import allgather_factor
from nfab.wire.cost import CostModel, default_cost_model

WORD_BYTES = 8
"""The control word each rank all-gathers per reduce-scatter: [|g|^2, loss] in fp32."""


@dataclass(slots=True)
class UnitRow:
    """One `fully_shard` unit's reduce-scatter per step, per rank."""

    unit: str
    elements: int
    """Real gradient elements (padding aside)."""
    routes: str
    wire_bytes: float
    fp32_bytes: float
    bf16_bytes: float
    fallbacks: str = ""
    """Why a region left its profile route, e.g. `cost(norm)`: the cost gate priced FP32 cheaper."""


@dataclass(slots=True)
class FSDPInspection:
    model: str
    world_size: int
    phase: str
    total_params: int
    units: list[UnitRow] = field(default_factory=list)
    route_bytes: dict[str, float] = field(default_factory=dict)

    @property
    def wire_bytes(self) -> float:
        return sum(u.wire_bytes for u in self.units)

    @property
    def fp32_bytes(self) -> float:
        return sum(u.fp32_bytes for u in self.units)

    @property
    def bf16_bytes(self) -> float:
        return sum(u.bf16_bytes for u in self.units)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(wire_bytes=self.wire_bytes, fp32_bytes=self.fp32_bytes, bf16_bytes=self.bf16_bytes,
                   ratio_fp32=self.fp32_bytes / self.wire_bytes, ratio_bf16=self.bf16_bytes / self.wire_bytes)
        return out


def unit_layouts(model: nn.Module, units: tuple[str, ...], world_size: int,
                 head_modules: tuple[str, ...] | None) -> list[tuple[str, ShardLayout]]:
    """Each unit's row layout as FSDP2 builds it (`plan_layouts`: its own parameters, padded dim-0
    shards), named: the units in order, then the root."""
    named = dict(model.named_modules())
    layouts = plan_layouts(model, [named[u] for u in units], world_size, head_modules)
    out = []
    for lay in layouts:
        first = lay.params[0].name
        out.append((next((u for u in units if first.startswith(u + ".")), "(root)"), lay))
    return out


def inspect_fsdp(name: str, model: nn.Module, profile: Profile, world_size: int, *, explicit: bool,
                 shard_units: tuple[str, ...], step: int = 0, total_steps: int | None = None,
                 cost_model: CostModel | None | Literal["default"] = "default",
                 head_modules: tuple[str, ...] | None = None) -> FSDPInspection:
    """Plan `model`'s FSDP2 reduce-scatters under `profile` at W without running anything."""
    cm = default_cost_model(world_size) if isinstance(cost_model, str) else cost_model  # None: no gate, as attach
    # priced as the front end prices a row group (its reduce-scatter, not DDP's all-reduce)
    ctl = Controller(profile, world_size, ShardCost(cm) if cm is not None else None,  # type: ignore[arg-type]
                     explicit=explicit, total_steps=total_steps)
    phase = ctl.phase(step)
    out = FSDPInspection(name, world_size, phase.name, sum(p.numel() for p in model.parameters()))
    w = world_size
    for unit, layout in unit_layouts(model, shard_units, w, head_modules):
        routes = ctl.routes(layout.plan(), phase, frozenset())
        wire, labels = allgather_factor(w) * WORD_BYTES, []
        for g in routes.groups:
            label, b = group_bytes(layout, g, w)  # as the front end counts them
            wire += b
            out.route_bytes[label] = out.route_bytes.get(label, 0.0) + b
            labels.append(f"{label}:{g.numel / layout.chunk:.0%}")
        fp32, bf16 = (rowscatter.plain_bytes(layout.chunk, w, size) for size in (4, 2))
        fallbacks = ", ".join(sorted({f"{why}({region})" for why, region in routes.fallbacks}))
        out.units.append(UnitRow(unit, layout.real_elements(), " ".join(labels), wire, fp32, bf16, fallbacks))
    return out
