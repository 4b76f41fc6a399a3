"""`nfab demo`: the main job end to end on the built-in defaults (what `make demo` runs).

calibrate resnet18 (quick) -> train FP32, static sign and the fitted profile on 2 gloo
ranks -> report. Each stage is the real CLI in a subprocess, exactly as a user runs it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from nfab.cli.output import console, fail


def _run(args: list[str], carry_on: int | None = None) -> None:
    """One stage as a subprocess; an exit code other than 0 (or `carry_on`) ends the demo with it."""
    exe = str(Path(sys.executable).parent / "nfab")
    console.print(f"[bold cyan]$ nfab {' '.join(args)}[/]")
    t0 = time.perf_counter()
    res = subprocess.run([exe, *args], check=False)
    if carry_on is not None and res.returncode == carry_on:
        console.print("[yellow]the demo trains the profile as calibrated; the report shows its validation[/]")
    elif res.returncode != 0:
        fail(f"demo stage 'nfab {args[0]}' failed with exit code {res.returncode}", code=res.returncode)
    console.print(f"[dim]({time.perf_counter() - t0:.0f} s)[/]")


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo(
        out: Annotated[Path, typer.Option(help="Folder for every artifact of the demo.")] = Path("runs/demo"),
        steps: Annotated[int, typer.Option(help="Training steps per run.", min=1)] = 150,
        nproc: Annotated[int, typer.Option(help="gloo ranks per run.", min=1)] = 2,
        calibrate: Annotated[bool, typer.Option(help="Calibrate first (else use the shipped profile).")] = True,
    ) -> None:
        """Calibrate resnet18, train FP32 / static sign / profile-guided, and report."""
        from nfab.cli.calibrate import VALIDATION_FAILED
        from nfab.config.shipped import resolve_config, resolve_profile

        config = str(resolve_config("resnet18-digits"))  # the shipped config, cloned or installed
        calib = out / "calibration"
        if calibrate:
            _run(["calibrate", "resnet18", "--quick", "--out", str(calib), "--overwrite"], carry_on=VALIDATION_FAILED)
            profile = calib / "profile.json"
        else:
            profile = resolve_profile("resnet18")
        common = ["--config", config, "--nproc", str(nproc), "--steps", str(steps), "--overwrite", "--quiet"]
        _run(["train", *common, "--fp32", "--run-dir", str(out / "fp32")])
        _run(["train", *common, "--route", "sign", "--run-dir", str(out / "static-sign")])
        _run(["train", *common, "--profile", str(profile), "--run-dir", str(out / "profile")])
        _run(["report", str(out / "fp32"), str(out / "static-sign"), str(out / "profile"), str(calib if calibrate
              else profile.parent), "--out", str(out / "report")])
        console.print(f"[bold green]demo done[/]: open {out / 'report' / 'report.html'}")
