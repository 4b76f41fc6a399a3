"""Turn the PATH arguments of `nfab report` into loaded run and calibration artifacts.

Globs are expanded here too, because a shell may pass `runs/*` through unexpanded
(quoted, or on Windows), and a folder of run dirs stands for them. A dir is a run dir
when it holds summary.json or metrics.parquet (checked first: a run dir may carry a copy
of its profile.json), and a calibration dir when it holds calibration.parquet or
profile.json. A JSON file whose `kind` is `nfab.bench.tta` is a time-to-accuracy result.
Anything else is a user error, named in one line.
"""

from __future__ import annotations

import glob
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from nfab.config.run import IN_RUN_DIR
from nfab.errors import NfabError
from nfab.report.artifacts import (
    CALIBRATION_FILE,
    METRICS_FILE,
    PROFILE_FILE,
    SUMMARY_FILE,
    CalibrationArtifacts,
    RunArtifacts,
    load_calibration,
    load_run,
)
from nfab.report.tta import TtaArtifact, is_tta, load_ttas

_RUN_FILES = (SUMMARY_FILE, METRICS_FILE)
_CALIBRATION_FILES = (CALIBRATION_FILE, PROFILE_FILE)
_GLOB_CHARS = set("*?[")


@dataclass(frozen=True, slots=True)
class Inputs:
    """Everything a report is built from, in the order the user named it."""

    runs: tuple[RunArtifacts, ...]
    calibrations: tuple[CalibrationArtifacts, ...]
    ttas: tuple[TtaArtifact, ...] = ()
    """Time-to-accuracy results (`nfab bench tta --json` files)."""


def expand_paths(args: Iterable[str]) -> list[Path]:
    """Expand globs, map an artifact file to its dir, drop duplicates, keep order."""
    paths: list[Path] = []
    for arg in args:
        if _GLOB_CHARS & set(arg) and not Path(arg).exists():
            matches = sorted(glob.glob(arg))
            if not matches:
                raise NfabError(f"no path matches '{arg}'")
            paths.extend(Path(m) for m in matches)
        else:
            paths.append(Path(arg))
    paths = [inner for path in paths for inner in (_collected(path) or [path])]
    seen: set[Path] = set()
    unique: list[Path] = []
    for path in paths:
        if path.is_file() and path.name in _RUN_FILES + _CALIBRATION_FILES:
            path = path.parent
        key = path.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(path)
    if not unique:
        raise NfabError("nothing to report: give at least one run or calibration dir, or a bench tta JSON")
    return unique


def _artifact_dir(path: Path) -> bool:
    return path.is_dir() and any((path / f).is_file() for f in _RUN_FILES + _CALIBRATION_FILES)


def _collected(path: Path) -> list[Path] | None:
    """The run and calibration dirs one level inside a folder that is neither itself (`runs/demo`
    after `make demo`: fp32, static-sign, profile, calibration; its `report` is skipped), or None."""
    if not path.is_dir() or _artifact_dir(path):
        return None
    inner = [child for child in sorted(path.iterdir()) if _artifact_dir(child)]
    return inner or None


def kind_of(path: Path) -> str:
    """'run', 'calibration' or 'tta'; raises for a missing or foreign path."""
    if not path.exists():
        raise NfabError(f"{path} does not exist")
    if is_tta(path):
        return "tta"
    if not path.is_dir():
        raise NfabError(f"{path} is not a run dir, a calibration dir or an nfab bench tta JSON (it is a file)")
    if any((path / f).is_file() for f in _RUN_FILES):
        return "run"
    if any((path / f).is_file() for f in _CALIBRATION_FILES):
        return "calibration"
    raise NfabError(f"{path} is not a run dir (no {' or '.join(_RUN_FILES)}) nor a "
                    f"calibration dir (no {' or '.join(_CALIBRATION_FILES)})")


def display_names(paths: list[Path]) -> list[str]:
    """The dir name, or parent/name where two inputs share a dir name."""
    names = [p.resolve().name for p in paths]
    counts = Counter(names)
    return [f"{p.resolve().parent.name}/{n}" if counts[n] > 1 else n
            for p, n in zip(paths, names, strict=True)]


def discover(args: Iterable[str]) -> Inputs:
    """Expand, classify and load every PATH argument."""
    paths = expand_paths(args)
    kinds = [kind_of(p) for p in paths]  # classify all before loading any: fail fast
    runs: list[RunArtifacts] = []
    calibrations: list[CalibrationArtifacts] = []
    ttas: list[TtaArtifact] = []
    for path, kind, name in zip(paths, kinds, display_names(paths), strict=True):
        if kind == "run":
            runs.append(load_run(path, name))
            inrun = path / IN_RUN_DIR  # what `attach(model, "auto")` calibrated inside the run
            if any((inrun / f).is_file() for f in _CALIBRATION_FILES):
                calibrations.append(load_calibration(inrun, f"{name}/{IN_RUN_DIR}"))
        elif kind == "tta":
            ttas.extend(load_ttas(path, name.removesuffix(".json")))
        else:
            calibrations.append(load_calibration(path, name))
    return Inputs(runs=tuple(runs), calibrations=tuple(calibrations), ttas=tuple(ttas))
