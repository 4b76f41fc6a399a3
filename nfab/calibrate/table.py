"""The calibration table (`calibration.parquet`): typed schema, atomic write, checked read.

One row per (phase, region class, route, error feedback). The file's key-value metadata
holds `nfab.version`, `nfab.command` and `nfab.meta`: a JSON object with the nfab version, the command, the sweep's
configuration and the FP32 reference run's statistics, so `nfab fit` can refit the
profile (health thresholds included) from the file alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from nfab.errors import NfabError
from nfab.fsutil import atomic_write

META_KEY = b"nfab.meta"

SCHEMA = pa.schema([
    ("model", pa.string()),
    ("dataset", pa.string()),
    ("optimizer", pa.string()),
    ("world_size", pa.int64()),
    ("phase", pa.string()),
    ("phase_kind", pa.string()),
    ("step", pa.int64()),
    ("phase_fraction", pa.float64()),
    ("region", pa.string()),
    ("numel", pa.int64()),
    ("segments", pa.int64()),
    ("route", pa.string()),
    ("reducer", pa.string()),
    ("error_feedback", pa.bool_()),
    ("capacity_ok", pa.bool_()),
    ("bits_per_element", pa.float64()),
    ("wire_bytes", pa.int64()),
    ("fp32_wire_bytes", pa.int64()),
    ("cosine", pa.float64()),
    ("rel_error", pa.float64()),
    ("sign_agreement", pa.float64()),
    ("cum_cosine", pa.float64()),
    ("encode_decode_s", pa.float64()),
    ("loss_delta", pa.float64()),
    ("train_loss_delta", pa.float64()),
    ("trial_steps", pa.int64()),
    ("screen", pa.string()),
    ("loss_resolved", pa.float64()),
])
"""Column types of calibration.parquet (the report reads phase..loss_delta).

`trial_steps` is how many steps the cell's trial ran (0: none). `screen` says why a cell
has or lacks a trial: `reference` (fp32), `trial`, `trial_stopped` (ended early, failing),
`replay` (its replay fidelity already fails), `cheaper` (a cheaper route passed), `dominated`
(a cheaper route is at least as faithful in replay), `finer_failed` (a dearer, more faithful route
failed its trial), `bound` (its EF setting could no longer beat the other's bytes), `budget` (the
trial budget was spent), `no_trial` (not a trial route, or a region too small for trials).
A trial's `loss_delta` (`train_loss_delta`) is relative to the FP32 continuation's held-out
(training) loss, floored as validation floors its gap's denominator; `loss_resolved` is, on the
same scale, what one held-out prediction moves (validation's resolution): the fit allows a delta
up to the larger of it and its tolerance. Tables written before it have no `loss_resolved`
(their deltas are unfloored).
"""

FIT_REQUIRED: tuple[str, ...] = (
    "phase", "step", "phase_fraction", "region", "route", "error_feedback",
    "bits_per_element", "cosine", "loss_delta",
)
"""Columns `fit_profile` cannot do without; the rest have defaults (capacity_ok, numel, ...)."""

FIT_NUMERIC: tuple[str, ...] = ("step", "phase_fraction", "bits_per_element", "cosine", "loss_delta")


def write_table(path: str | Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> Path:
    """Write rows with the typed schema and `nfab.meta`, atomically (temp file + rename)."""
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    table = table.replace_schema_metadata({
        META_KEY: json.dumps(meta, allow_nan=False).encode(),
        b"nfab.version": str(meta.get("nfab_version", "")).encode(),
        b"nfab.command": str(meta.get("command", "")).encode(),
    })
    return atomic_write(path, lambda p: pq.write_table(table, p))


def read_table(path: str | Path) -> tuple[pd.DataFrame, dict[str, Any]]:
    """The table and its `nfab.meta` ({} when absent); every problem is one `NfabError` line."""
    path = Path(path)
    if not path.is_file():
        raise NfabError(f"calibration table {path} does not exist")
    try:
        pf = pq.ParquetFile(path)
        arrow = pf.read()
    except Exception as exc:  # ArrowInvalid, OSError, ...: a truncated or non-Parquet file
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise NfabError(f"cannot read {path} (truncated or not Parquet?): {reason}") from exc
    raw = (arrow.schema.metadata or {}).get(META_KEY)
    meta: dict[str, Any] = {}
    if raw is not None:
        try:
            meta = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise NfabError(f"{path}: malformed nfab metadata: {exc}") from exc
    frame = arrow.to_pandas()
    check_columns(frame, str(path))
    return frame, meta


def check_columns(frame: pd.DataFrame, where: str = "calibration table") -> None:
    """Raise one `NfabError` line naming missing or non-numeric columns."""
    missing = [c for c in FIT_REQUIRED if c not in frame.columns]
    if missing:
        raise NfabError(f"{where} is not an nfab calibration table: missing column(s) {', '.join(missing)}")
    bad = [c for c in FIT_NUMERIC if not pd.api.types.is_numeric_dtype(frame[c])]
    if bad:
        raise NfabError(f"{where}: column(s) {', '.join(bad)} must be numeric")
    if frame.empty:
        raise NfabError(f"{where} has no rows")
