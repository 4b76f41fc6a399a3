"""In-run calibration's fit (`attach(model, "auto")`): the windows' agreed samples -> table -> profile.

The runtime's windows (`nfab.runtime.control.window`) hold, per step, every rank's own gradient at the
same sampled elements. That is what `nfab calibrate` replays for its virtual ranks, at the real W and on
the real model: each region's sample goes through every candidate route (`cells.region_cells`, the
one row builder of both calibrators), the rows form a calibration table with `calibration.parquet`'s
schema, and the same `fit_profile` turns it into the profile. No trial runs inside a job, so the fit
decides on replay fidelity alone: under an adaptive optimizer that is how `nfab calibrate` decides too
(`fit.ADAPTIVE_COSINE`); under SGD a lossy route then needs `fit.HIGH_COSINE` (use `nfab calibrate`,
whose trials can admit coarser routes there).

Per-tensor qsum routes (q8, q4, q2) are not candidates: their scale is the whole slice's max |x|,
which a sample does not hold (it would read them finer than they are).
"""

from __future__ import annotations

import datetime as _dt
import logging
import math
from pathlib import Path
from typing import Any

import torch

from nfab import __version__
from nfab.calibrate.cells import Cells, PhaseLabels, region_cells
from nfab.calibrate.fit import HIGH_COSINE, fit_profile
from nfab.calibrate.sweep import CALIBRATION_FILE, PROFILE_FILE, table_frame
from nfab.calibrate.table import write_table
from nfab.config.attach import AttachConfig
from nfab.errors import NfabError
from nfab.models.registry import model_signature, parameter_layout
from nfab.profile.schema import Profile, file_sha256
from nfab.runtime.control.optim import is_adaptive
from nfab.runtime.control.window import Fit, Window, sample_layout, schedule
from nfab.runtime.state import RuntimeState
from nfab.wire.routes import ROUTES

log = logging.getLogger(__name__)

PER_TENSOR = ("q8", "q4", "q2")
CANDIDATES: tuple[str, ...] = tuple(r for r in ROUTES if r not in PER_TENSOR)
"""The routes a window measures: every route whose scale a sample holds."""
DATASET = "in-run"


def fitter(*, model: str, optimizer: str, total_steps: int | None, seed: int, rank: int, out: Path | None,
           meta: dict[str, Any]) -> Fit:
    """The runtime's fit: every window so far -> rows -> the profile (rank 0 writes both files to `out`).
    `optimizer`: the fit's family name ("adamw" adaptive, "sgd" not); `meta`: what the table's metadata
    adds (model signature, parameter layout, noise moment)."""

    replayed: dict[int, list[dict]] = {}  # a finished window's rows (its samples never change)

    def fit(window: Window, reference: dict[str, list[float]]) -> Profile:
        rows = []
        for i in range(len(window.windows)):
            if i not in replayed:
                replayed[i] = window_rows(window, i, model=model, optimizer=optimizer, total_steps=total_steps,
                                          seed=seed)
            rows.extend(replayed[i])
        table_meta = {
            **meta,
            "nfab_version": __version__, "torch_version": torch.__version__,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "model": model, "dataset": DATASET, "world_size": window.world_size,
            "optimizer": {"name": optimizer}, "steps": total_steps, "seed": seed,
            "phases": [{"name": phase_name(i), "step": w.start, "kind": "inrun"} for i, w in enumerate(window.windows)],
            "reference": {k: [v if math.isfinite(v) else None for v in vs] for k, vs in reference.items()},
            "in_run": {"window_steps": window.schedule.length, "windows": [w.start for w in window.windows],
                       "sampled_elements": window.size},
        }
        profile = fit_profile(table_frame(rows), meta=table_meta)
        # no reproducible setting (the run's model, data and loop are the user's): what was measured instead
        prov = {k: v for k, v in profile.provenance.items() if k != "calibrated"}
        prov["in_run"] = {**profile.provenance.get("calibrated", {}), **table_meta["in_run"]}
        profile = profile.model_copy(update={"provenance": prov, "evidence": {**profile.evidence, "validation": {
            "passed": None, "stopped": "calibrated inside the run: guarded by the health monitor, not validated "
                                       "against an FP32 run"}}})
        if out is not None and rank == 0:
            profile = write(out, rows, table_meta, profile)
        log.info("nfab auto: window %d fitted %s", len(window.windows) - 1,
                 {p.name: p.routes for p in profile.phases})
        return profile

    return fit


