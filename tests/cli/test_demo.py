"""`nfab demo` as `make demo` runs it, shortened: the shipped profile (no calibration), 10 steps a run.
What it must print: FP32, bf16 and the profile side by side for the declared link, bytes against both,
final accuracy, time to accuracy; the report holding the same table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

NFAB = str(Path(sys.executable).parent / "nfab")


@pytest.mark.slow
def test_demo_prints_runs_side_by_side_at_the_declared_link(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "100"}
    res = subprocess.run([NFAB, "demo", "--out", str(tmp_path / "demo"), "--steps", "10", "--no-calibrate"],
                         env=env, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    table = out[out.index("nfab demo: resnet18 on digits, W=2, trained for link:100mbit"):]
    rows = {cells[0]: cells for cells in map(str.split, table.splitlines())  # the table's rows: 9 cells
            if len(cells) == 9 and cells[0] in ("fp32", "bf16", "static-sign", "profile")}
    assert set(rows) == {"fp32", "bf16", "static-sign", "profile"}
    assert rows["fp32"][2:4] == ["1.0x", "0.5x"] and rows["bf16"][2:4] == ["2.0x", "1.0x"]  # bytes vs FP32, bf16
    assert float(rows["profile"][2].rstrip("x")) > 8  # the gate admits the profile's routes at 100 Mbit/s
    assert rows["fp32"][7] == "1.00x"  # time to accuracy against itself
    assert "the profile:" in table and "sooner to accuracy than FP32" in " ".join(table.split())
    html = (tmp_path / "demo" / "report" / "report.html").read_text()
    assert "Time to accuracy: at the declared link:100mbit (modelled)" in html
