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
        device: Annotated[str, typer.Option("--device", help="Where the codecs run: cpu, cuda, cuda:1, ...")] = "cpu",
        impl: Annotated[str, typer.Option(
            "--impl", help="auto (what the device takes), host (compiled CPU kernels) or torch (the path CUDA "
                           "takes, run on this device); both comma-separated (torch,host) run side by side, "
                           "reducer by reducer.")] = "auto",
        world_sizes: Annotated[str, typer.Option(
            "--world-sizes", help="Comma-separated world sizes to time.")] = "2,4,8,16",
    ) -> None:
        """Encode+decode GB/s beside a plain copy (one core), and bits per element at W=2,4,8,16."""
        import torch

        from nfab.bench.wire import bench_wire, measure_cost, write_rows
        from nfab.errors import ConfigError
        from nfab.fsutil import atomic_write_json
        from nfab.wire.registry import REDUCERS

        keys = [k.strip() for k in reducers.split(",") if k.strip()] if reducers else None
        unknown = [k for k in keys or [] if k not in REDUCERS]
        if unknown:
            raise ConfigError(f"unknown reducer(s) {', '.join(unknown)}: choose from {', '.join(REDUCERS)}")
        sizes = _world_sizes(world_sizes)
        try:
            dev = torch.device(device)
        except RuntimeError as e:
            raise ConfigError(f"--device {device!r}: {e}") from e
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"--device {device}: no CUDA device here")
        impls = [i.strip() for i in impl.split(",") if i.strip()] or ["auto"]
        if len(impls) == 1:
            rows = bench_wire(numel, reducers=keys, device=dev, impl=impls[0], world_sizes=sizes)
        else:  # side by side: each reducer timed by every path before the next reducer
            rows = [r for key in keys or list(REDUCERS) for i in impls
                    for r in bench_wire(numel, reducers=[key], device=dev, impl=i, world_sizes=sizes)]
        where = "one core" if dev.type == "cpu" else str(dev)
        paths = ",".join(dict.fromkeys(r.impl for r in rows)) or impl
        table = Table(title=f"nfab bench wire  (numel={numel:,}, {where}, {paths} path)")
        table.add_column("reducer")
        if len(impls) > 1:
            table.add_column("path")
        for w in sizes:
            table.add_column(f"W={w} enc+dec/copy", justify="right")
            table.add_column(f"W={w} bits/el", justify="right")
        by_key: dict[tuple[str, str], list] = {}
        for r in rows:
            by_key.setdefault((r.reducer, r.impl), []).append(r)
        for (key, path), rs in by_key.items():
            cells = []
            for r in rs:
                if r.capacity_ok:
                    cells += [f"{r.ratio_to_copy:.2f}x", f"{r.bits_per_element:.2f} / {r.fp32_bits_per_element:.0f}"]
                else:
                    cells += ["", "[dim]over capacity[/]"]
            table.add_row(key, *([path] if len(impls) > 1 else []), *cells)
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


def _world_sizes(text: str) -> list[int]:
    """--world-sizes as ints >= 2; a clear error otherwise."""
    from nfab.errors import ConfigError

    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(w < 2 for w in sizes):
        raise ConfigError(f"--world-sizes {text!r}: give comma-separated integers >= 2, e.g. 2,4")
    return sizes
