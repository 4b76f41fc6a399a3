"""Launches per bucket: how many kernels one rank's codec work issues on the torch path.

Why: on a GPU every kernel is a launch (microseconds of host time) and a pass over the bucket,
so "a few kernels per bucket, whatever its parameters" is what makes the hook cheap there; the
CPU's timings cannot show it. The count is exact and needs no GPU: the torch path (what CUDA
takes) runs on the CPU, and every op that computes or copies counts one (views and allocations
do not).

`bucket_lengths` makes the buckets: one segment, or many small parameters with tails (norms,
biases) between larger ones, as a transformer layer or a CNN's BatchNorm parameters fill a bucket.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nfab.wire import dispatch
from nfab.wire.registry import Reducer

NO_LAUNCH = frozenset({
    "view", "_unsafe_view", "as_strided", "slice", "select", "empty", "empty_strided", "expand", "reshape",
    "unsqueeze", "squeeze", "t", "transpose", "permute", "alias", "detach", "unbind", "split", "split_with_sizes",
    "narrow", "lift_fresh", "resize_", "set_"})
"""Ops that compute nothing on the device: views and allocations."""


@dataclass
class Launches:
    """The ops that launch work, by name."""

    ops: collections.Counter = field(default_factory=collections.Counter)

    @property
    def total(self) -> int:
        return sum(self.ops.values())


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.launches = Launches()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_LAUNCH:
            self.launches.ops[name] += 1
        return func(*args, **(kwargs or {}))


def bucket_lengths(segments: int, seed: int = 0) -> list[int]:
    """A bucket of `segments` parameters (one: 2^20 elements): small ones with tails (1-200 elements)
    between larger ones (whole 64-element blocks and a tail)."""
    if segments == 1:
        return [1 << 20]
    rng = random.Random(seed)
    return [rng.choice([rng.randint(1, 200), 64 * rng.randint(1, 40) + rng.randint(0, 63)]) for _ in range(segments)]


def count_launches(red: Reducer, lengths: Sequence[int], world_size: int,
                   device: torch.device | str = "cpu") -> Launches:
    """The launches of one rank's codec work on a bucket of `lengths` (scale, encode, owner step of the
    two-phase reducers, decode into the bucket), on the torch path (what CUDA takes); in steady state,
    after one untimed round (a bucket layout's index tables are made once)."""
    lengths = list(lengths)
    n = sum(lengths)
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
    with dispatch.host_paths(False):
        shared = red.local_scale(x, lengths) if red.needs_shared_scale else None
        enc = red.encode(x, lengths, world_size, shared, torch.Generator(device=x.device).manual_seed(1))
        payloads = [enc.payload] * world_size
        reduced, share = red.combine(payloads), red.owner_share(payloads, 0)
        scale = enc.scales if enc.scales is not None else shared
        out = torch.empty_like(x)
        if share is not None:
            red.owner_step(share, world_size)
        red.decode(reduced, scale, n, lengths, world_size, out=out)  # warm: per-layout tables are made once
        counter = _Counter()
        with counter:
            if red.needs_shared_scale:
                red.local_scale(x, lengths)
            red.encode(x, lengths, world_size, shared, torch.Generator(device=x.device).manual_seed(2))
            if share is not None:
                red.owner_step(share, world_size)
            red.decode(reduced, scale, n, lengths, world_size, out=out)
    return counter.launches
