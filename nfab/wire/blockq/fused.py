"""blockq's elementwise chains fused by `torch.compile` (opt-in: `NFAB_COMPILE=1`).

Why: the torch path (what CUDA takes) runs blockq's encode as about twenty full passes over
the bucket -- the counter hash alone is a dozen int32 passes (`noise.uniform`), then the
division by the block scale, the level arithmetic and the cast -- and its decode as four.
Each is memory-bound, so eager torch runs at a few hundredths of a copy. Compiled (inductor:
C++ on the CPU, Triton on CUDA), each chain is one kernel that reads x and writes the uint8
levels, the noise computed in registers and never stored.

The two functions here are pure over a (blocks, width) view of the bucket (`grid.Piece`): a
block's per-row values (safe scale, its counter base, its key's high word) broadcast over its
row, so there is no data-dependent control flow and no host read, and one compiled graph
(`dynamic=True`) serves every bucket size. They compute the eager path's bits, op for op:

- the hash: the Weyl counter of element i of segment s is `key_lo[s] + (i - start_s + 1) * G`
  (mod 2^32); for the element at column j of a block whose first element is i0, that is the
  row's base `key_lo[s] + (i0 - start_s + 1) * G` plus `j * G`, the same word. int32 products
  wrap mod 2^32 in inductor's C++ (vectorised lanes) and Triton as in eager torch;
- the level arithmetic in the eager order, `((x / s + 1) * (M / 2) + u)`, floor, clamp: inductor
  keeps each fp32 op rounded (its C++ is built without floating-point contraction, so no
  fused multiply-add). Triton may contract a multiply and an add into an FMA on CUDA: there
  the bits are checked by `make device-check` (bench/device_check.py), not assumed.

`tests/wire/test_fused.py` (run with NFAB_COMPILE_TESTS=1: compiling costs ~1 minute on CPU)
checks both against the eager path bit for bit. Any compile error falls back to eager
(logged once) for the rest of the process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import cache, lru_cache
from typing import Any

import torch

from nfab.wire import dispatch, noise
from nfab.wire.blockq import grid

log = logging.getLogger(__name__)

_GOLDEN_I32 = noise.GOLDEN - (1 << 32)
_MIX2_I32 = noise.MIX2 - (1 << 32)


def levels_rows(x: torch.Tensor, safe: torch.Tensor, base: torch.Tensor, hi: torch.Tensor,
                shift: torch.Tensor, half_m: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Stochastically rounded levels (uint8) of a (blocks, width) view `x`: `safe` (fp32), `base`
    and `hi` (int32: the counter at the row's first element, the key's high word) are (blocks, 1)
    columns, `shift` a 1-element int32 tensor (the stratum's offset on the 24-bit grid), `half_m`
    and `m` 0-d fp32 tensors (M / 2 and M: tensors, so one graph serves every route)."""
    col = torch.arange(x.shape[1], dtype=torch.int32, device=x.device)
    c = (base + col * _GOLDEN_I32) ^ hi  # the keyed Weyl counter, wrapping mod 2^32
    c = c ^ ((c >> 16) & 0xFFFF)  # logical shifts: arithmetic ones masked (see noise._mix32_)
    c = c * noise.MIX1
    c = c ^ ((c >> 15) & 0x1FFFF)
    c = c * _MIX2_I32
    c = c ^ ((c >> 16) & 0xFFFF)
    u24 = (((c >> 8) & 0xFFFFFF) + shift) & 0xFFFFFF
    u = u24.to(torch.float32) * 2.0**-24
    t = (x.to(torch.float32) / safe + 1.0) * half_m + u
    return torch.minimum(t.floor().clamp(min=0), m).to(torch.uint8)


