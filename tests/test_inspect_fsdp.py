"""`nfab inspect --parallel fsdp`: FSDP2's reduce-scatter per fully_shard unit, on paper (meta device).

That the paper matches what nfab's FSDP2 front end sends is checked on a real run:
tests/train/test_train_fsdp.py compares its metrics with `inspect_fsdp`.
"""

import json

import pytest
from typer.testing import CliRunner

from nfab.cli.app import app
from nfab.errors import ConfigError
from nfab.inspect_fsdp import WORD_BYTES, inspect_fsdp
from nfab.models import build_model
from nfab.profile.schema import Profile


@pytest.fixture(scope="module")
def gpt13b():
    return build_model("gpt", device="meta", size="1.3b")


def _plan(spec, route, world_size):
    return inspect_fsdp("gpt", spec.module, Profile.static(route), world_size, explicit=True,
                        shard_units=spec.shard_units, head_modules=spec.head_modules)


def test_units_are_the_blocks_then_the_root(gpt13b):
    res = _plan(gpt13b, "fp32", 8)
    assert [u.unit for u in res.units] == [*gpt13b.shard_units, "(root)"]
    assert sum(u.elements for u in res.units) == res.total_params  # every parameter once (the tied head too)
    # route fp32 is FSDP2's own reduce-scatter: its bytes plus one control word per unit
    assert res.wire_bytes == pytest.approx(res.fp32_bytes + len(res.units) * WORD_BYTES * 7 / 8)
    assert res.bf16_bytes == res.fp32_bytes / 2
    assert res.fp32_bytes == pytest.approx(7 / 8 * 4 * res.total_params, rel=1e-4)  # (W-1)/W, padding aside


def test_low_bit_routes_at_w8(gpt13b):
    sign, bq2 = _plan(gpt13b, "sign", 8), _plan(gpt13b, "bq2", 8)
    assert 7.9 < sign.fp32_bytes / sign.wire_bytes <= 8.0  # 4-bit count lanes at W=8, plus scales
    assert bq2.fp32_bytes / bq2.wire_bytes >= 14.0 and set(bq2.route_bytes) == {"bq2"}


def test_cli_prints_the_plan_and_refuses_an_unknown_wrapper(tmp_path):
    out = tmp_path / "plan.json"
    res = CliRunner().invoke(app, ["inspect", "gpt", "--size", "nano", "--parallel", "fsdp", "-w", "8",
                                   "--route", "bq2", "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["ratio_fp32"] == pytest.approx(doc["fp32_bytes"] / doc["wire_bytes"]) and doc["ratio_fp32"] > 10
    bad = CliRunner().invoke(app, ["inspect", "gpt", "--parallel", "zero"])
    assert isinstance(bad.exception, ConfigError)  # `nfab` (main) prints it as one line, exit 2


def test_units_name_what_the_cost_gate_kept_fp32():
    """On a link where one more collective's latency outweighs the bytes, a profile's block route is
    priced dearer than FP32's reduce-scatter: the plan said so nowhere (it showed fp32 bytes only)."""
    from nfab.wire.cost import CostModel, LinkCost

    spec = build_model("gpt", device="meta", size="nano")
    fast = CostModel("gloo", 2, LinkCost(1e-3, 1e12), LinkCost(1e-3, 1e12))
    res = inspect_fsdp("gpt", spec.module, Profile.static("bq2"), 2, explicit=False, shard_units=spec.shard_units,
                       cost_model=fast, head_modules=spec.head_modules)
    assert all("cost(" in u.fallbacks for u in res.units) and set(res.route_bytes) == {"fp32"}
    assert "cost(" in res.to_dict()["units"][0]["fallbacks"]
    kept = _plan(spec, "bq2", 2)  # an explicit route is honoured as asked
    assert all(u.fallbacks == "" for u in kept.units)
