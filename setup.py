"""Build hook: the shipped configs and calibrations travel in the wheel as package data.

They live at the repository root (`configs/`, `calibrations/`: data, never imported);
a wheel carries them under `nfab/shipped/`, where `nfab.config.shipped` finds them by
name (`--config gpt-nano-stdlib`, `--profile resnet18`). Everything else is in pyproject.toml.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SHIPPED = {"configs": ("*.yaml",), "calibrations": ("*/profile.json", "*/calibration.parquet")}


class BuildWithShipped(build_py):
    """`build_py` plus a copy of the shipped data into `nfab/shipped/` (editable installs read the checkout)."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for kind, patterns in SHIPPED.items():
            for pattern in patterns:
                for src in sorted((ROOT / kind).glob(pattern)):
                    dest = Path(self.build_lib) / "nfab" / "shipped" / kind / src.relative_to(ROOT / kind)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(src, dest)


setup(cmdclass={"build_py": BuildWithShipped})
