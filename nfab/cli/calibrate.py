"""`nfab calibrate MODEL [options] [KEY=VALUE...]`: sweep, write calibration.parquet, fit profile.json."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from nfab.cli.output import console, fail
from nfab.errors import NfabError, UserCodeError
from nfab.overrides import clash

if TYPE_CHECKING:
    from nfab.calibrate.config import CalibrationConfig
    from nfab.profile.schema import Profile

_STAGES = {"reference": "FP32 reference", "replay": "replay (phases)", "trials": "short trials (phases)",
           "validation": "validation (steps)"}


class SweepProgress:
    """A rich progress bar per sweep stage; call it as `progress(stage, done, total)`."""

    def __init__(self, out: Console) -> None:
        self._bar = Progress(TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(),
                             TimeElapsedColumn(), console=out, transient=False)
        self._tasks: dict[str, TaskID] = {}

    def __enter__(self) -> SweepProgress:
        self._bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.__exit__(*exc)  # type: ignore[arg-type]

    def __call__(self, stage: str, done: int, total: int) -> None:
        task = self._tasks.get(stage)
        if task is None:
            task = self._tasks[stage] = self._bar.add_task(_STAGES.get(stage, stage), total=total)
        self._bar.update(task, completed=done, total=total)


def _trials_phrase(cfg: CalibrationConfig, tol_cosine: float | None) -> str:
    """`trials of K steps`, or what happens instead where no trial can change the fit (AdamW):
    the header said "trials of 20 steps" and a trials bar filled, though no trial ran."""
    from nfab.calibrate.fit import TOL_COSINE, trials_can_run

    if trials_can_run(cfg.optimizer.name, TOL_COSINE if tol_cosine is None else tol_cosine):
        return f"trials of {cfg.trial_steps} steps"
    return f"no short trials ({cfg.optimizer.name}: replay fidelity decides)"


def _command_line(params: dict) -> str:
    """The command as typed, rebuilt from the parsed parameters (recorded in the artifacts)."""
    parts = ["nfab", "calibrate", params["model"]]
    for key, value in params.items():
        if key in ("model", "overrides") or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        parts += [flag] if value is True else [flag, str(value)]
    parts += list(params.get("overrides") or [])
    return " ".join(shlex.quote(p) for p in parts)


def profile_table(profile: Profile) -> Table:
    """Phases x region classes with the chosen route (EF marked), the profile's W range and health."""
    regions = [r for r in ("conv", "linear", "embedding", "head", "norm", "bias", "small", "other")
               if any(r in p.routes for p in profile.phases)]
    h = profile.health
    table = Table(title=f"profile for {profile.model.name}: W {profile.world_size.min}..{profile.world_size.max}, "
                        f"loss spike x{h.loss_spike_ratio:g}, grad-norm jump x{h.grad_norm_jump:g}")
    table.add_column("phase")
    table.add_column("start", justify="right")
    table.add_column("EF")
    for r in regions:
        table.add_column(r)
    for p in profile.phases:
        start = f"{p.start.fraction:.2f}" if p.start.fraction is not None else str(p.start.step)
        table.add_row(p.name, start, "yes" if p.error_feedback else "no", *(p.route_for(r) for r in regions))
    return table


def _traceback_log(exc: BaseException) -> str:
    """`exc`'s traceback in a temp file, whose path the one error line names (as `nfab train` names its rank log)."""
    import tempfile
    import traceback

    with tempfile.NamedTemporaryFile("w", prefix="nfab-calibrate-", suffix=".log", delete=False) as f:
        f.write("".join(traceback.format_exception(exc)))
    return f.name


VALIDATION_FAILED = 3
"""`nfab calibrate`'s exit code when it wrote the table and profile but the profile failed its validation
(1: the calibration itself failed, 2: bad input)."""


def check_tolerances(tol_cosine: float | None, tol_loss: float | None, tol_validate: float | None = None) -> None:
    """Fit's and validation's tolerances in their ranges, or one line and exit 2 before any work
    (`--tol-validate -1` calibrated, then failed every validation round, and exited 0)."""
    if tol_cosine is not None and not -1.0 <= tol_cosine <= 1.0:  # NaN fails both
        fail(f"--tol-cosine must be a cosine in [-1, 1], got {tol_cosine}")
    if tol_loss is not None and not tol_loss >= 0.0:
        fail(f"--tol-loss must be a relative loss increase >= 0, got {tol_loss}")
    if tol_validate is not None and not 0.0 <= tol_validate < float("inf"):
        fail(f"--tol-validate must be a relative loss gap >= 0, got {tol_validate}")


