"""Shaped links for benchmarks: run a function inside a private network namespace.

`run_shaped(rate, target, payload)` re-executes Python under `unshare --net`; the inner
process (`python -m nfab.bench.netns`) brings the namespace's loopback up, shapes it
with a token-bucket filter at `rate` (`tc qdisc add dev lo root tbf rate RATE ...`),
then calls `target(payload)` — which spawns the gloo ranks on 127.0.0.1, so every byte
they exchange really pays for that link — and writes the JSON result to a file the
outer process reads. Needs root, `unshare`, `ip` and `tc` (iproute2); `unavailable()`
says in one line what is missing.

All traffic of both ranks shares the one shaped loopback queue: RATE is the aggregate
bandwidth of the link, both directions together.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nfab.errors import NfabError
from nfab.fsutil import atomic_write_text

TOOLS = ("unshare", "ip", "tc")
BURST = "256kb"
"""Token-bucket depth: above loopback's 64 KiB MTU, small next to a gradient bucket."""
LATENCY = "1s"
"""Longest a packet may queue in the bucket before it is dropped (never, in practice)."""
_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$")


def check_rate(rate: str) -> str:
    """A `tc` rate such as `1gbit` or `100mbit` (lower-cased), or an NfabError."""
    r = rate.strip().lower()
    if not _RATE.match(r):
        raise NfabError(f"link rate {rate!r} is not a tc rate like 1gbit, 100mbit or 500kbit")
    return r


def rate_bits_per_s(rate: str) -> float:
    """A tc rate in bits per second (`1gbit` -> 1e9; `bps` units are bytes per second)."""
    r = check_rate(rate)
    m = re.match(r"^([\d.]+)([a-z]+)$", r)
    assert m is not None
    value, unit = float(m.group(1)), m.group(2)
    prefix = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
    if unit.endswith("bit"):
        return value * prefix[unit[:-3]]
    return 8 * value * prefix[unit[:-3]]


def unavailable() -> str | None:
    """Why a shaped link cannot be set up here (one line), or None when it can."""
    if os.environ.get("NFAB_NO_NETNS"):
        return "shaped links are disabled (NFAB_NO_NETNS is set)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"--link needs {', '.join(missing)} (iproute2 / util-linux) on PATH; install iproute2"
    if os.geteuid() != 0:
        return "--link needs root (it creates a network namespace and shapes its loopback with tc)"
    return None


def shape_loopback(rate: str) -> str:
    """Inside a fresh namespace: bring `lo` up and shape it; returns `tc qdisc show dev lo`."""
    ip, tc = shutil.which("ip"), shutil.which("tc")
    assert ip is not None and tc is not None
    subprocess.run([ip, "link", "set", "lo", "up"], check=True)
    subprocess.run([tc, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", check_rate(rate),
                    "burst", BURST, "latency", LATENCY], check=True)
    shown = subprocess.run([tc, "qdisc", "show", "dev", "lo"], check=True, capture_output=True, text=True)
    return shown.stdout.strip()


def run_shaped(rate: str, target: str, payload: dict[str, Any], timeout_s: float = 3600.0) -> dict[str, Any]:
    """Call `target` ("module:function", taking and returning JSON-able dicts) on a shaped link.

    The result gains `"link": {"rate", "bits_per_s", "qdisc"}`.
    """
    why = unavailable()
    if why is not None:
        raise NfabError(why)
    rate = check_rate(rate)
    unshare = shutil.which("unshare")
    assert unshare is not None
    with tempfile.TemporaryDirectory(prefix="nfab-netns-") as tmp:
        cfg, out = Path(tmp) / "payload.json", Path(tmp) / "result.json"
        cfg.write_text(json.dumps(payload))
        env = dict(os.environ)
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the namespace has nothing else
        cmd = [unshare, "--net", "--", sys.executable, "-m", "nfab.bench.netns",
               "--rate", rate, "--target", target, "--payload", str(cfg), "--out", str(out)]
        proc = subprocess.run(cmd, env=env, timeout=timeout_s, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-20:]
            raise RuntimeError(f"shaped-link run failed (exit {proc.returncode}):\n" + "\n".join(tail))
        return json.loads(out.read_text())


def forked_target(target: str) -> Callable[..., Any]:
    """The function `module:name` a namespace's process runs (here and in `nodes`), with the ranks
    it starts set to fork from one server that imported torch and nfab once (and loaded the host
    codecs): each spawned rank would pay that start-up again (2-4 s of CPU per rank)."""
    from nfab.distributed import fork_ranks_from_server

    fork_ranks_from_server()
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _inner(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m nfab.bench.netns")
    ap.add_argument("--rate", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--payload", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    qdisc = shape_loopback(a.rate)
    fn = forked_target(a.target)
    result = fn(json.loads(Path(a.payload).read_text()))
    result["link"] = {"rate": a.rate, "bits_per_s": rate_bits_per_s(a.rate), "qdisc": qdisc}
    atomic_write_text(a.out, json.dumps(result))


if __name__ == "__main__":
    _inner()
