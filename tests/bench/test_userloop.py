"""The one user-loop harness (`bench.userloop`, from the repository root): route variants and its command line."""

from __future__ import annotations

import dataclasses

import pytest

from bench.userloop import TWO_D_REGIONS, main, parse_route, run_variants
from nfab.bench.studyspec import SETTINGS


def test_route_grammar():
    assert parse_route("sign") == "sign"
    assert parse_route("2d=bq3") == {r: "bq3" for r in TWO_D_REGIONS}
    assert parse_route("2d=bq4,norm=bf16") == {**{r: "bq4" for r in TWO_D_REGIONS}, "norm": "bf16"}


@pytest.mark.world_size(2)
def test_a_route_variant_trains_the_held_out_model(tmp_path):
    """`route:2d=bq4`: block-scaled qsum on the 2-D weights, the rest FP32, in the study's own loop."""
    setting = dataclasses.replace(SETTINGS["heldout"], world_size=2, steps=3, eval_samples=32,
                                  data_options={"max_bytes": 200_000})
    fp32, bq4 = run_variants(setting, ("fp32", "route:2d=bq4"), seed=0, root=tmp_path)
    assert fp32.ok and bq4.ok, (fp32.error, bq4.error)
    assert bq4.ratio > 2.0 and bq4.fallback_steps == 0
    assert bq4.eval_loss < 1.5 * fp32.eval_loss  # three steps from the same init: no blow-up


def test_bad_input_is_one_line_and_exit_2(capsys):
    assert main(["--setting", "bert"]) == 2
    assert main(["--variants", "route:2d=nonsense"]) == 2
    assert main(["--variants", "int3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error:") for line in err)
