"""Shared test setup: one thread per process (2 cores, several gloo ranks), ranks forked from one server.

The suite starts hundreds of `run_ranks` ranks; forked from a server that imported torch and
nfab once and ran every host codec once (`nfab.rankserver`), each starts in a fraction of a
second instead of seconds of interpreter, torch, DDP and numba start-up
(nfab.distributed.fork_ranks_from_server).
"""

import pytest
import torch

from nfab.distributed import PRELOAD, fork_ranks_from_server
from nfab.runtime.frontends import fsdp2

torch.set_num_threads(1)
fork_ranks_from_server(PRELOAD)

_TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
collect_ignore_glob: list[str] = []
if not fsdp2.supported():  # a torch before 2.9 (`make compat TORCH=2.4.1`): nfab trains DDP only
    collect_ignore_glob += ["fsdp/*", "train/test_train_fsdp.py", "test_inspect_fsdp.py",
                            "bench/test_bench_fsdpstep.py"]
if _TORCH < (2, 6):  # Transformers 5 builds no model on it (nfab's integration is not what fails)
    collect_ignore_glob += ["integrations/test_transformers_dist.py"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the tests marked `fsdp2` on a torch without nfab's FSDP2 front end, with the reason."""
    why = fsdp2.unsupported()
    if why is None:
        return
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if "fsdp2" in item.keywords:
            item.add_marker(skip)
