"""`nfab bench hook`: nfab's hook beside plain DDP and PyTorch's hooks, and where its time goes."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from nfab.cli.output import console


def register(app: typer.Typer) -> None:
    @app.command("hook")
    def bench_hook(
        json_path: Annotated[Path | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
        model: Annotated[str, typer.Option("--model", help="Model (resnet18).")] = "resnet18",
        width: Annotated[int, typer.Option("--width", min=1, help="ResNet stem width.")] = 16,
        batch: Annotated[int, typer.Option("--batch", min=1, help="Samples per rank per step.")] = 16,
        steps: Annotated[int, typer.Option("--steps", min=1, help="Timed steps per variant.")] = 30,
        warmup: Annotated[int, typer.Option("--warmup", min=0, help="Untimed steps first.")] = 3,
    ) -> None:
        """Step time of plain DDP, nfab fp32 / sign and torch hooks on loopback (W=2), plus a breakdown."""
        from nfab.bench import hook as hook_mod
        from nfab.bench import step as step_mod
        from nfab.cli.bench_step import print_report

        cfg = hook_mod.hook_config(model=model, width=width, batch=batch, steps=steps, warmup=warmup)
        doc = step_mod.report(cfg, hook_mod.run(cfg))
        print_report(doc, f"nfab bench hook  (resnet18 width {width}, loopback)")
        parts = doc.get("breakdown_ms_per_step") or {}
        phases = parts.get("phases_ms_per_step") or {}
        if phases:
            names = sorted({k for v in phases.values() for k in v if k != "hook_cpu"}) + ["hook_cpu"]
            table = Table(title="nfab hook CPU by phase, ms per step (median; timed by the Runtime itself)")
            table.add_column("phase")
            for variant in phases:
                table.add_column(variant, justify="right")
            for name in names:
                table.add_row(name, *(f"{phases[v].get(name, 0.0):.3f}" for v in phases))
            console.print(table)
        if "allreduce" in parts:
            console.print(f"allreduce alone on the fp32 plan's {parts['buckets']} bucket(s): "
                          f"{parts['allreduce']:.3f} ms per step", highlight=False)
        if json_path is not None:
            step_mod.write_json(json_path, doc)
            console.print(f"wrote {json_path}")
