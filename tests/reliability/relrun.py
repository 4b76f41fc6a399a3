"""Helpers for reliability tests: the real `nfab` CLI in a subprocess, with a timeout, and its artifacts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from nfab.profile.schema import Profile

REPO = Path(__file__).resolve().parents[2]
NFAB = shutil.which("nfab") or str(Path(sys.executable).parent / "nfab")

# GPT nano on a slice of the stdlib text: a few seconds a step-pair on 2 gloo ranks.
GPT = [
    "--config", str(REPO / "configs/gpt-nano-stdlib.yaml"), "--quiet", "data.max_bytes=200000",
    "data.batch_size=8", "data.eval_batches=2", "schedule.warmup_steps=2", "comm.cost_model=none",
]
RESNET = [
    "--config", str(REPO / "configs/resnet18-digits.yaml"), "--quiet", "model.width=8", "data.batch_size=16",
    "schedule.warmup_steps=2", "comm.cost_model=none",
]


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str
    seconds: float


def nfab(*args: str, env: dict[str, str] | None = None, timeout: float = 120, cwd: Path | None = None) -> Result:
    """Run `nfab ARGS` in a subprocess (one torch thread, no inherited NFAB_FAULT) with a timeout."""
    base = {k: v for k, v in os.environ.items() if k != "NFAB_FAULT"}
    t0 = time.perf_counter()
    p = subprocess.run([NFAB, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                       env={**base, "OMP_NUM_THREADS": "1", "COLUMNS": "400", **(env or {})})
    return Result(p.returncode, p.stdout, p.stderr, time.perf_counter() - t0)


def one_line_error(r: Result) -> str:
    """Assert the run ended the way a user error must: exit 2, one `error:` line, no traceback."""
    lines = r.stderr.strip().splitlines()
    assert r.code == 2, (r.code, r.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    return lines[0]


def write_profile(path: Path, route: str | dict[str, str], model: str = "any", **sections: dict[str, Any]) -> Path:
    """A profile JSON for a static route, with sections (`health`, `world_size`, `fallback`) updated."""
    data = Profile.static(route, model_name=model).to_dict()
    for key, values in sections.items():
        data[key] = {**data.get(key, {}), **values}
    path.write_text(json.dumps(data, indent=1))
    Profile.load(path)  # the test's own profile must be valid
    return path


def metrics(run_dir: Path) -> pd.DataFrame:
    return pd.read_parquet(run_dir / "metrics.parquet")


def summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def tree(path: Path) -> dict[str, bytes]:
    """Every file under `path` and its bytes (to show nothing was written or changed)."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
