"""`nfab bench launches`: kernels per bucket on the torch path (a GPU's launch count, counted on CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from nfab.cli.output import console

LOSSY = ("signgather,signcount,signscatter,qsum-q8,qsum-q4,qsum-q2,blockq-bq3,blockq-bq2,blockq-bq4,blockq-bl5,"
         "blockqscatter-bq3,blockqscatter-bq2")


def register(app: typer.Typer) -> None:
    @app.command("launches")
    def bench_launches(
        json_path: Annotated[Path | None, typer.Option("--json", help="Write the rows as JSON here.")] = None,
        reducers: Annotated[str, typer.Option("--reducers", help="Comma-separated reducer keys.")] = LOSSY,
        world_sizes: Annotated[str, typer.Option("--world-sizes", help="Comma-separated world sizes.")] = "2,4,8",
        segments: Annotated[str, typer.Option(
            "--segments", help="Comma-separated parameters per bucket (1: one of 2^20 elements; more: small "
                               "ones with tails between larger ones).")] = "1,62",
    ) -> None:
        """Launches of one rank's codec work per bucket (scale, encode, owner step, decode) on the torch
        path (what CUDA takes): exact counts, no GPU needed."""
        from nfab.bench.launches import bucket_lengths, count_launches
        from nfab.cli.bench_wire import _world_sizes
        from nfab.errors import ConfigError
        from nfab.fsutil import atomic_write_json
        from nfab.wire.registry import REDUCERS

        keys = [k.strip() for k in reducers.split(",") if k.strip()]
        unknown = [k for k in keys if k not in REDUCERS]
        if unknown or not keys:
            raise ConfigError(f"--reducers {reducers!r}: choose from {', '.join(REDUCERS)}")
        sizes = _world_sizes(world_sizes)
        try:
            counts = [int(s) for s in segments.split(",") if s.strip()]
        except ValueError:
            counts = []
        if not counts or any(c < 1 for c in counts):
            raise ConfigError(f"--segments {segments!r}: give comma-separated integers >= 1, e.g. 1,62")
        rows = []
        for key in keys:
            red = REDUCERS[key]
            for w in sizes:
                if not red.capacity(w).ok:
                    continue
                for k in counts:
                    lengths = bucket_lengths(k)
                    rows.append({"reducer": key, "world_size": w, "segments": k, "numel": sum(lengths),
                                 "launches": count_launches(red, lengths, w).total})
        table = Table(title="nfab bench launches  (one rank's codec work per bucket, torch path)")
        for name in ("reducer", "W", "segments", "launches"):
            table.add_column(name, justify="left" if name == "reducer" else "right")
        for r in rows:
            table.add_row(r["reducer"], str(r["world_size"]), str(r["segments"]), str(r["launches"]))
        console.print(table)
        console.print("launches: every op that computes or copies, one kernel each on a GPU")
        if json_path is not None:
            atomic_write_json(json_path, {"schema": "nfab.bench.launches", "version": 2, "rows": rows})
            console.print(f"wrote {json_path}")
