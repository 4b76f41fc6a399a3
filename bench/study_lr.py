"""One study setting's variant at scaled learning rates, in the study's own user loop (seed 0).

    OMP_NUM_THREADS=1 .venv/bin/python bench/study_lr.py SETTING VARIANT FACTORS

e.g. `bench/study_lr.py heldout2 bq2 1.1,1.2` and `bench/study_lr.py heldout2 fp32 0.9,1.2`:
the README's evidence that block-scaled rounding under AdamW acts like a lower learning rate
(the noise inflates Adam's second moment; `nfab/runtime/moment.py`).
"""
import dataclasses
import sys
from pathlib import Path

from nfab.bench.study import StudyConfig
from nfab.bench.studyloop import run_variants

if __name__ == "__main__":  # spawned ranks re-import this file: run only in the parent
    name, variant = sys.argv[1], sys.argv[2]
    base = StudyConfig().setting(name)
    for factor in map(float, sys.argv[3].split(",")):
        setting = dataclasses.replace(base, lr=base.lr * factor)
        (row,) = run_variants(setting, (variant,), seed=0, root=Path.cwd())
        print(name, variant, "lr x", factor, row.eval_loss, row.ratio, flush=True)
