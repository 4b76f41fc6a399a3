"""The compiled kernels' first-call cost: encode and decode a 65,536-element tensor through
signcount, signgather, signscatter and qsum-q8 at W = 2, 4, 8, 16, and print the process's CPU
seconds (torch import included). Run it twice with one fresh numba cache directory: the first
run compiles every kernel, the second loads them from the cache.

    D=$(mktemp -d)
    for i in 1 2; do NUMBA_CACHE_DIR=$D OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python bench/kernels_cold.py; done
"""
import time

t0 = time.process_time()
import torch  # noqa: E402

from nfab.wire.cost import codec_work  # noqa: E402
from nfab.wire.reducers import REDUCERS  # noqa: E402

torch.set_num_threads(1)
x = torch.randn(1 << 16)
for key in ("signcount", "signgather", "signscatter", "qsum-q8"):
    for w in (2, 4, 8, 16):
        if REDUCERS[key].capacity(w).ok:
            codec_work(REDUCERS[key], x, w)()
print(f"{time.process_time() - t0:.1f} s CPU")
