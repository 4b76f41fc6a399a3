"""Two nodes on one machine: network namespaces joined by a shaped veth pair.

`emulated_nodes(2, rate)` creates two named network namespaces (`nfab-PID-0`, `nfab-PID-1`; the
process's next context `-2`, `-3`, so several can be open at once),
each with its loopback up and one end of a veth pair named `nfab0` (10.77.0.1 and 10.77.0.2).
Both ends are shaped with `tc tbf` at RATE, so each direction of the inter-node link carries
RATE (full duplex, like a NIC; a single-node `--link` shapes one loopback queue that both
directions share). `delay` adds a `netem` delay in front (needs the kernel's sch_netem).

A rank on a node advertises its node's veth address (GLOO_SOCKET_IFNAME=nfab0): a peer on
the same node reaches that address over the node's own loopback, unshaped; a peer on the
other node crosses the veth. So intra-node traffic is free and only inter-node traffic pays
for the link, and the veth's tx counters count exactly the bytes that crossed it.

`run_on_nodes(target, payload, world_size)` runs `target` once per node (`python -m
nfab.bench.nodes` under `ip netns exec`), each starting its node's W/nodes ranks, which
rendezvous (c10d TCPStore) at node 0's address. Needs root and iproute2; `unavailable()`
says in one line what is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nfab.bench import netns
from nfab.errors import NfabError
from nfab.fsutil import atomic_write_text

IFACE = "nfab0"
"""The inter-node interface's name inside every node's namespace."""
SUBNET = "10.77.0"
PORT = 29411
"""The rendezvous port on node 0 (its namespace is private, so a fixed port is free)."""
MAX_NODES = 2
_PREFIX = "nfab-"
_CONTEXTS = itertools.count()
"""Numbers the emulated-node contexts of this process, so that several can be open at once
(each pair of namespaces and its veth have names of their own)."""
_DELAY = re.compile(r"^\d+(\.\d+)?(us|ms|s)$")


@dataclass(frozen=True, slots=True)
class Node:
    """One emulated node: its namespace and its address on the inter-node link."""

    index: int
    namespace: str
    address: str

    def exec_prefix(self) -> list[str]:
        """Argv prefix that runs a command inside this node's namespace."""
        return ["ip", "netns", "exec", self.namespace]


def check_nodes(nodes: int) -> int:
    if nodes not in range(1, MAX_NODES + 1):
        raise NfabError(f"--nodes must be 1 or 2 (emulated nodes on one machine), got {nodes}")
    return nodes


def check_delay(delay: str) -> str:
    d = delay.strip().lower()
    if not _DELAY.match(d):
        raise NfabError(f"link delay {delay!r} is not a tc time like 1ms, 500us or 0.1s")
    return d


def unavailable() -> str | None:
    """Why two emulated nodes cannot be set up here (one line), or None when they can."""
    if os.environ.get("NFAB_NO_NETNS"):
        return "emulated nodes are disabled (NFAB_NO_NETNS is set)"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return f"--nodes needs {', '.join(missing)} (iproute2) on PATH; install iproute2"
    if os.geteuid() != 0:
        return "--nodes needs root (it creates network namespaces joined by a veth pair shaped with tc)"
    return None


