"""One `nfab train` per run dir (its lock), and what `--resume` may change (nfab/train/rundir.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nfab.errors import NfabError
from nfab.train import rundir


def test_a_held_run_dir_is_refused_and_released_when_its_holder_ends(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with rundir.held(run):
        with pytest.raises(NfabError, match="is in use by another nfab train"), rundir.held(run):
            pass
    with rundir.held(run):  # released at the block's end
        pass
    # a holder killed outright (SIGKILL: no cleanup runs) leaves no stale lock: the kernel drops it
    code = ("import os, signal, sys; from pathlib import Path; from nfab.train import rundir; "
            "cm = rundir.held(Path(sys.argv[1])); cm.__enter__(); os.kill(os.getpid(), signal.SIGKILL)")
    assert subprocess.run([sys.executable, "-c", code, str(run)]).returncode == -9
    with rundir.held(run):
        pass


def test_overwrite_empties_the_run_dir_but_keeps_the_lock(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with rundir.held(run):
        (run / "checkpoints" / "step-000003").mkdir(parents=True)
        (run / "summary.json").write_text("{}")
        rundir.clear(run)
        assert [p.name for p in run.iterdir()] == [rundir.LOCK_FILE]


SAVED = {"steps": 100, "optim": {"name": "adamw", "lr": 0.003}, "comm": {"route": "sign", "fp32": False},
         "launch": {"nproc": 2, "timeout_s": 300.0}, "eval_every": 0}


def test_resume_may_lengthen_and_relaunch_but_not_retrain() -> None:
    longer = {**SAVED, "steps": 150, "eval_every": 10, "launch": {"nproc": 2, "timeout_s": 60.0}}
    rundir.check_resume(SAVED, longer, finished_steps=None)
    rundir.check_resume(SAVED, longer, finished_steps=100)  # a finished run trains on
    with pytest.raises(NfabError, match=r"comm\.route \(\"sign\" -> \"q8\"\), optim\.lr \(0\.003 -> 0\.5\)"):
        rundir.check_resume(SAVED, {**SAVED, "optim": {"name": "adamw", "lr": 0.5},
                                    "comm": {"route": "q8", "fp32": False}}, finished_steps=None)
    with pytest.raises(NfabError, match=r"launch\.nproc \(2 -> 4\)"):
        rundir.check_resume(SAVED, {**SAVED, "launch": {"nproc": 4, "timeout_s": 300.0}}, finished_steps=None)
    with pytest.raises(NfabError, match="the run finished its 100 steps: nothing to resume"):
        rundir.check_resume(SAVED, SAVED, finished_steps=100)
    # a key an older config.json lacks has nothing to differ from
    rundir.check_resume({"steps": 100}, SAVED, finished_steps=None)


def test_a_nearly_full_disk_is_named_in_the_failure_line(tmp_path: Path) -> None:
    """On a full disk a rank failed in its checkpoint write and its log (same disk) stayed empty: the line
    said only 'exited with code 1 without an error message'."""
    from nfab.train.launch import _disk_note

    assert "MB free (out of space?)" in _disk_note(tmp_path, floor_bytes=1 << 62)
    assert _disk_note(tmp_path, floor_bytes=0) == ""
