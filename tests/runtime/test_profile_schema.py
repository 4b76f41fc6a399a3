"""Profile schema: round trip, validation errors that name the problem, phases over a run."""

import json

import pytest

from nfab.errors import ProfileError
from nfab.profile.schema import Phase, PhaseStart, Profile


def _doc(**over):
    d = {"schema": "nfab.profile", "version": 1, "model": {"name": "m", "signature": None},
         "phases": [{"name": "warm", "start": {"step": 0}, "routes": {"conv": "fp32"}},
                    {"name": "main", "start": {"fraction": 0.2}, "routes": {"conv": "sign", "norm": "fp32"}}]}
    d.update(over)
    return d


def test_round_trip_and_phase_lookup(tmp_path):
    p = Profile.from_dict(_doc(overrides={"*.bias": "fp32"}))
    path = p.save(tmp_path / "p.json")
    q = Profile.load(path)
    assert q == p
    assert q.phase_at(0, total_steps=100).name == "warm"
    assert q.phase_at(19, total_steps=100).name == "warm"
    assert q.phase_at(20, total_steps=100).name == "main"
    assert q.phase_at(20, total_steps=100).route_for("linear") == "fp32"  # unnamed region stays fp32


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.update(version=2), "version 2"),
    (lambda d: d.update(schema="other"), "not an nfab profile"),
    (lambda d: d.update(colour="red"), "unknown key"),
    (lambda d: d["phases"][0]["routes"].update(conv="int3"), "unknown route"),
    (lambda d: d["phases"][0]["routes"].update(tail="sign"), "unknown region"),
    (lambda d: d["phases"][0].update(start={"step": 1, "fraction": 0.1}), "exactly one"),
    (lambda d: d.update(phases=[]), "at least one phase"),
    (lambda d: d.update(health={"loss_spike_ratio": 0.5}), "loss_spike_ratio"),
    (lambda d: d.update(health={"min_fidelity_cosine": 2.0}), "min_fidelity_cosine"),  # a cosine is in [-1, 1]
    # which phase runs before the first start was a guess (the earliest ran from step 0, before its own start)
    (lambda d: d["phases"][0].update(start={"fraction": 0.3}), "no phase starts at step 0 or fraction 0"),
    (lambda d: d["phases"][1].update(name="warm"), "two phases are named 'warm'"),
    (lambda d: d["phases"][1].update(start={"step": 0}), "phases 'warm' and 'main' start at the same point"),
])
def test_bad_profiles_raise_one_clear_error(mutate, match):
    d = _doc()
    mutate(d)
    with pytest.raises(ProfileError, match=match):
        Profile.from_dict(d)


def test_load_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="bad.json.*not valid JSON"):
        Profile.load(bad)
    with pytest.raises(ProfileError, match="cannot read"):
        Profile.load(tmp_path / "missing.json")


def test_signature_mismatch_is_refused():
    p = Profile.from_dict(_doc(model={"name": "resnet18", "signature": "a" * 64}))
    with pytest.raises(ProfileError, match="another parameter layout"):
        p.check_model("resnet18", "b" * 64)
    p.check_model("resnet18", "a" * 64)


def test_static_routes():
    p = Profile.static({"conv": "sign", "layer1.*": "q8"})
    assert p.phases[0].routes == {"conv": "sign"} and p.overrides == {"layer1.*": "q8"}
    assert Phase(name="x", start=PhaseStart(step=0), routes={}).route_for("conv") == "fp32"
    assert json.loads(Profile.static("q4").to_json())["phases"][0]["routes"]["norm"] == "q4"


def test_checked_in_json_schema_is_current():
    from pathlib import Path

    from nfab.cli.profile import schema_text

    path = Path(__file__).resolve().parents[2] / "schemas" / "profile.schema.json"
    assert path.read_text() == schema_text(), "run: nfab profile schema -o schemas/profile.schema.json"
    schema = json.loads(schema_text())
    assert schema["additionalProperties"] is False and {"schema", "version", "model", "phases"} <= set(
        schema["required"])
    assert schema["$defs"]["Health"]["properties"]["probe_every"]["type"] == "integer"