def unit_scaled_rows(sums: torch.Tensor, scale: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
    """(S * unit - 1) * scale (fp32) of a (blocks, width) view of W-rank sums `sums`, `scale` a
    (blocks, 1) fp32 column, `unit` the 0-d fp32 2 / (M * W): `unit_values` then `scale_blocks_`."""
    return (sums.to(torch.float32) * unit - 1.0) * scale


@lru_cache(maxsize=64)
def _constant(value: float, device: torch.device) -> torch.Tensor:
    """A 0-d fp32 tensor on `device`, made once (fp32 as eager torch rounds a Python scalar)."""
    return torch.tensor(value, dtype=torch.float32, device="cpu").to(device, non_blocking=True)


_failed = False


@cache
def _compiled(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    return torch.compile(fn, dynamic=True, fullgraph=True)


def _run(fn: Callable[..., torch.Tensor], piece: grid.Piece, *args: Any) -> torch.Tensor | None:
    """`fn` compiled, on `args`; None (and eager from then on) when compiling fails. A one-row
    view (a segment's tail block) runs `fn` eagerly: the same ops, and compiling it would
    specialise a graph on the size 1."""
    global _failed
    if piece.rows == 1:
        return fn(*args)
    try:
        return _compiled(fn)(*args)
    except Exception as err:  # noqa: BLE001  (any compiler failure: the eager path is exact)
        _failed = True
        log.warning("nfab: torch.compile of blockq's codecs failed, the eager torch path runs instead: %s",
                    str(err).splitlines()[0] if str(err) else type(err).__name__)
        return None


def active(*tensors: torch.Tensor) -> bool:
    """Whether the fused chains run on these tensors: the torch path is taken (not the host
    kernels), compiling is switched on (`dispatch.compile_enabled`) and has not failed."""
    return not _failed and dispatch.compile_enabled() and not dispatch.supports(*tensors)


@lru_cache(maxsize=256)
def _row_counters(lengths: tuple[int, ...], block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block (CPU int64): its segment, and its first element's index within that segment plus 1."""
    seg, first = [], []
    for s, n in enumerate(lengths):
        starts = torch.arange(0, n, block, dtype=torch.int64, device="cpu")
        seg.append(torch.full_like(starts, s))
        first.append(starts + 1)
    if not seg:
        return torch.empty(0, dtype=torch.int64, device="cpu"), torch.empty(0, dtype=torch.int64, device="cpu")
    return torch.cat(seg), torch.cat(first)


def levels(x: torch.Tensor, safe: torch.Tensor, lengths: Sequence[int], block: int, parts: tuple[grid.Piece, ...],
           stratum: noise.Stratum, m: int) -> torch.Tensor | None:
    """blockq's levels of the bucket `x` (uint8, one per element) by the compiled chain, the same
    bits as `BlockQSum._levels`; None when not `active` or compiling failed (the caller runs eager)."""
    if not active(x):
        return None
    dev = x.device
    keys = stratum.keys(len(lengths), dev)
    seg, first = (t.to(dev, non_blocking=True) for t in _row_counters(tuple(lengths), block))
    key = keys[seg]  # per block: a gather over blocks, not elements
    lo, hi = key & 0xFFFFFFFF, (key >> 32) & 0xFFFFFFFF
    base = noise._as_i32((lo + first * _GOLDEN_I32) & 0xFFFFFFFF).unsqueeze(1)  # exact in int64: |first * G| < 2^63
    hi = noise._as_i32(hi).unsqueeze(1)
    shift = torch.tensor([stratum.shift], dtype=torch.int32, device="cpu").to(dev, non_blocking=True)
    half_m, top = _constant(0.5 * m, dev), _constant(float(m), dev)
    flat = x.reshape(-1)
    out = torch.empty(flat.numel(), dtype=torch.uint8, device=dev) if len(parts) > 1 else None
    for p in parts:
        b = slice(p.first_block, p.first_block + p.rows)
        got = _run(levels_rows, p, grid.rows(flat, p), safe[b].unsqueeze(1), base[b], hi[b], shift, half_m, top)
        if got is None:
            return None
        if out is None:
            return got.view(-1)
        grid.rows(out, p).copy_(got)
    return out


def unit_scaled(sums: torch.Tensor, block_scales: Callable[[], torch.Tensor], lengths: Sequence[int], block: int,
                total: int, out: torch.Tensor | None) -> torch.Tensor | None:
    """The decoded mean (fp32) of the W-rank sums `sums` against the block scales (`block_scales()`,
    asked only when the chain runs), by the compiled chain (into `out` when given), the same bits as
    `unit_values` then `scale_blocks_`; None when not `active`, the layout needs a gather
    (`grid.pieces`), or compiling failed."""
    parts = grid.pieces(tuple(lengths), block) if active(sums) else None
    if parts is None:
        return None
    scale = block_scales()
    unit = _constant(2.0 / total, sums.device)
    flat = sums.reshape(-1)
    res = out.view(-1) if out is not None else torch.empty(flat.numel(), dtype=torch.float32, device=flat.device)
    for p in parts:
        got = _run(unit_scaled_rows, p, grid.rows(flat, p), grid.column(scale, p), unit)
        if got is None:
            return None
        if out is None and len(parts) == 1:
            return got.view(-1)  # one view and nowhere given: the compiled output is the mean
        grid.rows(res, p).copy_(got)
    return res
