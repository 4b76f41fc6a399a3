"""Block-scaled qsum's replay for W virtual ranks in one pass (calibration replays every step here).

Bit for bit what W encodes, the lanes' SUM and the decode give (`tests/wire/test_blockq.py`), in
far fewer passes; split from `reducer.py` to keep that module readable.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from nfab.wire import noise
from nfab.wire.blockq.grid import block_index


def summed(xs: Sequence[torch.Tensor], lengths: Sequence[int] | None, gens: list, block: int, steps: int,
           element_scales: Callable[[torch.Tensor, Sequence[int]], torch.Tensor],
           with_locals: bool = True) -> tuple[torch.Tensor, list[torch.Tensor | None]] | None:
    """`replay_with_locals`'s values, bit for bit, in far fewer passes (calibration replays every
    step of its validation run through here): the W ranks' block maxima, scales and noise hash are
    computed once (the strata share one key per segment and differ only in the shift), the
    ranks' levels are rounded as one W x n tensor, and their integer sum is decoded directly --
    what the lanes' SUM yields exactly, since no lane carries (capacity). None when the inputs
    fall outside that case (other key sources, non-finite values): the generic path runs.
    `block`, `steps` and `element_scales` are the reducer's (`BlockQSum`)."""
    w = len(xs)
    keys = gens[0].source if gens and isinstance(gens[0], noise.Stratum) else None
    if (not isinstance(keys, torch.Tensor) or len(gens) != w
            or any(not isinstance(g, noise.Stratum) or g.source is not keys or g.rank != r or g.world_size != w
                   for r, g in enumerate(gens))):
        return None
    flat = torch.stack([x.reshape(-1).to(torch.float32) for x in xs])  # W x n
    n = flat.shape[1]
    lengths = [n] if lengths is None else list(lengths)
    absmax = flat.abs().amax(0)
    if n == 0 or not math.isfinite(float(absmax.max())):  # NaN and inf propagate: one check for every rank
        return None
    bid, nblocks = block_index(tuple(lengths), block, flat.device)
    block_max = torch.zeros(nblocks, dtype=torch.float32, device=flat.device)
    block_max.scatter_reduce_(0, bid, absmax, "amax", include_self=True)  # = MAX over ranks of their maxima
    scale = element_scales(block_max, lengths)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    m = steps
    t = torch.div(flat, safe)
    t.add_(1.0).mul_(0.5 * m)  # level coordinate in [0, m], as `encode`
    u = noise.strata_uniform(keys.to(flat.device), tuple(lengths), tuple(g.shift for g in gens))
    levels = t.add_(u).floor_().clamp_(0, m)  # W x n, whole numbers in [0, m] as float32
    total = levels.sum(0)  # exact: small whole numbers
    mean = total.mul_(2.0 / (m * w)).sub_(1.0).mul_(scale)  # values[sum] of `decode`, times the scales
    if not with_locals:
        return mean, [None] * w
    locals_ = levels.mul_(2.0 / m).sub_(1.0).mul_(scale)  # unit[levels] * scale of `encode`'s local
    return mean, list(locals_.unbind(0))
