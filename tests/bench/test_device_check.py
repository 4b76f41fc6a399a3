"""`make device-check` (bench/device_check.py) on a machine without CUDA: the same script a lent GPU
runs, in quick mode, end to end. Kept working here, so the first lent minutes produce results, not
set-up: every step ok (the GPU-only step saying it skipped), its files under the output
folder (at most 8: what the device runner brings back), and a summary that says it ran on the CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the full GPU check takes minutes: make device-check")
def test_device_check_runs_every_step_on_cpu_and_writes_its_results(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "device_check.py"), "--out", str(out)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "no CUDA: ran on cpu" in p.stdout
    files = sorted(f.name for f in out.iterdir())
    assert len(files) <= 8 and {"results.json", "summary.txt", "wire_host.json", "wire_torch.json"} <= set(files)
    results = json.loads((out / "results.json").read_text())["results"]
    assert set(results) == {"cuda_tests", "wire", "ranks", "hook"}
    assert all(r["ok"] for r in results.values()), {k: r.get("error") for k, r in results.items()}
    # the GPU-only step is ok here because it says it did not run, not because it passed
    assert "skipped" in results["cuda_tests"]["result"]
    assert results["ranks"]["ddp"]["replicas_bit_identical"]
    hook = results["hook"]["variants"]
    assert set(hook) == {"nfab"}
    assert all(v["ms_per_step"] > 0 for v in hook.values())
    assert (out / "summary.txt").read_text().strip() == p.stdout.strip()