def phase_name(i: int) -> str:
    return f"p{i}-inrun"


def window_rows(window: Window, i: int, *, model: str, optimizer: str, total_steps: int | None,
                seed: int) -> list[dict]:
    """The calibration table's rows of window `i` (phase `phase_name(i)`)."""
    regions: dict[str, list[tuple[int, int, int]]] = {}  # region -> (column, sampled, numel) per parameter
    at = 0
    for s in window.layout:
        n = int(s.positions.numel())
        regions.setdefault(s.region, []).append((at, n, s.numel))
        at += n
    win = window.windows[i]
    labels = PhaseLabels(model, DATASET, optimizer, window.world_size, phase_name(i), "inrun", win.start,
                         win.start / total_steps if total_steps else 0.0, len(win.steps))
    cells: Cells = {}
    for region, parts in regions.items():
        parts = [p for p in parts if p[1] > 0]
        if not parts:
            continue
        cols = torch.cat([torch.arange(c, c + n) for c, n, _ in parts])
        steps_x = [[step[r].index_select(0, cols) for r in range(window.world_size)] for step in win.steps]
        scale = None if win.scale is None else win.scale.index_select(0, cols)
        cells.update(region_cells(labels, region, sum(m for _, _, m in parts), len(parts), steps_x,
                                  [n for _, n, _ in parts], scale, CANDIDATES, seed + win.start))
    return list(cells.values())


def write(out: Path, rows: list[dict], meta: dict[str, Any], profile: Profile) -> Profile:
    """calibration.parquet and profile.json in `out` (each atomically), the profile naming its table."""
    table_path = write_table(out / CALIBRATION_FILE, rows, meta)
    profile = profile.model_copy(update={"provenance": {
        **profile.provenance, "calibration_file": str(table_path), "calibration_sha256": file_sha256(table_path)}})
    profile.save(out / PROFILE_FILE)
    return profile


def check(cfg: AttachConfig) -> None:
    """What `attach(model, "auto")` refuses before anything is registered, in one line each."""
    if cfg.route is not None:
        raise NfabError('give profile="auto" or route=, not both')
    if cfg.hierarchy not in (None, "flat"):
        raise NfabError('profile="auto" does not yet calibrate a two-level reduction (hierarchy=): attach it flat')


def window_for(runtime: RuntimeState, module: torch.nn.Module, cfg: AttachConfig) -> Window:
    """The in-run calibration windows of a DDP or FSDP2 runtime: sample layout, schedule, and the fit.
    FSDP2's parameters are those its reduce-scatters carry (whole sizes, in the modules' order)."""
    comms = getattr(runtime, "comms", None)
    params = ([(p.name, p.region, p.numel) for c in comms for p in c.layout.params] if comms
              else [(n, runtime.regions[n], p.numel()) for n, p in module.named_parameters() if p.requires_grad])
    opt = cfg.optimizer
    family = "adamw" if opt is not None and is_adaptive(opt) else "sgd"
    if opt is None and runtime.rank == 0:
        log.warning('nfab: profile="auto" without optimizer=: routes are judged as under SGD (a lossy route '
                    "needs a replay cosine of %.2f); pass optimizer= to calibrate where it acts", HIGH_COSINE)
    meta = {"signature": model_signature(module), "parameters": parameter_layout(module),
            "noise_moment": getattr(runtime, "moment", None) is not None}
    fit = fitter(model=type(module).__name__, optimizer=family, total_steps=cfg.total_steps, seed=cfg.seed,
                 rank=runtime.rank, out=cfg.calibration_out, meta=meta)
    return Window(schedule(cfg.total_steps, cfg.calibration_window), sample_layout(params, cfg.seed), fit,
                  world_size=runtime.world_size, group=getattr(runtime, "group", None))
