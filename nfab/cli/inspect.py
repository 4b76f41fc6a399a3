"""`nfab inspect MODEL`: regions, buckets, routes, capacity and bytes per step (meta device)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from nfab.cli.output import console
from nfab.config.run import NFAB_BUCKET_MB
from nfab.overrides import parse_kv

if TYPE_CHECKING:
    from nfab.models import ModelSpec
    from nfab.profile.schema import Profile

_META_MIN_PARAMS = 50_000_000


def register(app: typer.Typer) -> None:
    @app.command("inspect", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def inspect(
        ctx: typer.Context,
        model: Annotated[str, typer.Argument(help="resnet18, vit, gpt or module.path:factory.")],
        world_size: Annotated[int, typer.Option("--world-size", "-w", help="Ranks to plan for.")] = 4,
        size: Annotated[str | None, typer.Option(help="Model size (gpt: nano..1.3b, vit: nano/tiny/small).")] = None,
        profile: Annotated[str | None, typer.Option(help="Operating profile: a path or a shipped name.")] = None,
        route: Annotated[str | None, typer.Option(help="Static route, e.g. sign or conv:sign,norm:fp32.")] = None,
        step: Annotated[int, typer.Option(help="Training step whose profile phase to show.")] = 0,
        total_steps: Annotated[int | None, typer.Option(
            help="Run length (for phases given as fractions; default: the profile's calibrated length).")] = None,
        bucket_cap_mb: Annotated[float, typer.Option(
            help="DDP bucket cap, MB (default: 4, what nfab train gives its hook).")] = NFAB_BUCKET_MB,
        cost: Annotated[str | None, typer.Option(
            help="Cost model JSON from `nfab bench wire --cost`, or none: no cost gate, as attach(cost_model=None) "
                 "and comm.cost_model=none (default: a built-in 10 Gbit/s model).")] = None,
        buckets: Annotated[int, typer.Option(help="Show at most this many buckets.")] = 12,
        json_path: Annotated[Path | None, typer.Option(
            "--json", help="Also write the plan (all buckets) as JSON.")] = None,
        hierarchy: Annotated[str | None, typer.Option(
            help="Two-level plan: NODESxLOCAL (e.g. 64x8) or ranks per node; bytes per level.")] = None,
        parallel: Annotated[str, typer.Option(
            help="ddp (buckets, all-reduce) or fsdp (FSDP2 per block: reduce-scatter vs its FP32 / bf16).")] = "ddp",
    ) -> None:
        """Show the plan: region classes, buckets with their routes, capacity, bytes vs FP32.

        Extra `key=value` arguments are model options (e.g. width=16 small_input=true).
        """
        from nfab.attach_checks import check_globs
        from nfab.config.calibrated import calibrated_setting
        from nfab.config.shipped import resolve_profile
        from nfab.errors import ConfigError
        from nfab.inspect import crossovers, inspect_model
        from nfab.models import build_model
        from nfab.profile.schema import Profile
        from nfab.wire.cost import CostModel, default_cost_model

        options = parse_kv(ctx.args)
        if size is not None:
            options["size"] = size
        if profile is not None and route is not None:
            raise ConfigError("give at most one of --profile and --route")
        spec = build_model(model, device="meta", **options)
        if profile is not None:
            prof, explicit = Profile.load(resolve_profile(profile)), False
            _check_layout(prof, profile, model, spec)
            setting = calibrated_setting(prof)
            if total_steps is None and setting is not None:
                total_steps = setting.steps
        else:
            prof, explicit = Profile.static(route or "sign"), True
        check_globs(prof, spec.module)
        if parallel not in ("ddp", "fsdp"):
            raise ConfigError(f"--parallel must be ddp or fsdp, got {parallel!r}")
        cm = None if cost == "none" else CostModel.load(cost) if cost else default_cost_model(world_size)
        if parallel == "fsdp":
            if hierarchy is not None:
                raise ConfigError("--hierarchy plans DDP's two-level all-reduce; FSDP2's reduce-scatter is one level")
            _print_fsdp(model, size, spec, prof, world_size, explicit, step, total_steps, cm, json_path)
            return
        layout = _layout(hierarchy, world_size)
        res = inspect_model(model, spec.module, prof, world_size, explicit=explicit, step=step,
                            total_steps=total_steps, cost_model=cm, bucket_cap_mb=bucket_cap_mb,
                            head_modules=spec.head_modules, hierarchy=layout)
        shape = f" ({layout[0]} nodes x {layout[1]})" if layout else ""
        title = f"{model} {size or ''} — {res.total_params:,} parameters, W={world_size}{shape}, phase {res.phase!r}"
        t = Table(title=title)
        for col in ("region", "params", "elements", "profile route", "reducer"):
            t.add_column(col, justify="right" if col in ("params", "elements") else "left")
        for r in res.regions:
            t.add_row(r.region, str(r.params), f"{r.elements:,}", r.route, r.reducer)
        console.print(t)
        b = Table(title=f"buckets (first {min(buckets, len(res.buckets))} of {len(res.buckets)})")
        for col in ("#", "elements", "slices", "regions", "routes", "wire MB", "fp32 MB", "fallbacks"):
            b.add_column(col)
        for row in res.buckets[:buckets]:
            b.add_row(str(row.index), f"{row.elements:,}", str(row.slices), row.regions, row.routes,
                      f"{row.wire_bytes / 1e6:.2f}", f"{row.baseline_wire_bytes / 1e6:.2f}", row.fallbacks)
        console.print(b)
        cap_world = layout[0] if layout else world_size
        c = Table(title=f"reducer capacity at W={cap_world}" + (" (across nodes)" if layout else ""))
        for col in ("route", "reducer", "exact", "lane bits", "levels/rank", "bits/element sent"):
            c.add_column(col)
        for row in res.capacity:
            c.add_row(row.route, row.reducer, "yes" if row.ok else f"no: {row.reason}",
                      str(row.lane_bits or ""), str(row.levels or ""),
                      f"{row.bits_per_element:.2f}" if row.bits_per_element is not None else "")
        console.print(c)
        ratio = res.baseline_wire_bytes / res.wire_bytes if res.wire_bytes else float("inf")
        mix = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sorted(res.route_bytes.items()))
        console.print(f"per step, per rank: [bold]{res.wire_bytes / 1e6:.2f} MB[/] sent ({mix}) vs "
                      f"FP32 DDP {res.baseline_wire_bytes / 1e6:.2f} MB — {ratio:.1f}x fewer bytes "
                      f"(cost model: {cm.source if cm is not None else 'none, no cost gate'})")
        if layout:
            _print_levels(res)
        largest = max((row.elements for row in res.buckets), default=0)
        xs = crossovers(cm or default_cost_model(world_size), largest) if largest else []
        if xs:
            text = ", ".join(f"W>={w}: {best}" for w, best in xs)
            console.print(f"cheapest path for a {largest:,}-element bucket as W grows: {text}")
        if json_path is not None:
            from nfab.fsutil import atomic_write_json

            atomic_write_json(json_path, res.to_dict(xs))
            console.print(f"wrote {json_path}")


def _print_fsdp(model, size, spec, prof, world_size, explicit, step, total_steps, cm, json_path) -> None:  # noqa: ANN001
    """`--parallel fsdp`: one row per `fully_shard` unit, totals against FSDP2's FP32 and bf16 reduce-scatter."""
    from nfab.runtime.frontends import fsdp2

    fsdp2.require("nfab inspect --parallel fsdp")
    from nfab.inspect_fsdp import inspect_fsdp

    res = inspect_fsdp(model, spec.module, prof, world_size, explicit=explicit, shard_units=spec.shard_units,
                       step=step, total_steps=total_steps, cost_model=cm, head_modules=spec.head_modules)
    t = Table(title=f"{model} {size or ''} under FSDP2 — {res.total_params:,} parameters, {len(res.units)} "
                    f"fully_shard units, W={world_size}, phase {res.phase!r}")
    for col in ("unit", "elements", "routes", "wire MB", "fp32 MB", "bf16 MB", "fallbacks"):
        t.add_column(col, justify="left" if col in ("unit", "routes", "fallbacks") else "right")
    shown = res.units if len(res.units) <= 8 else [*res.units[:3], None, *res.units[-2:]]
    for u in shown:
        if u is None:
            t.add_row("...", "", "", "", "", "", "")
            continue
        t.add_row(u.unit, f"{u.elements:,}", u.routes, f"{u.wire_bytes / 1e6:.2f}", f"{u.fp32_bytes / 1e6:.2f}",
                  f"{u.bf16_bytes / 1e6:.2f}", u.fallbacks)
    console.print(t)
    gated = sorted({f for u in res.units for f in u.fallbacks.split(", ") if f})
    if gated:  # the units the table elides may carry them too
        console.print(f"kept off their profile route in some unit: {', '.join(gated)} (cost: the cost model "
                      "prices FP32 cheaper there; --cost names the link's)", highlight=False, soft_wrap=True)
    mix = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sorted(res.route_bytes.items()))
    console.print(f"reduce-scatter per step, per rank: [bold]{res.wire_bytes / 1e6:.2f} MB[/] sent ({mix}) vs "
                  f"FSDP2 FP32 {res.fp32_bytes / 1e6:.2f} MB ({res.fp32_bytes / res.wire_bytes:.2f}x fewer) and "
                  f"bf16 {res.bf16_bytes / 1e6:.2f} MB ({res.bf16_bytes / res.wire_bytes:.2f}x fewer)")
    if json_path is not None:
        from nfab.fsutil import atomic_write_json

        atomic_write_json(json_path, res.to_dict())
        console.print(f"wrote {json_path}")


