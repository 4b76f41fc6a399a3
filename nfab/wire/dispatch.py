"""The one place that chooses a codec's implementation for a device.

Every codec has a torch reference that runs on any device (CUDA included) and reads no value
back to the host, and, for CPU tensors, compiled numba kernels that produce the same bits in
fewer passes (each codec's `host.py` adapts tensors to its `*kernels.py`). The choice:

- `on_host(*tensors)`: the values are free to read here (all tensors on the CPU) and the host
  paths are switched on. Host code (the kernels, numpy codecs, a callback's direct flag read)
  runs only then; every other device takes torch ops that never wait for it.
- `supports(*tensors)`: `on_host`, numba importable on a little-endian machine, and contiguous
  memory: the compiled kernels may run.
- `host_paths(False)`, or `NFAB_HOST_KERNELS=0` in the environment before nfab is imported,
  sends CPU tensors down the device path too: a CPU machine runs, and tests hold bit for bit,
  the code CUDA takes (tests/runtime/test_host_reads_dist.py checks it reads nothing back).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

try:
    from nfab.wire import shared_kernels  # noqa: F401  (numba importable: the compiled kernels can load)
except ImportError:  # numba missing or unusable: the torch reference runs everywhere
    NUMBA = False
else:
    NUMBA = True

AVAILABLE = NUMBA and sys.byteorder == "little"
"""Whether the compiled CPU kernels can run on this machine (tests switch it off to run the reference)."""

_host = os.environ.get("NFAB_HOST_KERNELS", "1") != "0"


def on_host(*tensors: torch.Tensor) -> bool:
    """Whether host code may read these tensors' values: all on the CPU (where reading is
    free), unless `host_paths(False)` is in effect. False on CUDA and every other device."""
    if not _host:
        return False
    for t in tensors:  # a loop, not all(genexpr): asked many times per bucket
        if not t.is_cpu:
            return False
    return True


def host_device(device: torch.device) -> bool:
    """`on_host` for values still to be made on `device`."""
    return _host and device.type == "cpu"


def host_enabled() -> bool:
    """Whether CPU tensors take the host paths now (False under `host_paths(False)` or
    `NFAB_HOST_KERNELS=0`)."""
    return _host


@contextmanager
def host_paths(enabled: bool) -> Iterator[None]:
    """Let CPU tensors take the host paths (default) or, with False, the device paths every
    other device takes (process-wide: the hook's callbacks run on other threads)."""
    global _host
    was, _host = _host, enabled
    try:
        yield
    finally:
        _host = was


def supports(*tensors: torch.Tensor) -> bool:
    """Whether the compiled CPU path may run on these tensors (on the host, contiguous)."""
    if not (AVAILABLE and on_host(*tensors)):
        return False
    for t in tensors:
        if not t.is_contiguous():
            return False
    return True


def implementation(*tensors: torch.Tensor) -> str:
    """"host" (the compiled kernels) or "torch" (the reference): what these tensors take, for
    reports and benchmarks."""
    return "host" if supports(*tensors) else "torch"
