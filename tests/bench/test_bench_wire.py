"""`nfab bench wire`: the library rows, the JSON schema, and the CLI (no timing assertions)."""

import json

from typer.testing import CliRunner

from nfab.bench.wire import WORLD_SIZES, bench_wire, write_rows
from nfab.cli.app import app
from nfab.errors import ConfigError
from nfab.wire.registry import REDUCERS

KEYS = {"reducer", "world_size", "bits_per_element", "fp32_bits_per_element", "encode_decode_gbps",
        "copy_gbps", "ratio_to_copy", "capacity_ok"}


def test_rows_cover_every_reducer_and_world_size(tmp_path):
    rows = bench_wire(numel=4099, reps=1)
    assert {(r.reducer, r.world_size) for r in rows} == {(k, w) for k in REDUCERS for w in WORLD_SIZES}
    path = tmp_path / "wire.json"
    write_rows(path, rows)
    data = json.loads(path.read_text())
    assert all(KEYS <= set(d) for d in data)
    by = {(d["reducer"], d["world_size"]): d for d in data}
    sc4 = by[("signcount", 4)]
    assert sc4["bits_per_element"] <= sc4["fp32_bits_per_element"] / 10
    assert by[("allreduce-fp32", 4)]["bits_per_element"] == sc4["fp32_bits_per_element"] == 48.0
    q2 = by[("qsum-q2", 4)]
    assert not q2["capacity_ok"] and q2["bits_per_element"] is None
    assert all(d["copy_gbps"] > 0 for d in data)
    timed = [d for d in data if d["capacity_ok"]]
    assert all(d["encode_decode_gbps"] > 0 and d["ratio_to_copy"] > 0 and d["first_call_s"] > 0 for d in timed)
    assert all(d["encode_decode_gbps"] is None for d in data if not d["capacity_ok"])


def test_cli_prints_table_and_writes_json(tmp_path):
    path = tmp_path / "out.json"
    result = CliRunner().invoke(app, ["bench", "wire", "--numel", "2048", "--json", str(path)])
    assert result.exit_code == 0, result.output
    assert "nfab bench wire" in result.output
    assert len(json.loads(path.read_text())) == len(REDUCERS) * len(WORLD_SIZES)


def test_cli_times_only_the_named_reducers_and_rejects_unknown_ones(tmp_path):
    path = tmp_path / "out.json"
    result = CliRunner().invoke(app, ["bench", "wire", "--numel", "2048", "--reducers", "signgather,qsum-q8",
                                      "--json", str(path)])
    assert result.exit_code == 0, result.output
    assert {d["reducer"] for d in json.loads(path.read_text())} == {"signgather", "qsum-q8"}
    bad = CliRunner().invoke(app, ["bench", "wire", "--reducers", "nope"])
    assert isinstance(bad.exception, ConfigError) and "nope" in str(bad.exception)  # `main` makes it exit 2


def test_cli_times_several_paths_side_by_side(tmp_path):
    """`--impl host,torch`: every named reducer by each path, in one table and one JSON."""
    path = tmp_path / "out.json"
    result = CliRunner().invoke(app, ["bench", "wire", "--numel", "2048", "--reducers", "signgather,blockq-bq3",
                                      "--impl", "host,torch", "--world-sizes", "2", "--json", str(path)])
    assert result.exit_code == 0, result.output
    rows = json.loads(path.read_text())
    assert [(d["reducer"], d["impl"]) for d in rows] == [("signgather", "host"), ("signgather", "torch"),
                                                         ("blockq-bq3", "host"), ("blockq-bq3", "torch")]
    assert "host,torch" in result.output
