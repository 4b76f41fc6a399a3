"""The README's quick-start lines, run as written (plus short lengths) in a fresh folder, in order.

The block between the `quickstart` markers is the source: change the README and this test
runs the new lines. Speed arguments are appended per command; the commands themselves are
the README's. Full-length runs of the same lines are in the README's "measured" notes.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NFAB = str(Path(sys.executable).parent / "nfab")

FAST = {
    "calibrate": ["--steps", "8", "--phases", "2", "--trial-steps", "2", "--quick", "model.width=4", "ef_steps=2",
                  "eval_samples=32", "batch_size=8"],
    "train": ["--steps", "3", "--quiet"],
    "report": [],
}
"""What each command gets appended for speed (the profile then carries width 4: train reproduces it)."""


def quickstart_lines() -> list[list[str]]:
    text = (REPO / "README.md").read_text()
    block = text.split("<!-- quickstart", 1)[1].split("<!-- /quickstart -->", 1)[0]
    lines = []
    for raw in block.splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.startswith("nfab "):
            lines.append(shlex.split(line)[1:])
    return lines


def test_the_quickstart_block_is_the_headline_flow() -> None:
    lines = quickstart_lines()
    assert lines[0] == ["calibrate", "resnet18"]
    assert lines[1] == ["train", "--profile", "calibrations/resnet18/profile.json"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_readme_quickstart_runs_as_written(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for args in quickstart_lines():
        res = subprocess.run([NFAB, *args, *FAST[args[0]]], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=600, check=False)
        ok = (0, 3) if args[0] == "calibrate" else (0,)  # 3: written, validation failed (8 steps of width 4)
        assert res.returncode in ok, f"nfab {shlex.join(args)}:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2
    summaries = [json.loads((r / "summary.json").read_text()) for r in runs]
    assert all(s["complete"] and s["steps"] == 3 for s in summaries)
    configs = {("fp32" if "fp32" in r.name else "profile"): json.loads((r / "config.json").read_text()) for r in runs}
    config = configs["profile"]
    assert config["model"]["options"]["width"] == 4  # the calibrated setting, not the config file's
    assert config["comm"]["profile"] == "calibrations/resnet18/profile.json"
    # the FP32 line trains the same setting (it ran a config file at another W, and the report compared the two)
    for key in ("model", "data", "optim", "launch"):
        assert configs["fp32"][key] == config[key], key
    assert (tmp_path / "report" / "report.html").is_file() or any(tmp_path.rglob("report.html"))
