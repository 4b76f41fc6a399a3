"""Safety of files: a write that fails or is killed leaves the previous artifact intact and no temp behind."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nfab.fsutil import atomic_write, atomic_write_text, sweep_stale
from nfab.train import checkpoint

SLOW_WRITER = """
import sys, time
from nfab.fsutil import atomic_write

def write(tmp):
    with open(tmp, "wb") as f:
        for i in range(100_000):
            f.write(b"x" * (1 << 20))
            f.flush()
            if i == 4:
                print("writing", flush=True)
            time.sleep(0.01)

atomic_write(sys.argv[1], write)
"""


def temps(folder: Path) -> list[Path]:
    return sorted(folder.glob(".*.tmp"))


def test_a_writer_that_raises_leaves_the_old_file_and_no_temp(tmp_path: Path) -> None:
    target = atomic_write_text(tmp_path / "summary.json", '{"old": true}\n')

    def half(tmp: Path) -> None:
        tmp.write_text('{"new": ')
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, half)
    assert target.read_text() == '{"old": true}\n'
    assert temps(tmp_path) == []


def test_a_writer_killed_mid_write_leaves_the_old_file_and_the_next_write_sweeps_its_temp(tmp_path: Path) -> None:
    target = atomic_write_text(tmp_path / "metrics.parquet", "old")
    proc = subprocess.Popen([sys.executable, "-c", SLOW_WRITER, str(target)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        left = temps(tmp_path)
        assert len(left) == 1 and left[0].stat().st_size >= 5 << 20  # killed with megabytes half-written
    finally:
        proc.send_signal(signal.SIGKILL)  # no cleanup runs: as a crash or the OOM killer would
        proc.wait(timeout=30)
    assert target.read_text() == "old"
    assert sweep_stale(target) == left  # the dead writer's temp is recognised as stale ...
    atomic_write_text(target, "new")  # ... and any next write of that path removes it
    assert target.read_text() == "new" and temps(tmp_path) == []


def test_a_live_writers_temp_is_never_swept(tmp_path: Path) -> None:
    target = tmp_path / "profile.json"

    def check(tmp: Path) -> None:
        assert sweep_stale(target) == [] and tmp.exists()  # our own (live) temp is left alone
        tmp.write_text("{}")

    atomic_write(target, check)
    assert target.read_text() == "{}"


def test_a_checkpoint_save_killed_midway_is_swept_and_latest_stays_complete(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        checkpoint.save(tmp_path, 3, {"step": 3, "model": {"w": torch.ones(2)}}, {"rng": None, "hook": None})
        stale = tmp_path / "checkpoints" / ".step-000006.tmp"  # what a save killed before its rename leaves
        stale.mkdir()
        (stale / "state.pt").write_bytes(b"half")
        assert checkpoint.latest(tmp_path) == tmp_path / "checkpoints" / "step-000003"
        checkpoint.save(tmp_path, 9, {"step": 9, "model": {"w": torch.zeros(2)}}, {"rng": None, "hook": None})
        assert not stale.exists()
        latest = checkpoint.latest(tmp_path)
        assert latest is not None and latest.name == "step-000009"
        assert checkpoint.read(latest / "state.pt")["step"] == 9  # weights-only load
    finally:
        dist.destroy_process_group()


def test_a_symlink_is_written_through_and_a_folder_or_device_is_refused(tmp_path: Path) -> None:
    """The rename would replace whatever stands at the path: a link (the user's own layout), a folder,
    or, as root, a device node (`nfab profile schema -o /dev/full` once left a regular file there)."""
    target = atomic_write_text(tmp_path / "real.json", "old\n")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    atomic_write_text(link, "new\n")
    assert link.is_symlink() and target.read_text() == "new\n"
    folder = tmp_path / "folder.json"
    folder.mkdir()
    with pytest.raises(IsADirectoryError, match="is a folder"):
        atomic_write_text(folder, "x\n")
    with pytest.raises(OSError, match="is not a regular file"):
        atomic_write_text("/dev/null", "x\n")
    assert Path("/dev/null").is_char_device() and temps(tmp_path) == []
