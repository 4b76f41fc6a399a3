"""One phase's replay cells for one region: every candidate route's fidelity over W ranks' gradients.

The one place a calibration table's replay rows are made, for both calibrators: `nfab calibrate`
(W virtual ranks replayed in one process, `sweep.py`) and in-run calibration (`attach(model, "auto")`:
W real ranks' gradient samples, agreed by one all-gather, `inrun.py`). A row's wire figures
(`bits_per_element`, `wire_bytes`) are the region's whole size; its fidelity is measured on what
`steps_x` holds (the whole region offline, a sample of it in the run).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nfab.calibrate.replay import (
    NAN_FIDELITY,
    cheapest_wire,
    measure,
    measure_both,
    replay_reducer,
    true_means,
    truth_window,
)
from nfab.wire.registry import REDUCERS

Cells = dict[tuple[str, str, bool], dict[str, Any]]
"""(region, route, error feedback) -> a calibration.parquet row (`table.SCHEMA`)."""


@dataclass(frozen=True, slots=True)
class PhaseLabels:
    """What every row of one phase carries besides its measurement."""

    model: str
    dataset: str
    optimizer: str
    world_size: int
    phase: str
    phase_kind: str
    step: int
    phase_fraction: float
    reference_steps: int
    """`trial_steps` of the fp32 row: the steps its reference ran beyond the phase start."""


def region_cells(labels: PhaseLabels, region: str, numel: int, segments: int,
                 steps_x: Sequence[Sequence[torch.Tensor]], lengths: Sequence[int], scale: torch.Tensor | None,
                 routes: Sequence[str], seed: int) -> Cells:
    """Every (route, EF) cell of `region` replayed over `steps_x` (`steps_x[t][rank]`: flat gradients of
    `lengths` segments) against their true means, in the optimizer's space where `scale` is given."""
    w = labels.world_size
    truths = truth_window(true_means(steps_x), scale)  # what every route is compared with
    fp32_bytes = REDUCERS["allreduce-fp32"].wire_bytes(numel, w, segments)
    cells: Cells = {}
    for route in routes:
        reducer = replay_reducer(route, w)
        wire = cheapest_wire(route, numel, w, segments)
        fids = {False: NAN_FIDELITY, True: NAN_FIDELITY}
        if reducer is not None and reducer.lossy:
            fids[False], fids[True] = measure_both(reducer, steps_x, lengths, seed=seed, truths=truths, scale=scale)
        elif reducer is not None:  # a lossless route has no residual: EF on reads as EF off
            fids[False] = fids[True] = measure(reducer, steps_x, lengths, error_feedback=False, seed=seed,
                                               truths=truths, scale=scale)
        for ef in (False, True):
            fid = fids[ef]
            cells[(region, route, ef)] = {
                "model": labels.model, "dataset": labels.dataset, "optimizer": labels.optimizer,
                "world_size": w, "phase": labels.phase, "phase_kind": labels.phase_kind, "step": labels.step,
                "phase_fraction": labels.phase_fraction, "region": region, "numel": numel,
                "segments": segments, "route": route,
                "reducer": wire[0] if wire else "", "error_feedback": ef,
                "capacity_ok": reducer is not None,
                "bits_per_element": (8.0 * wire[1] / numel) if wire else math.nan,
                "wire_bytes": int(round(wire[1])) if wire else 0,
                "fp32_wire_bytes": int(round(fp32_bytes)),
                "cosine": fid.cosine, "rel_error": fid.rel_error, "sign_agreement": fid.sign_agreement,
                "cum_cosine": fid.cum_cosine, "encode_decode_s": fid.encode_decode_s,
                "loss_delta": 0.0 if route == "fp32" else math.nan, "loss_resolved": math.nan,
                "train_loss_delta": 0.0 if route == "fp32" else math.nan,
                "trial_steps": labels.reference_steps if route == "fp32" else 0,
                "screen": "reference" if route == "fp32" else "no_trial",
            }
    return cells
