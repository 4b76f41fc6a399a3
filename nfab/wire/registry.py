"""Reducers: aggregation paths that turn W ranks' gradients into their mean.

Each reducer is split into pure steps so the hook runtime can batch and overlap them:

    encode (local, pure) -> one payload collective (async) -> decode (pure)

plus a per-segment scale vector that the runtime averages across ranks in its control
word. `reduce` runs the whole path on a real process group; `replay` runs the same
arithmetic for W virtual ranks in one process (calibration). For the integer paths
(`signcount`, `signgather`, `qsum`) the payload sum is exact, so replay is bit-identical
to the real reduction.

Wire bytes count what each rank sends under the collective's algorithm: ring all-reduce
sends 2(W-1)/W of its payload, reduce-scatter (W-1)/W, all-gather (W-1)/W of W payloads.
"""
from __future__ import annotations

import torch

from nfab.wire import routes
from nfab.wire.blockq.reducer import BlockQSum, block_reducers
from nfab.wire.blockq.scatter import BlockQScatter, scatter_reducers
from nfab.wire.contract import (  # re-exported: the reducer contract lives in reducer.py
    Capacity,
    Encoded,
    Reducer,
    all_gather_flat,
    allgather_factor,
    allreduce_factor,
    gather_scales,
    mean_of_ranks,
)
from nfab.wire.lowp import AllReduce
from nfab.wire.qsum.reducer import QSum
from nfab.wire.sign.reducers import SignCount, SignGather
from nfab.wire.sign.scatter import SignScatter

__all__ = [
    "REDUCERS", "AllReduce", "BlockQScatter", "BlockQSum", "Capacity", "Encoded", "QSum", "Reducer", "SignCount",
    "SignGather", "SignScatter",
    "all_gather_flat", "allgather_factor", "allreduce_factor", "candidates", "gather_scales", "mean_of_ranks",
]


REDUCERS: dict[str, Reducer] = {
    "allreduce-fp32": AllReduce(torch.float32),
    "allreduce-bf16": AllReduce(torch.bfloat16),
    "allreduce-fp16": AllReduce(torch.float16),
    "signcount": SignCount(),
    "signgather": SignGather(),
    "signscatter": SignScatter(),
    "qsum-q8": QSum(8),
    "qsum-q4": QSum(4),
    "qsum-q2": QSum(2),
    **block_reducers(),  # blockq-bq3, blockq-bq4-128, ...
    **scatter_reducers(block_reducers()),  # blockqscatter-bq3, ...: the same bits, fewer bytes
}


def candidates(route: str) -> list[Reducer]:
    """Reducers that can carry a route; `sign` has three, block routes two (chosen by cost and capacity)."""
    if route == "fp32":
        return [REDUCERS["allreduce-fp32"]]
    if route in ("bf16", "fp16"):
        return [REDUCERS[f"allreduce-{route}"]]
    if route in ("q8", "q4", "q2"):
        return [REDUCERS[f"qsum-{route}"]]
    if route in routes.BLOCK_ROUTES:
        # the same bits either way; blockq first: replay takes the first with capacity (its fast replay)
        return [REDUCERS[f"blockq-{route}"], REDUCERS[f"blockqscatter-{route}"]]
    if route == "sign":
        return [REDUCERS["signgather"], REDUCERS["signcount"], REDUCERS["signscatter"]]
    raise ValueError(f"unknown route {route!r}; routes are {', '.join(routes.ROUTES)}")
