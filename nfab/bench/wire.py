"""Wire benchmark: codec speed beside a plain copy, and bits on the wire beside fp32.

Throughput is GB/s of fp32 gradient (numel * 4 bytes / seconds) on one core, for one rank's
codec work at each world size (`cost.codec_work`: encode, the shard owner's step of the
two-phase reducers on its one shard, decode; lane widths, and so the kernels, change with W),
timed right beside a plain copy of the same tensor: the ratio is the figure to read on a shared
machine. Bits per element come from each reducer's `wire_bytes` (what a rank actually sends) at
W = 2, 4, 8, 16. `first_call_s` is the
first encode+decode at that W in this process: it includes compiling the CPU kernels
(or loading them from numba's on-disk cache). Times are CPU seconds of this process
(`time.process_time`, one thread): on a shared machine they leave out the time spent
waiting for a core, which wall time would charge to whichever side it hit. Copy and codec
are timed alternately (best of 15 each), so both see the same moments of the machine.

`impl` chooses the codec path: "host" (the compiled CPU kernels, what CPU tensors take),
"torch" (the torch reference every other device takes, run here with
`dispatch.host_paths(False)`), or "auto" (whatever the device takes). On CUDA the times are
wall seconds around a device synchronisation, and the copy is the device's own copy
bandwidth: the ratio is the codec's speed against what the device can move.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from nfab.errors import ConfigError
from nfab.fsutil import atomic_write_json
from nfab.wire import dispatch
from nfab.wire.cost import best_time, codec_work
from nfab.wire.registry import REDUCERS, Reducer

WORLD_SIZES: tuple[int, ...] = (2, 4, 8, 16)


@dataclass(frozen=True, slots=True)
class WireRow:
    """One reducer at one world size."""

    reducer: str
    world_size: int
    bits_per_element: float | None
    """Wire bits each rank sends per gradient element (None when over capacity)."""
    fp32_bits_per_element: float
    capacity_ok: bool
    capacity: str
    """Lane width / levels, or why the reducer cannot be exact at this W."""
    encode_decode_gbps: float | None
    """None when over capacity (nothing to time)."""
    copy_gbps: float
    ratio_to_copy: float | None
    first_call_s: float | None
    numel: int
    device: str = "cpu"
    impl: str = "host"
    """"host" (compiled CPU kernels) or "torch" (the path CUDA and every other device take)."""


def _best_pair(copy: Callable[[], object], run: Callable[[], object], reps: int,
               clock: Callable[[], float] = time.process_time) -> tuple[float, float]:
    """Best seconds of `copy` and of `run`, timed alternately `reps` times each: both sample
    the same moments of a shared machine (memory bandwidth taken by other jobs shows in CPU
    time too), so drift cancels in their ratio."""
    copy()
    best_copy = best_run = float("inf")
    for _ in range(reps):
        t0 = clock()
        copy()
        t1 = clock()
        run()
        t2 = clock()
        best_copy, best_run = min(best_copy, t1 - t0), min(best_run, t2 - t1)
    return best_copy, best_run


IMPLS = ("auto", "host", "torch")


def _clock(device: torch.device) -> Callable[[], float]:
    """CPU seconds of this process on the CPU; wall seconds after the device's queued work on an
    accelerator (its kernels run asynchronously: CPU time would measure only the launches)."""
    if device.type == "cpu":
        return time.process_time
    sync = getattr(torch, device.type).synchronize

    def clock() -> float:
        sync()
        return time.perf_counter()

    return clock


def _impl(impl: str, device: torch.device) -> str:
    """The path `impl` names on `device` ("auto": what the device takes); a clear error when it cannot run."""
    if impl not in IMPLS:
        raise ConfigError(f"unknown impl {impl!r}: choose from {', '.join(IMPLS)}")
    if impl == "auto":
        return dispatch.implementation(device)
    if impl == "host" and (device.type != "cpu" or not dispatch.AVAILABLE):
        raise ConfigError(f"impl 'host' runs the compiled CPU kernels: not on {device.type}"
                          + ("" if device.type != "cpu" else " (numba is not installed)"))
    return impl


def _capacity_text(red: Reducer, world_size: int) -> tuple[bool, str]:
    cap = red.capacity(world_size)
    if not cap.ok:
        return False, cap.reason
    parts = [f"{cap.lane_bits}-bit lanes"] if cap.lane_bits else []
    if cap.levels:
        parts.append(f"{cap.levels} levels")
    return True, ", ".join(parts)


def bench_wire(numel: int = 1 << 22, reps: int = 15, seed: int = 0,
               reducers: Sequence[str] | None = None, device: torch.device | str = "cpu", impl: str = "auto",
               world_sizes: Sequence[int] = WORLD_SIZES) -> list[WireRow]:
    """Time every reducer's (or the named reducers') encode+decode at W = 2, 4, 8, 16 beside a
    copy on `device`, by the path `impl` names; bits per element."""
    device = torch.device(device)
    impl = _impl(impl, device)
    clock = _clock(device)
    if numel < 1:
        raise ValueError(f"numel must be >= 1, got {numel}")
    keys = list(REDUCERS) if reducers is None else list(reducers)
    unknown = [k for k in keys if k not in REDUCERS]
    if unknown:
        raise ValueError(f"unknown reducer(s) {', '.join(unknown)}: choose from {', '.join(REDUCERS)}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core: the figure is per rank, comparable across machines
    try:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(seed), device="cpu").to(device)
        dst = torch.empty_like(x)
        gb = numel * 4 / 1e9
        rows: list[WireRow] = []
        fp32 = REDUCERS["allreduce-fp32"]
        for key in keys:
            red = REDUCERS[key]
            for w in world_sizes:
                ok, text = _capacity_text(red, w)
                ed_gbps = first = None
                if ok:
                    with dispatch.host_paths(impl == "host"):
                        run = codec_work(red, x, w)
                        t0 = clock()
                        run()
                        first = clock() - t0
                        copy_s, run_s = _best_pair(lambda: dst.copy_(x), run, reps, clock)
                    ed_gbps = gb / run_s
                else:
                    copy_s = best_time(lambda: dst.copy_(x), reps, clock)
                copy_gbps = gb / copy_s
                rows.append(WireRow(
                    reducer=key,
                    world_size=w,
                    bits_per_element=red.bits_per_element(w) if ok else None,
                    fp32_bits_per_element=fp32.bits_per_element(w),
                    capacity_ok=ok,
                    capacity=text,
                    encode_decode_gbps=ed_gbps,
                    copy_gbps=copy_gbps,
                    ratio_to_copy=ed_gbps / copy_gbps if ed_gbps is not None else None,
                    first_call_s=first,
                    numel=numel,
                    device=str(device),
                    impl=impl,
                ))
        return rows
    finally:
        torch.set_num_threads(threads)


def write_rows(path: str | Path, rows: list[WireRow]) -> None:
    atomic_write_json(path, [asdict(r) for r in rows])


def _measure_rank(rank: int, world_size: int, large_numel: int) -> str:
    from nfab.wire.cost import measure

    return measure(large_numel=large_numel).to_json()


def measure_cost(world_size: int = 2, large_numel: int = 1 << 18) -> str:
    """`nfab.wire.cost.measure` on real gloo ranks; the CostModel JSON (identical on every rank)."""
    from nfab.distributed import run_ranks

    results = run_ranks(_measure_rank, world_size, large_numel, timeout_s=600)
    return results[0]
