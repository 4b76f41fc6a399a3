"""The one place that chooses a codec's implementation for a device.

Every codec's math is written once in torch (the reference, and what every device, CUDA
included, runs: it reads no value back to the host). For CPU tensors some codecs add compiled
numba kernels that produce the same bits in fewer passes (each codec's `host.py` adapts tensors
to its `*kernels.py`). A codec keeps the operations whose implementations differ in a small ops
object: a torch one (`sign.ops.SignOps`, `qsum.ops.QSumOps`, `blockq.ops.BlockQOps`,
`segments.SegmentOps`, ...) and, where it has kernels, a host one that subclasses it
(`HostSignOps`, ...; where its per-call conditions -- contiguous memory, a dtype -- do not hold
it runs the torch one). `ops` picks the object for a device, once per device and switch
setting, by `kind`; the reducers call it and never ask which they got:

- "torch": any device but the CPU, or the CPU under `host_paths(False)`: torch ops only, never
  a value read back;
- "reads": the CPU without the compiled kernels (numba missing, or `AVAILABLE` switched off):
  the torch math, with values read on the host where that is free (numpy, Python floats);
- "host": the CPU with the kernels: the host ops.

`host_paths(False)`, or `NFAB_HOST_KERNELS=0` in the environment before nfab is imported,
sends CPU tensors down the device path too: a CPU machine runs, and tests hold bit for bit,
the code CUDA takes (tests/runtime/test_host_reads_dist.py checks it reads nothing back).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

try:
    from nfab.wire import shared_kernels  # noqa: F401  (numba importable: the compiled kernels can load)
except ImportError:  # numba missing or unusable: the torch reference runs everywhere
    NUMBA = False
else:
    NUMBA = True

AVAILABLE = NUMBA and sys.byteorder == "little"
"""Whether the compiled CPU kernels can run on this machine (tests switch it off to run the reference)."""

TORCH, READS, HOST = "torch", "reads", "host"

_host = os.environ.get("NFAB_HOST_KERNELS", "1") != "0"


def kind(device: torch.device) -> str:
    """What runs on `device` now: HOST (compiled kernels), READS (the torch math, host reads
    free) or TORCH (the device path). The rule every ops object is chosen by."""
    if not (_host and device.type == "cpu"):
        return TORCH
    return HOST if AVAILABLE else READS


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


_OPS: dict[tuple[Any, ...], Any] = {}


def ops(device: torch.device, torch_ops: type, host_ops: type | None = None, read_ops: type | None = None) -> Any:
    """The ops object of one codec (its classes) for `device`: `host_ops` where `kind` is HOST,
    `read_ops` where it is READS (or HOST without `host_ops`), else `torch_ops`. Made once per
    (device, kind) and shared: ops objects hold no state."""
    k = kind(device)
    key = (device, k, torch_ops, host_ops, read_ops)
    got = _OPS.get(key)
    if got is None:
        if k == HOST and host_ops is not None:
            cls = host_ops
        elif k != TORCH and read_ops is not None:
            cls = read_ops
        else:
            cls = torch_ops
        got = _OPS[key] = cls()
    return got


def implementation(device: torch.device) -> str:
    """"host" (the compiled kernels) or "torch" (the reference): what tensors on `device` take
    now, for reports and benchmarks."""
    return "host" if kind(device) == HOST else "torch"
