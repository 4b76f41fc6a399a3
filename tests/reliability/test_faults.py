"""Injected faults (NFAB_FAULT) in real 2-rank `nfab train` runs: each ends in a safe fallback or one clear line.

A rank crash with `--max-restarts 1` (torchrun restarts, resume from the last checkpoint with
hook state, no step lost or repeated) is tests/train/test_train_runs.py::
test_torchrun_restart_loses_and_repeats_no_step; it is not repeated here.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from relrun import GPT, Result, metrics, nfab, summary, write_profile

pytestmark = [pytest.mark.slow, pytest.mark.world_size(2)]

SPIKE_AT, COOLDOWN, READMIT = 5, 3, 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Result]]:
    """Every faulted run, three launches at a time (2 cores; a launch is mostly start-up, the hang waits)."""
    root = tmp_path_factory.mktemp("faults")
    profile = write_profile(
        root / "spike-profile.json", {"linear": "sign", "embedding": "sign"}, model="gpt",
        # shadow_steps 0: an alarm demotes at once (the path without FP32 shadows); with shadows the
        # injected spike (the loss x10, the gradients untouched) is a false alarm: tests/runtime/test_health.py
        health={"warmup_steps": 3, "cooldown_steps": COOLDOWN, "readmit_after": READMIT, "probe_every": 0,
                "shadow_steps": 0},
        world_size={"min": 4, "max": 8},  # 2 ranks: outside the range, a warning and a safe run
    )

    def run(name: str, fault: str, *args: str, timeout: float = 180) -> Callable[[], tuple[Path, Result]]:
        out = root / name
        return lambda: (out, nfab("train", *args, "--nproc", "2", "--run-dir", str(out),
                                  env={"NFAB_FAULT": fault}, timeout=timeout))

    jobs = {
        "hang": run("hang", "hang@step=2,rank=1", *GPT, "--steps", "6", "--route", "sign", "launch.timeout_s=10",
                    "metrics_every=1", timeout=200),  # metrics_every=1: the steps before the hang are on disk
        "nan": run("nan", "nan@step=2,rank=1;inf@step=4,rank=0", *GPT, "--steps", "6", "--route", "sign"),
        "spike": run("spike", f"spike@step={SPIKE_AT},factor=10;slow@step=3,rank=1,seconds=2", *GPT,
                     "--steps", "12", "--profile", str(profile), "launch.timeout_s=10"),
        "fp32-nan": run("fp32-nan", "nan@step=1,rank=0", *GPT, "--steps", "4", "--fp32"),
    }
    # three at a time: the hung run spends its 10 s timeout waiting, and the other two use the cores
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


def running(pid: int) -> bool:
    """A live (not zombie) process."""
    status = Path(f"/proc/{pid}/status")
    try:
        return "\tZ" not in next(line for line in status.read_text().splitlines() if line.startswith("State:"))
    except (OSError, StopIteration):
        return False


def ok(runs: dict[str, tuple[Path, Result]], name: str) -> Path:
    out, r = runs[name]
    assert r.code == 0, r.stderr
    return out


def test_nan_and_inf_on_one_rank_skip_the_step_on_every_rank(runs) -> None:
    out = ok(runs, "nan")
    m = metrics(out).set_index("step")
    assert m.index[m["skipped"]].tolist() == [2, 4]
    for step in (2, 4):
        assert "nonfinite" in m.at[step, "fallback_reason"] and m.at[step, "grad_norm"] == 0.0
    assert m.loc[[0, 1, 3, 5], "loss"].map(math.isfinite).all()
    s = summary(out)
    assert s["skipped_steps"] == 2 and s["complete"] is True
    assert math.isfinite(s["final_eval"]["loss"])
    assert s["replicas_identical"] is True  # every rank skipped the same steps: bit-identical parameters


def test_plain_ddp_skips_a_nonfinite_step_too(runs) -> None:
    out = ok(runs, "fp32-nan")
    m = metrics(out)
    assert m["skipped"].tolist() == [False, True, False, False]
    s = summary(out)
    assert s["skipped_steps"] == 1 and s["replicas_identical"] is True and math.isfinite(s["final_eval"]["loss"])


def test_loss_spike_demotes_to_fp32_for_the_cooldown_then_readmits(runs) -> None:
    out = ok(runs, "spike")
    m = metrics(out).set_index("step")
    events = {step: e for step, e in m["events"].items() if e}
    readmit_at = SPIKE_AT + COOLDOWN + READMIT - 1  # healthy steps counted from SPIKE_AT + COOLDOWN
    assert list(events) == [SPIKE_AT, readmit_at], events
    assert events[SPIKE_AT].startswith("fallback:loss_spike") and "linear" in events[SPIKE_AT], events
    assert events[readmit_at].startswith("readmit:") and "linear" in events[readmit_at]
    fp32_only = [json.loads(mix) == {"fp32": 1.0} for mix in m["route_mix"]]
    assert [s for s, only in enumerate(fp32_only) if only] == list(range(SPIKE_AT + 1, readmit_at + 1))
    assert m.index[m["fallback"]].tolist() == list(range(SPIKE_AT, readmit_at + 1))
    assert summary(out)["replicas_identical"] is True


def test_a_slow_rank_is_no_fallback(runs) -> None:
    out, r = runs["spike"]
    m = metrics(ok(runs, "spike")).set_index("step")
    assert m.at[3, "step_time_s"] >= 2.0  # rank 1 slept 2 s at step 3: its peer waited in the all-reduce
    assert not m.loc[:SPIKE_AT - 1, "fallback"].any() and not m["skipped"].any()


def test_world_size_outside_the_profile_range_warns_and_runs(runs) -> None:
    out, r = runs["spike"]
    assert r.code == 0
    warning = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "valid for world sizes 4..8, this run has 2 ranks" in warning[0], r.stderr


def test_a_rank_that_never_arrives_times_out_with_one_line(runs) -> None:
    out, r = runs["hang"]
    lines = r.stderr.strip().splitlines()
    assert r.code == 1 and len(lines) == 1, r.stderr
    line = lines[0]
    assert line.startswith("error: training failed: rank 0: a collective timed out after 10 s (launch.timeout_s)")
    assert "in step 2: forward/backward (gradient all-reduce" in line and "rank 1 never arrived" in line
    assert "Traceback" not in r.stderr
    assert r.seconds < 150  # start-up (slow on a loaded machine) + 10 s timeout + teardown: not the 300 s default
    # torchrun stopped the hung rank: no worker of this run is left
    log = (out / "logs" / "node0.log").read_text()
    pids = {int(x) for pair in re.findall(r"Sending process (\d+) closing signal|\(pid: (\d+)\)", log)
            for x in pair if x}
    assert pids and not [pid for pid in pids if running(pid)]
    s = summary(out)  # written after steps 0 and 1, never finished
    assert s["complete"] is False and s["steps"] == 2
