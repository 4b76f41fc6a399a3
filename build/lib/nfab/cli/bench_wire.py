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
    ) -> None:
        """Encode+decode GB/s beside a plain copy (one core), and bits per element at W=2,4,8,16."""
        from nfab.bench.wire import WORLD_SIZES, bench_wire, measure_cost, write_rows
        from nfab.fsutil import atomic_write_json

        rows = bench_wire(numel)
        table = Table(title=f"nfab bench wire  (numel={numel:,}, one core)")
        for col in ("reducer", "enc+dec GB/s", "copy GB/s", "ratio"):
            table.add_column(col, justify="left" if col == "reducer" else "right")
        for w in WORLD_SIZES:
            table.add_column(f"bits/el W={w}", justify="right")
        by_key: dict[str, list] = {}
        for r in rows:
            by_key.setdefault(r.reducer, []).append(r)
        for key, rs in by_key.items():
            first = rs[0]
            cells = [f"{r.bits_per_element:.2f} / {r.fp32_bits_per_element:.0f}" if r.capacity_ok
                     else "[dim]over capacity[/]" for r in rs]
            table.add_row(key, f"{first.encode_decode_gbps:.2f}", f"{first.copy_gbps:.2f}",
                          f"{first.ratio_to_copy:.3f}", *cells)
        console.print(table)
        console.print("bits/el: wire bits sent per rank per element / fp32 all-reduce's; "
                      "speed timed at W=4 (W=2 where W=4 is over capacity)")
        if json_path is not None:
            write_rows(json_path, rows)
            console.print(f"wrote {json_path}")
        if cost is not None:
            model = measure_cost(2)
            import json

            atomic_write_json(cost, json.loads(model))
            console.print(f"wrote {cost}")
