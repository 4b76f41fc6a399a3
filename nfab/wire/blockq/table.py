"""blockq's scale table: the fp32 scale each uint8 code stands for.

SCALES[c] = 2^((c - 160) / 4): four codes per octave, code 160 + 4e + j standing for
2^e * SCALES[160 + j] for j < 4, exactly (scaling by 2^e is exact in the normal range, and
fp32(2^(e + j/4)) = 2^e * fp32(2^(j/4)); `tests/wire/test_blockq_fast.py` checks every entry).
That is what lets the CPU kernels find a block max's code from its exponent and mantissa bits
(`kernels.scale_codes`) instead of a binary search over the table.
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
