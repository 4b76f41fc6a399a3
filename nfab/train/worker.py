"""torchrun's entry point for one rank: `python -m nfab.train.worker CONFIG.json`.

Joins the process group (NCCL when CUDA is present, else gloo), agrees on rank 0's
config, trains, and turns any failure into one marked line on stderr that the launcher
shows to the user (`nfab-worker-error: rank R: ...`), with the traceback in the log.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import signal
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from nfab.errors import NfabError
from nfab.train.config import LaunchConfig, config_from_dict
from nfab.train.loop import stage, train

ERROR_MARK = "nfab-worker-error:"


def _device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    threads = os.environ.get("OMP_NUM_THREADS")  # an explicit choice wins (same threads, same bits)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(int(threads) if threads else max(1, (os.cpu_count() or 1) // local_world))
    return torch.device("cpu")


def _init_process_group(device: torch.device, timeout_s: float) -> None:
    """Join the group through torchrun's store, under a key prefix of its own per restart attempt.

    torchrun keeps one store across restarts; without the prefix a restarted rank can read a
    dead peer's gloo address from the first attempt and fail or hang connecting to it.
    """
    store, rank, world = next(dist.rendezvous("env://"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.PrefixStore(
        f"nfab/attempt{attempt}", store), rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))


def _is_timeout(exc: BaseException) -> bool:
    """A collective that gave up waiting for a peer (gloo: "Timed out waiting", NCCL: "Watchdog ... timeout")."""
    text = f"{type(exc).__name__} {exc}".lower()
    return "timed out" in text or "timeout" in text


def _whose_peer(nnodes: int) -> str:
    """Who never arrived, as far as this rank can tell: with several nodes, name them."""
    if nnodes <= 1:
        return "a peer never arrived"
    node = int(os.environ.get("GROUP_RANK", "0"))
    others = [str(n) for n in range(nnodes) if n != node]
    where = f"node {others[0]}" if len(others) == 1 else f"nodes {', '.join(others)}"
    return (f"on node {node} of {nnodes}, a peer on this node or on {where} never arrived "
            "(a rank gone, or the link between the nodes down)")


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())


LAUNCHER_ENV = "NFAB_LAUNCHER_PID"
"""Set by `nfab train` for its ranks: the pid of the process that starts them (torchrun runs in it)."""


def _end_with_launcher() -> None:
    """Ask the kernel to end this rank when the process that started it ends (Linux PR_SET_PDEATHSIG):
    after `kill -9` of `nfab train`, its ranks trained on as orphans and wrote the run dir, beside a
    `--resume` started meanwhile. A launcher already gone when the request is made (it was killed
    while this rank imported torch) cannot signal it: then this rank's parent is no longer the
    launcher `nfab train` named, and it ends here. Elsewhere nothing changes."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    launcher = os.environ.get(LAUNCHER_ENV, "")
    if launcher.isdigit() and os.getppid() != int(launcher):
        os._exit(128 + signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    rank = int(os.environ.get("RANK", "0"))
    _end_with_launcher()
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints every thread's stack (hang diagnosis)
    faulthandler.enable()  # an abort (NCCL's watchdog ends a timed-out rank so) leaves the Python stack in the log
    timeout_s = LaunchConfig().timeout_s
    nnodes = 1
    try:
        data = json.loads(Path(args[0]).read_text())
        timeout_s = float(data.get("launch", {}).get("timeout_s", timeout_s))
        nnodes = int(data.get("launch", {}).get("nnodes", 1))
        device = _device()
        _init_process_group(device, timeout_s)
        box = [data]
        dist.broadcast_object_list(box, src=0)  # every rank trains rank 0's config
        train(config_from_dict(box[0]), device)
        dist.barrier()
        dist.destroy_process_group()
        return 0
    except NfabError as exc:
        print(f"{ERROR_MARK}[2] rank {rank}: {exc}", file=sys.stderr, flush=True)
        return 2
    except Exception as exc:  # noqa: BLE001 - one marked line for the launcher, the traceback for the log
        traceback.print_exc()
        message = _one_line(exc)
        if _is_timeout(exc):
            inner = re.split(r"\w+(?:Error|Exception): ", message)[-1].split(" At: ")[0]  # torch's callback wrapping
            message = (f"a collective timed out after {timeout_s:g} s (launch.timeout_s) in {stage()}: "
                       f"{_whose_peer(nnodes)} ({inner})")
        print(f"{ERROR_MARK}[1] rank {rank}: {message}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo's C++ threads can std::terminate (SIGABRT) while
    # being destroyed after a finished run; every artifact is closed by now.
    os._exit(code)
