"""`nfab inspect` at scale: the cheapest exact sign path for a 1.3B GPT at W = 8 and 512, and --json."""

import json
import subprocess
import sys

import pytest
from inprocess import nfab_main
from typer.testing import CliRunner

from nfab.cli.app import app
from nfab.inspect import inspect_model
from nfab.models import build_model
from nfab.profile.schema import Profile
from nfab.wire.cost import default_cost_model


@pytest.fixture(scope="module")
def gpt13b():
    return build_model("gpt", device="meta", size="1.3b")


@pytest.mark.parametrize("world_size,at_least", [(8, 10.0), (512, 5.0)])
def test_sign_at_scale_beats_fp32_ddp(gpt13b, world_size, at_least):
    res = inspect_model("gpt", gpt13b.module, Profile.static("sign"), world_size, explicit=True,
                        cost_model=default_cost_model(world_size), head_modules=gpt13b.head_modules)
    assert res.ratio >= at_least
    assert set(res.route_bytes) == {"signscatter"}  # the cheapest exact sign path at these W
    assert [lv.world_size for lv in res.levels] == [world_size]
    assert res.levels[0].wire_bytes == res.wire_bytes


def test_json_writes_what_the_table_shows(tmp_path):
    path = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["inspect", "gpt", "--size", "1.3b", "--world-size", "8", "--route", "sign",
                                      "--json", str(path)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    data = json.loads(path.read_text())
    assert f"{data['wire_bytes'] / 1e6:.2f} MB sent" in result.output
    assert f"{data['ratio']:.1f}x fewer bytes" in result.output
    assert data["world_size"] == 8 and data["crossovers"][0] == {"from_world_size": 2, "cheapest": "signgather"}
    shown = [line for line in result.output.splitlines() if "signscatter" in line and "yes" in line]
    assert shown and any(c["reducer"] == "signscatter" and c["ok"] for c in data["capacity"])
    assert sum(b["wire_bytes"] for b in data["buckets"]) == pytest.approx(data["wire_bytes"])


def test_two_level_plan_shows_both_levels_and_checks_capacity_at_w_nodes(gpt13b):
    res = inspect_model("gpt", gpt13b.module, Profile.static("q8"), 512, explicit=True,
                        cost_model=default_cost_model(512), head_modules=gpt13b.head_modules, hierarchy=(64, 8))
    assert [(lv.level, lv.world_size) for lv in res.levels] == [("node-local", 8), ("across nodes", 64),
                                                                ("all ranks", 512)]
    assert sum(lv.wire_bytes for lv in res.levels) == pytest.approx(res.wire_bytes)
    assert set(res.route_bytes) == {"q8"}  # q8 is over capacity at W=512 flat, exact at W = 64 nodes
    assert next(c for c in res.capacity if c.route == "q8").ok
    across = res.levels[1].wire_bytes
    assert res.slow_link_bytes == pytest.approx(8 * across)
    assert res.slow_link_ratio > 3.5 > res.ratio  # the slow link gains; the fast one carries fp32


def test_hierarchy_json_writes_what_the_table_shows(tmp_path):
    path = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["inspect", "gpt", "--size", "1.3b", "--world-size", "512", "--route", "sign",
                                      "--hierarchy", "64x8", "--json", str(path)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    data = json.loads(path.read_text())
    assert data["hierarchy"] == {"nodes": 64, "local_world": 8}
    for lv in data["levels"]:
        assert f"{lv['wire_bytes'] / 1e6:.2f}" in result.output
    assert f"{data['slow_link_bytes_per_node'] / 1e6:.2f} MB vs FP32 DDP" in result.output
    assert f"{data['slow_link_ratio']:.1f}x fewer bytes" in result.output
    assert f"{data['ratio']:.1f}x fewer bytes" in result.output


BAD_HIERARCHY = ["inspect", "gpt", "--size", "nano", "--world-size", "512", "--hierarchy"]


@pytest.mark.parametrize("bad", ["63x8", "2y", "auto", "0"])
def test_a_bad_hierarchy_is_one_line_and_exit_2(bad):
    res = nfab_main(*BAD_HIERARCHY, bad)  # the console entry in this process (tests/inprocess.py)
    assert res.code == 2, res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_a_bad_hierarchy_exits_2_from_a_real_process():
    res = subprocess.run([sys.executable, "-c", "from nfab.cli.app import main; main()", *BAD_HIERARCHY, "63x8"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_region_routes_follow_the_route_globs():
    """`*:sign,norm:fp32`: the glob beats the class, so norms go sign too; the table said fp32 for
    every region while the reducers and bytes were sign."""
    spec = build_model("resnet18", device="meta", width=8, small_input=True, num_classes=10)
    res = inspect_model("resnet18", spec.module, Profile.static("*:sign,norm:fp32"), 4, explicit=True,
                        cost_model=default_cost_model(4), head_modules=spec.head_modules)
    assert {r.region: r.route for r in res.regions}["norm"] == "sign"
    mixed = inspect_model("resnet18", spec.module, Profile.static("conv:sign,*.bias:q8"), 4, explicit=True,
                          cost_model=default_cost_model(4), head_modules=spec.head_modules)
    assert {r.region: r.route for r in mixed.regions}["conv"] == "sign"
    assert {r.region: r.route for r in mixed.regions}["norm"] == "fp32,q8"  # BatchNorm weights fp32, biases q8


def test_cost_none_plans_what_a_run_without_a_cost_model_sends():
    """`attach(cost_model=None)` / `comm.cost_model=none` run no cost gate; inspect planned only with
    one (`--cost none` was 'cannot read cost model none'), so its bytes disagreed with such a run."""
    args = ["inspect", "resnet18", "-w", "2", "--parallel", "fsdp", "--profile", "resnet18", "width=16",
            "small_input=true", "num_classes=10", "in_channels=1"]
    gated = CliRunner().invoke(app, args)
    free = CliRunner().invoke(app, [*args, "--cost", "none"])
    assert gated.exit_code == 0 and free.exit_code == 0, free.output
    assert "cost(" in gated.output and "cost(" not in free.output  # the gate kept norms FP32 only with a model
    ddp = CliRunner().invoke(app, ["inspect", "resnet18", "-w", "2", "--route", "sign", "--cost", "none"])
    assert ddp.exit_code == 0 and "none, no cost gate" in " ".join(ddp.output.split())
