"""What a rank server loads once, so that no rank forked from it pays it again.

`nfab.distributed.fork_ranks_from_server` starts gloo ranks by forking one server process.
Importing this module in that server (it is in `nfab.distributed.PRELOAD`) imports torch,
DDP's dependencies and `nfab.api`, and runs every host codec once on a small input, so that
numba's target registries (~2 s of CPU per process) and each kernel's machine code (compiled,
or loaded from numba's disk cache) are in memory before the first fork. Measured on the
2-core machine: a forked rank's first DDP step with several lossy routes took 1.4-3.4 s
without this and is dominated by the step itself with it.

Why a module and not a function: a forkserver only imports its preload list (and Python 3.11's
ignores the caller's sys.path, so the warm-up must live in the installed package, not in
tests/). Importing it never fails: a warm-up that cannot run leaves each rank to load what it
needs itself, as before. The warm-up draws only from its own generators: a forked rank finds
torch's, numpy's and Python's global random streams as a freshly started interpreter does.
"""

from __future__ import annotations

import logging

import torch

import nfab.api  # noqa: F401 - what `nfab.attach` imports, loaded once
from nfab.wire.registry import REDUCERS

log = logging.getLogger(__name__)

try:  # FSDP2 (`fully_shard`) and its DTensor parameters, through their public modules
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
except ImportError:  # an older torch: FSDP2 tests skip or import it themselves
    pass

WARM_WORLD_SIZES: tuple[int, ...] = (2, 3, 4)
"""Lane widths and capacities depend on W; the kernels' machine code does not, but each W's
first encode builds its cached lane layouts and tables."""


def warm_host_codecs(numel: int = 3000) -> None:
    """Encode, combine and decode every registered reducer once per W on a small fp32 input,
    as W virtual ranks in this process (no process group: safe before a fork)."""
    g = torch.Generator().manual_seed(0)
    lengths = [numel // 3, numel - numel // 3]
    for world_size in WARM_WORLD_SIZES:
        xs = [torch.randn(numel, generator=g, device="cpu") for _ in range(world_size)]
        for reducer in REDUCERS.values():
            if not reducer.capacity(world_size).ok:
                continue
            gens = [torch.Generator().manual_seed(r) for r in range(world_size)]
            reducer.replay_with_locals(xs, lengths, gens)
            reducer._replay(xs, lengths, gens)  # encode, sum, decode: the hook's kernels (blockq's replays skip them)
            if not reducer.needs_shared_scale:
                views = [xs[0][: lengths[0]], xs[0][lengths[0]:]]
                reducer.encode_views(views, lengths, world_size, with_sq=reducer.reads_sq(xs[0]))


def warm_row_codecs(numel: int = 3000) -> None:
    """The FSDP2 front end's row paths (`runtime/core/rowscatter.py`) without a process group: the
    block codes, the per-row packing, the owner's sums and the decode, compiled once here."""
    x = torch.randn(2 * numel, generator=torch.Generator().manual_seed(1))
    lengths = [numel, numel]
    for key in ("blockqscatter-bq3", "signscatter"):
        red = REDUCERS[key]
        if key == "signscatter":
            enc = red.encode(x, lengths, 2)
            red.decode(red.owner_step(red.owner_share([enc.payload, enc.payload], 0), 2), enc.scales[:1],
                       lengths[0], lengths[:1], 2)
            continue
        codes = red.agree_input(red.local_scale(x, lengths))
        enc = red.encode(x, lengths, 2, codes, torch.Generator().manual_seed(2))
        red.owner_step(red.owner_share([enc.payload, enc.payload], 0), 2)


try:
    warm_host_codecs()
    warm_row_codecs()
except Exception as exc:  # noqa: BLE001 - a warm-up only: a rank loads what it needs itself
    log.debug("rank server warm-up skipped: %s", exc)
