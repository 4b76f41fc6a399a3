"""`nfab bench study`: FP32, fp16, PowerSGD r2/r8, static sign (+/- EF) and nfab's profile in a user's loop."""

from __future__ import annotations

import shlex
import shutil
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markdown import Markdown

from nfab.cli.output import console, fail
from nfab.errors import NfabError


def _names(text: str | None, known: tuple[str, ...], what: str) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    for n in names:
        if n not in known:
            fail(f"unknown study {what} {n!r} (known: {', '.join(known)})")
    return names


def _seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        fail(f"--seeds must be comma-separated integers, got {text!r}")
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        fail(f"--seeds must be distinct integers >= 0, got {text!r}")
    return seeds


def register(app: typer.Typer) -> None:
    @app.command("study")
    def bench_study(
        out: Annotated[Path, typer.Option(help="Folder for study.json/.md, report.html and the Pareto PNGs.")] = Path(
            "bench/study"),
        settings: Annotated[str | None, typer.Option(
            help="Comma-separated subset of resnet18,gpt,heldout,heldout2,heldout3,heldout-w8,heldout-w8c,"
                 "heldout-600,recipe-gpt,recipe-vit,recipe-cnn (default: all).", show_default=False)] = None,
        variants: Annotated[str | None, typer.Option(
            help="Comma-separated subset of fp32,bf16,fp16,powersgd-r2,powersgd-r8,sign,sign-ef,bq3,bl6,bl5,bq2,bq2-nm,"
                 "bl5-nm,profile,profile-nm (default: all).",
            show_default=False)] = None,
        steps: Annotated[int | None, typer.Option(min=1, help="Steps for every setting (default: each its own).",
                                                  show_default=False)] = None,
        world_size: Annotated[int | None, typer.Option(
            "--world-size", "-w", min=1, help="gloo ranks for every setting (default 4).", show_default=False)] = None,
        publish: Annotated[bool, typer.Option(
            "--publish", help="Copy study.json to bench/study.json, regenerate docs/study.md's tables and "
                              "the Pareto PNGs from it.")] = False,
        append: Annotated[bool, typer.Option(
            "--append", help="Merge into OUT/study.json, keeping its rows of other settings/variants/seeds.")] = False,
        seeds: Annotated[str, typer.Option(
            help="Comma-separated seeds: every setting x variant runs once per seed; the tables show the first "
                 "(an appended study's own), an across-seed table the spread.")] = "0",
        regen_docs: Annotated[bool, typer.Option(
            "--regen-docs", help="Only regenerate docs/study.md's tables and the PNGs from bench/study.json.")
        ] = False,
    ) -> None:
        """Quality and gradient bytes of every variant, side by side, with a bytes-vs-quality plot."""
        from nfab.bench import studydocs
        from nfab.bench.study import SETTINGS, VARIANTS, StudyConfig, harness, run_study

        root = Path.cwd()
        if regen_docs:
            try:
                written = studydocs.regen_docs(root)
            except NfabError as exc:
                fail(str(exc))
            console.print("regenerated " + ", ".join(str(p) for p in written))
            return
        try:
            harness(root)  # the loop and the held-out models live in a repository checkout
        except NfabError as exc:
            fail(str(exc))
        for s in _names(settings, tuple(SETTINGS), "setting") or SETTINGS:
            prof = SETTINGS[s].profile
            if prof is not None and not (root / prof).is_file() and (variants is None or "profile" in variants):
                fail(f"{prof} not found: run the study from the repository root (or calibrate {s} first)")
        cfg = StudyConfig(out=out, settings=_names(settings, tuple(SETTINGS), "setting") or tuple(SETTINGS),
                          variants=_names(variants, VARIANTS, "variant") or VARIANTS, steps=steps,
                          world_size=world_size, seeds=_seeds(seeds), append=append)
        command = shlex.join(["nfab", *sys.argv[1:]])
        try:
            doc = run_study(cfg, command=command, log=lambda s: console.print(s, highlight=False), root=root)
        except ValueError as exc:
            fail(str(exc))
        console.print(Markdown((out / "study.md").read_text()))
        console.print(f"wrote {out / 'study.json'}, {out / 'study.md'}, {out / 'report.html'}")
        if publish:
            shutil.copyfile(out / "study.json", root / studydocs.STUDY_JSON)
            written = studydocs.regen_docs(root)
            console.print("published " + ", ".join(str(p) for p in [root / studydocs.STUDY_JSON, *written]))
        if any(not r["ok"] for r in doc["rows"]):
            fail("some study runs failed (see study.md)", code=1)
