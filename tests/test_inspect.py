"""`nfab inspect` at scale: the cheapest exact sign path for a 1.3B GPT at W = 8 and 512, and --json."""

import json

import pytest
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
