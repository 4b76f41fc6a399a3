"""`nfab train`: instrumented DDP training under torchrun (the work is in nfab.train)."""

from __future__ import annotations

import shlex
import sys
from typing import Annotated

import typer
from rich.markup import escape

from nfab.cli.output import console, err_console, fail
from nfab.overrides import clash
from nfab.profile.routes import format_route, parse_route
from nfab.wire.cost import is_declared


def _flags(**values: object) -> list[str]:
    """CLI flags as `key=value` overrides (None: not given)."""
    out = []
    for key, value in values.items():
        if value is None or value is False:
            continue
        out.append(f"{key}={'true' if value is True else value}")
    return out


def _key(item: str) -> str:
    return item.partition("=")[0]


def warn(message: str) -> None:
    """One warning line on stderr: a safe fallback the user should know about (not markup)."""
    err_console.print(f"[bold yellow]warning:[/] {escape(message)}", highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    @app.command("train", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def train(
        ctx: typer.Context,
        config: Annotated[str | None, typer.Option(
            "--config", "-c", help="YAML config: a path or a shipped name (gpt-nano-stdlib).")] = None,
        profile: Annotated[str | None, typer.Option(
            help="Operating profile: profile.json or a shipped name (resnet18). Alone, it reproduces the "
                 "calibrated setting (model, data, optimizer, batch, schedule, steps, W); with --fp32 or "
                 "--route, that setting sent as they say (the baseline beside it).")] = None,
        route: Annotated[str | None, typer.Option(
            help="Static route: sign, q8, ... everywhere, or conv:sign,norm:fp32,*.bias:fp32.")] = None,
        fp32: Annotated[bool, typer.Option("--fp32", help="Plain DDP / FSDP2, no nfab hook (the reference).")] = False,
        model: Annotated[str | None, typer.Option(help="Model (resnet18, vit, gpt, module:factory).")] = None,
        dataset: Annotated[str | None, typer.Option(
            "--data", "--dataset", metavar="DATA", help="Training data: digits, stdlib-text, a file KIND:PATH "
            "(tokens:, npz:, npy:, parquet:, text:, cifar10:) or module.path:factory.")] = None,
        eval_data: Annotated[str | None, typer.Option(
            "--eval-data", metavar="DATA", help="Held-out data, named as --data is.")] = None,
        loss: Annotated[str | None, typer.Option(
            "--loss", metavar="module.path:fn", help="The loss fn(model, batch) -> scalar (default: the "
                                                    "model's own, else cross-entropy).")] = None,
        parallel: Annotated[str | None, typer.Option(
            help="Data-parallel wrapper: ddp (default) or fsdp (FSDP2, sharded per block).")] = None,
        nproc: Annotated[int | None, typer.Option(help="Ranks per node.")] = None,
        steps: Annotated[int | None, typer.Option(help="Optimizer steps.")] = None,
        precision: Annotated[str | None, typer.Option(
            help="Autocast dtype of the forward: fp32 (default), bf16, or fp16 with a loss scaler.")] = None,
        run_dir: Annotated[str | None, typer.Option(help="Artifact folder (default runs/MODEL-ROUTE-TIME).")] = None,
        resume: Annotated[bool, typer.Option("--resume", help="Continue from the run dir's checkpoint.")] = False,
        overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace what the run dir holds.")] = False,
        quiet: Annotated[bool, typer.Option("--quiet", help="No progress bar.")] = False,
        nnodes: Annotated[int | None, typer.Option(help="torchrun: nodes in the job.")] = None,
        node_rank: Annotated[int | None, typer.Option(help="torchrun: this node's rank.")] = None,
        rdzv_endpoint: Annotated[str | None, typer.Option(help="torchrun: HOST:PORT of node 0.")] = None,
        rdzv_backend: Annotated[str | None, typer.Option(help="torchrun: rendezvous backend.")] = None,
        max_restarts: Annotated[int | None, typer.Option(help="torchrun: restarts after a failure.")] = None,
    ) -> None:
        """Train with DDP or FSDP2 + the nfab hook under torchrun; extra KEY=VALUE args override the config."""
        from nfab.train.launch import WorkerError, launch, resolve_config

        extra = list(ctx.args)
        bad = [a for a in extra if "=" not in a or a.startswith("-")]
        if bad:
            fail(f"unknown option or argument {bad[0]!r} (overrides look like key=value)")
        setting = None
        if profile is not None and (fp32 or route is not None):
            setting, profile = profile, None  # the profile's calibrated setting, sent as --fp32 / --route say
        comm = []
        if profile is not None or route is not None or fp32:
            comm = ["comm.profile=null", "comm.route=null", "comm.fp32=false"]
            comm += _flags(**{"comm.profile": profile, "comm.fp32": fp32})
            if route is not None:
                comm.append(f"comm.route={format_route(parse_route(route))}")
        options = {  # the config key each option sets: (the option as the user typed it, its value)
            "parallel": ("--parallel", parallel), "launch.nproc": ("--nproc", nproc), "steps": ("--steps", steps),
            "precision": ("--precision", precision), "run_dir": ("--run-dir", run_dir), "resume": ("--resume", resume),
            "overwrite": ("--overwrite", overwrite), "quiet": ("--quiet", quiet),
            "loss": ("--loss", loss), "data.eval": ("--eval-data", eval_data),
            "launch.nnodes": ("--nnodes", nnodes), "launch.node_rank": ("--node-rank", node_rank),
            "launch.rdzv_endpoint": ("--rdzv-endpoint", rdzv_endpoint),
            "launch.rdzv_backend": ("--rdzv-backend", rdzv_backend),
            "launch.max_restarts": ("--max-restarts", max_restarts),
        }
        flags = comm + _flags(**{key: value for key, (_, value) in options.items()})
        # a key set both ways is refused: whichever layer won, the other value went unread
        named = {"model.name": ("--model", model), "data.name": ("--dataset", dataset)}
        taken = {key: option for key, (option, value) in named.items() if value is not None}
        sent_as = "--route" if route is not None else "--fp32" if fp32 else "--profile"
        taken |= {_key(item): sent_as for item in comm}
        taken |= {key: option for key, (option, value) in options.items() if value is not None and value is not False}
        if (message := clash(extra, taken)) is not None:
            fail(message)
        cfg = resolve_config(config, extra, flags, names={"model": model, "data": dataset}, setting=setting)
        cfg.command = shlex.join(["nfab", *sys.argv[1:]])
        try:
            result = launch(cfg, warn=warn)
        except WorkerError as exc:
            fail(str(exc), code=exc.code)  # `fail` prints it as text: torch's [brackets] stay as they are
        s = result.summary
        if s is None:
            return
        if s.get("replicas_identical") is False:
            warn(f"{result.run_dir}: the ranks' parameters differ at the end of the run (replicas_identical: false)")
        # printed under `--quiet` too (it drops the progress bar): where the run went, and its figures
        console.print(f"[bold]{result.run_dir}[/]: " + summary_text(s, cfg.comm.cost_model), highlight=False,
                      soft_wrap=True)


def summary_text(s: dict, cost_model: str | None = None) -> str:
    """A finished run's figures in one line, from its summary.json. Steps on which the cost gate kept
    regions at FP32 (`StepStats.cost_gated`) are counted, with the reason and the override: under
    `--quiet` attach's warning goes to the log only, and `make demo`'s profile run on loopback read
    "compression 1.0x" with nothing to say why."""
    ev = s.get("final_eval", {})
    parts = [f"{s['steps']} steps", f"{s['wall_time_s']:.1f} s", f"eval loss {ev.get('loss', float('nan')):.4f}"]
    if "accuracy" in ev:
        parts.append(f"accuracy {ev['accuracy']:.2%}")
    if "perplexity" in ev:
        parts.append(f"perplexity {ev['perplexity']:.2f}")
    parts.append(f"compression {s['compression_ratio']:.1f}x")
    if (gated := s.get("cost_gated_steps")) and is_declared(cost_model):  # the user's link: nothing to suggest
        parts.append(f"cost gate: some regions kept at FP32 on {gated} of {s['steps']} steps (low bits were not "
                     f"modelled 15% cheaper on the declared {cost_model.strip()})")
    elif gated:
        parts.append(f"cost gate: some regions kept at FP32 on {gated} of {s['steps']} steps (low bits were not "
                     "modelled 15% cheaper on the link; comm.cost_model=link:100mbit declares a link, "
                     "comm.cost_model=none compresses anyway)")
    return ", ".join(parts)
