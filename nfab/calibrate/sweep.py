"""One calibration sweep: reference run, phase points, replay, trials -> table rows.

All in one process: W virtual ranks are W data shards of one model. The stages report
progress through a `Progress` callback (the CLI draws it with rich); the library itself
only logs.
"""

from __future__ import annotations

import datetime as _dt
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import torch

from nfab import __version__
from nfab.calibrate.budget import BUDGET_RATIO, trial_allowed, validation_allowance
from nfab.calibrate.cells import Cells, PhaseLabels, region_cells
from nfab.calibrate.config import CalibrationConfig
from nfab.calibrate.fit import (
    HIGH_COSINE,
    TOL_COSINE,
    TOL_LOSS,
    fidelity_bars,
    fit_profile,
    passes,
    probe_floor,
    trials_can_run,
)
from nfab.calibrate.search import Tolerances, ef_order, search_phase, trial_candidate
from nfab.calibrate.table import SCHEMA, read_table, write_table
from nfab.calibrate.task import Task
from nfab.calibrate.timing import StageClock
from nfab.calibrate.trajectory import (
    Reference,
    TrialResult,
    checkpoint_grid,
    fp32_capture,
    phase_points,
    quantization_scale,
    reference_continuation,
    run_reference,
    run_trial,
    train_delta,
)
from nfab.calibrate.validate import TOL_VALIDATE, Validation, loss_floor, resolution, validate_profile
from nfab.models import model_signature
from nfab.models.registry import parameter_layout
from nfab.profile.schema import Profile, file_sha256

log = logging.getLogger(__name__)

CALIBRATION_FILE = "calibration.parquet"
PROFILE_FILE = "profile.json"

Progress = Callable[[str, int, int], None]
"""progress(stage, done, total): called as each unit of a stage finishes."""


STOP_FACTOR = 3.0
"""A trial stops early once its training loss runs this x the loss tolerance above the FP32 continuation's."""


@dataclass(frozen=True, slots=True)
class SweepResult:
    rows: list[dict[str, Any]]
    meta: dict[str, Any]
    seconds: float
    task: Task
    """The sweep's model and data (validation keeps training it)."""
    reference: Reference


def _noop(stage: str, done: int, total: int) -> None:
    return None


def run_sweep(cfg: CalibrationConfig, progress: Progress | None = None, command: str = "", *,
              tol: Tolerances | None = None, clock: StageClock | None = None,
              budget_ratio: float = BUDGET_RATIO) -> SweepResult:
    """Measure the (phase, region, route, EF) cells of the calibration table that the fit can use
    (trials capped in steps by the budget: see budget.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _sweep(cfg, progress or _noop, command, tol or Tolerances(TOL_COSINE, TOL_LOSS), clock or StageClock(),
                      budget_ratio)
    finally:
        torch.set_num_threads(threads)


def _trial_routes(cfg: CalibrationConfig, cells: dict[tuple[str, str, bool], dict[str, Any]], region: str) -> list[str]:
    """Routes of a region that may get a trial: every measured route of the reducer registry that is
    lossy and sends under half of FP32's bits (`--quick`: only QUICK_TRIAL_ROUTES)."""
    fp32 = cells[(region, "fp32", False)]["bits_per_element"]
    wanted = set(cfg.trial_routes()) if cfg.quick else None
    return [route for route in cfg.all_routes
            if (wanted is None or route in wanted) and trial_candidate(cells[(region, route, False)], fp32)]


