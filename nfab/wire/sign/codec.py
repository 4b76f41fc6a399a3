"""The sign codec's torch reference: one vote per element (x > 0; an exact zero by `tie`),
this rank's own decoded votes, and the table from a count of positive votes to the decoded value.

Also the trit packing of signscatter's even-W majority (`pack_trits`). Runs on any device; the
compiled CPU path (`nfab.wire.sign.host`, through `nfab.wire.sign.ops`) gives the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import numpy as np
import torch

from nfab.wire.segments import scale_segments_


def sign_bits(x: torch.Tensor, tie: int = 0) -> torch.Tensor:
    """One vote per element: True where x > 0, False where x < 0 or NaN; an exact zero (+0.0 or
    -0.0) votes True when `tie` is even, False when it is odd.

    Why: one bit cannot abstain. signSGD's x >= 0 sends every zero as a positive vote, so a
    gradient that is exactly zero on every rank (an embedding row no token used, a padding row,
    a parameter DDP's `find_unused_parameters` left at zero) decoded to +scale each step and
    moved the weight with no gradient. The hook passes tie = group rank + step: at even W half the
    ranks' zeros vote each way, so where every rank holds a zero the count ties (decoded 0); at odd
    W the one vote left over changes sign from step to step. (A tie by element position as well
    would decorrelate neighbours at odd W, but it cost the compiled vote kernel 3.7x: an index per
    element.)
    """
    positive = tie % 2 == 0  # then a zero (+-0.0) votes as x >= 0 does, else as x > 0 does
    return x >= 0 if positive else x > 0


@cache
def _unit_sign_table() -> np.ndarray:
    """256 entries: 8 packed vote bits -> their 8 fp32 values (+1 / -1) as one void item."""
    bits = (np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1
    return np.ascontiguousarray(np.where(bits == 1, 1.0, -1.0).astype(np.float32)).view("V32").reshape(-1)


def sign_values(bits: torch.Tensor, scales: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """This rank's own decoded contribution: +scale where the vote is positive, else -scale."""
    local = torch.where(bits.reshape(-1), 1.0, -1.0).to(torch.float32)
    return scale_segments_(local, scales, lengths)


def sign_values_packed(packed: np.ndarray, n: int, scales: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """`sign_values` from votes packed 1 bit per element (little-endian bit order), on CPU
    only (the CPU encoders' path: it reads the scale on the host)."""
    lengths = list(lengths)
    out = np.empty(packed.size * 8, dtype=np.float32)
    table = _unit_sign_table()
    if len(lengths) == 1:  # fold the one scale into the table: fl(+-1 * s) either way
        table = (table.view(np.float32) * scales.reshape(-1)[0].item()).astype(np.float32).view("V32")
        np.take(table, packed, mode="clip", out=out.view("V32"))
        return torch.from_numpy(out)[:n]
    np.take(table, packed, mode="clip", out=out.view("V32"))
    return scale_segments_(torch.from_numpy(out)[:n], scales, lengths)


def vote_table(world_size: int, vote: str, device: torch.device | None = None) -> torch.Tensor:
    """Decode table from a positive count c in [0, W] to a vote value.

    `majority`: sign(2c - W), a tie (even W, c = W/2) decodes to 0.
    `mean`: (2c - W) / W, the average of the ranks' +-1 votes.
    """
    c = torch.arange(world_size + 1, dtype=torch.float32, device=device)
    diff = 2 * c - world_size
    if vote == "majority":
        return torch.sign(diff)
    if vote == "mean":
        return diff / world_size
    raise ValueError(f"unknown vote {vote!r}: use 'majority' or 'mean'")


TRITS_PER_BYTE = 5  # 3**5 = 243 <= 256
TRIT_GROUP_BYTES = 8  # a group of 40 trits: 8 bytes, one int64 word (see `nfab.wire.sign.scatter`)


def _pow3(device: torch.device) -> torch.Tensor:
    """3**0..3**4 as int32 on `device`, computed there (no host-to-device copy)."""
    return torch.pow(3, torch.arange(TRITS_PER_BYTE, dtype=torch.int32, device=device))


def pack_trits(trits: torch.Tensor) -> torch.Tensor:
    """Values in {0, 1, 2} (length a multiple of 40) -> trit bytes: in each group of 40 values and 8
    bytes, byte e = sum over k of value (8k + e) times 3**k (signscatter's trit order)."""
    grid = trits.reshape(-1, TRITS_PER_BYTE, TRIT_GROUP_BYTES).to(torch.int32)
    weights = _pow3(trits.device).view(1, -1, 1)
    return (grid * weights).sum(1).reshape(-1).to(torch.uint8)


def unpack_trits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of `pack_trits`: the first `numel` digits (int32)."""
    weights = _pow3(packed.device).view(1, -1, 1)
    digits = (packed.to(torch.int32).reshape(-1, 1, TRIT_GROUP_BYTES) // weights) % 3
    return digits.reshape(-1)[:numel]
