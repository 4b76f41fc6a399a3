"""Bucket plans: the slice table of one DDP bucket's flat gradient buffer.

`GradBucket.parameters()` gives the bucket's parameters in buffer order; each one's
gradient occupies `numel` consecutive elements. DDP rebuilds its buckets after the
first iteration, so a plan is keyed by the identity of the bucket's parameters, never
by `bucket.index()` alone, and a rebuilt bucket simply gets a new plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Slice:
    """One parameter's gradient inside a bucket buffer."""

    offset: int
    numel: int
    name: str
    region: str


@dataclass(frozen=True, slots=True)
class BucketPlan:
    """The slice table of one bucket."""

    key: tuple[int, ...]
    slices: tuple[Slice, ...]
    numel: int

    def regions(self) -> set[str]:
        return {s.region for s in self.slices}

    def __hash__(self) -> int:  # the key identifies the bucket; hashing every slice each step would cost
        return hash(self.key)


def plan_key(params: list[torch.Tensor]) -> tuple[int, ...]:
    """Identity of a bucket: its parameters, in order."""
    return tuple(id(p) for p in params)


def build_plan(
    params: list[torch.Tensor],
    grads: list[torch.Tensor] | None,
    buffer: torch.Tensor,
    names: dict[int, str],
    regions: dict[str, str],
) -> BucketPlan:
    """Slice table from a bucket's parameters (and, when given, their gradient views).

    Offsets come from the gradient views' storage offsets when they alias the buffer,
    else from the running sum of numels (DDP's layout).
    """
    slices = []
    offset = 0
    base = buffer.data_ptr()
    esize = buffer.element_size()
    for i, p in enumerate(params):
        n = p.numel()
        off = offset
        if grads is not None and i < len(grads):
            g = grads[i]
            delta = g.data_ptr() - base
            if g.numel() == n and 0 <= delta < buffer.numel() * esize:
                off = delta // esize
        name = names.get(id(p), f"<unnamed:{i}>")
        slices.append(Slice(off, n, name, regions.get(name, "other")))
        offset = off + n
    total = sum(s.numel for s in slices)
    if total != buffer.numel():
        raise RuntimeError(f"bucket plan covers {total} elements but the buffer has {buffer.numel()}")
    return BucketPlan(plan_key(params), tuple(slices), buffer.numel())
