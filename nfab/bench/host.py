"""What machine a benchmark ran on, recorded beside its numbers.

A result is comparable only to results of the same machine: a chaotic recipe's FP32 target
moves with the kernels the CPU's instruction set selects (resnet18-digits' seed-0 target is
0.0457 under AVX-512 and 0.0748 with ATen held to AVX2, same code), and speeds move with
everything. So each benchmark document names the CPU, the kernel level torch picked for it,
the cores and any GPU.
"""

from __future__ import annotations

import os
import platform
from typing import Any

import torch


def _cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo on Linux, else what `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe() -> dict[str, Any]:
    """`cpu`, `cpu_capability` (ATen's kernel level: AVX512, AVX2, DEFAULT...), `cores` and `cuda`
    (the first GPU's name, or None)."""
    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpu": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count(),
        "cuda": cuda,
    }
