"""A guard that records every host read of a tensor's values, for runs on the device paths.

Under `dispatch.host_paths(False)` a CPU run takes the paths every other device takes, so
within the hook body and its callbacks nothing should read a tensor's value on the host.
`HostReads` is a `TorchFunctionMode` (thread-local: enter it on the thread that runs the
code) that records, with the nfab line that made it:
- value reads: `.item()`, `.tolist()`, `.numpy()`, `.cpu()`, `bool/float/int(t)`, `torch.equal`;
- ops whose output size depends on values (`nonzero`, boolean-mask indexing,
  `repeat_interleave` without `output_size`): on CUDA they wait for the device;
- host-to-device copies that block: `torch.tensor(data, device=...)` and
  `.to(device)` without `non_blocking=True` (a literal `device="cpu"` is a deliberate host
  tensor and passes; a device object, e.g. `x.device`, is the gradient's device).
It records instead of raising: an exception inside a DDP callback would hang the peer.
"""

from __future__ import annotations

import traceback

import torch
from torch.overrides import TorchFunctionMode

READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__", "__array__",
         "equal", "allclose", "nonzero", "argwhere", "masked_select", "unique"}


def _where() -> str:
    for fr in reversed(traceback.extract_stack()[:-2]):
        if "/nfab/" in fr.filename:
            return f"{fr.filename.split('/nfab/')[-1]}:{fr.lineno} {fr.name}"
    return "?"


def _names_device(args: tuple, kwargs: dict) -> bool:
    if kwargs.get("device") is not None:
        return True
    for a in args[1:]:
        if isinstance(a, torch.device):
            return True
        if isinstance(a, str):
            try:
                torch.device(a)
                return True
            except RuntimeError:
                pass
    return False


class HostReads(TorchFunctionMode):
    """Records host reads (see the module doc) into `self.seen` (shared list, any thread)."""

    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        bad = None
        if name in READS:
            bad = name
        elif name in ("tensor", "as_tensor") and kwargs.get("device") not in (None, "cpu"):
            bad = f"{name}(device=...) blocking copy"
        elif name == "to" and _names_device(args, kwargs) and not kwargs.get("non_blocking", False):
            bad = "to(device) blocking copy"
        elif name == "repeat_interleave" and "output_size" not in kwargs and any(
                isinstance(a, torch.Tensor) for a in args[1:2]):
            bad = "repeat_interleave without output_size"
        elif name == "__getitem__" and len(args) > 1 and isinstance(args[1], torch.Tensor) \
                and args[1].dtype == torch.bool:
            bad = "boolean-mask indexing"
        if bad is not None:
            self.seen.append(f"{bad} at {_where()}")
        return func(*args, **kwargs)
