"""qsum scales: how q8/q4/q2 slices summed on the wire get one scale every rank agrees on.

Lanes summed on the wire need one scale on every rank before encoding. Agreeing it in
the step is a blocking all-reduce (MAX) inside the hook, and on a busy link that small
collective queues behind the payloads already in flight, stalling backward. Three cases:

- a qsum slice in a coalesced bucket is gathered, not summed: each rank encodes with its
  own per-segment max |x| (carried by the control word) and every rank decodes each row
  with that row's scale — no agreement, no saturation, finer levels;
- otherwise `qsum_scale="exact"` (default) agrees by the blocking MAX, as calibrate's
  replay does (`StepStats.scale_rounds` counts them);
- `qsum_scale="delayed"` ("delayed scaling", as FP8 recipes scale by an amax history):
  a slice that was on qsum in the previous step encodes with the max of its agreed
  max |x| over the last `AMAX_HISTORY` steps, identical on every rank; elements beyond
  it saturate at +-scale for that step (`StepStats.saturated_slices`). Measured in
  `python -m bench.study`, that clipping cost GPT +1.4% loss against exact's +0.06%, so it is
  opt-in. A slice's first qsum step, or its first after a gap, agrees exactly.

The history holds host floats agreed from control words (folded once per step); the
delayed scale goes to the device as one non-blocking copy per group.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

import torch

AMAX_HISTORY = 16
"""Steps of agreed max |x| a qsum slice's delayed scale is the max of."""
QSUM_SCALES = ("delayed", "exact")


class AmaxHistory:
    """Per qsum slice: (step, agreed max |x|) of its latest consecutive qsum steps."""

    def __init__(self, mode: str) -> None:
        if mode not in QSUM_SCALES:
            raise ValueError(f"qsum_scale must be one of {', '.join(QSUM_SCALES)}, got {mode!r}")
        self.mode = mode
        self.history: dict[str, deque[tuple[int, float]]] = {}

    def delayed(self, names: Iterable[str], step: int, device: torch.device) -> torch.Tensor | None:
        """The delayed scales of a group's slices at `step`, or None (agree now): exact mode,
        or a slice that was not on qsum in the previous step."""
        if self.mode != "delayed":
            return None
        out = []
        for name in names:
            h = self.history.get(name)
            if not h or h[-1][0] != step - 1:
                return None
            out.append(max(a for _, a in h))
        # deliberately built on the CPU from host floats, then one non-blocking copy
        return torch.tensor(out, dtype=torch.float32, device="cpu").to(device, non_blocking=True)

    def fold(self, agreed: dict[str, float], step: int) -> None:
        """Append `step`'s agreed max |x| to each slice's history (restarted after a gap)."""
        for name, a in agreed.items():
            h = self.history.get(name)
            if h is None or h[-1][0] != step - 1:
                h = self.history[name] = deque(maxlen=AMAX_HISTORY)
            h.append((step, a))

    def state_dict(self) -> dict[str, list[list[float]]]:
        return {k: [list(e) for e in h] for k, h in self.history.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = {k: deque(((int(st), float(a)) for st, a in h), maxlen=AMAX_HISTORY)
                        for k, h in state.items()}
