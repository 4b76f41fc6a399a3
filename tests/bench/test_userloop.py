"""The user's own DDP loop (the held-out measurement harness), short."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from nfab.bench.userloop import TWO_D_REGIONS, UserLoopConfig, main, parse_route, run_user_loop


def test_route_grammar():
    assert parse_route(None) is None and parse_route("sign") == "sign"
    assert parse_route("2d=bq3") == {r: "bq3" for r in TWO_D_REGIONS}
    assert parse_route("2d=bq4,norm=bf16") == {**{r: "bq4" for r in TWO_D_REGIONS}, "norm": "bf16"}


@pytest.mark.world_size(2)
def test_short_bq_run_writes_its_artifacts(tmp_path):
    cfg = UserLoopConfig(world_size=2, steps=4, eval_every=2, max_bytes=200_000, eval_windows=64,
                         route=parse_route("2d=bq4"), health={"probe_every": 2})
    s = run_user_loop(cfg, tmp_path, timeout_s=240)
    assert s["replicas_identical"] and s["bytes_ratio"] > 2.0
    assert set(s["val_curve"]) == {2, 4} and s["val_loss"] == s["val_curve"][4] < 20
    m = pd.read_parquet(tmp_path / "metrics.parquet")
    assert list(m["step"]) == [0, 1, 2, 3]
    probed = [json.loads(c) for c in m["region_cosine"] if c != "{}"]
    assert probed and all(v > 0.6 for c in probed for v in c.values())  # bq4 stays well above the 0.5 floor
    assert json.loads((tmp_path / "summary.json").read_text())["demotions"] == 0


def test_bad_input_is_one_line_and_exit_2(capsys):
    assert main(["--out", "x", "--health", '{"bogus": 1}']) == 2
    assert main(["--out", "x", "--route", "2d=nonsense"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error:") for line in err)
