"""One calibration sweep: reference run, phase points, replay, trials -> table rows.

All in one process: W virtual ranks are W data shards of one model. The stages report
progress through a `Progress` callback (the CLI draws it with rich); the library itself
only logs.
"""

from __future__ import annotations

import datetime as _dt
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nfab import __version__
from nfab.calibrate.config import CalibrationConfig
from nfab.calibrate.fit import fit_profile
from nfab.calibrate.replay import NAN_FIDELITY, cheapest_wire, measure, replay_reducer, true_means
from nfab.calibrate.table import read_table, write_table
from nfab.calibrate.task import Task
from nfab.calibrate.trajectory import checkpoint_grid, phase_points, run_reference, run_trial
from nfab.models import model_signature
from nfab.profile.schema import Profile, file_sha256
from nfab.wire.reducers import REDUCERS

log = logging.getLogger(__name__)

CALIBRATION_FILE = "calibration.parquet"
PROFILE_FILE = "profile.json"

Progress = Callable[[str, int, int], None]
"""progress(stage, done, total): called as each unit of a stage finishes."""


@dataclass(frozen=True, slots=True)
class SweepResult:
    rows: list[dict[str, Any]]
    meta: dict[str, Any]
    seconds: float


def _noop(stage: str, done: int, total: int) -> None:
    return None


def run_sweep(cfg: CalibrationConfig, progress: Progress | None = None, command: str = "") -> SweepResult:
    """Measure every (phase, region, route, EF) cell of the calibration table."""
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _sweep(cfg, progress, command)
    finally:
        torch.set_num_threads(threads)


