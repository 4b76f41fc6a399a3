"""The calibration simulator's gap for a fixed profile over several seeds: is validation's verdict
biased against the user loop (`nfab bench study`), or only noisy?

    OMP_NUM_THREADS=1 .venv/bin/python bench/sim_gap.py PROFILE SEEDS [key=value ...]

For each seed it rebuilds the profile's calibrated setting (provenance.calibrated) at that seed,
runs the FP32 reference and the profile over the whole window, exactly as validation does (one
round, no tightening), and prints validation's gap (averaged over the last quarter's evals) and
the gap at the end alone (what the study compares); `eval_samples=1024` (say) evaluates on
as many samples as the study. Prints one JSON line per seed, then the mean and sd.
"""
import json
import statistics
import sys

from nfab.calibrate import make_config
from nfab.calibrate.config import parse_overrides
from nfab.calibrate.task import Task
from nfab.calibrate.trajectory import eval_points, run_reference, run_schedule
from nfab.calibrate.validate import final_gap, loss_floor, segments_of
from nfab.config.calibrated import profile_base
from nfab.profile.schema import Profile


def calibrated_config(profile: Profile, seed: int, extra: dict):
    """The profile's calibrated setting (what `nfab train --profile` reproduces, `profile_base`) as
    a calibration at `seed`, at the calibrated W, with `extra` key=value overrides over it."""
    base = profile_base(profile, "")
    over = {f"{section}.{k}": v for section, d in base.items() if section != "comm" and isinstance(d, dict)
            for k, v in d.items() if not (section == "model" and k == "name")}
    over.update(steps=base["steps"], seed=seed, **extra)
    cal = profile.provenance["calibrated"]
    return make_config(base["model"]["name"], dataset=base["data"]["name"], world_size=cal["world_size"],
                       overrides=over)


def gap_at(profile: Profile, seed: int, extra: dict) -> dict:
    cfg = calibrated_config(profile, seed, extra)
    task = Task(cfg)
    ref = run_reference(task)
    steps = cfg.steps
    run = run_schedule(task, ref.checkpoints[0], 0, steps, segments_of(profile, steps), seed=seed,
                       eval_at=set(eval_points(steps)), save_at=set())
    gap = final_gap(ref.eval_loss, run.eval_loss, steps, loss_floor(ref.eval_loss))
    end = (run.eval_loss[steps] - ref.eval_loss[steps]) / ref.eval_loss[steps]
    return {"seed": seed, "fp32": ref.eval_loss[steps], "profile": run.eval_loss[steps], "gap": gap, "end_gap": end}


if __name__ == "__main__":
    prof = Profile.load(sys.argv[1])
    extra = parse_overrides(sys.argv[3:])
    gaps = []
    for s in (int(x) for x in sys.argv[2].split(",")):
        r = gap_at(prof, s, extra)
        gaps.append(r["gap"])
        print(json.dumps(r), flush=True)
    sd = statistics.stdev(gaps) if len(gaps) > 1 else 0.0
    print(json.dumps({"mean_gap": statistics.fmean(gaps), "sd": sd, "seeds": len(gaps)}))
