"""numba caches nfab's kernels in a per-user directory (`nfab.wire.numba_cache`), never in the package.

The subprocess checks start a fresh interpreter (numba reads its cache directory once, at import)
with NUMBA_CACHE_DIR unset, as a user's shell would have it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import nfab
from nfab.wire import numba_cache

PACKAGE = Path(nfab.__file__).parent


def _python(code: str, **env: str) -> dict:
    """Run `code` in a fresh interpreter without NUMBA_CACHE_DIR (plus `env`); its last stdout line as JSON."""
    environ = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "XDG_CACHE_HOME")}
    res = subprocess.run([sys.executable, "-c", code], env={**environ, **env, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_cache_dir_is_numba_cache_dir_else_xdg_else_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert numba_cache.cache_dir({}) == tmp_path / "home/.cache/nfab/numba"
    assert numba_cache.cache_dir({"XDG_CACHE_HOME": "relative/ignored"}) == tmp_path / "home/.cache/nfab/numba"
    assert numba_cache.cache_dir({"XDG_CACHE_HOME": str(tmp_path / "xdg")}) == tmp_path / "xdg/nfab/numba"
    assert numba_cache.cache_dir({"XDG_CACHE_HOME": str(tmp_path / "xdg"), "NUMBA_CACHE_DIR": "/chosen"}) == Path(
        "/chosen")


def test_a_numba_cache_dir_the_user_set_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "mine"))
    assert numba_cache.configure() == str(tmp_path / "mine")
    assert os.environ["NUMBA_CACHE_DIR"] == str(tmp_path / "mine")


def test_a_cached_kernel_compiles_into_the_user_cache_dir_not_the_package(tmp_path: Path) -> None:
    started = time.time()
    got = _python(
        "import json, numpy as np\n"
        "from nfab.wire import shared_kernels\n"
        "import numba\n"
        "out = np.empty(3, dtype=np.uint64)\n"
        "shared_kernels.first_draw_keys(np.arange(3, dtype=np.uint64), out)\n"
        "print(json.dumps({'config': numba.config.CACHE_DIR}))\n",
        XDG_CACHE_HOME=str(tmp_path / "xdg"))
    where = tmp_path / "xdg/nfab/numba"
    assert got["config"] == str(where)
    written = {p.suffix for p in where.rglob("shared_kernels.first_draw_keys-*")}
    assert written == {".nbi", ".nbc"}, sorted(where.rglob("*"))
    in_package = [p for p in PACKAGE.rglob("*.nb[ic]") if p.stat().st_mtime >= started]
    assert in_package == []


def test_numba_imported_first_and_no_writable_home_still_caches_outside_the_package(tmp_path: Path) -> None:
    """A user who imported numba before nfab: its config is set too. An XDG_CACHE_HOME under a file
    (nothing can be made there; as root a read-only directory would not stop a write): a private temp dir."""
    (blocker := tmp_path / "a-file").write_text("")
    got = _python(
        "import json, os, numba\n"
        "import nfab.wire\n"
        "print(json.dumps({'config': numba.config.CACHE_DIR, 'env': os.environ['NUMBA_CACHE_DIR']}))\n",
        XDG_CACHE_HOME=str(blocker / "cache"))
    assert got["config"] == got["env"]
    assert Path(got["env"]).parent == Path(tempfile.gettempdir()) and Path(got["env"]).name.startswith("nfab-numba-")
