"""Shared test setup: one thread per process (2 cores, several gloo ranks), ranks forked from one server.

The suite starts hundreds of `run_ranks` ranks; forked from a server that imported torch and
nfab once and ran every host codec once (`nfab.rankserver`), each starts in a fraction of a
second instead of seconds of interpreter, torch, DDP and numba start-up
(nfab.distributed.fork_ranks_from_server).
"""

import sys

import torch

from nfab.distributed import PRELOAD, fork_ranks_from_server

torch.set_num_threads(1)
fork_ranks_from_server(PRELOAD)

FRAMEWORKS = ("lightning.pytorch", "pytorch_lightning", "transformers.trainer")
"""Trainer frameworks whose ranks run in tests/integrations: importing one costs a rank 1-3 s of CPU."""


def pytest_collection_finish(session) -> None:  # noqa: ANN001 - pytest's hook
    """The server starts at the first rank, after collection: it also imports the frameworks the
    collected test modules imported, once, so that their ranks do not each import them again."""
    fork_ranks_from_server(PRELOAD + tuple(name for name in FRAMEWORKS if name in sys.modules))
