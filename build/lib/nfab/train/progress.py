"""Rank 0's live progress bar: step, loss, route mix and wire megabytes (rich)."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def mix_text(route_mix: str) -> str:
    """`{"fp32": 0.1, "signcount": 0.9}` -> `signcount 90% fp32 10%`."""
    mix = json.loads(route_mix)
    return " ".join(f"{k} {v:.0%}" for k, v in sorted(mix.items(), key=lambda kv: -kv[1]))


class ProgressBar:
    """A rich progress bar; a no-op when disabled (other ranks, `--quiet`)."""

    def __init__(self, total: int, start: int, title: str, enabled: bool) -> None:
        self.enabled = enabled
        self.wire_mb = 0.0
        if not enabled:
            return
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
            console=Console(), transient=False,
        )
        self.task = self.progress.add_task(title, total=total, completed=start, info="")
        self.progress.start()

    def update(self, row: dict[str, Any], wire_mb_total: float) -> None:
        if not self.enabled:
            return
        info = f"loss {row['loss']:.4f} | {mix_text(row['route_mix'])} | {wire_mb_total:.1f} MB"
        self.progress.update(self.task, completed=row["step"] + 1, info=info)

    def close(self) -> None:
        if self.enabled:
            self.progress.stop()
