"""`nfab bench wire`: codec throughput beside a copy, and wire bits beside fp32."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from nfab.cli.output import console


def register(app: typer.Typer) -> None:
    @app.command("wire")
    def bench_wire(
        json_path: Annotated[Path | None, typer.Option("--json", help="Write the rows as JSON here.")] = None,
        numel: Annotated[int, typer.Option("--numel", min=1, help="Gradient elements to encode.")] = 1 << 22,
        cost: Annotated[Path | None, typer.Option(
            "--cost", help="Also measure the cost model on 2 gloo ranks and save its JSON here.")] = None,
        reducers: Annotated[str | None, typer.Option(
            "--reducers", help="Comma-separated reducer keys to time (default: every reducer).")] = None,
    ) -> None:
        """Encode+decode GB/s beside a plain copy (one core), and bits per element at W=2,4,8,16."""
        from nfab.bench.wire import WORLD_SIZES, bench_wire, measure_cost, write_rows
        from nfab.errors import ConfigError
        from nfab.fsutil import atomic_write_json
        from nfab.wire.registry import REDUCERS

        keys = [k.strip() for k in reducers.split(",") if k.strip()] if reducers else None
        unknown = [k for k in keys or [] if k not in REDUCERS]
        if unknown:
            raise ConfigError(f"unknown reducer(s) {', '.join(unknown)}: choose from {', '.join(REDUCERS)}")
        rows = bench_wire(numel, reducers=keys)
        table = Table(title=f"nfab bench wire  (numel={numel:,}, one core)")
        table.add_column("reducer")
        for w in WORLD_SIZES:
            table.add_column(f"W={w} enc+dec/copy", justify="right")
            table.add_column(f"W={w} bits/el", justify="right")
        by_key: dict[str, list] = {}
        for r in rows:
            by_key.setdefault(r.reducer, []).append(r)
        for key, rs in by_key.items():
            cells = []
            for r in rs:
                if r.capacity_ok:
                    cells += [f"{r.ratio_to_copy:.2f}x", f"{r.bits_per_element:.2f} / {r.fp32_bits_per_element:.0f}"]
                else:
                    cells += ["", "[dim]over capacity[/]"]
            table.add_row(key, *cells)
        console.print(table)
        copy = sorted(r.copy_gbps for r in rows)[len(rows) // 2]
        first = max((r.first_call_s or 0.0) for r in rows)
        console.print(f"enc+dec/copy: one rank's encode + decode speed over a plain copy timed beside it "
                      f"(copy median {copy:.2f} GB/s); bits/el: wire bits sent per rank per element / fp32 "
                      f"all-reduce's; slowest first call {first:.2f} s (kernel compile or cache load)")
        if json_path is not None:
            write_rows(json_path, rows)
            console.print(f"wrote {json_path}")
        if cost is not None:
            model = measure_cost(2)
            import json

            atomic_write_json(cost, json.loads(model))
            console.print(f"wrote {cost}")
