"""Low precision: the plain SUM all-reduce in fp32, bf16 or fp16 (routes `fp32`, `bf16`, `fp16`).

One torch path on every device: cast (pre-scaled by 1/W, as DDP does), all-reduce, cast
back. No compiled kernels: the cast is one fused torch op and the collective is the
backend's own.
"""

from __future__ import annotations

import torch

from nfab.wire.contract import Capacity, Encoded, Reducer, allreduce_factor, allreduce_future, write_into


class AllReduce(Reducer):
    """Plain SUM all-reduce in fp32, bf16 or fp16, pre-scaled by 1/W (as DDP does) to avoid overflow."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self.route = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
        self.name = "allreduce"
        self.lossy = dtype != torch.float32

    def capacity(self, world_size: int) -> Capacity:
        return Capacity(self.name, world_size, ok=world_size >= 1)

    def payload_bytes(self, numel: int, world_size: int) -> int:
        return numel * torch.finfo(self.dtype).bits // 8

    def wire_bytes(self, numel: int, world_size: int, segments: int = 1) -> float:
        return allreduce_factor(world_size) * self.payload_bytes(numel, world_size)

    def encode(self, x, lengths, world_size, shared_scale=None, generator=None, tie=0) -> Encoded:
        payload = self._payload(x, world_size)
        local = payload.to(torch.float32) * world_size if self.lossy else None
        return Encoded(payload, None, local)

    def _payload(self, x: torch.Tensor, world_size: int) -> torch.Tensor:
        return (x * (1.0 / world_size)).to(self.dtype)  # DDP's own pre-scale

    def replay_mean(self, xs, lengths=None, generators=None, step=0) -> torch.Tensor:
        """`Reducer.replay_mean` from the payloads alone: `encode` decodes each rank's local eagerly
        (bf16 -> fp32 is 60% of a bf16 replay), which a replay without error feedback never reads."""
        w = len(xs)
        self.check(w)
        flat = [x.reshape(-1).to(torch.float32) for x in xs]
        numel = flat[0].numel()
        payloads = [self._payload(x, w) for x in flat]
        return self.decode(self.combine(payloads), None, numel, [numel] if lengths is None else lengths, w)

    def launch(self, payload, world_size, group):
        return allreduce_future(payload, group)

    def decode(self, reduced, scale_mean, numel, lengths, world_size, out=None):
        return write_into(out, reduced.to(torch.float32))
