"""Spawn W real gloo ranks on loopback and collect what each returns.

Tests and benchmarks use this to run real collectives in real processes (no mocks):
`run_ranks(fn, world_size, *args)` starts W processes, each joins a gloo process group on
127.0.0.1, calls `fn(rank, world_size, *args)` and sends back its (picklable) result. A
rank that raises, dies or runs past `timeout_s` fails the whole call with a clear error,
and the remaining processes are killed: a hang never outlives the timeout.

On an emulated node (`nfab.bench.nodes`) the same call starts only that node's share of
the ranks (`ranks=`), which rendezvous with the other node's at `master_addr:port`; each
rank sees torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE / GROUP_RANK for its node.

Ranks start by `spawn`: a fresh interpreter each, which pays Python's and torch's start-up
(2-4 s of CPU) per rank. A test suite that starts thousands of ranks calls
`fork_ranks_from_server()` once: later ranks fork from one server process that imported
torch once. Either way a rank sees the caller's `os.environ` as it is at the call.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue as queue_mod
import socket
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_START: Any = mp.get_context("spawn")
"""How run_ranks starts its processes (see `fork_ranks_from_server`)."""

PRELOAD: tuple[str, ...] = ("torch", "torch.distributed", "torch._dynamo", "nfab.rankserver")
"""What a rank server imports once (torch._dynamo: DDP's constructor imports it, seconds of CPU
per rank; nfab.rankserver: nfab.api and the host codecs, loaded once)."""


def fork_ranks_from_server(preload: Sequence[str] = PRELOAD) -> None:
    """Start every later gloo `run_ranks` rank by forking multiprocessing's forkserver, which
    imports `preload` once, instead of spawning a fresh interpreter per rank (NCCL ranks still spawn).

    The server is a clean single-threaded process (never this one, which may hold threads or a
    CUDA context), so a fork from it is as safe as a spawn; a rank's result is the same.
    """
    global _START
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    _START = ctx


def start_method() -> str:
    """How gloo ranks start now: "spawn", or "forkserver" once `fork_ranks_from_server` ran.

    For harnesses that start their own rank processes (bench/userloop.py's
    `torch.multiprocessing.start_processes`): under the test suite they fork from the same
    warmed server as `run_ranks`. A forked rank sees the server's environment, not the caller's.
    """
    return str(_START.get_start_method())


def free_port() -> int:
    """An unused TCP port on loopback (for a rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args_blob: bytes,
    queue: Any,
    pg_timeout_s: float,
    master_addr: str = "127.0.0.1",
    node: tuple[int, int, int] = (0, 0, 0),
    backend: str = "gloo",
    environ: dict[str, str] | None = None,
) -> None:
    group_rank, first, local_world = node
    if environ is not None:  # the caller's environment now (a forked rank inherits the server's)
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank - first),
                      LOCAL_WORLD_SIZE=str(local_world or world_size), GROUP_RANK=str(group_rank))
    torch.set_num_threads(1)
    try:
        if backend == "nccl":  # one GPU per rank of this node (NCCL refuses two ranks on one device)
            torch.cuda.set_device((rank - first) % torch.cuda.device_count())
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s)
        )
        args = torch.load(io.BytesIO(args_blob), weights_only=False)
        result = fn(rank, world_size, *args)
        blob = io.BytesIO()
        torch.save(result, blob)  # by value: shared-memory tensors die with this process
        message = (rank, True, blob.getvalue())
    except BaseException:  # noqa: BLE001 - report anything to the parent, then exit
        message = (rank, False, traceback.format_exc())
    # the whole message is in the pipe before teardown: a rank that dies in it (gloo's threads
    # have aborted the process there under load: "Resource deadlock avoided") would otherwise
    # leave the parent blocked on a half-written result
    queue.put(message)
    queue.close()
    queue.join_thread()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    pg_timeout_s: float = 60.0,
    ranks: range | None = None,
    master_addr: str = "127.0.0.1",
    port: int | None = None,
    group_rank: int = 0,
    backend: str = "gloo",
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` ranks (gloo, or `backend="nccl"` with
    one GPU per rank); return results by rank.

    `fn` must be importable at module level (the spawn start method pickles it by name).
    `ranks` (default: all) are the ranks this machine (node `group_rank`) runs; the others
    join the same rendezvous at `master_addr:port` from elsewhere. Results are this node's,
    in rank order.
    """
    # NCCL ranks always spawn: the forkserver is fork-safe for CPU work, unproven with CUDA
    ctx = _START if backend != "nccl" else mp.get_context("spawn")
    queue = ctx.Queue()
    ranks = range(world_size) if ranks is None else ranks
    port = free_port() if port is None else port
    node = (group_rank, ranks.start, len(ranks))
    # Arguments travel by value: tensors pickled by torch.multiprocessing would share one
    # storage between all ranks, and in-place updates on one rank would leak into another.
    blob = io.BytesIO()
    torch.save(args, blob)
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, port, blob.getvalue(), queue, pg_timeout_s, master_addr, node, backend,
                  dict(os.environ)),
            daemon=True,
        )
        for rank in ranks
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in ranks:
            try:
                rank, ok, payload = queue.get(timeout=timeout_s)
            except queue_mod.Empty as exc:  # some rank hung or died silently
                raise TimeoutError(
                    f"{len(ranks) - len(results) - len(errors)} rank(s) did not finish "
                    f"within {timeout_s:.0f} s"
                ) from exc
            if ok:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("a rank failed\n" + "\n".join(errors))
    return [results[r] for r in ranks]
