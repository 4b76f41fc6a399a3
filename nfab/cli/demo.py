"""`nfab demo`: the main job end to end on the built-in defaults (what `make demo` runs).

calibrate resnet18 (quick) -> train FP32, bf16, static sign and the fitted profile on 2 gloo ranks
for a declared slow link (`comm.cost_model=link:100mbit`: the cost gate prices that link, not this
machine's loopback, so it decides the same way on every run) -> report -> one table: bytes against
FP32 and bf16, final accuracy, and time to accuracy modelled at the link (`nfab.report.linktime`).
Each stage is the real CLI in a subprocess, exactly as a user runs it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from nfab.cli.output import console, fail

LINK = "link:100mbit"
"""The link the demo trains for: slow enough that the gradient's bytes are most of an FP32 step."""
RUNS = (("fp32", ["--fp32"]), ("bf16", ["--route", "bf16"]), ("static-sign", ["--route", "sign"]))
"""The comparisons the profile is trained beside: FP32, bf16 (half the bytes) and sign without control."""


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


def print_summary(run_dirs: list[Path]) -> None:
    """The demo in one table: every run priced at the link it declared, then the profile's line in words."""
    from nfab.report.discover import discover
    from nfab.report.formatting import cell
    from nfab.report.linktime import ACCURACY_POINTS, link_view

    priced = link_view(list(discover([str(d) for d in run_dirs]).runs))
    if priced is None:
        fail("the demo's runs hold no FP32 run for a declared link: nothing to compare")
    link, frame, target = priced
    table = Table(title=f"nfab demo: resnet18 on digits, W=2, trained for {link}", title_justify="left",
                  header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    heads = {"run": "run", "wire_mb": "grad.\nMB", "fewer_bytes_vs_fp32": "fewer B\nvs FP32",
             "fewer_bytes_vs_bf16": "fewer B\nvs bf16", "accuracy": "final\nacc.",
             "accuracy_delta_pts": "Δ acc.\n(pts)", "time_to_accuracy_s": f"s to\n{target:.1%}",
             "speedup_vs_fp32": "×\nFP32", "speedup_vs_bf16": "×\nbf16"}
    for col, head in heads.items():
        table.add_column(head, justify="left" if col == "run" else "right", no_wrap=True)
    for row in frame.to_dict("records"):
        table.add_row(*(cell(c, row[c]) for c in heads))
    console.print(table)
    console.print(f"time to accuracy: modelled at {link} (each step: this machine's compute, the fastest half of "
                  f"its steps, + its gradient bytes at the link), until held-out accuracy first reaches {target:.2%} "
                  f"(FP32's mean over its last evaluations, less {ACCURACY_POINTS:g} point); × = how many times "
                  "sooner than FP32 / bf16",
                  highlight=False)
    prof = frame[frame["run"] == "profile"].to_dict("records")
    if prof:
        p = prof[0]
        console.print(f"[bold]the profile[/]: {cell('fewer_bytes_vs_fp32', p['fewer_bytes_vs_fp32'])} fewer gradient "
                      f"bytes than FP32 ({cell('fewer_bytes_vs_bf16', p['fewer_bytes_vs_bf16'])} fewer than bf16), "
                      f"final accuracy {cell('accuracy', p['accuracy'])} "
                      f"({cell('accuracy_delta_pts', p['accuracy_delta_pts'])} points against FP32), "
                      f"at {link} {cell('speedup_vs_fp32', p['speedup_vs_fp32'])} sooner to accuracy than FP32 "
                      f"and {cell('speedup_vs_bf16', p['speedup_vs_bf16'])} sooner than bf16", highlight=False)


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo(
        out: Annotated[Path, typer.Option(help="Folder for every artifact of the demo.")] = Path("runs/demo"),
        steps: Annotated[int, typer.Option(help="Training steps per run.", min=1)] = 150,
        nproc: Annotated[int, typer.Option(help="gloo ranks per run.", min=1)] = 2,
        calibrate: Annotated[bool, typer.Option(help="Calibrate first (else use the shipped profile).")] = True,
    ) -> None:
        """Calibrate resnet18; train FP32, bf16, static sign and the profile for a 100 Mbit/s link; report."""
        from nfab.cli.calibrate import VALIDATION_FAILED
        from nfab.config.shipped import resolve_config, resolve_profile

        t0 = time.perf_counter()
        config = str(resolve_config("resnet18-digits"))  # the shipped config, cloned or installed
        calib = out / "calibration"
        if calibrate:
            _run(["calibrate", "resnet18", "--quick", "--out", str(calib), "--overwrite"], carry_on=VALIDATION_FAILED)
            profile = calib / "profile.json"
        else:
            profile = resolve_profile("resnet18")
        # every run declares the link (FP32 and bf16 record it, the profile's cost gate prices it) and is
        # evaluated every 10 steps: the time-to-accuracy curve
        common = ["--config", config, "--nproc", str(nproc), "--steps", str(steps), "--overwrite", "--quiet",
                  f"comm.cost_model={LINK}", "eval_every=10"]
        runs = [*RUNS, ("profile", ["--profile", str(profile)])]
        for name, flags in runs:
            _run(["train", *common, *flags, "--run-dir", str(out / name)])
        dirs = [out / name for name, _ in runs]
        _run(["report", *map(str, dirs), str(calib if calibrate else profile.parent), "--out", str(out / "report")])
        print_summary(dirs)
        console.print(f"[bold green]demo done[/] in {time.perf_counter() - t0:.0f} s: open "
                      f"{out / 'report' / 'report.html'}")
