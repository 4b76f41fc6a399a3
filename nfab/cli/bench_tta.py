"""`nfab bench tta`: time to FP32's smoothed final validation loss (+2%), per communication variant and seed,
on an emulated link; a verdict for every variant over the seeds."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from nfab.cli.output import console, fail
from nfab.errors import NfabError

DEFAULT_SEEDS = "0-2"
"""Three seeds by default: on resnet18's recipe one seed's time to target is a draw (docs/benchmarks.md)."""


def _x(v: float | None, at_least: float | None = None) -> str:
    if v is None:
        return "never" if at_least is None else f">= {at_least:.2f}x"
    return f"{v:.2f}x"


def print_report(doc: dict[str, Any]) -> None:
    """Time and steps to target, speed-ups against FP32 and bf16 DDP, bytes to target."""
    from nfab.bench.tta import summary_rows

    link = doc.get("link")
    table = Table(title=f"nfab bench tta  ({doc['config']['model']}, W={doc['config']['world_size']}, "
                        f"{link['rate'] + ' loopback' if link else 'loopback (unshaped)'}; "
                        f"target {doc['target_loss']:.4f}: {doc.get('target_rule', 'FP32 final val loss')})")
    for col in ("variant", "time to target s", "steps to target", "× fp32", "× bf16", "final loss",
                "ms/step", "MB to target", "fewer bytes/step"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for r in summary_rows(doc):
        t = r["time_to_target_s"]
        fewer = r["fewer_bytes_per_step_vs_fp32"]
        table.add_row(r["variant"], "never" if t is None else f"{t:.1f}",
                      f"{r['steps_to_target'] or '-'} / {r['steps']}",
                      _x(r["speedup_vs_fp32"], r["speedup_vs_fp32_at_least"]),
                      _x(r["speedup_vs_bf16"], r["speedup_vs_bf16_at_least"]) if "bf16" in doc["variants"] else "-",
                      f"{r['final_loss']:.4f}",
                      f"{r['step_ms']:.0f}", f"{r['wire_bytes'] / 1e6:.1f}", "" if fewer is None else f"{fewer:.1f}x")
    console.print(table)
    from nfab.report.tta import recipe_text

    console.print(f"{doc['parameters']:,} parameters; recipe: {recipe_text(doc)}; FP32 {doc['fp32_steps']} steps, "
                  f"others up to {doc['max_steps']}; evaluated every {doc['config']['eval_every']} steps; "
                  f"clock: {doc['clock']}; × = time to target of the base / the variant's (>1: sooner)",
                  highlight=False)


def print_over_seeds(doc: dict[str, Any]) -> None:
    """Per variant over the seeds: reached k of n, median time to target, median speed-ups (`seeds_table`)."""
    from nfab.report.formatting import cell
    from nfab.report.tta import SEEDS_BASES, seeds_table

    frame = seeds_table(doc["over_seeds"])
    bases = [b for b in SEEDS_BASES if b in doc["over_seeds"]]
    table = Table(title=f"over seeds {', '.join(map(str, doc['seeds']))}: each seed against its own FP32 target")
    for col in ("variant", "reached", "median time to target s", *(f"median × {b}" for b in bases)):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for row in frame.to_dict("records"):
        table.add_row(row["variant"], row["reached"], cell("median_time_to_target_s", row["median_time_to_target_s"]),
                      *("" if b == row["variant"] else row[f"median_speedup_vs_{b}"] or "-" for b in bases))
    console.print(table)
    console.print("a seed that never reached its target counts as slower than any that did (0x against a base "
                  "that did)", highlight=False)
    from nfab.bench.ttaseeds import verdict_lines

    rule = doc["runs"][0].get("target_rule", "FP32's final validation loss")
    console.print(f"[bold]verdict[/] (each seed against its own target: {rule}):", highlight=False)
    for line in verdict_lines(doc["over_seeds"]):
        console.print(f"  {line}", highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    @app.command("tta")
    def bench_tta(
        link: Annotated[str | None, typer.Option(
            "--link", help="Shape the ranks' loopback to a tc rate (100mbit); needs root + iproute2.")] = None,
        model: Annotated[str, typer.Option(
            "--model", help="resnet18 (width 32, digits) or gpt (nano, stdlib text).")] = "resnet18",
        steps: Annotated[int | None, typer.Option(
            "--steps", min=1, help="FP32's steps (default: the model's shipped config).")] = None,
        eval_every: Annotated[int, typer.Option("--eval-every", min=1, help="Validation cadence in steps.")] = 10,
        profile: Annotated[Path | None, typer.Option(
            "--profile", help="Profile for nfab-profile (default: the shipped calibrations/<model>/profile.json).")
        ] = None,
        variants: Annotated[str | None, typer.Option(
            "--variants", help="Comma-separated subset of: fp32, bf16, powersgd, nfab-profile (fp32 always runs).")
        ] = None,
        world_size: Annotated[int, typer.Option("--world-size", min=1, help="Ranks (W).")] = 2,
        cost_model: Annotated[str | None, typer.Option(
            "--cost-model", help="nfab's cost gate: measure (at attach), link:RATE or none (decide by bytes); "
                                 "default: the --link declared (link:100mbit), else measure.")] = None,
        seeds: Annotated[str, typer.Option(
            "--seeds", help="Run once per seed (0,1,2 or 0-4), each side by side, and give a verdict over them.")
        ] = DEFAULT_SEEDS,
        tolerance: Annotated[float, typer.Option(
            "--tolerance", help="The target: FP32's smoothed final val loss x (1 + this).")] = 0.02,
        json_path: Annotated[Path | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
        overrides: Annotated[list[str] | None, typer.Argument(
            help="key=value overrides on the model's training recipe, stepped as nfab train steps it "
                 "(optim.lr=0.1 optim.grad_clip=1.0 accum_steps=2 precision=bf16).")] = None,
    ) -> None:
        """Time to FP32's final validation loss: FP32, bf16 and PowerSGD DDP and nfab's profile, side by side."""
        from nfab.bench import netns, tta, ttaseeds
        from nfab.bench import step as step_mod
        from nfab.config.shipped import resolve_profile
        from nfab.profile.schema import Profile

        if link is not None:
            netns.check_rate(link)
            why = netns.unavailable()
            if why is not None:
                fail(why)
        try:
            path = profile if profile is not None else resolve_profile(model)
            prof, source = step_mod.on_bench_model(Profile.load(path).to_dict(), str(path))
            kw: dict[str, Any] = {}
            if variants is not None:
                kw["variants"] = tuple(v.strip() for v in variants.split(",") if v.strip())
            seed_list = ttaseeds.parse_seeds(seeds)
            user = tuple(overrides or ())
            if any(o.split("=", 1)[0].strip() == "seed" for o in user):
                fail("bench tta runs once per --seeds (default 0-2): give --seeds 5, not seed=5")
            cfgs = [tta.TtaConfig(model=model, overrides=(*user, f"seed={s}"), steps=steps, eval_every=eval_every,
                                  world_size=world_size, link=link,
                                  cost_model=cost_model or tta.declared_cost_model(link), profile=prof,
                                  profile_source=source, tolerance=tolerance, **kw)
                    for s in seed_list]
        except NfabError as exc:
            fail(str(exc))
        command = shlex.join(["nfab", *sys.argv[1:]])
        console.print(f"nfab bench tta: {', '.join(cfgs[0].variants)}; profile: {source}; "
                      f"seeds {', '.join(map(str, seed_list))}; nfab's cost model: {cfgs[0].cost_model}; "
                      f"target: {tta.target_rule(cfgs[0])}", highlight=False)
        docs = []
        for cfg in cfgs:
            docs.append(tta.report(cfg, tta.run(cfg), command=command))
            print_report(docs[-1])
        over = ttaseeds.seeds_document(seed_list, docs, command=command)
        print_over_seeds(over)  # a verdict for every variant, from one seed too
        doc = docs[0] if len(docs) == 1 else over
        if json_path is not None:
            tta.write_json(json_path, doc)
            console.print(f"wrote {json_path}")
