"""Route names: the user's vocabulary for how a region's gradient travels.

`fp32`, `bf16`, `fp16` (plain all-reduce, `nfab.wire.lowp`), `q8`, `q4`, `q2` (exact qsum,
`nfab.wire.qsum`), `sign` (`nfab.wire.sign`) and the block-scaled `BLOCK_ROUTES`
(`nfab.wire.blockq`). `nfab.wire.registry.candidates` maps a route to the reducers that carry it.
"""

from __future__ import annotations

BLOCK_ROUTES: tuple[str, ...] = ("bq8", "bq4", "bq3", "bl6", "bl5", "bq2", *(
    f"bq{bits}-{block}" for block in (128, 256) for bits in (8, 4, 3, 2)))
"""Block-scaled qsum (`nfab.wire.blockq`), dearest first: `bq<bits>` = 2^bits levels per rank (`bq2` = 4
levels, `bq3` = 8), one agreed scale per 64 elements; `bl5`, `bl6` = 5 and 6 levels ("block-scaled,
5/6 levels", 64-element blocks only); `bq4-128` = 16 levels, 128-element blocks."""
ROUTES: tuple[str, ...] = ("fp32", "bf16", "fp16", "q8", "q4", "q2", "sign", *BLOCK_ROUTES)
"""Every route a profile or a user may name, cheapest-last is NOT implied."""
