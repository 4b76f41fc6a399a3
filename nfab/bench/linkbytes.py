"""Bytes on a shaped link: counted by the interface, and predicted by the model.

Measured: the node's first rank reads its namespace's tx counter (`/proc/net/dev`) for the
shaped interface — `lo` for a single-node `--link` (every byte any rank sends), the veth
`nfab0` with `--nodes 2` (every byte that leaves the node) — before and after each timed
step; the nodes' counts are summed. They include TCP/IP and Ethernet headers and ACKs.

Modelled: the bytes each rank sends per step under its collectives' algorithms (what
`Reducer.wire_bytes` and nfab's `StepStats.wire_bytes` count: ring all-reduce 2(W-1)/W of
the payload, ring all-gather W-1 payloads), times the ring edges that cross the link. On a
single shaped loopback every edge crosses it (W edges). With 2 nodes of consecutive ranks
the ring 0 -> 1 -> ... -> W-1 -> 0 crosses between the nodes twice, whatever W, so the
link carries 2 ranks' worth: that is why a two-level reduction (node-local first) saves
nothing on a ring's inter-node bytes at W/node = 1 but changes what each crossing carries.
DDP also broadcasts module buffers (BatchNorm statistics) from rank 0 before every forward.
The floor variant (buffers and barriers only) measured them crossing once per rank outside
rank 0's node (2 nodes of 2: 46 KB against 19 KB of buffers), as if rank 0 sent them to every
rank itself: W-1 copies on one loopback, W - W/nodes between nodes.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch

from nfab.bench.nodes import tx_bytes
from nfab.wire.contract import allreduce_factor

POWERSGD_RANK = 2
POWERSGD_MIN_COMPRESSION_RATE = 2.0
"""torch's PowerSGDState defaults, as the bench uses them."""


class TxCounter:
    """Reads one interface's tx bytes in this process's network namespace (None: reads 0)."""

    def __init__(self, iface: str | None) -> None:
        self.iface = iface

    def read(self) -> int:
        return 0 if self.iface is None else tx_bytes(self.iface)


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def params_digest(module: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes (bit-for-bit comparison across runs)."""
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def crossing_edges(world_size: int, nodes: int) -> int:
    """Ring edges that cross the shaped link: all W on one loopback, `nodes` between nodes."""
    return world_size if nodes == 1 else nodes


def buffer_bytes(module: torch.nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in module.buffers())


def powersgd_bytes(module: torch.nn.Module, world_size: int, rank: int = POWERSGD_RANK) -> float:
    """Bytes each rank sends per step under torch's powerSGD_hook (after its warm-up).

    Its rule: a gradient viewed as (shape[0], rest) is compressed to P (n x r) and Q (m x r)
    when (n + m) r * min_compression_rate < n m; the rest are all-reduced uncompressed. All
    three are fp32 ring all-reduces.
    """
    elements = 0
    for p in module.parameters():
        n = p.shape[0] if p.dim() else 1
        m = p.numel() // max(n, 1)
        r = min(n, m, rank)
        compressed = (n + m) * r
        elements += compressed if compressed * POWERSGD_MIN_COMPRESSION_RATE < n * m else n * m
    return allreduce_factor(world_size) * 4.0 * elements


def per_rank_bytes(variant: str, module: torch.nn.Module, world_size: int, nfab_info: dict[str, Any] | None,
                   ) -> float:
    """Gradient bytes each rank sends per step for a bench variant (before the link's crossing factor)."""
    numel = sum(p.numel() for p in module.parameters())
    if variant in ("plain", "allreduce-hook"):
        return allreduce_factor(world_size) * 4.0 * numel
    if variant in ("fp16", "bf16"):
        return allreduce_factor(world_size) * 2.0 * numel
    if variant == "floor":
        return 0.0
    if variant == "powersgd":
        return powersgd_bytes(module, world_size)
    assert nfab_info is not None, f"no nfab info for {variant}"
    return float(nfab_info["wire_bytes_per_step"])


def modelled_link_bytes(variant: str, module: torch.nn.Module, world_size: int, nodes: int,
                        nfab_info: dict[str, Any] | None) -> float:
    """Bytes the model predicts across the shaped link per step (every node's tx together).

    A two-level nfab variant sends its node-local level inside the node (never across) and its
    cross level as W/nodes rings of `nodes` ranks, each crossing the link `nodes` times."""
    gradient = per_rank_bytes(variant, module, world_size, nfab_info) * crossing_edges(world_size, nodes)
    if nfab_info is not None and nfab_info.get("inter_node_bytes_per_step"):
        inter, intra = nfab_info["inter_node_bytes_per_step"], nfab_info["intra_node_bytes_per_step"]
        flat = float(nfab_info["wire_bytes_per_step"]) - inter - intra
        gradient = flat * crossing_edges(world_size, nodes) + inter * (world_size // nodes) * nodes
    buffers = buffer_bytes(module) * (world_size - 1 if nodes == 1 else world_size - world_size // nodes)
    return gradient + buffers
