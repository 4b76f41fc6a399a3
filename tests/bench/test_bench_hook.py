"""`nfab bench hook`: the variants run side by side, the breakdown is complete, the CLI writes JSON."""

import json

import pytest
from typer.testing import CliRunner

from nfab.bench import hook as hook_mod
from nfab.bench import step as step_mod
from nfab.cli.app import app

PHASES = {"plan", "norm", "encode", "launch", "decode", "fold", "hook_cpu"}


@pytest.mark.world_size(2)
def test_cli_runs_every_hook_variant_and_writes_json(tmp_path):
    path = tmp_path / "hook.json"
    args = ["bench", "hook", "--width", "8", "--batch", "4", "--steps", "3", "--warmup", "2", "--json", str(path)]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert "nfab bench hook" in result.output and "hook_cpu" in result.output and "decode" in result.output
    doc = json.loads(path.read_text())
    assert [r["variant"] for r in doc["rows"]] == list(hook_mod.HOOK_VARIANTS)
    assert all(r["steps"] == 3 and r["median_ms"] > 0 for r in doc["rows"])
    assert all(r["ratio_to_floor"] is None for r in doc["rows"])  # no floor variant here
    assert doc["nfab"]["nfab-fp32"]["route_mix"] == {"fp32": 1.0}
    parts = doc["breakdown_ms_per_step"]
    phases = parts["phases_ms_per_step"]
    assert set(phases) == {"nfab-fp32", "nfab-sign"}
    for variant, ms in phases.items():
        assert set(ms) == PHASES, variant  # the hook's own phases, as the Runtime timed them
        assert all(v >= 0 for v in ms.values())
        # the phases partition the hook's CPU time (medians of parts need not add up exactly)
        assert ms["hook_cpu"] > 0 and max(ms[k] for k in PHASES - {"hook_cpu"}) <= ms["hook_cpu"] * 1.5
    assert parts["allreduce"] > 0
    assert parts["buckets"] == len(parts["bucket_numel"]) >= 1
    assert sum(parts["bucket_numel"]) == doc["parameters"]
    assert doc["config"] == step_mod.BenchConfig.from_dict(doc["config"]).to_dict()