def _sweep(cfg: CalibrationConfig, progress: Progress, command: str, tol: Tolerances, clock: StageClock,
           budget_ratio: float) -> SweepResult:
    w = cfg.world_size
    done = 0

    def tick_ref() -> None:
        nonlocal done
        done += 1
        progress("reference", done, cfg.steps)

    with clock.stage("setup"):
        task = Task(cfg)
    with clock.stage("reference"):
        ref = run_reference(task, tick_ref, trial_steps=cfg.trial_steps)
    grid = checkpoint_grid(cfg.steps, task.warmup_steps)
    tail = max(1, cfg.steps // 10)
    points = phase_points(ref.grad_norm, grid, task.warmup_steps, cfg.phases, tail=tail)
    log.info("phase points: %s", points)

    total_numel = sum(r.numel for r in task.regions.values())
    trial_regions = sorted(((r.name, r.numel) for r in task.regions.values()
                            if r.numel / total_numel >= cfg.trial_min_share), key=lambda rn: -rn[1])
    order = ef_order(cfg.optimizer.name)
    # the bars the fit will apply: under AdamW replay fidelity decides alone, so no trial can change the fit
    bar, high = fidelity_bars(cfg.optimizer.name, tol.cosine, HIGH_COSINE)
    search_tol = Tolerances(bar, tol.loss)
    # no "trials" progress where none can run: a full bar read as trials run under AdamW
    trial_progress = progress if trials_can_run(cfg.optimizer.name, tol.cosine, HIGH_COSINE) else _noop
    trials_run = trial_steps_run = 0
    # a trial's held-out delta is judged down to what the held-out batch resolves (validate.resolution)
    floor, nats = loss_floor(ref.eval_loss), resolution(*task.eval_predictions)
    rows: list[dict[str, Any]] = []
    for p_i, (step, kind) in enumerate(points):
        name = f"p{p_i}-{kind}"
        ckpt = ref.checkpoints[step]
        with clock.stage("trials"):
            captured = fp32_capture(task, ref, step, cfg.ef_steps)
        with clock.stage("replay"):
            task.restore(ckpt)  # the phase's optimizer state: where Adam-style optimizers act
            cells = _replay_cells(cfg, task, captured, name, kind, step)
        progress("replay", p_i + 1, len(points))
        bases: dict[int, TrialResult] = {}  # the FP32 continuation, made for the phase's first trial
        tally = {False: 0, True: 0}  # this phase's trials per EF setting (budget.trial_allowed)

        def trial(region: str, route: str, ef: bool, *, _step: int = step, _ckpt: dict = ckpt,
                  _bases: dict = bases, _cells: dict = cells, _done: int = p_i + 1, _tally: dict = tally) -> bool:
            nonlocal trial_steps_run
            if not _bases:  # a phase near the end has no reference state K steps on: then it is a run
                _bases[_step] = reference_continuation(task, ref, _step, cfg.trial_steps)
            _base = _bases[_step]
            res = run_trial(task, _ckpt, _step, cfg.trial_steps, {region: route}, error_feedback=ef,
                            seed=cfg.seed + 7 * _step + 1, base=_base, stop_above=STOP_FACTOR * tol.loss,
                            floor=floor)
            cell = _cells[(region, route, ef)]
            # judged as validation judges a gap: over the floored FP32 loss, down to one held-out prediction
            denominator = max(_base.eval_loss, floor)
            cell["loss_delta"] = _rel(res.eval_loss, _base.eval_loss, denominator)
            cell["loss_resolved"] = nats / denominator if denominator > 0 else 0.0
            cell["train_loss_delta"] = train_delta(res.train_loss, _base.train_loss, floor)
            cell["trial_steps"] = len(res.train_loss)
            trial_steps_run += len(res.train_loss)
            cell["screen"] = "trial_stopped" if res.stopped_early else "trial"
            trial_progress("trials", _done, len(points))
            _tally[ef] += 1
            return passes(cell, search_tol.cosine, search_tol.loss, high)

        def allow(ef: bool, _p: int = p_i, _tally: dict = tally) -> bool:
            return trial_allowed(cfg.steps, cfg.trial_steps, _p, len(points), used=trial_steps_run,
                                 phase_trials=_tally[ef], ratio=budget_ratio)

        with clock.stage("trials"):
            trials_run += search_phase(cells, trial_regions, candidates=lambda r, _c=cells: _trial_routes(cfg, _c, r),
                                       order=order, tol=search_tol, high_cosine=high, run=trial, allow=allow)
        trial_progress("trials", p_i + 1, len(points))
        rows.extend(cells.values())

    meta = {
        "nfab_version": __version__,
        "torch_version": torch.__version__,
        "command": command,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "model": cfg.model,
        "model_options": dict(task.spec.options),
        "signature": model_signature(task.spec.module),
        "parameters": parameter_layout(task.spec.module),
        "dataset": cfg.dataset,
        "data_options": dict(task.data_options),
        "eval_data": cfg.setting.data.eval,
        "loss": task.loss.name,
        "collate": cfg.setting.data.collate,
        "world_size": w,
        "optimizer": cfg.optimizer.model_dump(mode="json"),
        "schedule": cfg.schedule.model_dump(mode="json"),
        "batch_size": cfg.batch_size,
        "accum_steps": cfg.accum_steps,  # the step's recipe (the optimizer's entry holds grad_clip)
        "precision": cfg.precision,
        "steps": cfg.steps,
        "run_steps": cfg.run_steps,
        "trial_steps": cfg.trial_steps,
        "ef_steps": cfg.ef_steps,
        "quick": cfg.quick,
        "noise_moment": task.moment is not None,
        "seed": cfg.seed,
        "warmup_steps": task.warmup_steps,
        "phases": [{"name": f"p{i}-{k}", "step": s, "kind": k} for i, (s, k) in enumerate(points)],
        "reference": {"loss": _finite(ref.loss), "grad_norm": _finite(ref.grad_norm), "lr": ref.lr,
                      "eval_loss": {str(k): v for k, v in sorted(ref.eval_loss.items()) if math.isfinite(v)}},
        "tolerances": {"cosine": tol.cosine, "loss": tol.loss},
        "trials": trials_run,
        "trial_steps_run": trial_steps_run,
        "seconds": round(clock.elapsed(), 2),
        "timing": clock.split(),
    }
    return SweepResult(rows, meta, clock.elapsed(), task, ref)


def _replay_cells(cfg: CalibrationConfig, task: Task, captured: list[list[torch.Tensor]], name: str, kind: str,
                  step: int) -> Cells:
    """Every (region, route, EF) cell of a phase with its replay fidelity over the captured FP32 steps."""
    labels = PhaseLabels(cfg.model, cfg.dataset, cfg.optimizer.name, cfg.world_size, name, kind, step,
                         step / cfg.steps, cfg.trial_steps)
    cells: Cells = {}
    for region in task.regions.values():
        steps_x = [[task.gather(g, region.name) for g in grads] for grads in captured]
        scale = quantization_scale(task, region.name)  # None without a second moment (SGD)
        cells.update(region_cells(labels, region.name, region.numel, len(region.lengths), steps_x, region.lengths,
                                  scale, cfg.all_routes, cfg.seed + step))
    return cells


def _rel(value: float, base: float, denominator: float | None = None) -> float:
    """(value - base) relative to `denominator` (default: `base`)."""
    if not math.isfinite(value):
        return math.inf
    d = base if denominator is None else denominator
    return (value - base) / d if d else math.nan


def _finite(values: list[float]) -> list[float | None]:
    return [v if math.isfinite(v) else None for v in values]


@dataclass(frozen=True, slots=True)
class Calibration:
    """What `calibrate` wrote and measured."""

    table_path: Path
    profile_path: Path
    profile: Profile
    timing: dict[str, float | None]
    """Wall seconds per stage, total and the ratio to the FP32 reference (see timing.StageClock.split)."""
    validation: Validation | None


def calibrate(cfg: CalibrationConfig, out: str | Path, *, progress: Progress | None = None, command: str = "",
              tol_cosine: float | None = None, tol_loss: float | None = None, validate: bool = True,
              tol_validate: float = TOL_VALIDATE, budget_ratio: float = BUDGET_RATIO) -> Calibration:
    """Sweep, fit, validate (tightening as needed), then write calibration.parquet and profile.json.

    `budget_ratio` caps trials and validation's tightening rounds in simulated steps (budget.py):
    the calibration costs about this many times its FP32 reference run, whatever the machine's load.
    """
    out = Path(out)
    clock = StageClock()
    tol = Tolerances(TOL_COSINE if tol_cosine is None else tol_cosine, TOL_LOSS if tol_loss is None else tol_loss)
    result = run_sweep(cfg, progress, command, tol=tol, clock=clock, budget_ratio=budget_ratio)
    frame = table_frame(result.rows)
    profile = fit_profile(frame, tol.cosine, tol.loss, meta=result.meta)
    validation = None
    if validate:
        done = 0

        def tick() -> None:
            nonlocal done
            done += 1
            (progress or _noop)("validation", done, done)

        with clock.stage("validation"):
            profile, validation = validate_profile(
                result.task, result.reference, profile, frame, tol=tol, tolerance=tol_validate, seed=cfg.seed,
                step_budget=validation_allowance(cfg.steps, result.meta["trial_steps_run"], budget_ratio), tick=tick)
    if validation is not None and math.isfinite(validation.probe_min):
        profile = with_validated_floor(profile, validation.probe_min)
    meta = {**result.meta, "timing": clock.split(), "seconds": round(clock.elapsed(), 2),
            "validation": None if validation is None else {"passed": validation.passed,
                                                           "gap": validation.to_evidence()["gap"],
                                                           "rounds": len(validation.rounds)}}
    table_path = write_table(out / CALIBRATION_FILE, result.rows, meta)
    timing = clock.split()
    prov = {**profile.provenance, "calibration_file": str(table_path), "calibration_sha256": file_sha256(table_path),
            "timing": timing}
    profile = profile.model_copy(update={"provenance": prov})
    profile.save(out / PROFILE_FILE)
    return Calibration(table_path, out / PROFILE_FILE, profile, timing, validation)


def with_validated_floor(profile: Profile, probe_min: float) -> Profile:
    """`profile` with its probe floor no higher than half the lowest probe cosine its validated run read.

    The fit sets the floor from the replay cosines at the phase starts; later in a phase the hook's
    probe reads lower on a healthy route: the signal shrinks as the loss falls while rounding noise
    does not, and under error feedback a step's estimate carries earlier steps' error (on the CNN
    recipe, bq2 + EF on the convolutions replayed at 0.68 at its phase start and the probe read 0.11
    and 0.15 a hundred steps on, in FP32 shadow windows: conv demoted for 90 of 300 steps, 2.8x fewer
    bytes, at a loss within one held-out digit). Validation ran the profile over the whole schedule
    and passed; a probe reading below half of what that run read is what the floor should catch."""
    floor = min(profile.health.min_fidelity_cosine, probe_floor(probe_min))
    return profile.model_copy(update={"health": profile.health.model_copy(update={"min_fidelity_cosine": floor})})


def table_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """The rows as the typed table `read_table` would return (what the fit reads)."""
    return pa.Table.from_pylist(rows, schema=SCHEMA).to_pandas()


def fit_file(table_path: str | Path, out: str | Path, *, tol_cosine: float | None = None,
             tol_loss: float | None = None) -> Profile:
    """Fit a profile from a calibration file and write it (atomically) to `out`.

    A refit is not validated (validation needs the model and data, not only the table):
    its evidence says so.
    """
    frame, meta = read_table(table_path)
    kwargs = {k: v for k, v in (("tol_cosine", tol_cosine), ("tol_loss", tol_loss)) if v is not None}
    profile = fit_profile(frame, meta=meta, provenance={
        "calibration_file": str(table_path), "calibration_sha256": file_sha256(table_path)}, **kwargs)
    profile = profile.model_copy(update={"evidence": {**profile.evidence, "validation": {
        "passed": None, "stopped": "refit from the table: not validated (run nfab calibrate to validate)"}}})
    profile.save(out)
    return profile
