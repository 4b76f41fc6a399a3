"""End-to-end `nfab train` runs: 2 gloo ranks under torchrun, artifacts, resume, restart, multi-node."""

from __future__ import annotations

import json
import math
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from inprocess import nfab_main
from trainrun import GPT, RESNET, Result, metrics, nfab_train, start_train

from nfab.distributed import free_port
from nfab.train import rundir

pytestmark = [pytest.mark.slow, pytest.mark.world_size(2)]

COLUMNS = {
    "step": "int64", "phase": "object|str", "loss": "float64", "lr": "float64", "grad_norm": "float64",
    "wire_bytes": "int64", "baseline_wire_bytes": "int64", "intra_node_bytes": "int64", "inter_node_bytes": "int64",
    "probe_wire_bytes": "int64", "shadow_wire_bytes": "int64",
    "calibration_wire_bytes": "int64", "route_mix": "object|str", "fallback": "bool",
    "fallback_reason": "object|str", "skipped": "bool", "cost_gated": "bool",
    "calibrating": "bool", "shadow": "bool", "alarms": "int64",
    "false_alarms": "int64", "fidelity_cosine": "float64", "region_cosine": "object|str",
    "hook_time_s": "float64",
    "collectives": "int64", "scale_rounds": "int64", "saturated_slices": "int64", "step_time_s": "float64",
    "eval_loss": "float64", "eval_accuracy": "float64", "events": "object|str",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Result]]:
    """Every run these tests inspect, two launches at a time (2 cores; much of a launch is waiting)."""
    root = tmp_path_factory.mktemp("runs")
    crash = {"NFAB_FAULT": "crash@step=5,rank=1"}

    def plain(name: str, base: list[str], *flags: str, env: dict[str, str] | None = None) -> tuple[Path, Result]:
        out = root / name
        return out, nfab_train(*base, *flags, "--nproc", "2", "--run-dir", str(out), env=env, timeout=240)

    def crash_then_resume() -> tuple[Path, Result]:
        out, crashed = plain("gpt-resume", GPT, "--route", "sign", env=crash)
        snapshot = (crashed, json.loads((out / "summary.json").read_text()), metrics(out))
        resumed = nfab_train("--resume", "--run-dir", str(out), "--quiet", timeout=240)
        return out, Result(resumed.code, resumed.stdout, resumed.stderr, snapshot)

    def two_nodes() -> tuple[Path, Result]:
        out, endpoint = root / "gpt-2nodes", f"127.0.0.1:{free_port()}"
        procs = [start_train(*GPT, "--route", "sign", "--nproc", "1", "--nnodes", "2", "--node-rank", str(n),
                             "--rdzv-endpoint", endpoint, "--run-dir", str(out)) for n in (0, 1)]
        outs = [p.communicate(timeout=240) for p in procs]
        code = max(p.returncode for p in procs)
        return out, Result(code, outs[0][0], "\n".join(o[1] for o in outs))

    jobs: dict[str, Callable[[], tuple[Path, Result]]] = {
        "gpt-sign": lambda: plain("gpt-sign", GPT, "--route", "sign"),
        "gpt-resume": crash_then_resume,
        "gpt-restart": lambda: plain("gpt-restart", GPT, "--route", "sign", "--max-restarts", "1", env=crash),
        "gpt-2nodes": two_nodes,
        "resnet-fp32": lambda: plain("resnet-fp32", RESNET, "--fp32"),
        "resnet-route-fp32": lambda: plain("resnet-route-fp32", RESNET, "--route", "fp32"),
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


def ok(runs: dict[str, tuple[Path, Result]], name: str) -> Path:
    out, r = runs[name]
    assert r.code == 0, r.stderr
    return out


def final_model(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return torch.load(run_dir / "checkpoints" / latest / "state.pt", weights_only=True)["model"]


def check_artifacts(run_dir: Path, steps: int, lm: bool) -> tuple[dict, object]:
    m = metrics(run_dir)
    assert list(m.columns) == list(COLUMNS)
    for col, kinds in COLUMNS.items():
        assert str(m[col].dtype) in kinds.split("|"), (col, m[col].dtype)
    assert m["step"].tolist() == list(range(steps))
    assert m["loss"].map(math.isfinite).all()
    assert m["loss"].iloc[-2:].mean() < m["loss"].iloc[:2].mean()
    for mix in m["route_mix"]:
        assert abs(sum(json.loads(mix).values()) - 1) < 1e-9
    evals = m[m["eval_loss"].notna()]
    assert len(evals) >= 1 and evals["step"].iloc[-1] == steps - 1
    assert m["eval_accuracy"].isna().all() if lm else evals["eval_accuracy"].between(0, 1).all()
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["complete"] is True and s["steps"] == steps and s["world_size"] == 2
    assert s["wire_bytes_total"] == m["wire_bytes"].sum()
    assert ("perplexity" in s["final_eval"]) == lm and ("accuracy" in s["final_eval"]) == (not lm)
    return s, m


def test_gpt_sign_artifacts(runs) -> None:
    s, m = check_artifacts(ok(runs, "gpt-sign"), 8, lm=True)
    assert s["compression_ratio"] > 1 and s["route"] == "sign" and s["fp32"] is False and s["profile"] is None
    assert s["bucket_cap_mb"] == 4.0  # nfab's default bucket under the hook (DDP's 25 for --fp32)
    assert s["noise_moment"] is True  # "auto": a static route under AdamW
    assert (m["wire_bytes"] < m["baseline_wire_bytes"]).iloc[1:].all()  # step 0 runs before DDP's bucket rebuild
    assert (m["collectives"] > 0).all() and (m["scale_rounds"] == 0).all()  # the hook ran; sign has no scale round
    out, result = runs["gpt-sign"]
    assert str(out) in result.stdout and "8 steps" in result.stdout  # `--quiet` drops the progress bar, not this line


def test_resnet_fp32_equals_route_fp32(runs) -> None:
    plain, m_plain = check_artifacts(ok(runs, "resnet-fp32"), 6, lm=False)
    routed, m_routed = check_artifacts(ok(runs, "resnet-route-fp32"), 6, lm=False)
    assert m_plain["loss"].tolist() == m_routed["loss"].tolist()
    assert plain["compression_ratio"] == 1 and plain["route"] == "fp32" and plain["fp32"] is True
    assert plain["bucket_cap_mb"] == 25.0
    assert routed["route"] == "fp32" and routed["fp32"] is False
    assert routed["noise_moment"] is False and plain["noise_moment"] is False  # SGD: no second moment


def test_crash_then_resume_matches_uninterrupted(runs) -> None:
    out = ok(runs, "gpt-resume")
    crashed, summary, partial = runs["gpt-resume"][1].extra
    assert crashed.code != 0
    assert len(crashed.stderr.strip().splitlines()) == 1, crashed.stderr
    assert "rank 1 exited with code 1" in crashed.stderr
    assert summary["complete"] is False
    assert partial["step"].tolist() == list(range(len(partial))) and len(partial) >= 3  # what it did is on disk
    reference = ok(runs, "gpt-sign")
    assert metrics(out)["step"].tolist() == list(range(8))
    a, b = final_model(out), final_model(reference)
    assert a.keys() == b.keys()
    assert metrics(out)["loss"].tolist() == metrics(reference)["loss"].tolist()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_torchrun_restart_loses_and_repeats_no_step(runs) -> None:
    out = ok(runs, "gpt-restart")
    m = metrics(out)
    assert m["step"].tolist() == list(range(8))
    assert m["loss"].tolist() == metrics(ok(runs, "gpt-sign"))["loss"].tolist()
    s = json.loads((out / "summary.json").read_text())
    # the crash at step 5 resumed from the step-3 checkpoint (checkpoint_every=3), and the summary says so
    assert s["restart_count"] == 1 and s["restarts"] == [{"kind": "restart", "attempt": 1, "resumed_from_step": 3}]


def test_a_resume_is_recorded_but_is_no_restart(runs) -> None:
    s = json.loads((ok(runs, "gpt-resume") / "summary.json").read_text())
    assert s["restart_count"] == 0 and s["restarts"] == [{"kind": "resume", "attempt": 0, "resumed_from_step": 3}]
    assert json.loads((ok(runs, "gpt-sign") / "summary.json").read_text())["restarts"] == []


def test_two_nodes_on_one_machine_match_one_node(runs) -> None:
    out, reference = ok(runs, "gpt-2nodes"), ok(runs, "gpt-sign")
    s, m = check_artifacts(out, 8, lm=True)
    assert m["loss"].tolist() == metrics(reference)["loss"].tolist()
    assert s["wire_bytes_total"] == json.loads((reference / "summary.json").read_text())["wire_bytes_total"]


def test_finished_run_dir_is_refused(runs) -> None:
    done = ok(runs, "gpt-sign")
    before = sorted(str(p) for p in done.rglob("*"))
    r = nfab_main("train", *GPT, "--route", "sign", "--nproc", "2", "--run-dir", str(done))  # refused before launch
    assert r.code == 2 and "already holds a finished run" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr + r.stdout
    assert sorted(str(p) for p in done.rglob("*")) == before


def test_resume_refuses_what_it_would_not_honour_and_a_busy_run_dir(runs) -> None:
    """A finished run resumed as it was added fake restarts; a resume with another lr trained the saved
    schedule while config.json recorded the new one; two `nfab train` into one run dir both exited 0
    and the first run was lost. All three are one line, exit 2, before any rank starts."""
    done = ok(runs, "gpt-sign")
    before = {str(p): p.stat().st_mtime_ns for p in done.rglob("*")}
    cases = [
        (["--resume"], "the run finished its 8 steps: nothing to resume"),
        (["--resume", "--steps", "12", "optim.lr=0.5"], "trained with other settings: optim.lr (0.003 -> 0.5)"),
    ]
    for flags, expect in cases:
        r = nfab_main("train", "--run-dir", str(done), "--quiet", *flags)
        assert r.code == 2 and expect in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    with rundir.held(done):  # another nfab train is writing it
        r = nfab_main("train", *GPT, "--route", "sign", "--nproc", "2", "--run-dir", str(done), "--overwrite")
    assert r.code == 2 and "is in use by another nfab train" in r.stderr, r.stderr
    assert {str(p): p.stat().st_mtime_ns for p in done.rglob("*")} == before


def test_ctrl_c_is_one_line_and_exit_130(tmp_path: Path) -> None:
    """SIGINT to `nfab train` (Ctrl-C): torchrun's launcher raises its own SignalException, which
    printed a 59-line traceback and exit 1; now one line and the shell's 130."""
    out = tmp_path / "interrupted"
    p = start_train("--config", str(RESNET[1]), "--steps", "5000", "--quiet", "model.width=8", "data.batch_size=16",
                    "comm.cost_model=none", "--route", "sign", "--nproc", "2", "--run-dir", str(out))
    deadline = time.monotonic() + 120
    while not (out / "logs").exists() and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.2)
    time.sleep(3)  # the ranks are up
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 130, stderr
    assert stderr.strip().splitlines() == ["error: interrupted"], stderr


def test_a_rendezvous_that_fails_is_one_line(tmp_path: Path) -> None:
    """A node that never joined: node 0 waited torch's 900 s (launch.timeout_s ignored), then printed a
    traceback. A rendezvous port in use: a traceback. Both are now one line."""
    import socket

    with socket.socket() as busy, ThreadPoolExecutor(max_workers=2) as pool:  # both at once: one waits 3 s
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        lone = pool.submit(nfab_train, *RESNET, "--route", "sign", "--nproc", "1", "--nnodes", "2", "--node-rank",
                           "0", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--run-dir", str(tmp_path / "alone"),
                           "launch.timeout_s=3", timeout=120)
        taken = nfab_train(*RESNET, "--fp32", "--nproc", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
                           "--run-dir", str(tmp_path / "taken"), timeout=120)
        alone = lone.result()
    assert alone.code == 1, alone.stderr
    assert alone.stderr.strip().splitlines() == [alone.stderr.strip()] and "Traceback" not in alone.stderr
    assert "timed out after launch.timeout_s (1 of 2 nodes joined)" in alone.stderr
    assert taken.code == 2 and "its port is in use by another process" in taken.stderr, taken.stderr
    assert len(taken.stderr.strip().splitlines()) == 1


def _children(pid: int) -> set[int]:
    """Child processes of `pid` (Linux /proc), for the rank processes torchrun started in it."""
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        text = (task / "children").read_text() if (task / "children").exists() else ""
        out |= {int(c) for c in text.split()}
    return out


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_ranks_end_with_a_killed_launcher(tmp_path: Path) -> None:
    """`kill -9` of `nfab train` left its ranks training as orphans to the end, writing the run dir
    (beside a --resume started meanwhile); they now end with it (PR_SET_PDEATHSIG)."""
    p = start_train("--config", str(RESNET[1]), "--steps", "5000", "--quiet", "model.width=8", "data.batch_size=16",
                    "comm.cost_model=none", "--route", "sign", "--nproc", "2", "--run-dir", str(tmp_path / "run"))
    deadline = time.monotonic() + 120
    while len(ranks := _children(p.pid)) < 2 and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.2)
    assert len(ranks) == 2, p.communicate(timeout=30)
    time.sleep(2)  # past the ranks' start-up
    p.kill()
    p.communicate(timeout=30)
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{r}").exists() and "zombie" not in Path(f"/proc/{r}/status").read_text()
              for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [r for r in ranks if Path(f"/proc/{r}").exists()
             and "zombie" not in Path(f"/proc/{r}/status").read_text()]
    for r in alive:  # do not leave them behind if the check fails
        os.kill(r, signal.SIGKILL)
    assert not alive
