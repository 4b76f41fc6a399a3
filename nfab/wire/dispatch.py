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
- `compile_paths(True)`, or `NFAB_COMPILE=1`: the torch path runs the lossy codecs' stages
  compiled by `torch.compile` (`wire/fusion.py`, each codec's `fused.py`; the same bits, eager
  after any compile error). Off by default on every device: on CPU the host kernels are faster
  (docs/gpu.md), and on CUDA no GPU run has yet measured it against eager (`make device-check`
  times both); compiling costs seconds per lane layout.
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
_compile = os.environ.get("NFAB_COMPILE", "0") == "1"


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


def compile_enabled() -> bool:
    """Whether the torch path runs its fused chains compiled (`NFAB_COMPILE=1`, `compile_paths`)."""
    return _compile


@contextmanager
def compile_paths(enabled: bool) -> Iterator[None]:
    """Let the torch path run its compiled chains (True) or eager torch ops (False), process-wide."""
    global _compile
    was, _compile = _compile, enabled
    try:
        yield
    finally:
        _compile = was


def supports(*tensors: torch.Tensor) -> bool:
    """Whether the compiled CPU path may run on these tensors (on the host, contiguous)."""
    if not (AVAILABLE and on_host(*tensors)):
        return False
    for t in tensors:
        if not t.is_contiguous():
            return False
    return True


def implementation(*tensors: torch.Tensor) -> str:
    """"host" (the compiled kernels), "torch" (the reference) or "compiled" (the reference with
    its fused chains compiled): what these tensors take, for reports and benchmarks."""
    if supports(*tensors):
        return "host"
    return "compiled" if _compile else "torch"
