"""Launches per bucket on the torch path (what a GPU runs): as many for a bucket of 60 parameters
as for one of 20 (`nfab.bench.launches`, counted on CPU).

One launch per segment made a bucket of 62 small parameters (resnet18's) cost 50-240 ops per step
on qsum, blockq and blockqscatter.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from nfab.bench.launches import bucket_lengths, count_launches
from nfab.cli.app import app
from nfab.errors import ConfigError
from nfab.wire.registry import REDUCERS

ROUTES = ["signgather", "signcount", "signscatter", "qsum-q8", "qsum-q4", "qsum-q2", "blockq-bq3", "blockq-bq2",
          "blockq-bq4", "blockq-bl5", "blockqscatter-bq3", "blockqscatter-bq4", "blockqscatter-bl5"]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", ROUTES)
def test_launches_per_bucket_do_not_grow_with_its_parameters(name, world_size):
    red = REDUCERS[name]
    if not red.capacity(world_size).ok:
        pytest.skip("over capacity")
    few, many = (count_launches(red, bucket_lengths(k, seed), world_size) for k, seed in ((20, 1), (60, 2)))
    assert few.total == many.total, f"20 segments: {few}; 60 segments: {many}"
    assert many.total > 0, "the counter saw no op"


def test_bench_launches_writes_its_counts_and_refuses_bad_input(tmp_path):
    path = tmp_path / "launches.json"
    result = CliRunner().invoke(app, ["bench", "launches", "--reducers", "qsum-q8", "--world-sizes", "2",
                                      "--segments", "1,20", "--json", str(path)])
    assert result.exit_code == 0, result.output
    rows = json.loads(path.read_text())["rows"]
    assert [(r["segments"], r["launches"] > 0) for r in rows] == [(1, True), (20, True)]
    for bad in (["--segments", "0"], ["--reducers", "nope"], ["--world-sizes", "1"]):
        out = CliRunner().invoke(app, ["bench", "launches", *bad])
        assert isinstance(out.exception, ConfigError), out.output  # `main` makes it one line and exit 2
