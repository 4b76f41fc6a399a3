"""Shared test setup: one thread per process (2 cores, several gloo ranks), ranks forked from one server.

The suite starts hundreds of `run_ranks` ranks; forked from a server that imported torch and
nfab once and ran every host codec once (`nfab.rankserver`), each starts in a fraction of a
second instead of seconds of interpreter, torch, DDP and numba start-up
(nfab.distributed.fork_ranks_from_server).
"""

import torch

from nfab.distributed import PRELOAD, fork_ranks_from_server
from nfab.runtime.frontends import fsdp2

torch.set_num_threads(1)
fork_ranks_from_server(PRELOAD)

if not fsdp2.supported():  # a torch before 2.9 (`make compat TORCH=2.4.1`): nfab trains DDP only
    collect_ignore_glob = ["fsdp/*", "train/test_train_fsdp.py", "test_inspect_fsdp.py",
                           "bench/test_bench_fsdpstep.py"]
