"""`nfab bench step`: training-step time of communication variants side by side, optionally on a shaped link."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from nfab.cli.output import console, fail
from nfab.errors import NfabError
from nfab.train.config import NFAB_BUCKET_MB


def _routes(info: dict[str, Any] | None) -> str:
    if not info:
        return ""
    mix = ", ".join(f"{k} {v:.0%}" for k, v in sorted(info["route_mix"].items(), key=lambda kv: -kv[1]))
    falls = "; ".join(info["fallback_reasons"])
    return mix + (f" [dim](fallback: {falls})[/]" if falls else "")


def _wire_ratios(r: dict[str, Any], info: dict[str, Any] | None) -> tuple[str, str]:
    """Gradient bytes per step against FP32 and against bf16 DDP (bf16 sends half of FP32)."""
    if info:
        vs_fp32 = info["wire_bytes_per_step"] / info["baseline_wire_bytes_per_step"]
    elif r["variant"] in WIRE_VS_FP32:
        vs_fp32 = WIRE_VS_FP32[r["variant"]]
    else:
        return "", ""
    return f"{vs_fp32:.3f}", f"{2 * vs_fp32:.3f}"


WIRE_VS_FP32 = {"plain": 1.0, "allreduce-hook": 1.0, "bf16": 0.5, "fp16": 0.5, "floor": 0.0}
"""Gradient bytes against FP32 of the torch variants whose bytes do not depend on the model."""


def print_report(doc: dict[str, Any], title: str) -> None:
    """The summary rows as a rich table (median, p10-p90, paired ratios to FP32, the floor and bf16,
    bytes against FP32 and bf16, nfab routes)."""
    has_floor = any(r["ratio_to_floor"] is not None for r in doc["rows"])
    has_bf16 = any(r.get("ratio_to_bf16") is not None for r in doc["rows"])
    has_link = any(r.get("measured_wire_bytes_per_step") is not None for r in doc["rows"])
    table = Table(title=title)
    for col in ("variant", "median ms", "p10–p90 ms", "× plain", *(["× bf16"] if has_bf16 else []),
                *(["× floor"] if has_floor else []), "wire / fp32", "wire / bf16",
                *(["link MB/step measured", "modelled"] if has_link else []), "nfab routes"):
        table.add_column(col, justify="left" if col in ("variant", "nfab routes") else "right")
    for r in doc["rows"]:
        info = doc["nfab"].get(r["variant"])
        cells = [r["variant"], f"{r['median_ms']:.1f}", f"{r['p10_ms']:.1f}–{r['p90_ms']:.1f}",
                 f"{r['ratio_to_plain']:.3f}"]
        if has_bf16:
            cells.append("" if r.get("ratio_to_bf16") is None else f"{r['ratio_to_bf16']:.3f}")
        if has_floor:
            cells.append("" if r["ratio_to_floor"] is None else f"{r['ratio_to_floor']:.3f}")
        cells.extend(_wire_ratios(r, info))
        if has_link:
            measured, modelled = r.get("measured_wire_bytes_per_step"), r.get("modelled_wire_bytes_per_step")
            cells += ["" if measured is None else f"{measured / 1e6:.3f}",
                      "" if modelled is None else f"{modelled / 1e6:.3f}"]
        table.add_row(*cells, _routes(info))
    console.print(table)
    cfg, link = doc["config"], doc.get("link")
    console.print(
        f"{doc['parameters']:,} parameters, W={cfg['world_size']}, batch {cfg['batch']}/rank, "
        f"{cfg['steps']} timed steps after {cfg['warmup']} warm-up; "
        f"link: {_link(link)}; "
        "ratios are medians of per-step ratios", highlight=False)


def _link(link: dict[str, Any] | None) -> str:
    if not link:
        return "loopback (unshaped)"
    if link.get("nodes", 1) > 1:
        delay = f", {link['delay']} delay" if link.get("delay") else ""
        return f"{link['nodes']} nodes joined by {link['rate']} each way{delay}"
    return f"{link['rate']} loopback"


def register(app: typer.Typer) -> None:
    @app.command("step")
    def bench_step(
        link: Annotated[str | None, typer.Option(
            "--link", help="Shape the ranks' loopback to a tc rate (1gbit, 100mbit); needs root + iproute2.")] = None,
        model: Annotated[str, typer.Option("--model", help="Model (resnet18).")] = "resnet18",
        width: Annotated[int, typer.Option("--width", min=1, help="ResNet stem width (64 = full).")] = 64,
        batch: Annotated[int, typer.Option("--batch", min=1, help="Samples per rank per step.")] = 16,
        steps: Annotated[int, typer.Option("--steps", min=1, help="Timed steps per variant.")] = 20,
        warmup: Annotated[int, typer.Option("--warmup", min=0, help="Untimed steps first.")] = 3,
        data: Annotated[str, typer.Option("--data", help="synthetic-images or digits.")] = "synthetic-images",
        image_size: Annotated[int, typer.Option("--image-size", min=1)] = 32,
        profile: Annotated[Path | None, typer.Option(
            "--profile", help="Profile for nfab-profile (default calibrations/resnet18/profile.json, "
                              "else a test profile: conv/linear/head sign).")] = None,
        variants: Annotated[str | None, typer.Option(
            "--variants", help="Comma-separated subset of: plain, floor, bf16, fp16, powersgd, nfab-fp32, "
                               "nfab-sign, nfab-sign-2level, nfab-profile, allreduce-hook.")] = None,
        nfab_bucket_mb: Annotated[float, typer.Option(
            "--nfab-bucket-mb", min=0.1,
            help="DDP bucket cap for the nfab variants (nfab train's default; others: DDP's 25).")] = NFAB_BUCKET_MB,
        json_path: Annotated[Path | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
        nodes: Annotated[int, typer.Option(
            "--nodes", help="Emulated nodes: 2 = network namespaces of W/2 ranks joined by the --link.")] = 1,
        world_size: Annotated[int, typer.Option("--world-size", min=1, help="Ranks in all (W).")] = 2,
        delay: Annotated[str | None, typer.Option(
            "--delay", help="One-way delay on the inter-node link (1ms; --nodes 2; needs tc netem).")] = None,
        cost_model: Annotated[str, typer.Option(
            "--cost-model", help="nfab variants: measure (at attach) or none (decide by bytes).")] = "measure",
        parallel: Annotated[str, typer.Option(
            "--parallel", help="ddp, or fsdp: FSDP2 with FP32 / bf16 reduce-scatter, the floor and nfab.")] = "ddp",
    ) -> None:
        """Step time per variant, side by side in one run (W=2 gloo ranks), with ratios to FP32 and bf16 DDP."""
        from nfab.bench import netns
        from nfab.bench import nodes as nodes_mod
        from nfab.bench import step as step_mod

        if link is not None:
            netns.check_rate(link)
            why = netns.unavailable() if nodes == 1 else nodes_mod.unavailable()
            if why is not None:
                fail(why)
        prof, source = step_mod.on_bench_model(*step_mod.load_profile_dict(profile))
        kw: dict[str, Any] = {}
        if variants is not None:
            kw["variants"] = tuple(v.strip() for v in variants.split(",") if v.strip())
        try:
            cfg = step_mod.BenchConfig(model=model, width=width, batch=batch, steps=steps, warmup=warmup, data=data,
                                       image_size=image_size, link=link, profile=prof, profile_source=source,
                                       nfab_bucket_mb=nfab_bucket_mb, nodes=nodes, world_size=world_size,
                                       delay=delay, cost_model=cost_model, parallel=parallel, **kw)
        except NfabError as exc:
            fail(str(exc))
        console.print(f"nfab bench step: {', '.join(cfg.variants)}; profile: {source}", highlight=False)
        doc = step_mod.report(cfg, step_mod.run(cfg))
        wrapper = " FSDP2," if parallel == "fsdp" else ""
        link_text = _link(doc.get("link"))
        print_report(doc, f"nfab bench step  (resnet18 width {width},{wrapper} W={world_size}, {link_text})")
        if json_path is not None:
            step_mod.write_json(json_path, doc)
            console.print(f"wrote {json_path}")
