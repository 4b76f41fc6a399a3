"""Faults across two emulated nodes: real `nfab train` under torchrun, one launcher per node.

Each node is a network namespace (`nfab.bench.nodes`) whose rank talks to the other node
over a tc-shaped veth pair. The inter-node link is pulled mid-run (one line per node naming
the timed-out collective and the node, no hang past launch.timeout_s), and one node's rank
is killed under `--max-restarts 1` (both nodes restart, resume from the checkpoint, no step
lost or repeated, bit for bit the uninterrupted run, replicas identical, the restart recorded in
summary.json).
"""

from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from relrun import GPT, NFAB, metrics, nfab, summary

from nfab.bench import nodes

pytestmark = [
    pytest.mark.slow, pytest.mark.world_size(2),
    pytest.mark.skipif(nodes.unavailable() is not None, reason=str(nodes.unavailable())),
]
STEPS = 8


def start_nodes(made: list[nodes.Node], run_dir: Path, *args: str, env: dict[str, str] | None = None,
                ) -> list[subprocess.Popen[str]]:
    """`nfab train` once per emulated node (1 rank each), rendezvous at node 0's address."""
    import os

    base = {k: v for k, v in os.environ.items() if k != "NFAB_FAULT"}
    full = {**base, "OMP_NUM_THREADS": "1", "COLUMNS": "400", "GLOO_SOCKET_IFNAME": nodes.IFACE, **(env or {})}
    endpoint = f"{made[0].address}:{nodes.PORT}"
    return [subprocess.Popen([*n.exec_prefix(), NFAB, "train", *GPT, "--steps", str(STEPS), *args, "--nproc", "1",
                              "--nnodes", "2", "--node-rank", str(n.index), "--rdzv-endpoint", endpoint,
                              "--run-dir", str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=full) for n in made]


def finish(procs: list[subprocess.Popen[str]], timeout: float) -> list[tuple[int, str]]:
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            err += "\n<killed by the test: hung>"
        out.append((p.returncode, err))
    return out


@dataclass
class LinkDown:
    results: list[tuple[int, str]]  # (exit code, stderr) per node
    elapsed: float  # seconds from pulling the link to both launchers' exit
    run_dir: Path


def pull_the_link(out: Path) -> LinkDown:
    with nodes.emulated_nodes(2, "1gbit") as (made, _):
        # rank 0 dawdles 3 s at step 3, so the link goes down while both ranks are mid-run
        procs = start_nodes(made, out, "--route", "sign", "launch.timeout_s=10", "metrics_every=1",
                            env={"NFAB_FAULT": "slow@step=3,rank=0,seconds=3"})
        deadline = time.monotonic() + 240
        while not (out / "metrics.parquet").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        if not (out / "metrics.parquet").exists():
            return LinkDown(finish(procs, timeout=1), -1.0, out)  # the run never reached its first step
        nodes.set_link(made[0], up=False)
        pulled = time.monotonic()
        results = finish(procs, timeout=120)
        return LinkDown(results, time.monotonic() - pulled, out)


def kill_a_node(out: Path) -> list[tuple[int, str]]:
    with nodes.emulated_nodes(2, "1gbit") as (made, _):
        return finish(start_nodes(made, out, "--route", "sign", "--max-restarts", "1", "checkpoint_every=3",
                                  env={"NFAB_FAULT": "crash@step=5,rank=1"}), timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both faults at once, each on a pair of emulated nodes of its own, beside the uninterrupted
    reference on one node of 2 ranks (two nodes of one rank train bit for bit like it:
    tests/train/test_train_runs.py, tests/bench/test_bench_nodes.py). The pulled link spends most
    of its run waiting out its 10 s timeout; the others use the cores meanwhile."""
    root = tmp_path_factory.mktemp("node-faults")
    with ThreadPoolExecutor(max_workers=3) as pool:
        jobs = {"linkdown": pool.submit(pull_the_link, root / "linkdown"),
                "restart": pool.submit(kill_a_node, root / "restart"),
                "reference": pool.submit(nfab, "train", *GPT, "--steps", str(STEPS), "--route", "sign",
                                         "checkpoint_every=3", "--nproc", "2", "--run-dir", str(root / "reference"),
                                         timeout=300)}
        done = {name: job.result() for name, job in jobs.items()}
    return {**done, "root": root}


def test_link_down_mid_run_fails_each_node_with_one_line_within_the_timeout(runs) -> None:
    down: LinkDown = runs["linkdown"]
    assert down.elapsed >= 0, f"the run never reached its first step: {down.results}"
    for node, (code, err) in enumerate(down.results):
        lines = err.strip().splitlines()
        assert code == 1 and len(lines) == 1, err
        line = lines[0]
        assert line.startswith(f"error: training failed: rank {node}: a collective timed out after 10 s "
                               "(launch.timeout_s) in step "), line
        assert f"on node {node} of 2" in line and f"node {1 - node} never arrived" in line, line
        assert "Traceback" not in err
    assert down.elapsed < 60, down.elapsed  # 10 s timeout + torchrun's teardown, not the 300 s default
    assert len(metrics(down.run_dir)) < STEPS and summary(down.run_dir)["complete"] is False


def test_one_node_killed_restarts_both_and_resumes_from_the_checkpoint(runs) -> None:
    reference, out = runs["root"] / "reference", runs["root"] / "restart"
    assert runs["reference"].code == 0, runs["reference"].stderr
    results = runs["restart"]
    assert all(code == 0 for code, _ in results), results
    m = metrics(out)
    assert m["step"].tolist() == list(range(STEPS))  # no step lost or repeated
    assert m["loss"].tolist() == metrics(reference)["loss"].tolist()  # and bit for bit the uninterrupted run
    s = summary(out)
    assert s["complete"] is True and s["replicas_identical"] is True
    # checkpoint_every=3 in GPT: the crash at step 5 resumes from the step-3 checkpoint
    assert s["restart_count"] == 1
    assert s["restarts"] == [{"kind": "restart", "attempt": 1, "resumed_from_step": 3}]
    assert summary(reference)["restart_count"] == 0 and summary(reference)["restarts"] == []
