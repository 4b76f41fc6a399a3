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
        if parts:
            table = Table(title=f"nfab fp32 hook parts, ms per step over {parts['buckets']} bucket(s), median")
            table.add_column("part")
            table.add_column("ms", justify="right")
            for key in ("allreduce", "allreduce+ctrl", "ctrl_allgather", "allreduce_launch_only",
                        "norm_pass", "prescale", "hook_cpu"):
                table.add_row(key, f"{parts[key]:.3f}")
            console.print(table)
            console.print("hook_cpu: nfab hook body + callback per step (Runtime.hook_time_s); the hook "
                          "runs two norm passes per bucket", highlight=False)
        if json_path is not None:
            step_mod.write_json(json_path, doc)
            console.print(f"wrote {json_path}")
