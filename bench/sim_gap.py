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
from nfab.profile.schema import Profile


def gap_at(profile: Profile, seed: int, extra: dict) -> dict:
    cal = profile.provenance["calibrated"]
    o = cal["optimizer"]
    over = {"optim.name": o["name"], "optim.lr": o["lr"], "optim.weight_decay": o["weight_decay"],
            "optim.betas": list(o["betas"]), "schedule.name": cal["schedule"]["name"],
            "schedule.warmup_steps": cal["schedule"]["warmup_steps"], "batch_size": cal["batch_size"],
            "seed": seed, **{f"model.{k}": v for k, v in cal["model_options"].items()},
            **{f"data.{k}": v for k, v in cal["data_options"].items()}, **extra}
    cfg = make_config(cal["model"], dataset=cal["dataset"], steps=cal["steps"], world_size=cal["world_size"],
                      overrides=over)
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
