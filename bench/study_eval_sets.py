"""Does the study's verdict depend on which held-out windows it evaluates? Train like the study loop,
then evaluate on the first 1024 test windows (the study's), a strided 1024 and the whole test split.

    OMP_NUM_THREADS=1 PYTHONPATH=bench:. .venv/bin/python bench/study_eval_sets.py heldout fp32,profile 0

(held-out GPT, seed 0: the profile's gap is +0.82% on the study's windows, +0.96% strided,
+1.00% on all 3124: the eval set does not explain the seed-to-seed spread)."""
import json
import os
import sys

import torch
import torch.distributed as dist

from nfab.bench import studyloop
from nfab.data.loader import make_eval_loader

OUT = "/tmp/nfab-eval-sets"

@torch.no_grad()
def _eval_subsets(module, test, task, setting, rank):
    module.eval()
    n = len(test)
    subsets = {"first1024": range(min(1024, n)), "strided1024": range(0, n, max(1, n // 1024)), "all": range(n)}
    res = {}
    for name, idx in subsets.items():
        loader = make_eval_loader(torch.utils.data.Subset(test, list(idx)), batch_size=64, rank=rank,
                                  world_size=setting.world_size)
        sums = torch.zeros(3, dtype=torch.float64)
        for x, y in loader:
            logits = module(x)
            sums[0] += studyloop._loss(task, logits, y).double() * y.numel()
            sums[2] += y.numel()
        dist.all_reduce(sums)
        res[name] = float(sums[0] / sums[2])
    if rank == 0:
        os.makedirs(OUT, exist_ok=True)
        with open(f"{OUT}/{setting.name}.{_VARIANT[0]}.s{_SEED[0]}.json", "w") as f:
            json.dump({"n_test": n, **res}, f)
    return res["first1024"] * 1024, 0.0, 1024.0

_VARIANT = [""]
_SEED = [0]
_orig_train = studyloop._train

def _train(rank, setting, variant, profile, seed):
    _VARIANT[0], _SEED[0] = variant, seed
    return _orig_train(rank, setting, variant, profile, seed)

def worker(rank, *args):  # spawned: patch the study loop's evaluation in this rank, then run it
    studyloop._evaluate = _eval_subsets
    studyloop._train = _train
    studyloop._worker(rank, *args)

if __name__ == "__main__":
    import tempfile
    from pathlib import Path

    import torch.multiprocessing as mp

    from nfab.bench.study import StudyConfig
    name, variants, seed = sys.argv[1], tuple(sys.argv[2].split(",")), int(sys.argv[3])
    setting = StudyConfig().setting(name)
    prof = str(Path.cwd() / setting.profile)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(setting, variants, prof, seed, studyloop._free_port(), tmp),
                           nprocs=setting.world_size, join=True, start_method="spawn")
    for v in variants:
        print(v, open(f"{OUT}/{name}.{v}.s{seed}.json").read())
