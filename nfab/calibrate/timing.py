"""Where a calibration's time goes: reference, replay, trials, validation.

The calibration budget is stated against the sweep's own FP32 reference run (measured in
the same process, so the ratio stays meaningful on a loaded machine): `ratio` is the
whole calibration's wall time over the reference's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from nfab.profile.evidence import SHOWN


@dataclass(slots=True)
class StageClock:
    """Wall and CPU seconds per stage; `other` is what no stage claimed (the fit, the files)."""

    wall: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SHOWN[:-1], 0.0))
    cpu: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SHOWN[:-1], 0.0))
    started: float = field(default_factory=time.perf_counter)
    started_cpu: float = field(default_factory=time.process_time)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Charge the block's wall and CPU time to `name`."""
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - t0
            self.cpu[name] = self.cpu.get(name, 0.0) + time.process_time() - c0

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def ratio(self) -> float | None:
        """Calibration wall time so far over the reference run's (None before the reference ran)."""
        ref = self.wall.get("reference", 0.0)
        return self.elapsed() / ref if ref > 0 else None

    def split(self) -> dict[str, float | None]:
        """`{stage}_s` wall and `{stage}_cpu_s` CPU seconds, `other_s`, `total_s`, `cpu_s`, `ratio` (total /
        reference, wall) and `cpu_ratio` (the same in this process's CPU time: on a shared machine the
        wall ratio moves with everyone else's load, the CPU ratio much less)."""
        total = self.elapsed()
        out: dict[str, float | None] = {f"{k}_s": round(v, 2) for k, v in self.wall.items()}
        out["other_s"] = round(max(0.0, total - sum(self.wall.values())), 2)
        out["total_s"] = round(total, 2)
        cpu_total = time.process_time() - self.started_cpu
        out.update({f"{k}_cpu_s": round(v, 2) for k, v in self.cpu.items()})
        out["cpu_s"] = round(cpu_total, 2)
        ref = self.wall.get("reference", 0.0)
        out["ratio"] = round(total / ref, 3) if ref > 0 else None
        ref_cpu = self.cpu.get("reference", 0.0)
        out["cpu_ratio"] = round(cpu_total / ref_cpu, 3) if ref_cpu > 0 else None
        return out

