"""Helpers for `nfab train` tests: run the real CLI (subprocess) and read its artifacts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[2]
NFAB = shutil.which("nfab") or str(Path(sys.executable).parent / "nfab")

GPT = [
    "--config", str(REPO / "configs/gpt-nano-stdlib.yaml"), "--steps", "8", "--quiet",
    "data.max_bytes=200000", "data.batch_size=8", "data.eval_batches=2", "eval_every=4", "checkpoint_every=3",
    "metrics_every=2", "schedule.warmup_steps=2", "comm.cost_model=none",
]
RESNET = [
    "--config", str(REPO / "configs/resnet18-digits.yaml"), "--steps", "6", "--quiet", "model.width=8",
    "data.batch_size=16", "eval_every=3", "checkpoint_every=3", "schedule.warmup_steps=2", "comm.cost_model=none",
]


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str
    extra: object = None


def nfab_train(*args: str, env: dict[str, str] | None = None, timeout: float = 120, cwd: Path | None = None,
               ) -> Result:
    """Run `nfab train ARGS` in a subprocess with a timeout."""
    base = {k: v for k, v in os.environ.items() if k != "NFAB_FAULT"}
    full_env = {**base, "OMP_NUM_THREADS": "1", **(env or {})}
    p = subprocess.run([NFAB, "train", *args], capture_output=True, text=True, timeout=timeout, env=full_env,
                       cwd=cwd)
    return Result(p.returncode, p.stdout, p.stderr)


def start_train(*args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "NFAB_FAULT"}
    return subprocess.Popen([NFAB, "train", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**env, "OMP_NUM_THREADS": "1"})


def metrics(run_dir: Path) -> pd.DataFrame:
    return pd.read_parquet(run_dir / "metrics.parquet")