def _layout(hierarchy: str | None, world_size: int) -> tuple[int, int] | None:
    """(nodes, ranks per node) from --hierarchy, checked against the world size; None: flat."""
    from nfab.errors import ConfigError
    from nfab.runtime.core.hierarchy import parse

    h = parse(hierarchy)
    if h is None:
        return None
    if h.local_world is None:
        raise ConfigError(f"--hierarchy {hierarchy}: inspect plans on paper; give NODESxLOCAL (e.g. 64x8) "
                          "or ranks per node")
    topo = h.topology(world_size, 0)
    return topo.nodes, topo.local_world


def _print_levels(res) -> None:  # noqa: ANN001 - an Inspection
    """Bytes per level (the fast node-local link, the slow inter-node one) and both factors."""
    nodes, local = res.hierarchy
    t = Table(title=f"bytes per level, per step ({nodes} nodes x {local} ranks)")
    for col in ("level", "W", "MB per rank", "MB per node", "FP32 DDP MB per rank"):
        t.add_column(col)
    for lv in res.levels:
        per_node = lv.wire_bytes * local if lv.level == "across nodes" else lv.wire_bytes
        t.add_row(lv.level, str(lv.world_size), f"{lv.wire_bytes / 1e6:.2f}",
                  f"{per_node / 1e6:.2f}" if lv.level != "node-local" else "(inside the node)",
                  f"{lv.baseline_wire_bytes / 1e6:.2f}")
    console.print(t)
    console.print(f"across the inter-node link, per node: [bold]{res.slow_link_bytes / 1e6:.2f} MB[/] vs FP32 DDP "
                  f"{res.baseline_wire_bytes / 1e6:.2f} MB — {res.slow_link_ratio:.1f}x fewer bytes")


def _check_layout(prof: Profile, where: str, model: str, spec: ModelSpec) -> None:
    """A profile calibrated for another model is refused, as `nfab train` and `attach` refuse it; one for
    the same model at another size or width plans its region routes on this layout (what a calibrated
    profile would send at 1.3b), with a note that says so."""
    from nfab.config.calibrated import layout_mismatch
    from nfab.errors import ProfileError

    mismatch = layout_mismatch(prof, spec)
    if mismatch is None:
        return
    if prof.model.name not in (model, spec.name):
        raise ProfileError(f"profile {where}: {mismatch}")
    console.print(f"note: profile {where} was calibrated for {prof.model.name} at another parameter layout: "
                  "planning its region routes on this one", highlight=False)
