"""The one user-loop harness (`bench.userloop`, from the repository root): route variants and its command line."""

from __future__ import annotations

import dataclasses

import pytest

from bench.studyspec import SETTINGS
from bench.userloop import TWO_D_REGIONS, main, parse_route, run_variants


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


@pytest.mark.world_size(2)
@pytest.mark.fsdp2
def test_the_recipe_loop_under_fsdp2(tmp_path):
    """`--parallel fsdp`: fully_shard per block, accumulation with set_requires_gradient_sync,
    clipping on DTensors. Route fp32 is plain FSDP2's reduce-scatter, so its losses are plain FSDP2's
    bit for bit; a block route sends several times fewer bytes than FSDP2's FP32 reduce-scatter."""
    setting = dataclasses.replace(SETTINGS["recipe-gpt"], parallel="fsdp", world_size=2, steps=3, eval_samples=32,
                                  data_options={"max_bytes": 200_000})
    assert setting.accum_steps > 1 and setting.grad_clip is not None
    plain, fp32, bq3 = run_variants(setting, ("fp32", "route:fp32", "route:2d=bq3"), seed=0, root=tmp_path)
    assert plain.ok and fp32.ok and bq3.ok, (plain.error, fp32.error, bq3.error)
    assert fp32.train_losses == plain.train_losses and fp32.eval_loss == plain.eval_loss
    assert len(plain.train_losses) == 3 and plain.train_losses[2] < plain.train_losses[0]
    assert plain.ratio == 1.0 and 0.999 < fp32.ratio < 1.0  # nfab adds only its 8-byte control words
    assert bq3.ratio > 4.0 and bq3.fallback_steps == 0 and bq3.train_losses != plain.train_losses


def test_bad_input_is_one_line_and_exit_2(capsys):
    assert main(["--setting", "bert"]) == 2
    assert main(["--variants", "route:2d=nonsense"]) == 2
    assert main(["--variants", "int3"]) == 2
    assert main(["--parallel", "fsdp", "--variants", "fp16"]) == 2  # FSDP2 takes no DDP comm hook
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("error:") for line in err)