def register(app: typer.Typer) -> None:
    @app.command("calibrate")
    def calibrate(
        ctx: typer.Context,
        model: Annotated[str, typer.Argument(metavar="MODEL", help="resnet18, vit, gpt or module.path:factory.",
                                             show_default=False)],
        overrides: Annotated[list[str] | None, typer.Argument(
            metavar="[KEY=VALUE]...", show_default=False,
            help="Setting and sweep options: model.width=8, data.max_bytes=100000, optim.lr=0.1, batch_size=16, "
                 "ef_steps=2.")
        ] = None,
        config: Annotated[str | None, typer.Option(
            "--config", "-c", help="The run config to calibrate for (same files as nfab train; default: the "
                                   "model's shipped config).", show_default=False)] = None,
        dataset: Annotated[str | None, typer.Option(
            "--data", "--dataset", metavar="DATA",
            help="Training data: a shipped name (digits, stdlib-text), a file KIND:PATH (tokens:, npz:, npy:, "
                 "parquet:, text:, cifar10:) or module.path:factory called as factory(split='train'|'val') "
                 "(default: the config's).", show_default=False)] = None,
        eval_data: Annotated[str | None, typer.Option(
            "--eval-data", metavar="DATA", help="Held-out data, named as --data is (default: --data's own "
                                                "held-out split).", show_default=False)] = None,
        loss: Annotated[str | None, typer.Option(
            "--loss", metavar="module.path:fn", help="The loss, fn(model, batch) -> scalar tensor (default: the "
                                                    "loss the model's output carries, else cross-entropy).",
            show_default=False)] = None,
        world_size: Annotated[int, typer.Option("--world-size", "-w", help="Virtual ranks W.")] = 4,
        routes: Annotated[str | None, typer.Option(
            help="Comma-separated routes to measure (default: every registered route but fp16, bq8 and the "
                 "-128/-256 block variants: fp32,bf16,q8,q4,q2,sign,bq4,bq3,bl6,bl5,bq2).",
            show_default=False)] = None,
        phases: Annotated[int | None, typer.Option(help="Phase points at most (default 4; --quick 2).",
                                                   show_default=False)] = None,
        steps: Annotated[int | None, typer.Option(help="FP32 reference steps (default per model).",
                                                  show_default=False)] = None,
        trial_steps: Annotated[int | None, typer.Option(
            "--trial-steps", help="Steps per short trial (default 20; --quick 10).", show_default=False)] = None,
        quick: Annotated[bool, typer.Option("--quick", help="Fewer phases, shorter trials on sign and q8 only.")
                         ] = False,
        out: Annotated[Path | None, typer.Option(
            "--out", "-o", help="Output dir (default calibrations/MODEL).", show_default=False)] = None,
        tol_cosine: Annotated[float | None, typer.Option(
            "--tol-cosine", help="Fit: minimum cosine to the true mean gradient (default 0.3).",
            show_default=False)] = None,
        tol_loss: Annotated[float | None, typer.Option(
            "--tol-loss", help="Fit: maximum relative held-out loss increase of a trial (default 0.02).",
            show_default=False)] = None,
        validate: Annotated[bool, typer.Option(
            "--validate/--no-validate", help="Run the fitted profile over the whole window against FP32 and "
                                             "tighten it until the gap is within --tol-validate.")] = True,
        tol_validate: Annotated[float, typer.Option(
            "--tol-validate", help="Validation: maximum relative held-out loss gap to FP32 at the end.")] = 0.01,
        budget: Annotated[float, typer.Option(
            "--budget", help="Cap on the whole calibration, in FP32 reference runs (trials and validation's "
                             "tightening rounds share it; counted in steps, never the clock).")] = 3.0,
        overwrite: Annotated[bool, typer.Option(
            "--overwrite", help="Replace a calibration already in the output folder.")] = False,
    ) -> None:
        """Measure routes per phase and region class on W virtual ranks, then fit a profile."""
        from nfab.calibrate import calibrate as run
        from nfab.calibrate import make_config, parse_overrides

        check_tolerances(tol_cosine, tol_loss, tol_validate)
        if not budget >= 1.2:  # the reference and replay alone cost about 1.2 reference runs
            fail(f"--budget must be at least 1.2 reference runs (the reference and replay), got {budget}")
        flags = {"loss": ("--loss", loss), "eval_data": ("--eval-data", eval_data),
                 "steps": ("--steps", steps), "phases": ("--phases", phases), "routes": ("--routes", routes),
                 "trial_steps": ("--trial-steps", trial_steps), "quick": ("--quick", quick or None)}
        if (message := clash(overrides or [], {k: o for k, (o, v) in flags.items() if v is not None})) is not None:
            fail(message)  # the override won in silence: `--steps 2 steps=5` calibrated 5 steps
        try:
            given = {k: v for k, v in (("loss", loss), ("eval_data", eval_data)) if v is not None}
            cfg = make_config(
                model, dataset=dataset, config=config, overrides={**parse_overrides(overrides or []), **given},
                world_size=world_size, phases=phases, steps=steps, trial_steps=trial_steps, quick=quick or None,
                routes=tuple(r.strip() for r in routes.split(",") if r.strip()) if routes else None,
            )
            target = out if out is not None else Path("calibrations") / model.replace(":", "_").replace("/", "_")
            held = [name for name in ("calibration.parquet", "profile.json") if (target / name).exists()]
            if held and not overwrite:  # from a clone's root the default folder is the shipped calibration
                raise NfabError(f"{target} already holds a calibration ({', '.join(held)}): pass --overwrite to "
                                "replace it, or --out DIR")
            command = _command_line(ctx.params)
            console.print(f"calibrating [bold]{cfg.model}[/] on {cfg.dataset}"
                          f"{f' (held out: {cfg.setting.data.eval})' if cfg.setting.data.eval else ''}"
                          f"{f', loss {cfg.setting.loss}' if cfg.setting.loss else ''}, W={cfg.world_size}, "
                          f"{cfg.steps} steps, {cfg.phases} phases, {_trials_phrase(cfg, tol_cosine)}"
                          f"{' (quick)' if cfg.quick else ''}", highlight=False)
            if cfg.run_steps:
                console.print(f"[yellow]warning:[/] calibrating {cfg.steps} steps of a {cfg.run_steps}-step run: "
                              "the spike/jump thresholds are fitted on the shorter run and widened for the "
                              f"longer one at attach; calibrate with --steps {cfg.run_steps} to fit them on "
                              "the whole run", highlight=False)
            with SweepProgress(console) as progress:
                result = run(cfg, target, progress=progress, command=command, tol_cosine=tol_cosine,
                             tol_loss=tol_loss, validate=validate, tol_validate=tol_validate, budget_ratio=budget)
        except UserCodeError as exc:  # the user's loss, data or forward: one line, its traceback in a log
            fail(f"{exc} (traceback: {_traceback_log(exc)})")
        except NfabError as exc:
            fail(str(exc))
        except Exception as exc:  # noqa: BLE001  (a user model's forward or backward, mostly: one line and a log)
            fail(f"calibration failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} "
                 f"(traceback: {_traceback_log(exc)})", code=1)
        from nfab.profile.evidence import describe_timing, describe_validation

        console.print(profile_table(result.profile))
        if result.validation is not None:
            console.print(describe_validation(result.validation.to_evidence()), highlight=False)
        console.print(f"time: {describe_timing(result.timing)}", highlight=False)
        console.print(f"wrote {result.table_path} and {result.profile_path}", highlight=False)
        if result.validation is not None and not result.validation.passed:  # `calibrate && train` must stop here
            console.print(f"[red]validation FAILED[/]: the profile is written as calibrated but did not hold within "
                          f"--tol-validate {tol_validate:g}; nfab train warns when it uses it (exit "
                          f"{VALIDATION_FAILED})", highlight=False)
            raise typer.Exit(VALIDATION_FAILED)
