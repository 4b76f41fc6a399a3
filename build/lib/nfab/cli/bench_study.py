"""`nfab bench study`: FP32 / static sign / sign+EF / calibrated profile, trained side by side."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markdown import Markdown

from nfab.cli.output import console, fail


def _extra_profiles(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        model, sep, path = item.partition("=")
        if not sep or not model or not path:
            fail(f"--refit expects MODEL=PROFILE.json, got {item!r}")
        if not Path(path).is_file():
            fail(f"--refit profile {path!r} not found")
        out[model] = path
    return out


def register(app: typer.Typer) -> None:
    @app.command("study")
    def bench_study(
        out: Annotated[Path, typer.Option(help="Folder for the runs, the report and study.json/.md.")] = Path(
            "bench/study"),
        steps: Annotated[int | None, typer.Option(min=1, help="Steps per run (default 150 resnet18, 300 gpt).")] = None,
        quick: Annotated[bool, typer.Option("--quick", help="40 steps per run (smoke check).")] = False,
        models: Annotated[str, typer.Option(help="Comma-separated study models.")] = "resnet18,gpt",
        nproc: Annotated[int, typer.Option(min=1, help="gloo ranks per run.")] = 4,
        variants: Annotated[str | None, typer.Option(
            help="Comma-separated subset of fp32,sign,sign-ef,profile,refit (default: all).")] = None,
        refit: Annotated[list[str] | None, typer.Option(
            help="MODEL=PROFILE.json: also run this profile (variant 'refit'); repeatable.")] = None,
    ) -> None:
        """Accuracy and traffic of FP32, static sign (with/without error feedback) and the shipped profile."""
        from nfab.bench.study import MODELS, VARIANTS, StudyConfig, run_study

        names = tuple(m.strip() for m in models.split(",") if m.strip())
        for m in names:
            if m not in MODELS:
                fail(f"unknown study model {m!r} (known: {', '.join(MODELS)})")
        for m in names:
            if not Path(MODELS[m].config).exists():
                fail(f"{MODELS[m].config} not found: run the study from the repository root")
        picked = None if variants is None else tuple(v.strip() for v in variants.split(",") if v.strip())
        for v in picked or ():
            if v not in VARIANTS:
                fail(f"unknown study variant {v!r} (known: {', '.join(VARIANTS)})")
        cfg = StudyConfig(out=out, models=names, steps=steps, quick=quick, nproc=nproc, variants=picked,
                          extra_profiles=_extra_profiles(refit or []))
        command = shlex.join(["nfab", *sys.argv[1:]])
        doc = run_study(cfg, command=command, log=lambda s: console.print(s, highlight=False))
        console.print(Markdown((out / "study.md").read_text()))
        console.print(f"wrote {out / 'study.json'}, {out / 'study.md'}"
                      + (f", {doc['report']}/report.html" if doc["report"] else " (report failed)"))
        if any(not r["ok"] for r in doc["rows"]):
            fail("some study runs failed (see study.md)", code=1)
