"""Installed, not only cloned: build the wheel, install it in a fresh venv, train with a shipped profile by name.

The fresh venv gets nfab from the wheel alone (no checkout on its path: it runs in an empty
folder). Its dependencies, the pinned torch==2.13.0 among them, come from this test's own
environment through a `.pth` line rather than a second multi-GB install, and the wheel is
built with this environment's setuptools (`--no-build-isolation`); `pip check` then proves
the wheel's requirements are met.

Most of the rest is numba compiling the installed copy's kernels (its cache is keyed by the
source path, so nothing of the checkout's applies): the installed runs compile at NUMBA_OPT=0,
about half the CPU of the default level, into a venv that is thrown away with the test. The
cheap checks run while the ranks train.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def clean_env() -> dict[str, str]:
    """No checkout on the path, one thread, numba's quickest compile (the installed copy compiles afresh)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "OMP_NUM_THREADS": "1", "NUMBA_OPT": "0"}


def run(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=timeout,
                          check=False)


def source_copy(dest: Path) -> Path:
    """The checkout's files as a fresh clone would have them (tracked and new, never ignored
    build output): a stale `build/` in the checkout must not leak old modules into the wheel."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, listed):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def ok(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 0, f"{res.args}:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
    return res.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_wheel_installs_and_trains_with_a_shipped_profile_by_name(tmp_path: Path) -> None:
    dist, venv, work = tmp_path / "dist", tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    src = source_copy(tmp_path / "src")
    ok(run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
            str(src)], cwd=tmp_path))
    (wheel,) = dist.glob("nfab-*.whl")
    ok(run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path))
    python = venv / "bin" / "python"
    ok(run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
            str(wheel)], cwd=tmp_path))
    site = Path(ok(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                       cwd=work)).strip())
    (site / "_nfab_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    where = ok(run([str(python), "-c", "import nfab, torch; print(nfab.__file__); print(torch.__version__)"],
                   cwd=work)).split()
    assert where[0].startswith(str(site)), where  # nfab from the wheel, not the checkout
    assert where[1] == torch.__version__, where  # the test's own torch (constraints.txt's pin; `make compat`'s)

    nfab = str(venv / "bin" / "nfab")
    train = subprocess.Popen([nfab, "train", "--profile", "resnet18", "--nproc", "2", "--steps", "3", "--quiet",
                              "--run-dir", "run"], cwd=work, env=clean_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:  # while its ranks start and compile
        ok(run([sys.executable, "-m", "pip", "--python", str(python), "check"], cwd=work))
        bad = run([nfab, "train", "--config", "gpt-nano-stdlib", "--route", "sign", "nosuch=1"], cwd=work)
        assert bad.returncode == 2 and "unknown key 'nosuch'" in bad.stderr, bad.stderr  # the config was found
        assert "valid" in ok(run([nfab, "profile", "check", "gpt"], cwd=work))
        out, err = train.communicate(timeout=600)
    finally:
        train.kill()
    assert train.returncode == 0, f"nfab train:\n{out[-2000:]}\n{err[-2000:]}"
    assert (work / "run" / "summary.json").is_file()
