"""blockq's scale table, and codes and scales found from it by exponent arithmetic (traced ops).

SCALES[c] = 2^((c - 160) / 4): four codes per octave, code 160 + 4e + j standing for
2^e * SCALES[160 + j] for j < 4, exactly (scaling by 2^e is exact in the normal range, and
fp32(2^(e + j/4)) = 2^e * fp32(2^(j/4)); `tests/wire/test_fused_eager.py` checks every entry).

Why arithmetic: a code or a scale read from the table is a gather, which inductor's CPU code runs
one scalar load at a time -- 0.3 ms for the codes and most of `row_terms`' 0.2 ms per 64K blocks
on one core (4M elements, where a copy takes 0.65 ms). From the exponent and mantissa bits they
are a few vector instructions per 16 blocks, and the same numbers: a block max m in
[2^e, 2^(e+1)) has every entry up to code 160 + 4e - 1 below it, none from 160 + 4e + 4, and
entry 160 + 4e + j below it exactly when SCALES[160 + j] is below m's mantissa (m / 2^e).
"""

from __future__ import annotations

import torch

CODE_OFFSET = 160
CODES_PER_OCTAVE = 4
SCALES = torch.tensor(
    [0.0] + [2.0 ** ((c - CODE_OFFSET) / CODES_PER_OCTAVE) for c in range(1, 256)], dtype=torch.float32,
    device="cpu",
)
"""The scale each uint8 code stands for (increasing; code 0 = all-zero block). On the CPU by name:
made at import, it must not take the caller's default device (`torch.set_default_device`)."""

_MANTISSA = 0x7FFFFF
_ONE_BITS = 0x3F800000  # 1.0f: a mantissa with this exponent is a value in [1, 2)


def _octave(scales: torch.Tensor) -> list[torch.Tensor]:
    """The four scales of the octave [1, 2) (0-d views of `scales`, the table on its device)."""
    return [scales[CODE_OFFSET + j] for j in range(CODES_PER_OCTAVE)]


def codes_of(block_max: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The smallest code whose scale covers each block max (uint8: torch.searchsorted(SCALES, m)
    clamped to 255), NaN as 0 (as after nan_to_num); `scales` is SCALES on the device.

    For m > 0 in [2^e, 2^(e+1)): 160 + 4e plus the octave entries below m's mantissa, clamped to
    [1, 255]. Below 2^-40 (subnormals too) the formula is at most 0, and there only code 0's zero
    lies under m: 1. At e = -40 code 160 + 4e = 0 is the zero, not 2^-40, and is always below m:
    the clamp to 1 supplies it when the mantissa is exactly 1. From 2^24 (inf too) every entry lies
    below: 255."""
    m = block_max.to(torch.float32)
    bits = m.view(torch.int32)  # a NaN's bits are never read: m > 0 is False (nan_to_num ran scalar)
    e = ((bits >> 23) & 0xFF) - 127
    mantissa = ((bits & _MANTISSA) | _ONE_BITS).view(torch.float32)
    code = CODE_OFFSET + CODES_PER_OCTAVE * e
    for entry in _octave(scales):
        code = code + (entry < mantissa).to(torch.int32)
    code = code.clamp(1, 255)
    return torch.where(m > 0, code, torch.zeros_like(code)).to(torch.uint8)


def scales_of(codes: torch.Tensor, scales: torch.Tensor, zero: float = 0.0) -> torch.Tensor:
    """SCALES[codes] (fp32), with `zero` for code 0 (1.0: a divisor that leaves an all-zero block at 0):
    the octave's entry with the code's octave added to its exponent bits (always in fp32's normal range)."""
    c = codes.to(torch.int32) - CODE_OFFSET
    step = c & (CODES_PER_OCTAVE - 1)
    o0, o1, o2, o3 = _octave(scales)
    entry = torch.where(step == 0, o0, torch.where(step == 1, o1, torch.where(step == 2, o2, o3)))
    s = (entry.view(torch.int32) + (c >> 2) * (1 << 23)).view(torch.float32)  # c >> 2: the floor
    return torch.where(codes > 0, s, torch.full_like(s, zero))