def _run(*argv: str) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if proc.returncode != 0:
        raise NfabError(f"`{' '.join(argv)}` failed: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def remove_stale() -> None:
    """Delete namespaces left behind by a dead nfab process (`nfab-PID-K` with PID gone)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for name in re.findall(rf"^({_PREFIX}(\d+)-\d+)\b", listed, flags=re.M):
        if not _alive(int(name[1])):
            subprocess.run(["ip", "netns", "del", name[0]], capture_output=True)


def shape(node: Node, rate: str, delay: str | None) -> str:
    """tbf at `rate` (behind a netem delay when given) on the node's end of the link; `tc qdisc show`."""
    tbf = ["tbf", "rate", netns.check_rate(rate), "burst", netns.BURST, "latency", netns.LATENCY]
    ns = node.namespace
    if delay is None:
        _run("tc", "-n", ns, "qdisc", "add", "dev", IFACE, "root", *tbf)
    else:
        try:
            _run("tc", "-n", ns, "qdisc", "add", "dev", IFACE, "root", "handle", "1:", "netem",
                 "delay", check_delay(delay))
        except NfabError as exc:
            raise NfabError(f"--delay needs the kernel's netem qdisc (sch_netem), which this machine lacks: "
                            f"{exc}") from exc
        _run("tc", "-n", ns, "qdisc", "add", "dev", IFACE, "parent", "1:", "handle", "2:", *tbf)
    return _run("tc", "-n", ns, "qdisc", "show", "dev", IFACE).strip()


@contextlib.contextmanager
def emulated_nodes(count: int, rate: str | None = None, delay: str | None = None,
                   ) -> Iterator[tuple[list[Node], list[str]]]:
    """`count` (1 or 2) node namespaces joined by a veth pair shaped at `rate`; the nodes and their qdiscs.

    Everything is removed on exit (deleting a namespace deletes its end of the pair).
    """
    why = unavailable()
    if why is not None:
        raise NfabError(why)
    check_nodes(count)
    remove_stale()
    pid, first = os.getpid(), next(_CONTEXTS) * MAX_NODES
    nodes = [Node(k, f"{_PREFIX}{pid}-{first + k}", f"{SUBNET}.{k + 1}") for k in range(count)]
    made: list[Node] = []
    try:
        for node in nodes:
            _run("ip", "netns", "add", node.namespace)
            made.append(node)
            _run("ip", "-n", node.namespace, "link", "set", "lo", "up")
        if count == 2:
            a, b = (f"nfv{pid % 100000}-{first}{k}" for k in "ab")  # creation names, renamed inside
            _run("ip", "link", "add", a, "netns", nodes[0].namespace, "type", "veth",
                 "peer", "name", b, "netns", nodes[1].namespace)
            for node, tmp in zip(nodes, (a, b), strict=True):
                _run("ip", "-n", node.namespace, "link", "set", tmp, "name", IFACE)
        qdiscs = []
        for node in nodes:
            if count == 2:
                _run("ip", "-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", IFACE)
                _run("ip", "-n", node.namespace, "link", "set", IFACE, "up")
                qdiscs.append(shape(node, rate, delay) if rate else "")
        yield nodes, qdiscs
    finally:
        for node in made:
            subprocess.run(["ip", "netns", "del", node.namespace], capture_output=True)


def set_link(node: Node, up: bool) -> None:
    """Bring the inter-node link down (or up) from `node`'s end: a cable pulled mid-run."""
    _run("ip", "-n", node.namespace, "link", "set", IFACE, "up" if up else "down")


def tx_bytes(iface: str) -> int:
    """Bytes this network namespace has sent on `iface` (its /proc/net/dev counter)."""
    for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
        name, _, rest = line.partition(":")
        if name.strip() == iface:
            return int(rest.split()[8])
    raise NfabError(f"no interface {iface!r} in this network namespace")


def run_on_nodes(target: str, payload: dict[str, Any], world_size: int, rate: str, delay: str | None = None,
                 timeout_s: float = 3600.0) -> dict[str, Any]:
    """Run `target` ("module:function(payload, node) -> dict") on 2 emulated nodes; node 0's result.

    The result gains `"link": {"rate", "bits_per_s", "delay", "qdisc", "nodes"}`.
    """
    if world_size % MAX_NODES:
        raise NfabError(f"--nodes 2 needs an even world size (W/2 ranks per node), got {world_size}")
    with emulated_nodes(MAX_NODES, rate, delay) as (nodes, qdiscs), \
            tempfile.TemporaryDirectory(prefix="nfab-nodes-") as tmp:
        cfg = Path(tmp) / "payload.json"
        cfg.write_text(json.dumps(payload))
        env = {**os.environ, "GLOO_SOCKET_IFNAME": IFACE}
        procs = []
        for node in nodes:
            cmd = [*node.exec_prefix(), sys.executable, "-m", "nfab.bench.nodes", "--target", target,
                   "--payload", str(cfg), "--out", str(Path(tmp) / f"node{node.index}.json"),
                   "--node", str(node.index), "--nodes", str(len(nodes)), "--world-size", str(world_size),
                   "--master", f"{nodes[0].address}:{PORT}"]
            log = open(Path(tmp) / f"node{node.index}.log", "w")  # noqa: SIM115 - closed below
            procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        codes = []
        try:
            for proc, _ in procs:
                codes.append(proc.wait(timeout=timeout_s))
        except subprocess.TimeoutExpired:
            codes.append(-1)
        finally:
            for proc, log in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                log.close()
        out = Path(tmp) / "node0.json"
        if any(c != 0 for c in codes) or not out.exists():
            tails = [f"node {k}: " + "\n".join((Path(tmp) / f"node{k}.log").read_text().strip().splitlines()[-15:])
                     for k in range(len(nodes))]
            raise RuntimeError(f"two-node run failed (exit codes {codes}):\n" + "\n".join(tails))
        result = json.loads(out.read_text())
    result["link"] = {"rate": rate, "bits_per_s": netns.rate_bits_per_s(rate), "delay": delay,
                      "qdisc": qdiscs[0], "nodes": len(nodes), "interface": IFACE}
    return result


def _inner(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m nfab.bench.nodes")
    for key in ("--target", "--payload", "--out", "--master"):
        ap.add_argument(key, required=True)
    for key in ("--node", "--nodes", "--world-size"):
        ap.add_argument(key, required=True, type=int)
    a = ap.parse_args(argv)
    fn = netns.forked_target(a.target)
    addr, _, port = a.master.rpartition(":")
    per_node = a.world_size // a.nodes
    node = {"index": a.node, "nodes": a.nodes, "world_size": a.world_size, "master_addr": addr,
            "port": int(port), "ranks": [a.node * per_node, (a.node + 1) * per_node]}
    result = fn(json.loads(Path(a.payload).read_text()), node)
    atomic_write_text(a.out, json.dumps(result))


if __name__ == "__main__":
    _inner()
