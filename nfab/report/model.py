"""The built report: the tables and the files written, handed to the terminal and HTML."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

_HIDDEN = ("fp32_reference",)
_OPTIONAL = ("accuracy", "perplexity", "calibration_steps")  # shown only when some run recorded them


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibrationView:
    """One calibration dir's table; `fitted` is False while profile.json is missing."""

    name: str
    table: pd.DataFrame
    fitted: bool
    heatmap: str | None = None
    """File name of the heatmap PNG, relative to the report dir."""
    notes: tuple[str, ...] = ()
    """Lines under the table: the profile's validation against FP32 and the calibration's time split."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TtaView:
    """One time-to-accuracy result's table and its loss-against-wall-time plot (or, over seeds, the summary)."""

    name: str
    target_loss: float | None
    """FP32's final validation loss (None: a summary over seeds, each with its own target)."""
    table: pd.DataFrame
    plot: str | None
    """File name of the PNG, relative to the report dir (None: no plot)."""
    note: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    """Everything `nfab report` produced."""

    out: Path
    runs: pd.DataFrame
    comparison: pd.DataFrame
    calibrations: tuple[CalibrationView, ...]
    ttas: tuple[TtaView, ...] = ()
    images: tuple[tuple[str, str], ...] = ()
    """(title, file name relative to `out`) per run plot, in page order."""
    files: tuple[Path, ...] = field(default_factory=tuple)
    removed: tuple[Path, ...] = field(default_factory=tuple)
    """Plots and CSV an earlier report in `out` wrote that this one did not (stale), now removed."""


def visible_columns(frame: pd.DataFrame) -> list[str]:
    """The columns a person reads: bookkeeping hidden, all-empty metric columns dropped."""
    return [c for c in frame.columns
            if c not in _HIDDEN and not (c in _OPTIONAL and frame[c].isna().all())]