def _sweep(cfg: CalibrationConfig, progress: Progress | None, command: str) -> SweepResult:
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    progress = progress or _noop
    task = Task(cfg)
    w = cfg.world_size

    done = 0

    def tick_ref() -> None:
        nonlocal done
        done += 1
        progress("reference", done, cfg.steps)

    ref = run_reference(task, tick_ref)
    grid = checkpoint_grid(cfg.steps, task.warmup_steps)
    tail = max(1, cfg.steps // 10)
    points = phase_points(ref.grad_norm, grid, task.warmup_steps, cfg.phases, tail=tail)
    log.info("phase points: %s", points)

    total_numel = sum(r.numel for r in task.regions.values())
    trial_regions = [r for r in task.regions.values() if r.numel / total_numel >= cfg.trial_min_share]
    trial_routes = [r for r in cfg.trial_routes() if replay_reducer(r, w) is not None]
    plan = [(region.name, route, ef) for region in trial_regions for route in trial_routes for ef in (False, True)]
    total_trials = len(points) * (1 + len(plan))
    trials_done = 0

    rows: list[dict[str, Any]] = []
    for p_i, (step, kind) in enumerate(points):
        name = f"p{p_i}-{kind}"
        ckpt = ref.checkpoints[step]
        base = run_trial(task, ckpt, step, cfg.trial_steps, {}, error_feedback=False, seed=cfg.seed,
                         capture=cfg.ef_steps)
        trials_done += 1
        progress("trials", trials_done, total_trials)
        # ---- reducer-side replay over the first ef_steps steps of the FP32 continuation
        cells: dict[tuple[str, str, bool], dict[str, Any]] = {}
        for region in task.regions.values():
            idx = task.region_index(region.name)
            steps_x = [[g.index_select(0, idx) for g in grads] for grads in base.captured]
            truths = true_means(steps_x)
            fp32_bytes = REDUCERS["allreduce-fp32"].wire_bytes(region.numel, w, len(region.lengths))
            for route in cfg.all_routes:
                reducer = replay_reducer(route, w)
                wire = cheapest_wire(route, region.numel, w, len(region.lengths))
                for ef in (False, True):
                    fid = NAN_FIDELITY if reducer is None else measure(
                        reducer, steps_x, region.lengths, error_feedback=ef, seed=cfg.seed + step, truths=truths)
                    cells[(region.name, route, ef)] = {
                        "model": cfg.model, "dataset": cfg.dataset, "optimizer": cfg.optimizer.name,
                        "world_size": w, "phase": name, "phase_kind": kind, "step": step,
                        "phase_fraction": step / cfg.steps, "region": region.name, "numel": region.numel,
                        "segments": len(region.lengths), "route": route,
                        "reducer": wire[0] if wire else "", "error_feedback": ef,
                        "capacity_ok": reducer is not None,
                        "bits_per_element": (8.0 * wire[1] / region.numel) if wire else math.nan,
                        "wire_bytes": int(round(wire[1])) if wire else 0,
                        "fp32_wire_bytes": int(round(fp32_bytes)),
                        "cosine": fid.cosine, "rel_error": fid.rel_error, "sign_agreement": fid.sign_agreement,
                        "cum_cosine": fid.cum_cosine, "encode_decode_s": fid.encode_decode_s,
                        "loss_delta": 0.0 if route == "fp32" else math.nan,
                        "train_loss_delta": 0.0 if route == "fp32" else math.nan,
                        "trial_steps": cfg.trial_steps if route == "fp32" else 0,
                    }
        progress("replay", p_i + 1, len(points))
        # ---- short trials: one region on a candidate route, the rest FP32
        for t_i, (region_name, route, ef) in enumerate(plan):
            res = run_trial(task, ckpt, step, cfg.trial_steps, {region_name: route}, error_feedback=ef,
                            seed=cfg.seed + 7 * step + t_i + 1)
            cell = cells[(region_name, route, ef)]
            cell["loss_delta"] = _rel(res.eval_loss, base.eval_loss)
            cell["train_loss_delta"] = _rel(res.tail_loss, base.tail_loss)
            cell["trial_steps"] = cfg.trial_steps
            trials_done += 1
            progress("trials", trials_done, total_trials)
        rows.extend(cells.values())

    meta = {
        "nfab_version": __version__,
        "torch_version": torch.__version__,
        "command": command,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "model": cfg.model,
        "model_options": dict(task.spec.options),
        "signature": model_signature(task.spec.module),
        "dataset": cfg.dataset,
        "data_options": dict(task.data_options),
        "world_size": w,
        "optimizer": cfg.optimizer.model_dump(mode="json"),
        "schedule": cfg.schedule.model_dump(mode="json"),
        "batch_size": cfg.batch_size,
        "steps": cfg.steps,
        "trial_steps": cfg.trial_steps,
        "ef_steps": cfg.ef_steps,
        "quick": cfg.quick,
        "seed": cfg.seed,
        "warmup_steps": task.warmup_steps,
        "phases": [{"name": f"p{i}-{k}", "step": s, "kind": k} for i, (s, k) in enumerate(points)],
        "reference": {"loss": _finite(ref.loss), "grad_norm": _finite(ref.grad_norm), "lr": ref.lr},
        "seconds": round(time.perf_counter() - t0, 2),
        "cpu_seconds": round(time.process_time() - cpu0, 2),
    }
    return SweepResult(rows, meta, time.perf_counter() - t0)


def _rel(value: float, base: float) -> float:
    if not math.isfinite(value):
        return math.inf
    return (value - base) / base if base else math.nan


def _finite(values: list[float]) -> list[float | None]:
    return [v if math.isfinite(v) else None for v in values]


def calibrate(cfg: CalibrationConfig, out: str | Path, *, progress: Progress | None = None, command: str = "",
              tol_cosine: float | None = None, tol_loss: float | None = None) -> tuple[Path, Path, Profile, float]:
    """Run the sweep, write calibration.parquet, fit and write profile.json next to it."""
    out = Path(out)
    result = run_sweep(cfg, progress, command)
    table_path = write_table(out / CALIBRATION_FILE, result.rows, result.meta)
    profile = fit_file(table_path, out / PROFILE_FILE, tol_cosine=tol_cosine, tol_loss=tol_loss)
    return table_path, out / PROFILE_FILE, profile, result.seconds


def fit_file(table_path: str | Path, out: str | Path, *, tol_cosine: float | None = None,
             tol_loss: float | None = None) -> Profile:
    """Fit a profile from a calibration file and write it (atomically) to `out`."""
    frame, meta = read_table(table_path)
    kwargs = {k: v for k, v in (("tol_cosine", tol_cosine), ("tol_loss", tol_loss)) if v is not None}
    profile = fit_profile(frame, meta=meta, provenance={
        "calibration_file": str(table_path), "calibration_sha256": file_sha256(table_path)}, **kwargs)
    profile.save(out)
    return profile
