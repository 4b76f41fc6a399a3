"""`nfab train` with `comm.hierarchy`: 2 emulated nodes x 2 ranks on loopback (torchrun's static
rendezvous, as two `nfab train --nnodes 2 --node-rank N` launches), and bad values refused."""

from __future__ import annotations

import json

import pytest
from inprocess import nfab_main
from trainrun import REPO, metrics, start_train

from nfab.distributed import free_port

pytestmark = [pytest.mark.slow, pytest.mark.world_size(4)]

GPT = [
    "--config", str(REPO / "configs/gpt-nano-stdlib.yaml"), "--steps", "4", "--quiet", "data.max_bytes=100000",
    "data.batch_size=4", "data.eval_batches=1", "eval_every=0", "checkpoint_every=0", "metrics_every=2",
    "schedule.warmup_steps=1", "comm.cost_model=none", "--route", "sign",
]


def test_two_nodes_of_two_reduce_in_two_levels(tmp_path):
    out, endpoint = tmp_path / "gpt-2x2", f"127.0.0.1:{free_port()}"
    procs = [start_train(*GPT, "comm.hierarchy=auto", "--nproc", "2", "--nnodes", "2", "--node-rank", str(n),
                         "--rdzv-endpoint", endpoint, "--run-dir", str(out)) for n in (0, 1)]
    outs = [p.communicate(timeout=400) for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[1] for o in outs)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["hierarchy"] == "2x2"
    assert summary["replicas_identical"] is True
    m = metrics(out)
    assert (m["inter_node_bytes"] > 0).all() and (m["intra_node_bytes"] > m["inter_node_bytes"]).all()
    assert (m["wire_bytes"] >= m["intra_node_bytes"] + m["inter_node_bytes"]).all()
    assert summary["inter_node_bytes_total"] == int(m["inter_node_bytes"].sum())


@pytest.mark.parametrize("value,says", [("3", "do not divide the world size 2"), ("2y", "NODESxLOCAL")])
def test_a_bad_hierarchy_is_one_line_and_exit_2(tmp_path, value, says):
    # refused before launch: the console entry in this process (tests/inprocess.py)
    r = nfab_main("train", *GPT, f"comm.hierarchy={value}", "--nproc", "2", "--run-dir", str(tmp_path / "bad"))
    assert r.code == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in r.stderr, r.stderr
